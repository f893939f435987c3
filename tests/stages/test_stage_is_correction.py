"""`rollout.is_correction` (the engine correction, issue 42) in `rlhf train-ppo`, tiny random model, CPU.

vLLM is not installed here, so the engine's log-probs are synthetic: an `Experience` from the hf engine gets
`engine_logprobs` set by hand, which is all the vLLM engine adds to it (`rollout/vllm_engine.py`). With the hf
engine itself a set correction does nothing and says so once."""

import math

import pytest
import torch
from stage_helpers import compose
from test_stage_ppo import build_trainer

from rlhf_cli.config import ConfigError
from rlhf_cli.preflight import VALIDATORS
from rlhf_cli.rollout import is_correction_stats

# 2 prompts × 4 samples, two minibatches: the update is off-policy, the old log-probs come from the rollout's pass
BATCH = ["ppo.rollout_batch_size=2", "ppo.n_samples_per_prompt=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4", "reward.type=checker"]
GROUPS = [*BATCH, "ppo.advantage_estimator=grpo"]


def rollout(tmp_path, overrides=()):
    tr = build_trainer(tmp_path, [*GROUPS, *overrides])
    exp, _, _ = tr.maker.make_experience(0)
    gen = torch.Generator().manual_seed(0)
    mask = exp.mask.bool()
    exp.advantages = torch.where(mask, torch.randn(mask.shape, generator=gen), 0.0)  # the checker gives 0 here
    return tr, exp


def policy_losses(tr, exp, mode, engine_shift, high=2.0):
    """The policy loss of each of the update's first-epoch micro-batches with engine log-probs = old − shift."""
    tr.cfg.rollout.is_correction, tr.cfg.rollout.is_high = mode, high
    exp.engine_logprobs = torch.where(exp.mask.bool(), exp.logprobs - engine_shift, 0.0)
    out = []
    for b, num_tokens, num_seqs, _ in tr.micro_batches(exp):
        out.append(tr.losses(b, num_tokens, num_seqs).policy.item())
        if len(out) == 2:
            break
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gae"])
def test_tis_truncates_the_ratio_and_icepop_masks_it(tmp_path, estimator):
    tr = build_trainer(tmp_path, [*BATCH, f"ppo.advantage_estimator={estimator}"])
    exp, _, _ = tr.maker.make_experience(0)
    gen = torch.Generator().manual_seed(0)
    exp.advantages = torch.where(exp.mask.bool(), torch.randn(exp.mask.shape, generator=gen), 0.0)
    plain = policy_losses(tr, exp, "none", 0.0)
    assert all(x != 0 for x in plain)
    # ρ = π_old/μ = e^shift on every token
    assert policy_losses(tr, exp, "tis", 0.0) == pytest.approx(plain, rel=1e-6)  # ρ = 1
    assert policy_losses(tr, exp, "tis", math.log(1.5)) == pytest.approx([1.5 * x for x in plain], rel=1e-5)
    assert policy_losses(tr, exp, "tis", math.log(4.0)) == pytest.approx([2.0 * x for x in plain], rel=1e-5)
    assert policy_losses(tr, exp, "icepop", math.log(1.5)) == pytest.approx([1.5 * x for x in plain], rel=1e-5)
    assert policy_losses(tr, exp, "icepop", math.log(4.0)) == [0.0, 0.0]  # outside [0.5, 2]: every token masked
    assert policy_losses(tr, exp, "seq_mask", math.log(0.25)) == [0.0, 0.0]
    assert policy_losses(tr, exp, "seq_mask", math.log(1.5)) == pytest.approx(plain, rel=1e-6)


def test_the_statistics_are_the_ratios_quantiles_and_the_masked_fraction(tmp_path):
    tr, exp = rollout(tmp_path)
    mask = exp.mask.bool()
    # ρ = 4 on the first row's tokens, 1 elsewhere
    shift = torch.zeros(mask.shape)
    shift[0] = math.log(4.0)
    exp.engine_logprobs = torch.where(mask, exp.logprobs - shift, 0.0)
    n0, n = int(mask[0].sum()), int(mask.sum())
    stats = is_correction_stats(exp, "icepop", None, 2.0)
    assert stats["rollout/is_masked_frac"] == pytest.approx(n0 / n)
    assert stats["rollout/is_ratio_p50"] == pytest.approx(1.0) and stats["rollout/is_ratio_p1"] == pytest.approx(1.0)
    assert stats["rollout/is_ratio_p99"] == pytest.approx(4.0 if n0 / n > 0.01 else 1.0, rel=1e-5)
    stats = is_correction_stats(exp, "seq_mask", None, 2.0)  # per sequence: 1 of the 8 rows
    assert stats["rollout/is_masked_frac"] == pytest.approx(1 / mask.any(1).sum().item())
    assert is_correction_stats(exp, "none", None, 2.0) == {}
    exp.engine_logprobs = None
    assert is_correction_stats(exp, "tis", None, 2.0) == {}


def test_with_the_hf_engine_a_set_correction_says_once_that_it_does_nothing(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        tr, exp = rollout(tmp_path, ["rollout.is_correction=tis"])
    said = [r.getMessage() for r in caplog.records if "does nothing with rollout.engine=hf" in r.getMessage()]
    assert len(said) == 1 and exp.engine_logprobs is None
    b, num_tokens, _, _ = next(tr.micro_batches(exp))
    assert b.engine_logprobs is None
    corrected = tr.losses(b, num_tokens).policy.item()
    tr.cfg.rollout.is_correction = "none"
    assert corrected == tr.losses(b, num_tokens).policy.item() != 0  # no engine log-probs: no weights


def test_top_p_below_one_warns_once_that_the_ratio_is_not_renormalised(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        build_trainer(tmp_path, [*GROUPS, "ppo.top_p=0.9"])
    said = [r.getMessage() for r in caplog.records if "not renormalised over the kept tokens" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ppo.top_p=0.9")


@pytest.mark.parametrize("extra,needle", [
    (["rollout.is_correction=ice"], "rollout.is_correction"),
    (["rollout.is_high=0"], "rollout.is_high must be > 0"),
    (["rollout.is_low=3", "rollout.is_high=2"], r"rollout.is_low must be in \[0, rollout.is_high=2.0\]")])
def test_bad_bounds_are_refused(extra, needle):
    cfg = compose("train_ppo", [*GROUPS, *extra])
    with pytest.raises(ConfigError, match=needle):
        VALIDATORS["train_ppo"](cfg)
