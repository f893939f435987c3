"""Shaping: a rollout's scores and log-probs -> per-token rewards, advantages and returns (`ppo.kl_in`,
`ppo.advantage_estimator`, `ppo.whiten_advantages`), over the tokens the policy sampled (the action mask)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli.core import add_at_last_token, kl_penalized_rewards
from rlhf_cli.rollout.stats import whiten_across_ranks


def shape(p: Any, estimator: Any, whiten: bool, beta: float, *, score: torch.Tensor, old_logprobs: torch.Tensor,
          ref_logprobs: torch.Tensor, values: torch.Tensor | None, action_mask: torch.Tensor,
          loss_mask: torch.Tensor, valid: torch.Tensor, groups: torch.Tensor,
          teacher_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards (B, R) float32: −β·kl_t on each sampled token plus the score (B,) at the last sampled
    token with `ppo.kl_in=reward`, the score alone with `loss` (β·KL is then a loss term); then (advantages,
    returns) (B, R) by the estimator (`core.ESTIMATORS[ppo.advantage_estimator]`) over the sampled tokens, the
    advantages whitened over `loss_mask`'s tokens of all ranks when `whiten` (`ppo.whiten_advantages`, or the
    estimator's default). A row that does not count (`valid` False: unscorable, or masked by `ppo.truncated=mask`)
    gets advantage 0 on every token, whatever the estimator.

    p: the run's `ppo` section; beta: β, the KL controller's value. old_logprobs, ref_logprobs: (B, R) float32;
    values: (B, R) float32 old values, None without a critic; action_mask: (B, R) float, 1 = a token the policy
    sampled (EOS included; `Episodes.action_mask`); loss_mask: (B, R), those of its tokens that enter the loss;
    valid: (B,) bool, rows that count in a group baseline and learn; groups: (B,) long group ids. score holds no
    NaN: an unscorable row's is 0 and it is not valid (`scores.unscored_rows`). teacher_rewards: (B, R) float32,
    on-policy distillation's per-token rewards (`core.teacher_token_rewards` × `reward.weights.teacher`), added to
    every sampled token's reward; None without a teacher."""
    if p.kl_in == "reward":
        rewards = kl_penalized_rewards(score, old_logprobs, ref_logprobs, action_mask, beta, p.kl_estimator)
    else:  # β·KL is a loss term (PolicyLearner.losses): the reward is the score alone
        rewards = add_at_last_token(torch.zeros_like(old_logprobs), action_mask, score)
    if teacher_rewards is not None:  # per token, beside the sequence score (`core.estimators.distill`)
        rewards = rewards + teacher_rewards
    advantages, returns = estimator(rewards, action_mask, scores=score, groups=groups, valid=valid, values=values,
                                    gamma=p.gamma, lam=p.lam)
    if whiten:
        advantages = whiten_across_ranks(advantages, loss_mask)
    return rewards, advantages * valid.to(advantages.dtype)[:, None], returns  # a row that does not count: 0
