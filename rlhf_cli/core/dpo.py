"""Direct preference losses (train-dpo): a policy's and a frozen reference's summed response log-probs of each
pair's chosen and rejected response -> a loss to minimise, with its statistics.

Every loss of :data:`DPO_LOSSES` (``dpo.loss``) is a function of one number per pair, the log-ratio gap

    h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))          (nats)

(y_w chosen, y_l rejected; each log-prob a sum over the response's tokens). :func:`dpo_loss` averages the
per-pair loss over the pairs and adds RPO's SFT term on the chosen responses (``dpo.sft_weight``).

The implicit reward of a response is ``beta * (log pi(y|x) - log pi_ref(y|x))`` (Rafailov et al. 2023, sec. 5);
``dpo/margin`` is chosen minus rejected (``beta * h``), and a pair counts as correct when it is > 0 strictly (at
the first step, with pi = pi_ref, no pair is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import rlhf_cli.registry as registry
from rlhf_cli.core.ops import _check_shapes, _compute_dtype


def sigmoid_loss(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO's loss per pair (``dpo.loss=sigmoid``), with conservative DPO's label smoothing.

    Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; the label smoothing ε
    (``dpo.label_smoothing``) of Mitchell 2023, "A note on DPO with noisy preferences" (cDPO: each label is
    flipped with probability ε; earlier TRL releases' ``label_smoothing`` of the sigmoid loss)::

        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    ``h``: ``(B,)`` log-ratio gaps (module docstring), nats; returns ``(B,)`` in nats, computed with
    ``logsigmoid`` (no overflow). At h = 0: log 2.
    """
    z = beta * h
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def ipo_loss(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """IPO's loss per pair (``dpo.loss=ipo``): a square regression of the gap on 1 / (2 beta).

    Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17
    (their τ is ``dpo.beta``)::

        loss = (h - 1 / (2 * beta)) ** 2

    ``(B,)`` -> ``(B,)``. :func:`dpo_loss` passes the gap of the per-token log-ratios (each response's log-ratio
    divided by its token count; ``registry.DPO_LOSSES`` declares ``ipo`` ``per_token``), the form TRL 1.12 uses and
    reports as the one the IPO authors confirmed their results with; a sum would make the square grow with the
    responses' length. ``label_smoothing`` must be 0 (IPO has no labels to smooth; `config.validate_dpo` refuses it).
    """
    if label_smoothing:
        raise ValueError(f"label_smoothing={label_smoothing} is defined for the sigmoid loss only")
    return (h - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """SLiC's calibration loss per pair (``dpo.loss=hinge``), on the log-ratio gap.

    Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", eq. 1 (the rank
    calibration loss max(0, δ - log P(y_w|x) + log P(y_l|x))), taken on the reference-relative gap ``h`` and
    scaled by ``beta`` as TRL's ``loss_type="hinge"`` does (δ = 1 / beta)::

        loss = max(0, 1 - beta * h)

    ``(B,)`` -> ``(B,)``. ``label_smoothing`` must be 0.
    """
    if label_smoothing:
        raise ValueError(f"label_smoothing={label_smoothing} is defined for the sigmoid loss only")
    return torch.relu(1.0 - beta * h)


DPO_LOSSES: dict[str, Callable[[Tensor, float, float], Tensor]] = registry.DPO_LOSSES.bind({
    "sigmoid": sigmoid_loss, "ipo": ipo_loss, "hinge": hinge_loss})
"""The per-pair losses by the name ``dpo.loss`` gives (``registry.DPO_LOSSES`` bound to their functions, in its
order); each takes ``(h, beta, label_smoothing)``. A choice declared ``per_token`` (IPO) gets the gap of the
per-token log-ratios."""


def dpo_loss(
    logprobs_chosen: Tensor,
    logprobs_rejected: Tensor,
    ref_logprobs_chosen: Tensor,
    ref_logprobs_rejected: Tensor,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    num_pairs: float | None = None,
    *,
    sft_weight: float = 0.0,
    chosen_tokens: Tensor | None = None,
    num_chosen_tokens: float | None = None,
    rejected_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The preference loss of a batch of pairs, plus RPO's SFT term on the chosen responses.

    ::

        loss = sum_i DPO_LOSSES[loss](h_i, beta, eps) / num_pairs
               + sft_weight * sum_i -log pi(y_w,i | x_i) / num_chosen_tokens

    with h_i the log-ratio gap of the module docstring, or for a loss declared ``per_token`` (IPO) the gap of
    (log pi(y|x) - log pi_ref(y|x)) / |y| of each response.

    The second term is the negative log-likelihood of the chosen responses per chosen token (Pang et al. 2024,
    "Iterative Reasoning Preference Optimization", eq. 3: RPO; TRL 1.12's ``loss_type=["sigmoid", "sft"]`` with
    ``loss_weights=[1, sft_weight]``, earlier TRL's ``rpo_alpha``).

    Args:
        logprobs_chosen, logprobs_rejected: ``(B,)`` the policy's summed response log-probs (nats, <= 0), with
            their graph (`forwards.pair_logprobs`).
        ref_logprobs_chosen, ref_logprobs_rejected: ``(B,)`` the reference's; no gradient flows into them.
        beta: ``dpo.beta`` > 0 (DPO's β, IPO's τ).
        loss: a name of :data:`DPO_LOSSES`.
        label_smoothing: ``dpo.label_smoothing`` ε in [0, 0.5) (sigmoid only).
        num_pairs: the divisor of the pair sums; default B. A trainer that cuts an optimizer step into
            micro-batches (and ranks) passes the step's pair count, so that the summed loss and gradient do not
            depend on the cut.
        sft_weight: ``dpo.sft_weight`` >= 0; 0 leaves the term out (and ``chosen_tokens`` is not read).
        chosen_tokens: ``(B,)`` each chosen response's token count (needed when ``sft_weight`` > 0 and for
            losses declared ``per_token``).
        rejected_tokens: ``(B,)`` each rejected response's token count (needed for losses declared
            ``per_token``).
        num_chosen_tokens: the divisor of the SFT term; default ``chosen_tokens.sum()`` (pass the step's count
            when cutting a step, as for ``num_pairs``).

    Returns:
        ``(loss, stats)``: ``loss`` 0-dim, float32 (float64 for float64 inputs), 0 and attached to the graph for
        an empty batch. ``stats``, detached floats, each a sum over this call's pairs / ``num_pairs`` (so that,
        like the loss, they sum over a step's micro-batches to the step's mean): ``dpo/loss`` (the whole loss),
        ``dpo/pair_loss`` (the first term), ``dpo/rewards_chosen`` and ``dpo/rewards_rejected`` (the implicit
        rewards, beta × log-ratio), ``dpo/margin`` (chosen − rejected), ``dpo/accuracy`` (the fraction of pairs
        whose margin is > 0), ``dpo/logprobs_chosen`` and ``dpo/logprobs_rejected`` (the policy's, nats);
        with ``sft_weight`` > 0 also ``dpo/sft_loss`` (the NLL per chosen token, unweighted).

    Raises:
        ValueError: shape mismatch, an unknown ``loss``, ``beta`` <= 0, ``label_smoothing`` outside [0, 0.5) or
        set for a loss other than sigmoid, ``sft_weight`` > 0 without ``chosen_tokens``, a loss declared
        ``per_token`` without both token counts.
    """
    _check_shapes(logprobs_chosen=logprobs_chosen, logprobs_rejected=logprobs_rejected,
                  ref_logprobs_chosen=ref_logprobs_chosen, ref_logprobs_rejected=ref_logprobs_rejected)
    if loss not in DPO_LOSSES:
        raise ValueError(f"loss must be one of {', '.join(DPO_LOSSES)}, got {loss!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss != "sigmoid":
        raise ValueError(f"label_smoothing={label_smoothing} is defined for the sigmoid loss only (loss={loss})")
    if sft_weight and chosen_tokens is None:
        raise ValueError("sft_weight > 0 needs chosen_tokens (each chosen response's token count)")
    per_token = registry.DPO_LOSSES[loss].per_token
    if per_token and (chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"loss={loss} needs chosen_tokens and rejected_tokens (its gap is per token)")
    dtype = _compute_dtype(logprobs_chosen, logprobs_rejected, ref_logprobs_chosen, ref_logprobs_rejected)
    chosen, rejected = logprobs_chosen.to(dtype), logprobs_rejected.to(dtype)
    chosen_ratio = chosen - ref_logprobs_chosen.detach().to(dtype)  # (B,) log pi/pi_ref of y_w
    rejected_ratio = rejected - ref_logprobs_rejected.detach().to(dtype)
    h = chosen_ratio - rejected_ratio  # (B,)
    n = torch.as_tensor(float(num_pairs) if num_pairs is not None else float(h.numel()), dtype=dtype,
                        device=h.device).clamp(min=1)
    gap = h
    if per_token:
        gap = (chosen_ratio / chosen_tokens.to(h.device, dtype).clamp(min=1)
               - rejected_ratio / rejected_tokens.to(h.device, dtype).clamp(min=1))
    pair_loss = DPO_LOSSES[loss](gap, beta, label_smoothing).sum() / n
    total = pair_loss
    stats = {"dpo/pair_loss": pair_loss}
    if sft_weight:
        count = chosen_tokens.sum() if num_chosen_tokens is None else num_chosen_tokens
        sft = -chosen.sum() / torch.as_tensor(count, dtype=dtype, device=h.device).clamp(min=1)
        total = total + sft_weight * sft
        stats["dpo/sft_loss"] = sft
    with torch.no_grad():
        stats.update({
            "dpo/loss": total,
            "dpo/rewards_chosen": beta * chosen_ratio.sum() / n,
            "dpo/rewards_rejected": beta * rejected_ratio.sum() / n,
            "dpo/margin": beta * h.sum() / n,
            "dpo/accuracy": (h > 0).to(torch.float64).sum() / n.double(),
            "dpo/logprobs_chosen": chosen.sum() / n,
            "dpo/logprobs_rejected": rejected.sum() / n,
        })
        values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()]).tolist()
    return total, dict(zip(stats.keys(), values))
