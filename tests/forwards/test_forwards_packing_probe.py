"""The packing probe (`forwards.packing_probe`, issue 41): on the real model and attention backend, two short
segments packed into one row must give each segment's hidden states alone; a backend that lets them attend to each
other (as an all-ones 2-D mask over packed rows did, transformers PR #46634) turns packing off with one line, and
the run goes on unpacked."""

import logging

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rlhf_cli.data import PackedPairCollator, PairCollator
from rlhf_cli.forwards import packing_probe, pair_collator, use_packing
from rlhf_cli.models import load_causal_lm, load_scalar_model


def broken_sdpa(monkeypatch):
    """sdpa that drops the 4D mask and attends causally over the whole row: packed segments see each other."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def broken(module, query, key, value, attention_mask, **kwargs):
        return sdpa(module, query, key, value, None, **{**kwargs, "is_causal": True})

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", broken)


def test_the_probe_passes_on_a_sound_backend_in_fp32_and_bf16_autocast(tiny_model_cfg, tokenizer):
    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    assert lm.config._attn_implementation == "sdpa"
    assert packing_probe(lm) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packing_probe(lm) is None
    lm.train()
    assert packing_probe(lm) is None and lm.training  # the mode is restored
    assert use_packing(lm, True)


def test_the_probe_fails_on_a_broken_backend_and_packing_goes_off(monkeypatch, caplog, tiny_model_cfg, tokenizer):
    rm = load_scalar_model(tiny_model_cfg, "fp32", seed=3)
    assert isinstance(pair_collator(rm, tokenizer.pad_token_id, True), PackedPairCollator)  # sound: packed
    broken_sdpa(monkeypatch)
    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    reason = packing_probe(lm)
    assert reason is not None and "attending to each other" in reason and "sdpa" in reason
    fresh = load_scalar_model(tiny_model_cfg, "fp32", seed=3)
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.forwards.packing"):
        assert not use_packing(lm, True)
        assert isinstance(pair_collator(fresh, tokenizer.pad_token_id, True), PairCollator)
        assert not use_packing(fresh, True)
    lines = [r.getMessage() for r in caplog.records if "packing probe" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("data.packing=true is off for this model")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_noise_is_not_taken_for_a_broken_backend(tiny_model_cfg, tokenizer, dtype):
    """The layout changes the order of sums only: the probe's own difference stays far inside its tolerance."""
    from rlhf_cli.forwards.packing import PROBE_TOLERANCE

    lm = load_causal_lm(tiny_model_cfg, "bf16" if dtype == torch.bfloat16 else "fp32", seed=1, tokenizer=tokenizer)
    assert next(lm.parameters()).dtype == dtype and PROBE_TOLERANCE[dtype] >= 1e-3
    assert packing_probe(lm) is None
