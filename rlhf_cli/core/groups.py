"""Group baselines of the critic-free estimators: statistics of each row's group of samples of one prompt.

A rollout with `ppo.n_samples_per_prompt = n` holds groups of n rows sampled from the same prompt; ``groups``
``(B,)`` gives each row its group's id (any integers; rows of a group need not be adjacent). ``valid`` ``(B,)``
marks the rows that count: a row masked out of the loss (`ppo.truncated=mask` and no EOS) neither learns nor
enters its group's statistics.

Exact semantics, for every baseline here:
  * a group whose valid scores are all equal (max == min, zero variance) gives each of its rows the adjusted
    score 0 exactly: no learning signal, and no division by a zero std;
  * a group with fewer than 2 valid rows gives 0 (no baseline can be formed from one sample);
  * invalid rows get 0.

In the update (`rollout.PolicyLearner.micro_batches`), a flat group's rows stay (unless `ppo.filter_groups` drops
them, `informative_groups`): no policy gradient, but their tokens count in the loss's divisors and take the KL
term; an invalid row has no token in the loss and counts in no divisor.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_stats(scores: Tensor, groups: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Per-row statistics of the row's group, over the group's valid rows.

    Args:
        scores: ``(B,)`` sequence scores (reward units).
        groups: ``(B,)`` integer group id of each row.
        valid: ``(B,)`` bool (or 0/1), rows that count.

    Returns:
        dict of ``(B,)`` float32 tensors (float64 internally for the sums): ``mean`` and ``std`` (the unbiased
        sample std, n − 1 in the denominator, as TRL, OpenRLHF and veRL use; 0 when n < 2) of the group's valid
        scores, ``count`` (valid rows in the group) and ``flat`` (1.0 where the group is degenerate: its valid
        scores are all equal, or it has fewer than 2 valid rows).

    Raises:
        ValueError: shapes differ or are not 1-D.
    """
    if scores.dim() != 1 or groups.shape != scores.shape or valid.shape != scores.shape:
        raise ValueError(f"scores, groups and valid must be (B,) tensors of one shape, got {tuple(scores.shape)}, "
                         f"{tuple(groups.shape)}, {tuple(valid.shape)}")
    v = valid.bool()
    _, inv = torch.unique(groups, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    s = torch.where(v, scores.double(), 0.0)
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(0, inv, v.double())
    total = torch.zeros_like(count).index_add_(0, inv, s)
    mean = total / count.clamp(min=1)
    dev2 = torch.where(v, (s - mean[inv]) ** 2, 0.0)
    var = torch.zeros_like(count).index_add_(0, inv, dev2) / (count - 1).clamp(min=1)
    big = torch.finfo(torch.float64).max
    hi = torch.full((n_groups,), -big, dtype=torch.float64, device=s.device).scatter_reduce(
        0, inv, torch.where(v, s, -big), "amax")
    lo = torch.full((n_groups,), big, dtype=torch.float64, device=s.device).scatter_reduce(
        0, inv, torch.where(v, s, big), "amin")
    flat = (hi <= lo) | (count < 2)
    std = torch.where(count >= 2, var.sqrt(), 0.0)
    return {"mean": mean[inv].float(), "std": std[inv].float(), "count": count[inv].float(),
            "flat": flat[inv].float()}


def group_adjusted_scores(scores: Tensor, groups: Tensor, valid: Tensor, baseline: str,
                          eps: float = 1e-6) -> Tensor:
    """The score each row learns from after its group's baseline.

    baselines (s_i a row's score, mean/std/n over its group's valid rows):
        ``"grpo"``      (s_i − mean) / (std + eps)     Shao et al. 2024, DeepSeekMath, sec. 4.1.2
        ``"dr_grpo"``   s_i − mean                     Liu et al. 2025, "Understanding R1-Zero-Like Training"
        ``"rloo"``      s_i − (Σ_{j≠i} s_j)/(n − 1)    Ahmadian et al. 2024, "Back to Basics"
                        = n/(n − 1) · (s_i − mean)
        ``"none"``      s_i                            (REINFORCE++, Hu 2025: no group baseline)

    Degenerate groups (all valid scores equal, or fewer than 2 valid rows) and invalid rows give exactly 0,
    except under ``"none"``, where only invalid rows give 0.

    Args:
        scores, groups, valid: as in `group_stats`.
        baseline: one of the four names above.
        eps: added to the std under ``"grpo"`` (veRL's 1e-6); irrelevant for flat groups, which give 0.

    Returns:
        ``(B,)`` float32, reward units (``"grpo"``: units of the group's std).

    Raises:
        ValueError: an unknown baseline, or bad shapes (see `group_stats`).
    """
    v = valid.bool()
    if baseline == "none":
        return torch.where(v, scores.float(), 0.0)
    st = group_stats(scores, groups, valid)
    centred = scores.double() - st["mean"].double()
    if baseline == "grpo":
        out = centred / (st["std"].double() + eps)
    elif baseline == "dr_grpo":
        out = centred
    elif baseline == "rloo":
        n = st["count"].double()
        out = centred * n / (n - 1).clamp(min=1)
    else:
        raise ValueError(f"unknown group baseline {baseline!r} (grpo, dr_grpo, rloo, none)")
    return torch.where(v & (st["flat"] == 0), out, 0.0).float()


def informative_groups(scores: Tensor, groups: Tensor, valid: Tensor) -> Tensor:
    """The rows whose group carries a learning signal: DAPO's dynamic sampling filter (Yu et al. 2025, "DAPO",
    sec. 3.2, eq. 11: a prompt is trained on only when 0 < |{o_i : o_i correct}| < G, i.e. its outputs' scores are
    not all equal). A row is kept when its group is not degenerate in `group_stats`'s sense: its valid scores are
    not all equal (max > min), and it has at least 2 valid rows. All rows of a kept group are kept, invalid ones
    too (they stay masked out of the loss); all rows of a dropped group are dropped.

    Args:
        scores, groups, valid: as in `group_stats` (``(B,)``; the scores after every penalty the advantages see).

    Returns:
        ``(B,)`` bool, True = the row's group is kept.

    Raises:
        ValueError: bad shapes (see `group_stats`).
    """
    return group_stats(scores, groups, valid)["flat"] == 0
