"""Rewards and advantages: KL-shaped per-token rewards, GAE, rewards-to-go.

Shapes and mask conventions are those of :mod:`rlhf_cli.core.ops`: ``(B, T)`` tensors,
``mask`` 1 on real response tokens (EOS included), 0 on the right padding after them.
Every output is 0 on padding, and nothing a padded position holds (±1e6, ±inf, NaN)
reaches a real position.

A multi-turn episode's mask has gaps (``1…1 0…0 1…1``: the 0s are tokens a tool or an
environment wrote, which the policy did not sample). The recursions here run over the
sampled tokens only, in order, as if the gap tokens were not there (`_over_sampled`);
the last real token is the last 1 of the row. A mask without gaps gives the values it
always did (the compaction is the identity on a right-padded row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf_cli.core.ops import (
    _bool_mask,
    _check_shapes,
    _compute_dtype,
    kl_estimate,
    masked_fill_zero,
)


def _check_unit_interval(**params: float) -> None:
    for name, value in params.items():
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


def teacher_token_rewards(teacher_logprobs: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """The per-token reward of on-policy distillation: the negated sampled-token reverse KL,

        r[b, t] = log π_teacher(a_t|s_t) − log π_student(a_t|s_t)   on each sampled token, 0 on padding

    (Agarwal et al. 2024, GKD, with λ = 1; Thinking Machines' "On-Policy Distillation", 2025: the advantage is
    −(log π_sampler − log π_teacher)). Its mean over sampled tokens is minus a one-sample estimate of
    KL(π_student ‖ π_teacher) per token (`distill/reverse_kl`). A teacher equal to the student gives 0.

    Args:
        teacher_logprobs: ``(B, T)`` log π_teacher of the sampled tokens, at the sampling temperature.
        logprobs: ``(B, T)`` log π_student of the same tokens at the rollout's weights (the old log-probs).
        mask: ``(B, T)``, 1 = a token the policy sampled (the action mask).

    Returns:
        ``(B, T)`` float32 (at least), nats per token; 0 where ``mask`` is 0, whatever the inputs hold there.
    """
    _check_shapes(teacher_logprobs=teacher_logprobs, logprobs=logprobs, mask=mask)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    m = _bool_mask(mask)
    return torch.where(m, teacher_logprobs.to(dtype) - logprobs.to(dtype), torch.zeros((), dtype=dtype,
                                                                                        device=logprobs.device))


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_beta: float | Tensor,
    estimator: str = "k1",
) -> Tensor:
    """Per-token rewards of RLHF-PPO: ``-beta * KL_t`` on every real token, plus the
    sequence score on the last real token (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022).

    Naive equivalent, per row ``b`` with ``L_b`` real tokens::

        r[b, t] = -kl_beta * kl_estimate(logprobs, ref_logprobs, estimator)[b, t]  for t < L_b
        r[b, L_b - 1] += scores[b]                                          if L_b > 0
        r[b, t] = 0                                                         for t >= L_b

    Args:
        scores: ``(B,)`` reward-model score of each sequence (reward units).
        logprobs: ``(B, T)`` log pi of the sampled tokens under the rollout policy.
        ref_logprobs: ``(B, T)`` log pi_ref of the same tokens.
        mask: ``(B, T)``, 1 = real response token. The "last real token" is the last 1 of
            the row; a row with no real token gets no score and is all zeros.
        kl_beta: KL coefficient beta (``ppo.kl_beta``, e.g. ``kl_controller.value``), >= 0.
        estimator: ``"k1"`` (default, as in Ziegler et al.), ``"k2"`` or ``"k3"``; see
            :func:`rlhf_cli.core.ops.kl_estimate`.

    Returns:
        ``(B, T)`` rewards, at least float32, reward units per token; 0 on padding.

    Raises:
        ValueError: shape mismatch or unknown estimator.
    """
    _check_shapes(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores must be (B,) = {tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}")
    m = _bool_mask(mask)
    kl = kl_estimate(logprobs, ref_logprobs, estimator, mask=m)  # (B, T), 0 on padding
    return add_at_last_token(-kl_beta * kl, m, scores)


def add_at_last_token(rewards: Tensor, mask: Tensor, scores: Tensor) -> Tensor:
    """``rewards`` with ``scores[b]`` added at the last real token of each row (the last 1 of ``mask``);
    a row with no real token is returned unchanged.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        mask: ``(B, T)``, 1 = real response token.
        scores: ``(B,)`` sequence scores (reward units).

    Returns:
        ``(B, T)`` in ``rewards``' dtype.
    """
    m = _bool_mask(mask)
    positions = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, positions, -1).amax(dim=1)  # (B,), -1 for an empty row
    score = torch.where(last >= 0, scores.to(rewards.dtype), 0.0)
    return rewards.scatter_add(1, last.clamp(min=0).unsqueeze(1), score.unsqueeze(1))


def _gae_deltas(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """TD residuals ``delta_t = r_t + gamma * V_{t+1} - V_t`` with padding zeroed first, so
    ``V`` after the last real token is 0 (terminal). Returns ``(deltas, values, mask)``."""
    _check_shapes(rewards=rewards, values=values, mask=mask)
    m = _bool_mask(mask)
    dtype = _compute_dtype(rewards, values)
    r = masked_fill_zero(rewards, m, dtype)
    v = masked_fill_zero(values, m, dtype)
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))  # V_{t+1}; 0 past the end
    deltas = torch.where(m, r + gamma * next_v - v, 0.0)
    return deltas, v, m


def _over_sampled(fn: Callable[..., tuple[Tensor, Tensor]], rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                  lam: float) -> tuple[Tensor, Tensor]:
    """``fn(rewards, values, mask, gamma, lam)`` run over each row's real tokens moved to the front, in order
    (a stable sort of the mask), and its outputs moved back: the gaps of a multi-turn mask are skipped, not
    ends of the episode. ``fn`` outputs 0 where the (compacted) mask is 0, so the gaps get 0."""
    _check_shapes(rewards=rewards, values=values, mask=mask)
    m = _bool_mask(mask)
    order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)  # (B, T): the real positions first
    advantages, returns = fn(rewards.gather(1, order), values.gather(1, order), m.gather(1, order), gamma, lam)
    return (torch.zeros_like(advantages).scatter(1, order, advantages),
            torch.zeros_like(returns).scatter(1, order, returns))


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, reverse loop over time (reference implementation).

    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16::

        delta_t = r_t + gamma * V_{t+1} - V_t      (V after the last real token = 0, terminal)
        A_t     = delta_t + gamma * lam * A_{t+1}  (A after the last real token = 0)
        R_t     = A_t + V_t                        (lambda-return, the value target)

    The last 1 of the mask ends the episode (the terminal state after EOS); 0s before it
    (a multi-turn episode's tool and environment tokens) are skipped: the recursion runs
    over the real tokens in order, ``V_{t+1}`` the value at the next real token. Rewards
    and values on padding have no influence, whatever they hold. Advantages are *not* whitened; call
    :func:`rlhf_cli.core.ops.masked_whiten` on them.
    :func:`compute_gae_vectorized` gives the same result without a Python loop over T.

    Args:
        rewards: ``(B, T)`` per-token rewards (e.g. :func:`kl_penalized_rewards`).
        values: ``(B, T)`` ``values[:, t]`` = V(state before response token t).
        mask: ``(B, T)``, 1 = real response token, 0 = padding.
        gamma: discount factor, in [0, 1].
        lam: GAE lambda (``ppo.lam``), in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, at least float32, reward units; 0 on
        padding.

    Raises:
        ValueError: shape mismatch, or ``gamma``/``lam`` outside [0, 1].
    """
    _check_unit_interval(gamma=gamma, lam=lam)
    return _over_sampled(_gae_loop, rewards, values, mask, gamma, lam)


def _gae_loop(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """`compute_gae` over a mask whose real tokens come first in each row."""
    deltas, v, m = _gae_deltas(rewards, values, mask, gamma)
    last_gae = torch.zeros_like(deltas[:, 0])  # (B,)
    advantages_reversed = []
    for t in reversed(range(deltas.shape[1])):
        last_gae = torch.where(m[:, t], deltas[:, t] + gamma * lam * last_gae, 0.0)
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, torch.where(m, advantages + v, 0.0)


def compute_gae_vectorized(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """:func:`compute_gae` without a Python loop over T: a doubling scan of ceil(log2 T) steps.

    Unrolls eq. 16 of Schulman et al. 2016, ``A_t = sum_{j >= 0} c^j delta_{t+j}`` with
    ``c = gamma * lam`` (over the real tokens, gaps skipped as in :func:`compute_gae`),
    by recursive doubling (Hillis & Steele 1986): starting from
    ``A = delta`` (a window of 1 term), each step ``A_t += c^w * A_{t+w}`` (0 past the end)
    doubles the window ``w``, so after ceil(log2 T) steps every window covers the rest of
    the row. Each step is one ``(B, T)`` vector op instead of T ``(B,)`` ones in the loop,
    and the sums are formed pairwise (at least as accurate as the loop). Because
    ``delta`` is 0 on padding and the real tokens are moved to the front first, it
    equals the reverse loop for any mask (right or left padding, gaps). Equal to
    :func:`compute_gae` within 1e-5 at T=1024 (tested); timings in
    ``benchmarks/gae_bench.py``.

    Args, returns and errors: as :func:`compute_gae`.
    """
    _check_unit_interval(gamma=gamma, lam=lam)
    return _over_sampled(_gae_scan, rewards, values, mask, gamma, lam)


def _gae_scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """`compute_gae_vectorized` over a mask whose real tokens come first in each row."""
    deltas, v, m = _gae_deltas(rewards, values, mask, gamma)
    advantages, decay, width = deltas, gamma * lam, 1
    while width < deltas.shape[1]:
        advantages = advantages + decay * torch.nn.functional.pad(advantages[:, width:], (0, width))
        decay, width = decay * decay, 2 * width
    advantages = torch.where(m, advantages, 0.0)
    return advantages, torch.where(m, advantages + v, 0.0)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Rewards-to-go ``G_t = sum_{s >= t} gamma^(s-t) r_s`` over the real tokens of a row (``s - t`` counts
    real tokens only: a multi-turn episode's gaps are skipped, as in :func:`compute_gae`).

    The ``lam = 1``, ``V = 0`` special case of :func:`compute_gae` (which it calls).

    Args:
        rewards: ``(B, T)`` per-token rewards.
        mask: ``(B, T)``, 1 = real response token, 0 = padding (ignored whatever it holds).
        gamma: discount factor, in [0, 1].

    Returns:
        ``(B, T)``, at least float32, reward units; 0 on padding.

    Raises:
        ValueError: shape mismatch, or ``gamma`` outside [0, 1].
    """
    advantages, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return advantages


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment: a score penalty that grows linearly over the last ``buffer`` tokens.

    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13, with
    L_max = ``max_new_tokens`` and L_cache = ``buffer``, scaled by ``penalty``::

        R_length(y) = 0                                        |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache      L_max - L_cache < |y| <= L_max
                    = -1                                       |y| > L_max
        returns penalty * R_length(y)

    Naive equivalent: ``[penalty * max(-1, min(0, (max_new_tokens - buffer - n) / buffer)) for n in lengths]``.

    Args:
        lengths: ``(B,)`` response lengths in tokens (EOS included), int or float.
        max_new_tokens: L_max (``ppo.max_new_tokens``), >= 1.
        buffer: L_cache (``ppo.overlong_buffer``), tokens, in [0, max_new_tokens]; 0 gives all zeros.
        penalty: the penalty at L_max (``ppo.overlong_penalty``), >= 0, score units.

    Returns:
        ``(B,)`` float32 (float64 for float64 lengths), <= 0: what to add to each response's score.

    Raises:
        ValueError: ``buffer`` outside [0, max_new_tokens] or a negative ``penalty``.
    """
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    n = lengths.to(_compute_dtype(lengths) if lengths.is_floating_point() else torch.float32)
    if buffer == 0:
        return torch.zeros_like(n)
    ramp = ((max_new_tokens - buffer) - n) / buffer
    return penalty * ramp.clamp(min=-1.0, max=0.0)
