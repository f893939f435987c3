"""Advantage estimators, by the name `ppo.advantage_estimator` gives: the functions of the choices
`registry.ADVANTAGE_ESTIMATORS` declares.

Every estimator turns a rollout into per-token advantages and the value targets (returns) under one
signature::

    advantages, returns = ESTIMATORS[name](rewards, mask, scores=..., groups=..., valid=..., values=...,
                                           gamma=ppo.gamma, lam=ppo.lam)

    rewards  (B, T) per-token rewards: `core.kl_penalized_rewards`, −β·kl_t plus the score at the last real
             token (`ppo.kl_in=reward`), or the score alone (`ppo.kl_in=loss`: β·KL is a loss term instead)
    mask     (B, T) 1 on real response tokens (EOS included), 0 on the right padding
    scores   (B,)   the sequence scores inside `rewards` (what a group baseline is taken of)
    groups   (B,)   group id: rows sampled from one prompt share it (`ppo.n_samples_per_prompt`)
    valid    (B,)   bool, rows that learn (False: masked out of the loss by `ppo.truncated=mask`)
    values   (B, T) the critic's V(s_t), or None for an estimator with `needs_critic=False`
    returns  (B, T) the critic's regression targets (for a critic-free estimator: the advantages, which
             nothing trains on)

Both outputs are at least float32, 0 on padding, not whitened: the trainer whitens them over the whole
rollout when `ppo.whiten_advantages` says so, whose default (null) is the estimator's own `whiten`.

The estimators (the README lists them with their papers):

    gae           GAE(γ, λ) against a learned critic (Schulman et al. 2016)               critic, whitened
    grpo          (s − mean_g) / (std_g + ε), KL reward-to-go (Shao et al. 2024)          n >= 2
    dr_grpo       s − mean_g, KL reward-to-go (Liu et al. 2025, Dr. GRPO)                 n >= 2
    rloo          s − leave-one-out mean, KL reward-to-go (Ahmadian et al. 2024)          n >= 2
    reinforce_pp  s, KL reward-to-go, whitened over the batch (Hu 2025, REINFORCE++)      whitened
    distill       r_t + s, per token, no discount (Agarwal et al. 2024, GKD λ = 1)         teacher

The critic-free ones share one rule: the sequence score is replaced by its group-adjusted value
(`core.groups.group_adjusted_scores`, with its exact semantics for flat groups, groups of one and invalid
rows), the per-token KL rewards stay as they are, and the advantage of token t is the γ-discounted
reward-to-go from t (OpenRLHF's rule for its rloo / group_norm / reinforce estimators). With γ = 1 and
`ppo.kl_in=loss` every token of a row gets the row's adjusted score, as in the GRPO paper.

To add an estimator: declare it in `registry.ADVANTAGE_ESTIMATORS` (its name and metadata, which `config.py`
reads), write its function here (shapes, units, paper and equation in its docstring, a test against a
hand-computed example and a loop reference) and bind it by name in `ESTIMATORS` below (docs/architecture.md,
"A new loss").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

import rlhf_cli.registry as registry
from rlhf_cli.core.advantages import add_at_last_token, compute_gae, discounted_returns
from rlhf_cli.core.groups import group_adjusted_scores

EstimatorFn = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator(registry.EstimatorChoice):
    """A bound estimator: its declaration's fields (`registry.EstimatorChoice`: `name`, `needs_critic`,
    `min_group_size`, `whiten`) and its function `fn(rewards, mask, *, scores, groups, valid, values, gamma, lam)
    -> (advantages, returns)`."""

    fn: EstimatorFn = field(kw_only=True)

    def __call__(self, rewards: Tensor, mask: Tensor, *, scores: Tensor, groups: Tensor, valid: Tensor,
                 values: Tensor | None, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
        if self.needs_critic and values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs the critic's values")
        return self.fn(rewards, mask, scores=scores, groups=groups, valid=valid, values=values, gamma=gamma,
                       lam=lam)


def gae(rewards: Tensor, mask: Tensor, *, values: Tensor, gamma: float, lam: float,
        **_: object) -> tuple[Tensor, Tensor]:
    """GAE(γ = `ppo.gamma`, λ = `ppo.lam`) against the critic's values: see `core.compute_gae` (Schulman et al.
    2016, eq. 16). returns = advantages + values, the λ-return. Groups play no part."""
    return compute_gae(rewards, values, mask, gamma, lam)


def outcome_advantages(rewards: Tensor, mask: Tensor, scores: Tensor, groups: Tensor, valid: Tensor, gamma: float,
                       baseline: str) -> tuple[Tensor, Tensor]:
    """The critic-free rule: A_t = Σ_{t' >= t} γ^(t'−t) r̃_t', where r̃ is `rewards` with each row's score
    replaced by its group-adjusted score (`core.groups.group_adjusted_scores(..., baseline)`); invalid rows are 0.

    Shapes: rewards/mask (B, T), scores/groups/valid (B,). Returns (advantages, advantages), at least float32,
    reward units (`grpo`: group-std units for the score part), 0 on padding.
    """
    adjusted = group_adjusted_scores(scores, groups, valid, baseline)
    shaped = add_at_last_token(rewards, mask, adjusted.to(rewards.dtype) - scores.to(rewards.dtype))
    advantages = discounted_returns(shaped, mask, gamma) * valid.to(shaped.dtype)[:, None]
    return advantages, advantages


def grpo(rewards: Tensor, mask: Tensor, *, scores: Tensor, groups: Tensor, valid: Tensor, gamma: float,
         **_: object) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath, section 4.1.2, outcome supervision): Â_i = (s_i − mean(s_g)) / (std(s_g)
    + ε) on every token of row i, std the unbiased sample std of the group, ε = 1e-6; plus the KL reward-to-go
    when `ppo.kl_in=reward`. See `outcome_advantages`."""
    return outcome_advantages(rewards, mask, scores, groups, valid, gamma, "grpo")


def dr_grpo(rewards: Tensor, mask: Tensor, *, scores: Tensor, groups: Tensor, valid: Tensor, gamma: float,
            **_: object) -> tuple[Tensor, Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", section 3):
    Â_i = s_i − mean(s_g), without GRPO's division by the group std (which up-weights nearly-solved and
    nearly-failed prompts). Its other half, no per-response length normalisation, is `ppo.aggregation=token-mean`
    (the default). See `outcome_advantages`."""
    return outcome_advantages(rewards, mask, scores, groups, valid, gamma, "dr_grpo")


def rloo(rewards: Tensor, mask: Tensor, *, scores: Tensor, groups: Tensor, valid: Tensor, gamma: float,
         **_: object) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs"; Kool et al. 2019): Â_i = s_i − 1/(n−1) Σ_{j≠i} s_j, the baseline of each
    sample the mean of its group's other samples (unbiased). See `outcome_advantages`."""
    return outcome_advantages(rewards, mask, scores, groups, valid, gamma, "rloo")


def reinforce_pp(rewards: Tensor, mask: Tensor, *, scores: Tensor, groups: Tensor, valid: Tensor, gamma: float,
                 **_: object) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"):
    A_t = Σ_{t' >= t} γ^(t'−t) (−β·kl_t' + score at EOS), no baseline; the trainer then normalises the
    advantages over the whole global batch (`whiten=True`), which stands in for the critic. Works with one
    sample per prompt. See `outcome_advantages`."""
    return outcome_advantages(rewards, mask, scores, groups, valid, gamma, "none")


def distill(rewards: Tensor, mask: Tensor, *, scores: Tensor, groups: Tensor, valid: Tensor,
            **_: object) -> tuple[Tensor, Tensor]:
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), eq. 2 with λ = 1 and the reverse KL; the sampled-token form of Thinking
    Machines' "On-Policy Distillation", 2025, and TRL's `DistillationTrainer` with `beta=1, lmbda=1`):

        A_t = r_t − s·[t = last] + ŝ                       on each sampled token t of a valid row, else 0

    where r_t = log π_teacher(a_t|s_t) − log π_student(a_t|s_t) (the negated sampled-token reverse KL,
    `core.teacher_token_rewards`, already in `rewards`, plus −β·kl_t with `ppo.kl_in=reward`), s the row's
    sequence score (the other sources of `reward.weights` and the score rules such as the missing-EOS penalty; 0
    with the teacher alone), which `rewards` holds at the last token, and ŝ its group-normalised advantage,
    GRPO's (s − mean_g)/(std_g + ε) (`core.groups.group_adjusted_scores`; 0 for a group of one, so a score beside
    the teacher needs `ppo.n_samples_per_prompt` >= 2, which config.py checks), on every token. No discount
    (`ppo.gamma` and `ppo.lam` are not read) and no baseline for the teacher's part: each token is credited with
    its own log-ratio, so the policy gradient's expectation is −∇ KL(π_student ‖ π_teacher) per token.

    Shapes: rewards/mask (B, T), scores/valid (B,). Returns (advantages, advantages), at least float32, nats
    (plus score units), 0 on padding and on invalid rows.
    """
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    m, s = mask.to(dtype), scores.to(dtype)
    per_token = rewards.to(dtype) - add_at_last_token(torch.zeros_like(m), m, s)  # the score taken off the last
    adjusted = group_adjusted_scores(scores, groups, valid, "grpo").to(dtype)
    advantages = (per_token + adjusted[:, None]) * m * valid.to(dtype)[:, None]
    return advantages, advantages


ESTIMATORS: dict[str, AdvantageEstimator] = {
    name: AdvantageEstimator(**vars(registry.ADVANTAGE_ESTIMATORS[name]), fn=fn)
    for name, fn in registry.ADVANTAGE_ESTIMATORS.bind({
        "gae": gae, "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
        "distill": distill}).items()}
"""The estimators by the name `ppo.advantage_estimator` gives: `registry.ADVANTAGE_ESTIMATORS` bound to their
functions, in its order."""
