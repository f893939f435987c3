"""Causal LM loading: dtypes, the seeded tiny model, switches, parameter counts, the GGUF cache."""

import copy
import logging
import os
from pathlib import Path

import pytest
import torch

from rlhf_cli.config import ConfigError
from rlhf_cli.models import count_parameters, load_causal_lm, torch_dtype_for
from rlhf_cli.models.loading import atomic_dir, is_checkpointing


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_torch_dtype_for():
    assert torch_dtype_for("fp32") is torch.float32
    assert torch_dtype_for("bf16-autocast") is torch.float32
    assert torch_dtype_for("bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="precision='fp16'"):
        torch_dtype_for("fp16")


def test_tiny_model_is_deterministic_and_keeps_global_rng(tiny_model_cfg, tokenizer, tiny_causal):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    again = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert _same_weights(tiny_causal, again)
    other = load_causal_lm(tiny_model_cfg, seed=1, tokenizer=tokenizer)
    assert not _same_weights(tiny_causal, other)


def test_tiny_model_shape_and_special_tokens(tiny_model_cfg, tokenizer, tiny_causal):
    c = tiny_causal.config
    arch = tiny_model_cfg.arch
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (
        arch.num_hidden_layers, arch.hidden_size, arch.num_attention_heads)
    assert c.vocab_size == len(tokenizer)
    assert c.pad_token_id == tokenizer.pad_token_id == 0  # <|endoftext|>, not the EOS
    assert c.eos_token_id == tokenizer.eos_token_id == 2
    assert tiny_causal.generation_config.pad_token_id == 0
    assert tiny_causal.generation_config.eos_token_id == [2]  # the EOS set (`eos.eos_ids`)
    assert c.use_cache is True and not is_checkpointing(tiny_causal)


def test_precision_checkpointing_and_attention_switches(tiny_model_cfg, tokenizer):
    cfg = copy.deepcopy(tiny_model_cfg)
    cfg.gradient_checkpointing = True
    cfg.attn_implementation = "eager"
    model = load_causal_lm(cfg, precision="bf16", tokenizer=tokenizer)
    assert all(p.dtype is torch.bfloat16 for p in model.parameters())
    assert is_checkpointing(model) and model.config.use_cache is False
    assert model.config._attn_implementation == "eager"
    model.train()
    ids = torch.tensor([[5, 6, 7, 2]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_count_parameters_counts_tied_embedding_once(tiny_causal):
    c = tiny_causal.config
    assert c.tie_word_embeddings
    total = count_parameters(tiny_causal, non_embedding=False)
    assert total == sum(p.numel() for p in tiny_causal.parameters())  # tied weight appears once
    assert count_parameters(tiny_causal) == total - c.vocab_size * c.hidden_size


def test_atomic_dir_keeps_previous_dir_on_failure(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "a.txt").write_text("new")
            raise RuntimeError("crash while writing")
    assert (target / "a.txt").read_text() == "old"
    with atomic_dir(target, overwrite=False) as tmp:  # first writer wins
        (tmp / "a.txt").write_text("late")
    assert (target / "a.txt").read_text() == "old"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (target / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or backup dirs left


def test_atomic_dir_first_writer_wins_a_race(tmp_path, monkeypatch):
    """Two writers of a cache (the ranks of a node, or nodes sharing the cache) both miss it: the one renaming its dir
    in second, after its own check said there was none, keeps the first one's and raises nothing."""
    target = tmp_path / "cache" / "tokenizer"
    real = os.replace

    def other_writer_first(src, dst):  # the other writer's rename lands between this one's check and its rename
        if Path(dst) == target and not target.exists():
            target.mkdir()
            (target / "a.txt").write_text("first")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", other_writer_first)
    with atomic_dir(target, overwrite=False) as tmp:
        (tmp / "a.txt").write_text("second")
    assert (target / "a.txt").read_text() == "first"
    assert [p.name for p in target.parent.iterdir()] == ["tokenizer"]  # its temp dir removed


def test_gguf_is_dequantised_once_then_loaded_from_cache(tiny_model_cfg, tokenizer, tiny_causal, tmp_path, monkeypatch):
    """The GGUF branch with transformers' de-quantiser stubbed by the tiny model (a real GGUF load
    is in test_models_smollm2.py): the first load writes the cache dir, the second only reads it."""
    import transformers
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    from rlhf_cli.models.loading import gguf_cache_dir

    real = transformers.AutoModelForCausalLM.from_pretrained.__func__
    gguf_calls = []

    def fake_from_pretrained(cls, path, *args, **kwargs):
        if kwargs.get("gguf_file"):
            gguf_calls.append(kwargs["gguf_file"])
            model = copy.deepcopy(tiny_causal)  # looks like a de-quantised GGUF model: not serialisable
            model.config.quantization_config = GgufConfig()
            model.hf_quantizer = AutoHfQuantizer.from_config(GgufConfig())
            return model
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(fake_from_pretrained))
    cfg = copy.deepcopy(tiny_model_cfg)
    cfg.init, cfg.gguf_file, cfg.cache_dir = "pretrained", cfg.tokenizer, str(tmp_path)
    mdir = gguf_cache_dir(cfg.gguf_file, cfg.cache_dir) / "model"

    first = load_causal_lm(cfg, tokenizer=tokenizer)
    assert len(gguf_calls) == 1 and (mdir / "config.json").is_file()
    assert "quantization_config" not in (mdir / "config.json").read_text()
    second = load_causal_lm(cfg, tokenizer=tokenizer)
    assert len(gguf_calls) == 1  # cache hit: no second de-quantisation
    assert _same_weights(first, second) and _same_weights(first, tiny_causal)
    assert first.config.pad_token_id == 0


def test_an_attention_implementation_the_family_lacks_falls_back(tmp_path, tokenizer, caplog):
    """Gemma 2 under transformers 5 supports no sdpa: `model.attn_implementation=sdpa` (the default) loads it with
    eager attention and says so in one line, for the causal LM and for a reward model saved from it."""
    from family_helpers import save_tiny

    from rlhf_cli.models import load_causal_lm, load_scalar_model, save_hf

    path = save_tiny("gemma2", tokenizer, tmp_path / "gemma2")
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="does not support"):  # the case this fallback exists for
        AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.models.loading"):
        lm = load_causal_lm(str(path), tokenizer=tokenizer)
    assert lm.config._attn_implementation == "eager"
    lines = [r.getMessage() for r in caplog.records if "attn_implementation" in r.getMessage()]
    assert len(lines) == 1 and "sdpa is not supported" in lines[0] and "using eager" in lines[0]
    rm = load_scalar_model(str(path), seed=0)
    save_hf(rm, tokenizer, tmp_path / "rm")
    assert load_scalar_model(str(tmp_path / "rm")).config._attn_implementation == "eager"


def test_other_errors_are_not_taken_for_a_missing_implementation():
    from rlhf_cli.models import with_attention_fallback

    def build(attn):
        raise ValueError("the config is broken")

    with pytest.raises(ValueError, match="broken"):
        with_attention_fallback(build, "sdpa", "m")
    assert with_attention_fallback(lambda a: a, "sdpa", "m") == "sdpa"


def test_a_model_dir_without_a_tokenizer_is_one_line_naming_the_dir(tiny_model_cfg, tiny_causal, tokenizer, tmp_path):
    """A model dir saved without its tokenizer (weights and config only) is refused in one line naming the dir and
    the fix, where transformers raised a long ValueError about sentencepiece: as the policy's tokenizer and as a
    scoring model's (`check_same_tokenizer`); with the tokenizer saved it loads."""
    from rlhf_cli.models.loading import ModelSourceError, load_tokenizer
    from rlhf_cli.stages.common import check_same_tokenizer

    tiny_causal.save_pretrained(tmp_path / "m")
    cfg = copy.deepcopy(tiny_model_cfg)
    cfg.tokenizer, cfg.name_or_path, cfg.gguf_file = None, str(tmp_path / "m"), None
    with pytest.raises(ModelSourceError, match=r"^'.*/m' holds no tokenizer \(no tokenizer\*.*\): save "
                                               r"the model's tokenizer there"):
        load_tokenizer(cfg)
    with pytest.raises(ModelSourceError, match=r"holds no tokenizer"):
        check_same_tokenizer(tokenizer, str(tmp_path / "m"), "reward model")
    tokenizer.save_pretrained(tmp_path / "m")
    check_same_tokenizer(tokenizer, str(tmp_path / "m"), "reward model")
    assert load_tokenizer(cfg).eos_token_id == tokenizer.eos_token_id
