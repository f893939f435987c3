"""Token-level primitives: log-probabilities, entropy, masked statistics, KL estimators.

Conventions shared by every function in :mod:`rlhf_cli.core`:

* ``B`` = batch, ``T`` = response length (right-padded), ``V`` = vocabulary.
* ``mask`` is ``(B, T)`` (bool, int or float), 1 for a real response token (EOS included),
  0 for padding. Masked entries are replaced by 0 with :func:`torch.where` *before* any
  arithmetic, so padding may hold anything (±1e6, ±inf, NaN) without touching an output
  or a gradient (``0 * nan`` is ``nan``; ``torch.where`` is not).
* Half-precision inputs (bf16/fp16) are upcast to float32; float32 and float64 are kept.
  Log-probabilities, entropies and KL values are in nats.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rlhf_cli.registry as registry


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype to compute in: the promoted dtype of ``tensors``, at least float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.promote_types(dtype, torch.float32)


def _bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_shapes(**tensors: Tensor) -> None:
    """Raise ``ValueError`` naming the arguments when the given tensors differ in shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}")


def _rowwise(fn, *tensors: Tensor) -> Tensor:
    """``fn`` applied to one batch row at a time (bounding temporaries to one row), stacked."""
    if tensors[0].dim() < 2 or tensors[0].shape[0] == 0:
        return fn(*tensors)
    return torch.stack([fn(*rows) for rows in zip(*tensors)])


def masked_fill_zero(x: Tensor, mask: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``x`` cast to ``dtype`` (default: at least float32) with padding replaced by exact 0.

    Uses ``torch.where``, so NaN/inf on padding neither leaks into the values nor into
    the gradient of ``x`` (the gradient on padded entries is exactly 0).
    """
    dtype = dtype or _compute_dtype(x)
    return torch.where(_bool_mask(mask), x.to(dtype), 0.0)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under the softmax of its logits, in nats.

    ``log pi(label) = logits[label] - logsumexp(logits)``: only the gathered logit and the
    logsumexp are formed, never a full ``(B, T, V)`` log-softmax, and one batch row at a
    time, so half-precision logits are upcast to a float32 ``(T, V)`` working set only.
    Equivalent to the naive
    ``torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)``.

    Args:
        logits: ``(B, T, V)`` float; ``logits[:, t]`` predicts ``labels[:, t]``.
        labels: ``(B, T)`` integer token ids in ``[0, V)`` (replace an ignore index such as
            -100 by any valid id first; mask the result instead).

    Returns:
        ``(B, T)`` float32 (float64 for float64 logits), in nats, ``<= 0``.

    Raises:
        ValueError: if ``labels.shape != logits.shape[:-1]``.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the "
            f"vocabulary dim {tuple(logits.shape[:-1])}"
        )
    dtype = _compute_dtype(logits)

    def _logprobs(z: Tensor, ids: Tensor) -> Tensor:
        z = z.to(dtype)
        return z.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)

    return _rowwise(_logprobs, logits, labels)


def nucleus_logits(logits: Tensor, labels: Tensor, top_p: float) -> Tensor:
    """``logits`` with every entry outside the top-p nucleus set to ``-inf``, the label kept: the logits of the
    distribution nucleus sampling draws from (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", eq. 3), so that `logprobs_from_logits` and `entropy_from_logits` of the result are
    renormalised over the kept tokens:

        log pi_p(a) = z_a - logsumexp_{v in S} z_v,   S = V^(p) u {a}

    V^(p), the nucleus, is the smallest set of most probable tokens whose probability reaches ``top_p``: a
    token is dropped when the tokens less probable than it, itself included, hold at most ``1 - top_p`` (the
    ascending cumulative sum of HF's ``TopPLogitsWarper`` and vLLM's top-p sampler, the samplers of
    ``rollout.engine``; the most probable token is always kept). vLLM's
    ``logprobs_mode="processed_logprobs"`` are these log-probs at the engine's own logits (trl#6789: a trainer's
    full-softmax log-probs differ from them by log of the nucleus mass).

    The label is always in S: a sampled token lies in the sampler's nucleus, so at the sampler's weights S is
    V^(p); a policy the update moved may push it out of its own nucleus, where pi_p(a) = 0 would make the PPO
    ratio 0 (no gradient under the clip) and CISPO's log-prob and the k3 KL infinite. Keeping it makes the
    log-prob finite and continuous as it leaves, as support replay has it by construction (the sampler's recorded
    kept set, which holds the sampled token, scores every policy: twinkle PR #254, SkyRL PR #2239), without
    storing a (B, T, V) set; it equals replay while the policy's nucleus is the sampler's.

    The set is chosen without gradient (it is piecewise constant in the logits); the gradient flows to the
    kept logits only. Naive equivalent, one position ``z`` ``(V,)`` with label ``a``: sort the probabilities
    descending, keep each token while the mass before it is < ``top_p``, add ``a``, set the rest to -inf.

    Args:
        logits: ``(B, T, V)`` float (already divided by the temperature); ``top_p`` acts on their softmax.
        labels: ``(B, T)`` integer token ids in ``[0, V)``; padding may hold any valid id (mask the log-probs).
        top_p: in (0, 1]; 1 returns ``logits`` itself (nothing dropped, no copy).

    Returns:
        ``(B, T, V)``, ``logits``' dtype, in its autograd graph: ``logits`` where kept, ``-inf`` elsewhere.

    Raises:
        ValueError: ``top_p`` outside (0, 1], or ``labels.shape != logits.shape[:-1]``.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits shape without the vocabulary dim "
                         f"{tuple(logits.shape[:-1])}")
    if top_p == 1:
        return logits
    dtype = _compute_dtype(logits)

    def _keep(z: Tensor, ids: Tensor) -> Tensor:
        ascending, order = torch.sort(z.to(dtype), dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False  # the most probable token
        drop = drop.scatter(-1, order, drop)  # back to vocabulary order
        return ~drop.scatter(-1, ids.long().unsqueeze(-1), False)  # the label stays

    with torch.no_grad():
        keep = _rowwise(_keep, logits.detach(), labels)
    return torch.where(keep, logits, float("-inf"))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of the softmax over the last dim, in nats.

    Finite when some logits are ``-inf`` (a masked vocabulary): those entries have
    ``p_v = 0`` and contribute exactly 0 (``0 * -inf`` is never formed, in the forward or
    the backward pass). A position whose logits are *all* ``-inf`` gets entropy 0.
    Computed in float32 one batch row at a time, so bf16/fp16 logits are safe and the
    float32 working set is ``(T, V)``.

    Args:
        logits: ``(B, T, V)`` (any leading dims) float.

    Returns:
        ``logits.shape[:-1]`` float32 (float64 for float64 logits), in nats, in
        ``[0, log V]``.
    """
    dtype = _compute_dtype(logits)

    def _entropy(z: Tensor) -> Tensor:
        logp = torch.log_softmax(z.to(dtype), dim=-1)
        finite = torch.isfinite(logp)
        logp = torch.where(finite, logp, 0.0)
        p = torch.where(finite, logp.exp(), 0.0)
        return -(p * logp).sum(-1)

    return _rowwise(_entropy, logits)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over real tokens (``mask == 1``), over all entries or along ``dim``.

    Naive equivalent: ``x[mask.bool()].mean()``. An all-zero mask (or a row with no real
    token when ``dim`` is given) gives 0, never NaN.

    Args:
        x: float tensor, same shape as ``mask`` (e.g. ``(B, T)``).
        mask: 1 = real token, 0 = padding (ignored whatever it holds).
        dim: reduce over this dim only; ``None`` reduces over everything.

    Returns:
        0-dim tensor (``dim=None``) or ``x`` reduced along ``dim``; at least float32.

    Raises:
        ValueError: if ``x`` and ``mask`` differ in shape.
    """
    _check_shapes(x=x, mask=mask)
    xm = masked_fill_zero(x, mask)
    count = _bool_mask(mask).sum() if dim is None else _bool_mask(mask).sum(dim)
    total = xm.sum() if dim is None else xm.sum(dim)
    return total / count.clamp(min=1).to(xm.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over real tokens.

    Naive equivalent: ``x[mask.bool()].var(unbiased=unbiased)``. With fewer than two real
    tokens the unbiased variance is undefined; this returns 0 then (one token: the
    centred sum of squares is 0 and the divisor is clamped to 1; no token: 0), never NaN.

    Args:
        x: float tensor, same shape as ``mask``.
        mask: 1 = real token, 0 = padding.
        unbiased: divide by ``n - 1`` (Bessel) instead of ``n``.

    Returns:
        0-dim tensor, at least float32, in the squared unit of ``x``.

    Raises:
        ValueError: if ``x`` and ``mask`` differ in shape.
    """
    _check_shapes(x=x, mask=mask)
    m = _bool_mask(mask)
    mean = masked_mean(x, m)
    centred = torch.where(m, masked_fill_zero(x, m) - mean, 0.0)
    n = m.sum().to(mean.dtype)
    return centred.square().sum() / (n - 1 if unbiased else n).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to mean 0 and (unbiased) std 1 over real tokens.

    ``(x - mean) / sqrt(var + eps)`` with ``var`` the unbiased :func:`masked_var`; with
    ``shift_mean=False`` the mean is added back (only the scale changes, as TRL does for
    rewards). Padding is 0 in the output. One real token gives 0 (``x`` itself when
    ``shift_mean=False``); an all-zero mask gives all zeros; never NaN.

    Args:
        x: float tensor, same shape as ``mask`` (e.g. advantages ``(B, T)``).
        mask: 1 = real token, 0 = padding.
        shift_mean: subtract the mean (True) or keep it (False).
        eps: added to the variance before the square root.

    Returns:
        Tensor shaped like ``x``, at least float32, dimensionless (``shift_mean=True``).

    Raises:
        ValueError: if ``x`` and ``mask`` differ in shape.
    """
    _check_shapes(x=x, mask=mask)
    m = _bool_mask(mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    whitened = (masked_fill_zero(x, m) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, 0.0)


def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = −log r = log π − log π_ref (``log_ratio``, any shape, nats): unbiased, high variance, can be < 0."""
    return log_ratio


def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = (log r)² / 2 of ``log_ratio`` = log π − log π_ref: biased (low bias near π_ref), low variance, >= 0."""
    return 0.5 * log_ratio.square()


def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = (r − 1) − log r of ``log_ratio`` = log π − log π_ref: unbiased, low variance, >= 0 (expm1: accurate
    near r = 1)."""
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS = registry.KL_ESTIMATORS.bind({"k1": kl_k1, "k2": kl_k2, "k3": kl_k3})
"""The per-token KL estimators by the name ``ppo.kl_estimator`` gives (``registry.KL_ESTIMATORS`` bound to their
functions, in its order); each maps the log-ratio log π − log π_ref to its estimate, elementwise."""


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1", mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi, in nats.

    Schulman, "Approximating KL Divergence" (2020), with ``log r = log pi_ref - log pi``:

    * ``"k1"``: ``-log r = log pi - log pi_ref`` -- unbiased, high variance, can be < 0.
    * ``"k2"``: ``(log r)^2 / 2`` -- biased (low bias near pi_ref), low variance, >= 0.
    * ``"k3"``: ``(r - 1) - log r`` -- unbiased, low variance, >= 0.

    Args:
        logprobs: ``(B, T)`` log pi of the sampled tokens (the policy that sampled them).
        ref_logprobs: ``(B, T)`` log pi_ref of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        mask: optional ``(B, T)``; when given, padding is 0 in the output whatever the
            inputs hold there.

    Returns:
        ``(B, T)``, at least float32, nats per token.

    Raises:
        ValueError: unknown ``estimator``, or shape mismatch.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {tuple(KL_ESTIMATORS)}, got {estimator!r}")
    _check_shapes(logprobs=logprobs, ref_logprobs=ref_logprobs)
    dtype = _compute_dtype(logprobs, ref_logprobs)
    if mask is not None:
        _check_shapes(logprobs=logprobs, mask=mask)
        logprobs, ref_logprobs = masked_fill_zero(logprobs, mask, dtype), masked_fill_zero(ref_logprobs, mask, dtype)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)  # log pi - log pi_ref = -log r
    return KL_ESTIMATORS[estimator](log_ratio)
