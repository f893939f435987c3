"""Advantage estimators, by the name `ppo.estimator` gives: the one place a new estimator is registered.

Every estimator turns a rollout's per-token rewards into per-token advantages and the value targets
(returns) under one signature::

    advantages, returns = ESTIMATORS[name](rewards, mask, values=values, gamma=ppo.gamma, lam=ppo.lam)

    rewards  (B, T) per-token rewards (`core.kl_penalized_rewards`: −β·kl_t plus the score at the EOS)
    mask     (B, T) 1 on real response tokens (EOS included), 0 on the right padding
    values   (B, T) the critic's V(s_t), or None for an estimator with `needs_critic=False`
    returns  (B, T) the critic's regression targets (for a critic-free estimator: the advantages' own
             baseline-free targets, which nothing trains on)

Both outputs are at least float32, 0 on padding, not whitened (the trainer whitens when
`ppo.whiten_advantages`). `needs_critic` declares whether the estimator reads a learned critic's values
(calling it without them raises); every estimator registered today does, so the PPO stage always builds a
critic.

To add an estimator: write its function in this package (shapes, units, paper and equation in its
docstring, a test against a hand-computed example), register it below with `register`, and add its
name to `config.ESTIMATORS` (a test checks that the two lists agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rlhf_cli.core.advantages import compute_gae


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: `fn(rewards, mask, *, values, gamma, lam) -> (advantages, returns)`."""

    name: str
    fn: Callable[..., tuple[Tensor, Tensor]]
    needs_critic: bool

    def __call__(self, rewards: Tensor, mask: Tensor, *, values: Tensor | None, gamma: float,
                 lam: float) -> tuple[Tensor, Tensor]:
        if self.needs_critic and values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs the critic's values")
        return self.fn(rewards, mask, values=values, gamma=gamma, lam=lam)


ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register(name: str, needs_critic: bool) -> Callable[[Callable[..., tuple[Tensor, Tensor]]],
                                                        Callable[..., tuple[Tensor, Tensor]]]:
    """Decorator: add `fn` to ESTIMATORS under `name` (the value of `ppo.estimator` that selects it).
    Raises ValueError when the name is taken."""

    def add(fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_critic)
        return fn

    return add


@register("gae", needs_critic=True)
def gae(rewards: Tensor, mask: Tensor, *, values: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE(γ = `ppo.gamma`, λ = `ppo.lam`) against the critic's values: see `core.compute_gae` (Schulman et al.
    2016, eq. 16). returns = advantages + values, the λ-return."""
    return compute_gae(rewards, values, mask, gamma, lam)
