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
    mask = exp.loss_mask.bool()
    exp.advantages = torch.where(mask, torch.randn(mask.shape, generator=gen), 0.0)  # the checker gives 0 here
    return tr, exp


def policy_losses(tr, exp, mode, engine_shift, high=2.0):
    """The policy loss of each of the update's first-epoch micro-batches with engine log-probs = old − shift."""
    tr.cfg.rollout.is_correction, tr.cfg.rollout.is_high = mode, high
    exp.engine_logprobs = torch.where(exp.loss_mask.bool(), exp.old_logprobs - engine_shift, 0.0)
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
    exp.advantages = torch.where(exp.loss_mask.bool(), torch.randn(exp.loss_mask.shape, generator=gen), 0.0)
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
    mask = exp.loss_mask.bool()
    # ρ = 4 on the first row's tokens, 1 elsewhere
    shift = torch.zeros(mask.shape)
    shift[0] = math.log(4.0)
    exp.engine_logprobs = torch.where(mask, exp.old_logprobs - shift, 0.0)
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


@pytest.mark.parametrize("extra,needle", [
    (["rollout.is_correction=ice"], "rollout.is_correction"),
    (["rollout.is_high=0"], "rollout.is_high must be > 0"),
    (["rollout.is_low=3", "rollout.is_high=2"], r"rollout.is_low must be in \[0, rollout.is_high=2.0\]")])
def test_bad_bounds_are_refused(extra, needle):
    cfg = compose("train_ppo", [*GROUPS, *extra])
    with pytest.raises(ConfigError, match=needle):
        VALIDATORS["train_ppo"](cfg)


def plain_logprobs(tr, exp, top_p):
    """The policy's log-probs of `exp`'s response tokens in plain torch: the model's logits / temperature,
    transformers' `TopPLogitsWarper` (the hf engine's filter) when top_p < 1, a log-softmax, the sampled token."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from rlhf_cli.models import lm_of

    ids, am, P = exp.input_ids, exp.attention_mask, exp.prompt_len
    with torch.no_grad():
        logits = lm_of(tr.actor.module)(input_ids=ids, attention_mask=am,
                                        position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    logits = logits[:, P - 1:-1].float() / tr.p.temperature  # (B, R, V)
    if top_p < 1:
        B, R, V = logits.shape
        logits = TopPLogitsWarper(top_p)(None, logits.reshape(B * R, V)).reshape(B, R, V)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
    return torch.where(am[:, P:].bool(), lp, 0.0)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_below_top_p_1_the_trainers_log_probs_are_renormalised_over_the_nucleus(tmp_path, top_p):
    """ppo.top_p < 1: the rollout's old log-probs and the update's new ones are the sampler's nucleus
    renormalised (what vLLM's processed_logprobs hold), so an engine correction against them finds ρ = 1; at
    top_p = 1 the whole softmax, as before."""
    tr, exp = rollout(tmp_path, [f"ppo.top_p={top_p}", "ppo.temperature=1.5", "ppo.max_new_tokens=8"])
    mask = exp.attention_mask[:, exp.prompt_len:].bool()
    want = plain_logprobs(tr, exp, top_p)
    assert torch.isfinite(want).all()  # every sampled token lies in the sampler's nucleus
    torch.testing.assert_close(exp.old_logprobs, want, rtol=1e-5, atol=1e-5)
    full = plain_logprobs(tr, exp, 1.0)
    gap = (exp.old_logprobs - full)[mask]  # -log(kept mass) >= 0 per token; 0 at top_p = 1
    assert (gap > 1e-3).float().mean() > 0.5 if top_p < 1 else gap.abs().max() < 1e-5
    # the update's own forwards (the one the rollout ran for the first micro-batch, the learner's for the rest),
    # with no step taken: the same numbers
    for b, num_tokens, num_seqs, rows in tr.micro_batches(exp):
        new = tr.losses(b, num_tokens, num_seqs).logprobs
        torch.testing.assert_close(new, want[rows], rtol=1e-5, atol=1e-5)
    # the engine correction against the engine's processed log-probs: nothing off-policy
    exp.engine_logprobs = want
    stats = is_correction_stats(exp, "icepop", None, 1.01)
    assert stats["rollout/is_masked_frac"] == 0.0
    assert stats["rollout/is_ratio_p1"] == pytest.approx(1.0, abs=1e-4)
    assert stats["rollout/is_ratio_p99"] == pytest.approx(1.0, abs=1e-4)
