"""One EOS rule (`rlhf_cli.eos.eos_ids`, issue 41): a model whose `generation_config` lists two EOS ids stops,
masks and scores at either.

The model is the tiny random Llama saved to a directory with `generation_config.eos_token_id = [2, 1]`
(`<|im_end|>`, the tokenizer's EOS, and `<|im_start|>`, standing in for a chat template's end-of-turn id such as
Phi-3's `<|end|>`), loaded with `model.name_or_path=<dir>` as a user's model is.
"""

import json
import types

import pytest
import torch
from test_stage_ppo import build_trainer, edit_generate

from rlhf_cli.data.tokenize import Encoder
from rlhf_cli.eos import eos_ids
from rlhf_cli.forwards import batched_scores
from rlhf_cli.models import load_causal_lm, load_generation_config, load_scalar_model, with_scoring_template
from rlhf_cli.rollout import HFGenerator, Sampling

EOS, TURN = 2, 1  # <|im_end|> (the tokenizer's EOS), <|im_start|> (a second id the model's generation config lists)


@pytest.fixture(scope="module")
def two_eos_dir(tmp_path_factory, tiny_model_cfg, tokenizer):
    """A tiny random causal LM saved with `generation_config.eos_token_id = [2, 1]`, its tokenizer beside it."""
    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    lm.generation_config.eos_token_id = [EOS, TURN]
    out = tmp_path_factory.mktemp("two_eos")
    lm.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def test_eos_ids_is_the_tokenizers_eos_then_the_generation_configs():
    tok = types.SimpleNamespace(eos_token_id=2)
    gen = types.SimpleNamespace
    assert eos_ids(tok, None) == (2,)
    assert eos_ids(tok, gen(eos_token_id=2)) == (2,)
    assert eos_ids(tok, gen(eos_token_id=7)) == (2, 7)
    assert eos_ids(tok, gen(eos_token_id=[7, 2, 9, 7])) == (2, 7, 9)
    assert eos_ids(types.SimpleNamespace(eos_token_id=None), gen(eos_token_id=[5])) == (5,)
    with pytest.raises(ValueError, match="no EOS id"):
        eos_ids(types.SimpleNamespace(eos_token_id=None), gen(eos_token_id=None))


def test_loading_keeps_the_model_side_of_the_set(two_eos_dir, tokenizer):
    lm = load_causal_lm(str(two_eos_dir), tokenizer=tokenizer)
    assert lm.generation_config.eos_token_id == [EOS, TURN]
    assert eos_ids(tokenizer, lm.generation_config) == (EOS, TURN)
    assert eos_ids(tokenizer, load_generation_config(str(two_eos_dir))) == (EOS, TURN)


def test_a_gguf_models_first_run_reads_the_set_too(two_eos_dir, tokenizer, monkeypatch):
    """A GGUF model not yet de-quantised: its generation config comes from the de-quantised dir, made now (the
    model's load right after reads the same cache), not None on the first run and the set on later ones."""
    from omegaconf import OmegaConf

    from rlhf_cli.config import ModelConfig
    from rlhf_cli.models import loading

    made = []
    monkeypatch.setattr(loading, "dequantized_gguf_dir", lambda spec, cache_dir=None: (made.append(spec)
                                                                                      or (two_eos_dir, False)))
    cfg = OmegaConf.structured(ModelConfig)
    cfg.gguf_file = "pkg:some-package/model.gguf"
    assert eos_ids(tokenizer, load_generation_config(cfg)) == (EOS, TURN) and made == [cfg.gguf_file]


def rig(lm, plan):
    """Make `lm` emit `plan[row][step]` at generation step `step` (None: any token but an EOS of the set)."""
    calls = {"n": 0}

    def hook(module, args, out):
        step, logits = calls["n"], out.clone()
        calls["n"] += 1
        logits[:, -1, [EOS, TURN]] = -1e9
        for row, ids in enumerate(plan):
            if step < len(ids) and ids[step] is not None:
                logits[row, -1, ids[step]] = 1e9
        return logits

    return lm.lm_head.register_forward_hook(hook)


def test_sampling_stops_and_masks_at_either_id(two_eos_dir, tokenizer):
    lm = load_causal_lm(str(two_eos_dir), tokenizer=tokenizer)
    handle = rig(lm, [[None, TURN], [None, None, EOS], []])
    gen = HFGenerator("fp32")
    gen.update_weights(lm)
    sampling = Sampling(eos_ids=eos_ids(tokenizer, lm.generation_config), pad_id=tokenizer.pad_token_id,
                        max_new_tokens=5, temperature=1.0, top_p=1.0)
    out = gen.generate([[5, 6, 7], [8, 9], [10]], [0, 1, 2], sampling)
    handle.remove()
    assert out.has_eos.tolist() == [True, True, False]
    assert out.mask.sum(1).tolist() == [2, 3, 5]
    assert out.responses[0, 1] == TURN and out.responses[1, 2] == EOS
    pad = tokenizer.pad_token_id
    assert (out.responses[0, 2:] == pad).all() and (out.responses[1, 3:] == pad).all()


def test_the_rollout_masks_and_counts_either_id(tmp_path, monkeypatch, two_eos_dir):
    tr = build_trainer(tmp_path, [f"model.name_or_path={two_eos_dir}", "model.init=pretrained", "ppo.truncated=mask"])
    assert tr.maker.eos_ids == tr.maker.sampling.eos_ids == (EOS, TURN)
    assert tr.maker.score_mixer.eos_ids == (EOS, TURN)

    def edit(responses):  # row 0 ends with the second id, row 1 with the tokenizer's EOS, the rest run out
        responses[responses == EOS] = 5
        responses[responses == TURN] = 5
        responses[0, 2], responses[1, 3] = TURN, EOS

    edit_generate(monkeypatch, tr, edit)
    exp, stats, _ = tr.maker.make_experience(0)
    P = exp.prompt_len
    mask = exp.attention_mask[:, P:].float()
    assert mask[0].sum() == 3 and mask[1].sum() == 4 and (mask[2:].sum(1) == 6).all()
    assert stats["response/eos_frac"] == pytest.approx(2 / 8)
    assert (exp.loss_mask[:2].sum(1) == mask[:2].sum(1)).all() and exp.loss_mask[2:].sum() == 0  # ppo.truncated


def test_the_reward_model_reads_either_id_as_the_tokenizers_eos(tiny_model_cfg, tokenizer):
    rm = load_scalar_model(tiny_model_cfg, "fp32", seed=3).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, TURN, 0], [0, 5, 6, 7, 8, 9, EOS], [0, 0, 5, 6, 7, EOS, 0]])
    am = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0]])
    plain = batched_scores(rm, ids, am, 8, "fp32")
    read = batched_scores(rm, ids, am, 8, "fp32", eos_ids=(EOS, TURN))
    assert plain[0] != plain[2]  # the closing id matters to the model ...
    assert read[0] == read[2] and read[1] == plain[1]  # ... and the set reads TURN as the tokenizer's EOS
    assert ids[0, 5] == TURN  # the caller's tensor is not changed


def test_data_and_the_exported_template_end_at_the_tokenizers_eos(tokenizer):
    turn = tokenizer.convert_ids_to_tokens(TURN)
    enc = Encoder(tokenizer, chat_template=True, eos_ids=(EOS, TURN))
    assert enc.encode_responses(["Hello" + turn, "Hello", "Hello" + turn + " <|im_end|>"]) == [
        enc.encode_responses(["Hello"])[0]] * 3
    assert enc.encode_responses(["Hello"])[0][-1] == EOS
    assert Encoder(tokenizer, chat_template=True).encode_responses(["Hello" + turn])[0][-2] != enc.encode_responses(
        ["Hello"])[0][-2]  # without the set, the second id's text stays in the response
    # a template that closes a turn with the second id and then the EOS: the exported one ends at the EOS alone
    tok = with_scoring_template(tokenizer, (EOS,))
    tok.chat_template = tokenizer.chat_template.replace("<|im_end|>", turn + "\n<|im_end|>")
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hello"}]
    exported = with_scoring_template(tok, (EOS, TURN))
    rendered = exported.apply_chat_template(conv, tokenize=False)
    assert rendered.endswith("assistant\nHello<|im_end|>"), rendered
    assert exported.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True))


def test_a_reward_model_keeps_the_set_for_its_readers(run_stage, two_eos_dir):
    """train-rm of a model listing two EOS ids: its `final/` config keeps the set (`rlhf eval` of the reward model
    and `load_generation_config` read it there) and its template ends a turn at the tokenizer's EOS."""
    from transformers import AutoTokenizer

    _, rm_dir, _ = run_stage("train_rm", [f"model.name_or_path={two_eos_dir}", "model.init=pretrained",
                                          "model.tokenizer=null", "data.builtin.rm_train=8", "data.builtin.rm_eval=4",
                                          "rm.batch_size=4", "rm.micro_batch_size=2", "rm.max_steps=1"])
    final = rm_dir / "final"
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == [EOS, TURN]
    tok = AutoTokenizer.from_pretrained(final)
    assert eos_ids(tok, load_generation_config(str(final))) == (EOS, TURN)
    _, eval_dir, _ = run_stage("eval", [f"reward_model.path={rm_dir}", "data.builtin.rm_train=8",
                                        "data.builtin.rm_eval=4"])
    result = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert result["mode"] == "reward_model" and result["pairs"] == 4
