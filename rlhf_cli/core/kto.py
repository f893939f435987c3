"""Kahneman-Tversky optimisation (train-kto): a policy's and a frozen reference's summed completion log-probs of
unpaired rows, each labelled desirable or undesirable, -> a loss to minimise, with its statistics.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", sec. 4.1, eq. 7 (the equation
TRL 1.12's ``KTOTrainer`` cites). With r(x, y) = log pi(y|x) - log pi_ref(y|x) (nats, sums over y's tokens) and
the reference point z0 (below)::

    v(x, y) = lambda_D * sigmoid(beta * (r(x, y) - z0))     y desirable
              lambda_U * sigmoid(beta * (z0 - r(x, y)))     y undesirable
    loss    = E_{x,y} [lambda_y - v(x, y)]

``lambda_D`` is ``kto.desirable_weight``, ``lambda_U`` ``kto.undesirable_weight``, ``beta`` ``kto.beta``. The
expectation is the mean over every row of an optimizer step, both classes together (TRL's ``losses.nanmean()``).

The reference point z0 is the paper's estimate of KL(pi || pi_ref) (sec. 4.1, "Implementation"): over a batch of
n rows, row i's prompt x_i is paired with the previous row's completion y_{i-1} (cycled: row 0 takes y_{n-1};
TRL's rotation of the completions by one; a previous row with x_i's own prompt, the other half of a split
preference pair, is passed over: :func:`kl_completion_index`), and::

    z0 = max(0, mean_i [log pi(y_{i-1}|x_i) - log pi_ref(y_{i-1}|x_i)])

with no gradient through it. A batch of one row has no mismatched pair (its "KL" would be its own log-ratio),
so train-kto refuses ``kto.batch_size=1``.

The implicit reward of a completion is ``beta * r(x, y)``, as DPO's (Rafailov et al. 2023, sec. 5).

KTO's loss is a family of one: train-kto has no ``kto.loss`` key, so nothing is declared in ``registry.py``. A
second unpaired loss (TRL's ``apo_zero_unpaired``) would make it a ``Registry("kto.loss", ...)`` in
``registry.FAMILIES`` with its table here, as ``core/dpo.py``'s ``DPO_LOSSES``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_cli.core.ops import _check_shapes, _compute_dtype


def kl_completion_index(n: int, prompts: Sequence[Hashable] | None = None) -> Tensor:
    """``(n,)`` long: the row whose completion row i's prompt is paired with for the reference point,
    ``(i - 1) mod n`` (TRL's ``[y_n, y_1, ..., y_{n-1}]``). With ``prompts`` (one key per row, e.g. its prompt
    ids as a tuple), the nearest earlier row, cycled, whose prompt differs from row i's, so that the two rows a
    preference pair is split into never pair with each other when they sit side by side (a length-grouped order
    puts them there); rows that share no prompt get TRL's rule, and a row whose prompt every row shares keeps the
    previous row. Raises ValueError for n < 2 (no mismatched pair)."""
    if n < 2:
        raise ValueError(f"the KL reference point needs at least 2 rows to pair a prompt with another row's "
                         f"completion (got {n})")
    if prompts is None:
        return (torch.arange(n) - 1) % n
    if len(prompts) != n:
        raise ValueError(f"kl_completion_index: {len(prompts)} prompts for {n} rows")
    index = []
    for i in range(n):
        j = next(((i - d) % n for d in range(1, n) if prompts[(i - d) % n] != prompts[i]), (i - 1) % n)
        index.append(j)
    return torch.tensor(index, dtype=torch.long)


def kl_reference_point(logratio_sum: Tensor, count: float) -> Tensor:
    """KTO's reference point z0, 0-dim float64, >= 0 (nats per sequence), no gradient.

    ``logratio_sum``: the sum over ``count`` mismatched pairs (x_i, y_{i-1}) (:func:`kl_completion_index`) of
    log pi(y_{i-1}|x_i) - log pi_ref(y_{i-1}|x_i), each a sum over the completion's tokens; a trainer sums it, and
    the count, over its micro-batches and ranks first, so that z0 is one number per optimizer step::

        z0 = max(0, logratio_sum / count)

    Raises ValueError for ``count`` < 1.
    """
    if count < 1:
        raise ValueError(f"the KL reference point needs at least one mismatched pair (got count={count})")
    return (logratio_sum.detach().to(torch.float64).sum() / float(count)).clamp(min=0.0)


def kto_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    desirable: Tensor,
    kl: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    *,
    num_rows: float | None = None,
    num_desirable: float | None = None,
    num_undesirable: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KTO's loss of a batch of unpaired rows (module docstring, eq. 7)::

        loss = (sum_{i desirable} lambda_D * (1 - sigmoid(beta * (r_i - z0)))
                + sum_{i undesirable} lambda_U * (1 - sigmoid(beta * (z0 - r_i)))) / num_rows

    Args:
        logprobs: ``(B,)`` the policy's summed completion log-probs (nats, <= 0), with their graph.
        ref_logprobs: ``(B,)`` the reference's; no gradient flows into them.
        desirable: ``(B,)`` bool, True where the row's completion is desirable (label true).
        kl: z0 (:func:`kl_reference_point`), nats, >= 0; detached.
        beta: ``kto.beta`` > 0.
        desirable_weight, undesirable_weight: ``kto.desirable_weight`` (lambda_D), ``kto.undesirable_weight``
            (lambda_U), > 0.
        num_rows: the divisor of the loss; default B. A trainer that cuts an optimizer step into micro-batches and
            ranks passes the step's row count, so that the loss and its gradient, summed over the micro-batches,
            do not depend on the cut.
        num_desirable, num_undesirable: the divisors of each class's statistics; default this batch's counts
            (pass the step's, as for ``num_rows``).

    Returns:
        ``(loss, stats)``: ``loss`` 0-dim, float32 (float64 for float64 inputs), 0 and attached to the graph for
        an empty batch. ``stats``, detached floats, each a sum over this call's rows divided by its divisor, so
        that they sum over a step's micro-batches to the step's mean: ``kto/loss`` (/ num_rows),
        ``kto/rewards_desirable`` and ``kto/logprobs_desirable`` (the implicit reward beta * r and the policy's
        log-prob, nats, / num_desirable), ``kto/rewards_undesirable`` and ``kto/logprobs_undesirable``
        (/ num_undesirable). A class's statistics are 0 when the batch holds none of it.

    Raises:
        ValueError: shape mismatch, ``beta`` or a weight <= 0, a negative ``kl``.
    """
    _check_shapes(logprobs=logprobs, ref_logprobs=ref_logprobs, desirable=desirable)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not (desirable_weight > 0 and undesirable_weight > 0):
        raise ValueError(f"the weights must be > 0, got desirable {desirable_weight}, undesirable {undesirable_weight}")
    dtype = _compute_dtype(logprobs, ref_logprobs)
    dev = logprobs.device
    z0 = torch.as_tensor(kl, dtype=dtype, device=dev).detach()
    if float(z0) < 0:
        raise ValueError(f"the KL reference point must be >= 0 (it is clamped), got {float(z0)}")
    lp = logprobs.to(dtype)
    ratio = lp - ref_logprobs.detach().to(dtype)  # (B,) r(x, y), nats
    good = desirable.to(dev).bool()
    per_row = torch.where(good, desirable_weight * (1 - F.sigmoid(beta * (ratio - z0))),
                          undesirable_weight * (1 - F.sigmoid(beta * (z0 - ratio))))  # (B,)

    def divisor(value: float | None, default: Tensor) -> Tensor:
        n = torch.as_tensor(float(value) if value is not None else float(default), dtype=dtype, device=dev)
        return n.clamp(min=1)

    n = divisor(num_rows, torch.tensor(float(ratio.numel())))
    n_good, n_bad = divisor(num_desirable, good.sum()), divisor(num_undesirable, (~good).sum())
    loss = per_row.sum() / n
    with torch.no_grad():
        stats = {
            "kto/loss": loss,
            "kto/rewards_desirable": beta * ratio[good].sum() / n_good,
            "kto/rewards_undesirable": beta * ratio[~good].sum() / n_bad,
            "kto/logprobs_desirable": lp[good].sum() / n_good,
            "kto/logprobs_undesirable": lp[~good].sum() / n_bad,
        }
        values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()]).tolist()
    return loss, dict(zip(stats.keys(), values))
