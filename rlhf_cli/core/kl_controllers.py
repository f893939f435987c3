"""KL-coefficient controllers for the per-token KL penalty ``-beta * KL_t``.

Both expose ``.value`` (the current beta, ``ppo.kl_beta``), ``.update(current_kl, n_steps)``
after each rollout, and ``state_dict()`` / ``load_state_dict()`` for checkpoints.

Units: ``current_kl`` is the mean over sequences of the per-sequence *summed* KL, in nats
per sequence, e.g. ``kl_estimate(logprobs, ref_logprobs, mask=mask).sum(1).mean()``;
``target`` (``ppo.kl_target``) uses the same unit. ``n_steps`` is the number of episodes
(sequences) in the rollout.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor


def _finite_float(name: str, value: float | Tensor) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class _KLController:
    """What both controllers share: ``value`` is the current beta, and it is all a checkpoint holds
    (``target`` and ``horizon`` come from the config on resume)."""

    value: float

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _finite_float("value", state["value"])


class FixedKLController(_KLController):
    """Constant KL coefficient: ``update`` does nothing.

    Args:
        beta: KL coefficient, >= 0.

    Raises:
        ValueError: ``beta`` negative or not finite.
    """

    def __init__(self, beta: float) -> None:
        self.value = _finite_float("beta", beta)
        if self.value < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """No-op (kept so trainers can call any controller the same way)."""

    def __repr__(self) -> str:
        return f"FixedKLController(beta={self.value})"


class AdaptiveKLController(_KLController):
    """Proportional controller steering the KL towards ``target`` (Ziegler et al. 2019,
    "Fine-Tuning Language Models from Human Preferences", section 2.2, eq. 3)::

        error = clip(current_kl / target - 1, -0.2, 0.2)
        beta <- beta * (1 + error * n_steps / horizon)

    beta is floored at 0 (only reachable when ``n_steps > 5 * horizon``).

    Args:
        init_beta: initial KL coefficient, >= 0.
        target: target KL (``ppo.kl_target``), nats per sequence, > 0.
        horizon: episodes over which the error is corrected (Ziegler et al. use 10000), > 0.

    Raises:
        ValueError: an argument out of range or not finite.
    """

    def __init__(self, init_beta: float, target: float, horizon: float) -> None:
        self.value = _finite_float("init_beta", init_beta)
        self.target = _finite_float("target", target)
        self.horizon = _finite_float("horizon", horizon)
        if self.value < 0:
            raise ValueError(f"init_beta must be >= 0, got {init_beta}")
        if self.target <= 0:
            raise ValueError(f"target must be > 0 (nats per sequence), got {target}")
        if self.horizon <= 0:
            raise ValueError(f"horizon must be > 0 (episodes), got {horizon}")

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Update ``value`` from the rollout's KL (nats per sequence) and its episode count.

        Raises:
            ValueError: ``current_kl`` not finite (it would poison beta for the rest of
                the run), or ``n_steps`` negative.
        """
        current_kl = _finite_float("current_kl", current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value = max(self.value * (1.0 + error * n_steps / self.horizon), 0.0)

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"
