"""The rollout record PPO (and every estimator after it) learns from: one batch of sampled responses with what
the no-grad passes computed for them, all in the training forward's layout (see `rollout/__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Experience:
    """One rollout batch on one rank. B rows, P prompt columns, R response columns."""

    input_ids: torch.Tensor  # (B, P+R) long, [left-padded prompt | right-padded response]
    attention_mask: torch.Tensor  # (B, P+R) long, 1 = real token
    mask: torch.Tensor  # (B, R) float, 1 = real response token (EOS included) that enters the loss
    logprobs: torch.Tensor  # (B, R) float32, old log π(a_t|s_t) at temperature, 0 on padding
    ref_logprobs: torch.Tensor  # (B, R) float32, log π_ref(a_t|s_t) at temperature
    values: torch.Tensor  # (B, R) float32, old V(s_t)
    rewards: torch.Tensor  # (B, R) float32, −β·kl_t plus the score at the last real token
    advantages: torch.Tensor  # (B, R) float32, GAE (whitened if ppo.whiten_advantages)
    returns: torch.Tensor  # (B, R) float32, advantages (unwhitened) + values
    scores: torch.Tensor  # (B,) float32, the score added at the EOS (after normalisation/penalty)
    groups: torch.Tensor  # (B,) long, the group id (the iteration's prompt index k) shared by a prompt's samples
    layouts: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)
    """`forwards.PackedRollout` of row sets, keyed by their row indices in order: the packed layouts the no-grad
    passes built (`data.packing`), so the update's forwards of the same micro-batch reuse them."""
    carried: Any = field(default=None, repr=False)
    """A list of (row indices, `learner.Forward`) of the update's first micro-batches, in update order, or None:
    their training forwards, which the maker ran at the rollout's weights (`ExperienceMaker.carries_forward`) and
    whose detached outputs are these rows' old log-probs and values; the update's backward of each micro-batch
    goes through its own (each used once; None when all are). On a micro-batch (`rows`): that micro-batch's
    `Forward`, when it is a carried one."""

    def rows(self, idx: torch.Tensor) -> Experience:
        """The rows `idx` as an Experience of their own (a micro-batch); it keeps their packed layout, if known."""
        sliced = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name not in ("layouts", "carried")}
        layout = self.layouts.get(tuple(idx.tolist()))
        return Experience(**sliced, layouts={} if layout is None else {tuple(range(len(idx))): layout})

    @property
    def layout(self) -> Any:
        """The packed layout of all rows, in order (a `forwards.PackedRollout`), or None when none was built."""
        return self.layouts.get(tuple(range(self.input_ids.shape[0])))

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.mask.shape[1]
