"""The real SmolLM2-135M-Instruct GGUF: offline load, the de-quantised cache, round trips through
plain transformers Auto classes. Slow: the first run de-quantises (~15-60 s), later ones read the cache."""

import os
import time

import pytest
import torch

from rlhf_cli.models import (
    load_causal_lm,
    load_scalar_model,
    save_hf,
    sequence_scores,
    token_values,
)
from rlhf_cli.models.loading import dequantized_gguf_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_model_cfg, tokenizer):
    """(causal LM, tokenizer), loaded offline through the GGUF cache. The `tokenizer` fixture comes
    from the same GGUF file and skips (fails under CI) when it is not installed."""
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert smollm2_model_cfg.gguf_file == smollm2_model_cfg.tokenizer or smollm2_model_cfg.tokenizer is None
    return load_causal_lm(smollm2_model_cfg, tokenizer=tokenizer).eval(), tokenizer


@pytest.fixture(scope="module")
def batch(smollm2):
    _, tok = smollm2
    texts = [
        [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
        [{"role": "user", "content": "What is 3 + 4?"},
         {"role": "assistant", "content": "3 + 4 = 7, so the answer is 7."}],
    ]
    rows = [tok(tok.apply_chat_template(m, tokenize=False).rstrip("\n"), add_special_tokens=False)["input_ids"]
            for m in texts]
    assert all(r[-1] == tok.eos_token_id for r in rows)
    T = max(map(len, rows))
    right = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    left = torch.tensor([[tok.pad_token_id] * (T - len(r)) + r for r in rows])
    right_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    left_mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return right, right_mask, left, left_mask


def test_gguf_loads_offline_and_second_load_hits_cache(smollm2, smollm2_model_cfg, batch):
    model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == len(tok) == 49152
    assert model.config.pad_token_id == 0 and not hasattr(model.config, "quantization_config")
    mdir, cached = dequantized_gguf_dir(smollm2_model_cfg.gguf_file, smollm2_model_cfg.cache_dir)
    assert cached and (mdir / "model.safetensors").is_file()
    t0 = time.perf_counter()
    again = load_causal_lm(smollm2_model_cfg, tokenizer=tok)
    assert time.perf_counter() - t0 < 15  # a de-quantisation takes longer; a cache hit ~1-3 s
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    ids, mask, _, _ = batch
    with torch.no_grad():  # real weights: a chat reply is far likelier than under a random model (ln 49152 = 10.8)
        loss = model(input_ids=ids[:1], attention_mask=mask[:1], labels=ids[:1].masked_fill(mask[:1] == 0, -100)).loss
    assert loss.item() < 5.0


def test_saved_policy_reloads_with_identical_logits(smollm2, batch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = smollm2
    save_hf(model, tok, tmp_path / "policy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    ids, mask, _, _ = batch
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)
    rtok = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert (rtok.pad_token_id, rtok.eos_token_id) == (0, 2) and rtok.chat_template == tok.chat_template


def test_reward_model_round_trip_and_padding(smollm2, batch, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model, tok = smollm2
    rm = load_scalar_model(init_from=model, seed=0).eval()
    right, right_mask, left, left_mask = batch
    with torch.no_grad():
        r_right = sequence_scores(rm, right, right_mask)
        r_left = sequence_scores(rm, left, left_mask)
        v = token_values(rm, right, right_mask)
    torch.testing.assert_close(r_left, r_right, atol=1e-4, rtol=0)
    eos_pos = right_mask.sum(1) - 1
    assert (right[torch.arange(2), eos_pos] == tok.eos_token_id).all()
    torch.testing.assert_close(r_right, v[torch.arange(2), eos_pos])

    save_hf(rm, tok, tmp_path / "rm", extra_config={"rlhf_reward_mean": 0.0, "rlhf_reward_std": 1.0})
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        scores = plain(input_ids=right, attention_mask=right_mask).logits[:, 0]
    torch.testing.assert_close(scores, r_right, atol=1e-5, rtol=0)
