"""Helpers shared by the core math tests (import as `core_helpers`)."""

import torch


def right_padded_mask(gen, B, T):
    """(B, T) bool mask with ragged lengths in [0, T]; the first row is full, the second empty."""
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0] = T
    if B > 1:
        lengths[1] = 0
    return torch.arange(T) < lengths[:, None]


def with_garbage(x, mask, value):
    """`x` with `value` wherever `mask` is 0 (a (B, T) mask broadcasts over a trailing vocab dim)."""
    m = mask if x.dim() == mask.dim() else mask[..., None]
    return torch.where(m, x, torch.full_like(x, value))
