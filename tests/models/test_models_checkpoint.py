"""save_hf round trips through plain transformers Auto classes; reward stats; scalar-dir checks."""

import copy
import json

import pytest
import torch

from rlhf_cli.models import (
    ModelSourceError,
    is_scalar_model_dir,
    load_causal_lm,
    load_scalar_model,
    read_score_stats,
    require_scalar_model_dir,
    save_hf,
    sequence_scores,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_causal, tiny_scalar, tokenizer):
    """A run dir with a policy in `policy/final` and a reward model in `rm/final`."""
    root = tmp_path_factory.mktemp("ckpt")
    save_hf(tiny_causal, tokenizer, root / "policy" / "final")
    save_hf(tiny_scalar, tokenizer, root / "rm" / "final",
            extra_config={"rlhf_reward_mean": 0.25, "rlhf_reward_std": 1.5})
    return root


def test_policy_reloads_with_auto_causal_lm(saved, tiny_causal, tokenizer, chat_rows, pad_batch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = saved / "policy" / "final"
    assert (d / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    ids, mask = pad_batch(chat_rows, tokenizer.pad_token_id, "right")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   tiny_causal(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)
    assert model.config.pad_token_id == 0 and model.generation_config.pad_token_id == 0
    tok = AutoTokenizer.from_pretrained(d)
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token_id) == ("<|endoftext|>", 0, 2)
    assert tok.chat_template == tokenizer.chat_template is not None
    assert not is_scalar_model_dir(d) and read_score_stats(d) is None


def test_reward_model_reloads_with_auto_sequence_classification(saved, tiny_scalar, tokenizer, chat_rows, pad_batch):
    from transformers import AutoModelForSequenceClassification

    d = saved / "rm" / "final"
    model = AutoModelForSequenceClassification.from_pretrained(d).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    ids, mask = pad_batch(chat_rows, tokenizer.pad_token_id, "right")
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        ours = sequence_scores(tiny_scalar, ids, mask)
        ours_left = sequence_scores(model, *pad_batch(chat_rows, tokenizer.pad_token_id, "left"))
    torch.testing.assert_close(plain, ours, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_left, ours, atol=1e-5, rtol=0)
    assert read_score_stats(d) == (0.25, 1.5)
    assert read_score_stats(saved / "rm") == (0.25, 1.5)  # run dir -> final/
    assert "rlhf_reward_mean" not in tiny_scalar.config.to_dict()  # the live config is untouched


def test_load_scalar_model_from_saved_dirs(saved, tiny_scalar, tiny_causal):
    rm = load_scalar_model(str(saved / "rm"))  # a saved reward model: loaded as is
    assert torch.equal(rm.score.weight, tiny_scalar.score.weight)
    critic = load_scalar_model(str(saved / "policy"), seed=0)  # a policy: trunk + new seeded head
    assert torch.equal(critic.model.embed_tokens.weight, tiny_causal.model.embed_tokens.weight)
    assert torch.equal(critic.score.weight, tiny_scalar.score.weight)
    policy = load_causal_lm(str(saved / "policy"))
    assert torch.equal(policy.lm_head.weight, tiny_causal.lm_head.weight)


def test_scalar_dir_checks(saved, tmp_path):
    assert is_scalar_model_dir(saved / "rm") and is_scalar_model_dir(saved / "rm" / "final")
    assert not is_scalar_model_dir(saved / "policy")
    assert not is_scalar_model_dir(tmp_path / "missing")
    assert require_scalar_model_dir(saved / "rm").endswith("final")
    with pytest.raises(ModelSourceError, match=r"reward model '.*policy' is not a reward model \(LlamaForCausalLM\)"):
        require_scalar_model_dir(saved / "policy")
    with pytest.raises(ModelSourceError, match="holds no model"):
        require_scalar_model_dir(tmp_path / "missing")


def test_failed_save_keeps_previous_checkpoint(saved, tiny_causal, tokenizer, monkeypatch):
    d = saved / "policy" / "final"
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        save_hf(tiny_causal, tokenizer, d, extra_config={"note": "never written"})
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    assert sorted(p.name for p in d.parent.iterdir()) == ["final"]
    assert "note" not in json.loads((d / "config.json").read_text())


def test_save_drops_quantization_config(tiny_causal, tokenizer, tmp_path):
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    model = copy.deepcopy(tiny_causal)
    model.config.quantization_config = GgufConfig()
    model.hf_quantizer = AutoHfQuantizer.from_config(GgufConfig())
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "plain")
    save_hf(model, tokenizer, tmp_path / "ours")
    assert "quantization_config" not in json.loads((tmp_path / "ours" / "config.json").read_text())
    assert model.hf_quantizer is not None  # restored on the live model
