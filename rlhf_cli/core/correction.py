"""The engine correction (``rollout.is_correction``): importance weights between the trainer's and the sampling
engine's log-probs of the same tokens.

A fast sampling engine (vLLM) and the trainer compute the policy with other kernels and precisions, so the
probability the engine sampled a token with, mu(a_t), is not the trainer's pi_old(a_t) at the same weights: the
rollout is slightly off-policy even before the first update (Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"). Each correction turns the token ratio

    rho_t = pi_old(a_t) / mu(a_t) = exp(old_logprobs_t - engine_logprobs_t)

into a constant weight w_t (no gradient) that multiplies token t's policy loss (`core.losses`' ``weights``):

    ``none``      w_t = 1
    ``tis``       w_t = clamp(rho_t, low, high)                 truncated importance sampling (Yao et al. 2025:
                                                                min(rho_t, C), i.e. low = 0, high = C)
    ``icepop``    w_t = rho_t if low <= rho_t <= high, else 0   IcePop (Ling Team 2025, "Every Step Evolves",
                                                                Ring-1T): tokens far off-policy are masked
    ``seq_mask``  w_t = 1 if low <= rho_i <= high, else 0,      the whole sequence masked by its geometric-mean
                  rho_i = exp(mean_t log rho_t)                 ratio (veRL's geometric rejection sampling; TRL's
                                                                sequence mask)

A masked token contributes 0 to the loss and still counts in its aggregation's divisor (`ppo.aggregation`), so
the weights never change how a minibatch's loss is normalised, nor make it depend on the micro-batching.

An undefined ratio: where both log-probs are -inf (0/0: neither side gives the token any probability, e.g. a
token the engine appended past its own support, or a trainer's nucleus that left it out) or either is NaN,
log rho_t is not a number. Such a token is masked (w_t = 0, counted as hit) under ``tis``, ``icepop`` and
``seq_mask`` (which masks its whole sequence): no weight can say how far off-policy it is, and its own policy
loss is not finite either (pi_old = 0), so it must not reach the loss with a weight that passes NaN on. Its
``ratio`` reads 1 (no measurable mismatch), and ``seq_mask``'s geometric mean runs over the row's other tokens;
the statistics stay finite. One side alone -inf is defined: rho_t = 0 (trainer) or +inf (engine), which every
mode's bounds truncate or mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_cli.core.ops import _bool_mask, _check_shapes, masked_fill_zero

IS_CORRECTIONS = ("none", "tis", "icepop", "seq_mask")


def is_bounds(mode: str, low: float | None, high: float) -> tuple[float, float]:
    """The bounds [low, high] a correction uses: ``low`` as given, or when None 0 for ``tis`` (Yao et al.'s
    one-sided truncation) and 1/high for ``icepop`` and ``seq_mask`` (a band symmetric in log space).

    Raises:
        ValueError: an unknown mode, high <= 0, low < 0 or low > high.
    """
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown engine correction {mode!r} ({', '.join(IS_CORRECTIONS)})")
    lo = (0.0 if mode == "tis" else 1.0 / high) if low is None else float(low)
    if high <= 0 or lo < 0 or lo > high:
        raise ValueError(f"engine correction bounds must satisfy 0 <= low <= high, high > 0 (got {lo}, {high})")
    return lo, float(high)


def engine_is_weights(old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, mode: str,
                      low: float | None, high: float) -> tuple[Tensor, Tensor, Tensor]:
    """The engine correction's per-token weights (module docstring for each mode's equation).

    Args:
        old_logprobs: ``(B, T)`` the trainer's log pi_old of the sampled tokens (nats).
        engine_logprobs: ``(B, T)`` the sampling engine's log mu of the same tokens (nats), after the same
            temperature (and over the same distribution: see `ppo.top_p`).
        mask: ``(B, T)``, 1 = real response token; padding may hold anything.
        mode: one of `IS_CORRECTIONS`.
        low, high: the bounds (`is_bounds`: None = the mode's default low).

    Returns:
        ``(weights, ratio, hit)``, each ``(B, T)``: ``weights`` float32 (float64 for float64 inputs), detached,
        finite, 0 on padding, 1 on real tokens under ``none``; ``ratio`` the ratio each mode judges, rho_t
        (``tis``, ``icepop``, ``none``) or the row's rho_i on each of its real tokens (``seq_mask``), 1 on padding
        and on undefined tokens (module docstring), never NaN; ``hit`` bool, the real tokens whose weight the
        bounds set: truncated (``tis``) or masked (``icepop``, ``seq_mask``, and the undefined tokens).

    Raises:
        ValueError: shape mismatch, or bad mode/bounds (`is_bounds`).
    """
    _check_shapes(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    lo, hi = is_bounds(mode, low, high)
    m = _bool_mask(mask)
    log_rho = masked_fill_zero(old_logprobs.detach(), m) - masked_fill_zero(engine_logprobs.detach(), m)
    undefined = torch.isnan(log_rho)  # 0/0 or a NaN input, on real tokens only (padding is 0 - 0)
    log_rho = torch.where(undefined, 0.0, log_rho)
    if mode == "seq_mask":
        defined = m & ~undefined
        lengths = defined.sum(dim=1, keepdim=True).clamp(min=1)
        row = log_rho.sum(dim=1, keepdim=True) / lengths  # NaN for a row holding both +inf and -inf
        undefined = m & (undefined.any(dim=1, keepdim=True) | torch.isnan(row))  # the whole row
        log_rho = torch.where(m & ~torch.isnan(row), row, 0.0)  # log rho_i on its tokens
    ratio = torch.exp(log_rho)  # 1 on padding and on undefined tokens
    inside = (ratio >= lo) & (ratio <= hi) & ~undefined
    if mode == "none":
        weights, hit = torch.ones_like(ratio), torch.zeros_like(m)
    elif mode == "tis":
        weights, hit = torch.where(undefined, 0.0, ratio.clamp(min=lo, max=hi)), ~inside
    elif mode == "icepop":
        weights, hit = torch.where(inside, ratio, 0.0), ~inside
    else:  # seq_mask
        weights, hit = inside.to(ratio.dtype), ~inside
    return torch.where(m, weights, 0.0), ratio, hit & m
