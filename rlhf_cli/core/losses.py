"""PPO and reward-model losses, each returning ``(loss, stats)``.

The policy losses ``ppo.policy_loss`` selects (:data:`POLICY_LOSSES`) share one signature: :func:`policy_loss`
(PPO's clipped surrogate, with clip-higher and dual-clip), :func:`gspo_loss` (the sequence ratio) and
:func:`cispo_loss` (the clipped IS weight on REINFORCE). Each takes optional constant per-token ``weights`` (the
engine correction, `core.correction`) that multiply its per-token loss before aggregation.

``loss`` is a 0-dim float32 tensor (float64 for float64 inputs) to minimise. ``stats`` is a
dict of detached Python floats with namespaced keys: ``*/loss`` is the returned loss value
(so it sums over micro-batches like the loss does); ``policy/kept_tokens`` counts the tokens the
policy losses' stats are over (`KEPT_TOKEN_MEANS`); every other stat is a mean over the real
tokens (or pairs) of *this call*. Inputs may be bf16: ratios and losses are computed in float32.

Aggregation over tokens (``aggregation``):

* ``"token-mean"`` (default): masked sum of the per-token loss divided by ``num_tokens``.
  ``num_tokens`` defaults to the real tokens of this call; a trainer that splits a
  minibatch into micro-batches (and ranks) passes the real-token count of the *whole*
  minibatch, so that the summed gradient does not depend on the split or world size.
* ``"seq-mean-token-mean"``: each row's token mean, summed over rows and divided by
  ``num_seqs`` (default: rows of this call with at least one real token); pass the
  minibatch's row count when splitting.

An all-zero mask returns a loss of exactly 0 that is still attached to the graph (so
``backward()`` runs and gives zero gradients), never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import rlhf_cli.registry as registry
from rlhf_cli.core.ops import (
    _bool_mask,
    _check_shapes,
    _compute_dtype,
    entropy_from_logits,
    kl_estimate,
    masked_fill_zero,
    masked_mean,
    masked_var,
)

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def _divisor(count: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def masked_aggregate(
    per_token: Tensor,
    mask: Tensor,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
) -> Tensor:
    """Reduce a ``(B, T)`` per-token loss that is already 0 on padding to a scalar.

    See the module docstring for ``aggregation``, ``num_tokens`` and ``num_seqs``.
    A count below 1 (e.g. an empty mask) is clamped to 1, giving 0.

    Raises:
        ValueError: unknown ``aggregation``.
    """
    m = _bool_mask(mask)
    if aggregation == "token-mean":
        return per_token.sum() / _divisor(m.sum() if num_tokens is None else num_tokens, per_token)
    if aggregation == "seq-mean-token-mean":
        seq_means = per_token.sum(dim=1) / m.sum(dim=1).clamp(min=1).to(per_token.dtype)  # (B,)
        return seq_means.sum() / _divisor(m.any(dim=1).sum() if num_seqs is None else num_seqs, per_token)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Detach and convert to Python floats with a single device sync."""
    values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()]).tolist()
    return dict(zip(stats.keys(), values))


def _weighted(per_token: Tensor, weights: Tensor | None, m: Tensor) -> Tensor:
    """``per_token`` times constant per-token ``weights`` (detached; `core.correction.engine_is_weights`), exact 0 on
    padding and where the weight is 0 (a masked token: its term is 0 even where ``loss_t`` is inf or NaN, and the
    gradient reaching ``per_token`` there is exactly 0, as on padding); ``per_token`` itself when ``weights`` is
    None."""
    if weights is None:
        return per_token
    _check_shapes(per_token=per_token, weights=weights)
    w = masked_fill_zero(weights.detach(), m, per_token.dtype)
    return torch.where(m & (w != 0), per_token * w, 0.0)


def _live(m: Tensor, weights: Tensor | None) -> Tensor:
    """(B, T) bool: the real tokens whose constant weight is not 0 (the terms a weighted loss keeps); ``m`` itself
    when ``weights`` is None. A policy loss reads log-probs and ratios on these tokens only: at a token of weight 0
    an inf or NaN log-ratio (log pi_old = -inf: the trainer gave the sampled token no probability) reaches neither
    the loss, its gradient, nor the stats."""
    if weights is None:
        return m
    _check_shapes(mask=m, weights=weights)
    return m & (weights.detach() != 0)


def _check_clips(clip: float, clip_high: float | None, dual_clip: float | None) -> float:
    """The upper clip ε_high (``clip_high``, default ``clip``); raises ValueError on a bad clip range."""
    if clip < 0:
        raise ValueError(f"clip must be >= 0, got {clip}")
    if clip_high is not None and clip_high < 0:
        raise ValueError(f"clip_high must be >= 0 or None, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
    return clip if clip_high is None else clip_high


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, m: Tensor, clip: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token clipped surrogate (negated) of a ratio with gradient, 0 on padding, and its clip fractions.

    ``loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip, 1 + clip_high))``, then for ``A_t < 0`` bounded above by
    ``-dual_clip * A_t`` when ``dual_clip`` is set (Ye et al. 2020's dual clip). All inputs ``(B, T)``, ``adv`` 0 on
    padding."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (per_token > bound) & m
        per_token = torch.where(dual, bound, per_token)
    active = (clipped > unclipped) & m  # the clipped term is the active one: zero gradient
    dtype = per_token.dtype
    flags = {
        "policy/clipfrac": masked_mean(active.to(dtype), m),
        "policy/clipfrac_high": masked_mean((active & (adv > 0)).to(dtype), m),
        "policy/clipfrac_low": masked_mean((active & (adv < 0)).to(dtype), m),
        "policy/dual_clipfrac": masked_mean(dual.to(dtype), m),
    }
    return torch.where(m, per_token, 0.0), flags


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
    *,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (``ppo.policy_loss=ppo``), negated for minimisation, with clip-higher and dual-clip.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, with the asymmetric clip range of
    Yu et al. 2025 (DAPO's clip-higher: ε_low = ``clip``, ε_high = ``clip_high``) and the dual clip of Ye et al.
    2020 ("Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", dual-clip PPO)::

        r_t    = exp(log pi(a_t) - log pi_old(a_t))
        loss_t = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)      (= -L^CLIP_t)
        loss_t = min(loss_t, -c * A_t)   where A_t < 0, when dual_clip = c is set

    aggregated over real tokens (module docstring). The dual clip bounds the loss of a token with a negative
    advantage whose ratio has grown past c (the gradient there is 0), so one very off-policy token cannot
    dominate the update. ``old_logprobs`` and ``advantages`` are treated as constants (detached); gradients
    flow into ``logprobs`` only.

    Args:
        logprobs: ``(B, T)`` log pi of the sampled tokens under the current policy (nats).
        old_logprobs: ``(B, T)`` log pi_old from the rollout (nats).
        advantages: ``(B, T)`` advantage estimates, usually whitened.
        mask: ``(B, T)``, 1 = real response token, 0 = padding (ignored whatever it holds).
        clip: ε_low (``ppo.clip``), >= 0.
        num_tokens, aggregation, num_seqs: see the module docstring.
        clip_high: ε_high (``ppo.clip_high``), >= 0; None = ``clip``.
        dual_clip: c (``ppo.dual_clip``), > 1; None = no dual clip.
        weights: ``(B, T)`` constant per-token weights multiplying ``loss_t`` before aggregation (the engine
            correction, ``rollout.is_correction``: `core.correction.engine_is_weights`); None = 1. A weight of 0
            removes the token's term but not its count in the divisor; the stats leave such a token out, and
            weights other than 0 do not change them.

    Returns:
        ``(loss, stats)``; stats (over real tokens of non-zero weight; 0 where there are none):
        ``policy/loss``; ``policy/clipfrac`` (fraction of real tokens where the
        clipped term is the active one, i.e. the gradient is zero), split into ``policy/clipfrac_high`` (A > 0,
        r > 1 + ε_high) and ``policy/clipfrac_low`` (A < 0, r < 1 - ε_low); ``policy/dual_clipfrac`` (fraction
        of real tokens the dual clip bounds; 0 without it); ``policy/approx_kl`` (k3 estimate of
        KL(pi_old || pi), nats per token: ``(r - 1) - log r``); ``policy/ratio_mean``; ``policy/kept_tokens``
        (how many tokens these means are over).

    Raises:
        ValueError: shape mismatch, negative ``clip`` or ``clip_high``, ``dual_clip <= 1``, unknown
        ``aggregation``.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = _check_clips(clip, clip_high, dual_clip)
    m = _bool_mask(mask)
    live = _live(m, weights)
    dtype = _compute_dtype(logprobs, old_logprobs, advantages)
    log_ratio = masked_fill_zero(logprobs, live, dtype) - masked_fill_zero(old_logprobs.detach(), live, dtype)
    adv = masked_fill_zero(advantages.detach(), m, dtype)
    ratio = torch.exp(log_ratio)
    per_token, flags = _clipped_surrogate(ratio, adv, live, clip, high, dual_clip)
    loss = masked_aggregate(_weighted(per_token, weights, m), m, num_tokens, aggregation, num_seqs)
    return loss, _policy_stats(loss, flags, log_ratio, ratio, live)


def _policy_stats(loss: Tensor, flags: dict[str, Tensor], log_ratio: Tensor, ratio: Tensor,
                  m: Tensor) -> dict[str, float]:
    """The policy losses' stats over the tokens ``m`` keeps (one host sync), always the same keys (ranks reduce
    them by position, `engine.reduce_stats`): 0 where it keeps none (every token padding or of weight 0), and
    ``policy/kept_tokens``, their count, by which a caller weighs the `KEPT_TOKEN_MEANS` over micro-batches
    (`rollout.learner.PolicyLearner.train_on`)."""
    with torch.no_grad():
        return _floats(
            {
                "policy/loss": loss,
                **flags,
                "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m),
                "policy/ratio_mean": masked_mean(ratio, m),
                KEPT_TOKENS: m.sum(),
            }
        )


KEPT_TOKENS = "policy/kept_tokens"
KEPT_TOKEN_MEANS = ("policy/clipfrac", "policy/clipfrac_high", "policy/clipfrac_low", "policy/dual_clipfrac",
                    "policy/approx_kl", "policy/ratio_mean")
"""The policy losses' stats that are means over their kept tokens (`_policy_stats`): a mean over several
micro-batches weighs each by its ``policy/kept_tokens``."""


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
    *,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (``ppo.policy_loss=gspo``): the clipped surrogate of the length-normalised sequence ratio, in its
    token form (GSPO-token), negated for minimisation.

    Zheng et al. 2025, "Group Sequence Policy Optimization": the length-normalised sequence ratio s_i of the GSPO
    objective, in the token form of GSPO-token (its eq. 14)::

        s_i    = exp(1/|y_i| * sum_t (log pi(y_i,t) - log pi_old(y_i,t)))           (geometric mean ratio)
        s_i,t  = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]                                (value s_i)
        loss_t = -min(s_i,t * A_t, clip(s_i,t, 1 - eps_low, 1 + eps_high) * A_t)

    then :func:`policy_loss`'s dual clip and aggregation. The value of ``s_i,t`` is ``s_i`` on every token of
    row i, so the clip is decided per sequence; where unclipped, the gradient of a token's term is
    ``-A_t * s_i * grad log pi_t``.
    With one advantage per row and ``aggregation="seq-mean-token-mean"`` the gradient is exactly that of the
    paper's sequence objective ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)``; ``"token-mean"`` weighs each
    row by its length. veRL and TRL compute the same token form.

    Args: as :func:`policy_loss` (``clip``/``clip_high`` bound ``s_i``; GSPO's paper uses 3e-4 and 4e-4). A token
    of weight 0 is left out of ``s_i`` and ``|y_i|`` too (the geometric mean runs over the kept tokens, as veRL's
    rejection masks do), but still counts in the aggregation's divisor.

    Returns:
        ``(loss, stats)``: :func:`policy_loss`'s keys; the clip fractions count the kept tokens (real, weight not 0)
        of clipped rows; ``policy/ratio_mean`` is the mean of ``s_i`` over kept tokens; ``policy/approx_kl`` is per
        token.

    Raises:
        ValueError: as :func:`policy_loss`.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = _check_clips(clip, clip_high, dual_clip)
    m = _bool_mask(mask)
    live = _live(m, weights)
    dtype = _compute_dtype(logprobs, old_logprobs, advantages)
    lp = masked_fill_zero(logprobs, live, dtype)
    log_ratio = lp - masked_fill_zero(old_logprobs.detach(), live, dtype)
    adv = masked_fill_zero(advantages.detach(), m, dtype)
    lengths = live.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)  # (B, 1)
    log_seq_ratio = log_ratio.sum(dim=1, keepdim=True) / lengths  # (B, 1)
    # log s_i,t = sg[log s_i] + log pi_t - sg[log pi_t]: value log s_i, gradient that of log pi_t
    ratio = torch.exp(log_seq_ratio.detach() + (lp - lp.detach()))  # (B, T)
    per_token, flags = _clipped_surrogate(ratio, adv, live, clip, high, dual_clip)
    loss = masked_aggregate(_weighted(per_token, weights, m), m, num_tokens, aggregation, num_seqs)
    return loss, _policy_stats(loss, flags, log_ratio, ratio, live)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
    *,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (``ppo.policy_loss=cispo``): REINFORCE weighted by the stop-gradient, clipped importance weight.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", eqs. 4-5::

        r_t    = exp(log pi(a_t) - log pi_old(a_t))
        w_t    = min(r_t, 1 + eps_high)                                  (eq. 5 without a lower bound)
        loss_t = -sg[w_t] * A_t * log pi(a_t)

    aggregated over real tokens (module docstring). The paper sets ε_low^IS large, i.e. no lower bound, and
    tunes only ε_high^IS; so does TRL (``loss_type="cispo"``: ``clamp(r, max=epsilon_high)``, an absolute cap:
    TRL's ``epsilon_high`` = 1 + ``clip_high`` here). Unlike PPO's clip no token's gradient is switched off:
    the gradient of a token's term is ``-w_t * A_t * grad log pi_t``. The loss *value* is not a surrogate of
    the return (it scales with log pi); only its gradient is meaningful.

    Args: as :func:`policy_loss`; ``clip`` is only the default of ``clip_high`` (1 + ε_high is the weight's
    cap); ``dual_clip`` must be None (there is no clipped objective to bound).

    Returns:
        ``(loss, stats)``: :func:`policy_loss`'s keys; ``policy/clipfrac`` = ``policy/clipfrac_high`` is the
        fraction of kept tokens (real, weight not 0) whose IS weight is capped; ``policy/clipfrac_low`` and
        ``policy/dual_clipfrac`` are 0.

    Raises:
        ValueError: as :func:`policy_loss`; ``dual_clip`` set.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = _check_clips(clip, clip_high, dual_clip)
    if dual_clip is not None:
        raise ValueError("dual_clip is not defined for CISPO: its weight is capped already (clip_high)")
    m = _bool_mask(mask)
    live = _live(m, weights)
    dtype = _compute_dtype(logprobs, old_logprobs, advantages)
    lp = masked_fill_zero(logprobs, live, dtype)
    log_ratio = lp - masked_fill_zero(old_logprobs.detach(), live, dtype)
    adv = masked_fill_zero(advantages.detach(), m, dtype)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio.detach(), max=1.0 + high)
    per_token = torch.where(live, -weight * adv * lp, 0.0)
    loss = masked_aggregate(_weighted(per_token, weights, m), m, num_tokens, aggregation, num_seqs)
    capped = ((ratio.detach() > 1.0 + high) & live).to(dtype)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    flags = {"policy/clipfrac": masked_mean(capped, live), "policy/clipfrac_high": masked_mean(capped, live),
             "policy/clipfrac_low": zero, "policy/dual_clipfrac": zero}
    return loss, _policy_stats(loss, flags, log_ratio, ratio, live)


POLICY_LOSSES = registry.POLICY_LOSSES.bind({"ppo": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss})
"""The policy losses by the name ``ppo.policy_loss`` gives (``registry.POLICY_LOSSES`` bound to their functions,
in its order); each takes :func:`policy_loss`'s arguments."""


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    value_clip: float | None,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 / OpenAI baselines; the L^VF term of Schulman et al. 2017 eq. 9)::

        V_clip_t = V_old_t + clip(V_t - V_old_t, -c, c)
        loss_t   = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)

    aggregated over real tokens (module docstring). ``value_clip=None`` uses the plain
    ``0.5 * (V_t - R_t)^2``. ``old_values`` and ``returns`` are constants (detached).

    Args:
        values: ``(B, T)`` current value predictions (reward units).
        old_values: ``(B, T)`` value predictions from the rollout.
        returns: ``(B, T)`` value targets (e.g. GAE returns).
        mask: ``(B, T)``, 1 = real response token, 0 = padding (ignored whatever it holds).
        value_clip: c (``ppo.value_clip``), > 0, or None to disable clipping.
        num_tokens, aggregation, num_seqs: see the module docstring.

    Returns:
        ``(loss, stats)``; stats: ``val/loss``; ``val/clipfrac`` (fraction of real tokens
        where the clipped term is the larger one; 0 without clipping);
        ``val/explained_var`` = ``1 - Var[R - V] / Var[R]`` over real tokens with the
        current ``values`` (1 = perfect, 0 = no better than a constant; 0 when
        ``Var[R] = 0``).

    Raises:
        ValueError: shape mismatch, ``value_clip <= 0``, unknown ``aggregation``.
    """
    _check_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
    m = _bool_mask(mask)
    dtype = _compute_dtype(values, old_values, returns)
    v = masked_fill_zero(values, m, dtype)
    v_old = masked_fill_zero(old_values.detach(), m, dtype)
    ret = masked_fill_zero(returns.detach(), m, dtype)
    unclipped = (v - ret).square()
    if value_clip is None:
        per_token, clipped = unclipped, unclipped
    else:
        v_clipped = v_old + torch.clamp(v - v_old, -value_clip, value_clip)
        clipped = (v_clipped - ret).square()
        per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * masked_aggregate(torch.where(m, per_token, 0.0), m, num_tokens, aggregation, num_seqs)
    with torch.no_grad():
        var_returns = masked_var(ret, m)
        explained_var = torch.where(
            var_returns > 0, 1.0 - masked_var(ret - v, m) / var_returns.clamp(min=torch.finfo(dtype).tiny), 0.0
        )
        stats = _floats(
            {
                "val/loss": loss,
                "val/clipfrac": masked_mean((clipped > unclipped).to(dtype), m),
                "val/explained_var": explained_var,
            }
        )
    return loss, stats


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL to the reference as a loss term, GRPO's D_KL[π_θ ‖ π_ref] (Shao et al. 2024, eq. 3-4, with the k3
    estimator): the per-token ``kl_estimate(logprobs, ref_logprobs, estimator)`` aggregated like the policy loss.
    The trainer adds ``ppo.kl_beta`` (β) times it to the policy loss when ``ppo.kl_in=loss``.

    Gradients flow through ``logprobs`` (the current policy's, on tokens it sampled before the update) only.
    With ``"k1"`` the expected gradient is zero (E_π[∇ log π] = 0), which is why the config refuses it.

    Args:
        logprobs: ``(B, T)`` log π_θ of the sampled tokens, with grad.
        ref_logprobs: ``(B, T)`` log π_ref of the same tokens.
        mask: ``(B, T)``, 1 = real response token that enters the loss.
        estimator: ``"k3"`` (default), ``"k2"`` or ``"k1"``; see :func:`rlhf_cli.core.ops.kl_estimate`.
        num_tokens, aggregation, num_seqs: see the module docstring.

    Returns:
        (loss, stats): the 0-dim loss in nats (per token, aggregated); stats ``policy/kl_ref``, the mean
        per-token estimate over this call's real tokens.

    Raises:
        ValueError: shape mismatch, unknown estimator or aggregation.
    """
    kl = kl_estimate(logprobs, ref_logprobs, estimator, mask=mask)
    loss = masked_aggregate(kl, mask, num_tokens, aggregation, num_seqs)
    return loss, _floats({"policy/kl_ref": masked_mean(kl.detach(), mask)})


def entropy_bonus(
    logits: Tensor | None,
    mask: Tensor,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token-mean",
    num_seqs: float | Tensor | None = None,
    *,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Entropy bonus S (Schulman et al. 2017 eq. 9): mean policy entropy over real tokens.

    A bonus to *maximise*: the PPO update (`rollout.learner`) subtracts ``ppo.c2`` × S from the policy loss.
    Padded positions never change the bonus; their logits still go through the softmax, so a model that
    emits ±inf/NaN logits on padding (real models do not) would get NaN gradients there.

    Args:
        logits: ``(B, T, V)`` policy logits (bf16 fine; -inf entries fine), or None when
            ``entropy`` is given.
        mask: ``(B, T)``, 1 = real response token, 0 = padding (ignored whatever it holds).
        num_tokens, aggregation, num_seqs: see the module docstring.
        entropy: ``(B, T)`` precomputed entropy in nats (e.g. from a fused kernel), instead
            of ``logits``.

    Returns:
        ``(bonus, stats)``; ``bonus`` in nats per token; stats: ``policy/entropy`` (mean
        entropy over this call's real tokens, nats).

    Raises:
        ValueError: both or neither of ``logits``/``entropy``, shape mismatch, unknown
        ``aggregation``.
    """
    if (logits is None) == (entropy is None):
        raise ValueError("pass exactly one of logits (B, T, V) or entropy (B, T)")
    if entropy is None:
        entropy = entropy_from_logits(logits)
    _check_shapes(entropy=entropy, mask=mask)
    m = _bool_mask(mask)
    per_token = masked_fill_zero(entropy, m)
    bonus = masked_aggregate(per_token, m, num_tokens, aggregation, num_seqs)
    with torch.no_grad():
        stats = _floats({"policy/entropy": masked_mean(per_token, m)})
    return bonus, stats


def pairwise_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: float | Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Bradley-Terry reward-model loss: mean of ``-log sigmoid(r_chosen - r_rejected - m)``.

    Ouyang et al. 2022 (InstructGPT) eq. 1; the optional margin ``m`` as in Touvron et al.
    2023 (Llama 2) eq. 2. Computed with ``logsigmoid`` (no overflow for large gaps).

    Args:
        chosen_rewards: ``(B,)`` scalar reward of each preferred response.
        rejected_rewards: ``(B,)`` scalar reward of its rejected counterpart.
        margin: None, a float, or ``(B,)`` per-pair margin (reward units).

    Returns:
        ``(loss, stats)``; ``loss`` in nats per pair (0, still attached to the graph, for
        an empty batch). stats: ``rm/loss``; ``rm/accuracy`` (fraction of pairs with
        ``r_chosen > r_rejected`` strictly: a tie is not correct; the margin is not
        used); ``rm/margin`` (mean ``r_chosen - r_rejected``); ``rm/chosen_mean``;
        ``rm/rejected_mean``.

    Raises:
        ValueError: shape mismatch.
    """
    _check_shapes(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    dtype = _compute_dtype(chosen_rewards, rejected_rewards)
    chosen, rejected = chosen_rewards.to(dtype), rejected_rewards.to(dtype)
    gap = chosen - rejected
    logit = gap if margin is None else gap - torch.as_tensor(margin, dtype=dtype, device=gap.device)
    n = max(gap.numel(), 1)
    loss = -F.logsigmoid(logit).sum() / n
    with torch.no_grad():
        stats = _floats(
            {
                "rm/loss": loss,
                "rm/accuracy": (gap > 0).double().sum() / n,  # float64: 7 of 10 reads 0.7
                "rm/margin": gap.sum() / n,
                "rm/chosen_mean": chosen.sum() / n,
                "rm/rejected_mean": rejected.sum() / n,
            }
        )
    return loss, stats
