"""The rollout record PPO (and every estimator after it) learns from: one batch of sampled responses with what
the no-grad passes computed for them, all in the training forward's layout (see `rollout/__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from rlhf_cli.forwards import Forward
from rlhf_cli.rollout.plan import UpdatePlan


@dataclass
class Experience:
    """One rollout batch on one rank. B rows, P prompt columns, R response columns."""

    input_ids: torch.Tensor  # (B, P+R) long, [left-padded prompt | right-padded response]
    attention_mask: torch.Tensor  # (B, P+R) long, 1 = real token (what a position may attend to)
    action_mask: torch.Tensor  # (B, R) float, 1 = a token the policy sampled (EOS included; `Episodes.action_mask`)
    loss_mask: torch.Tensor  # (B, R) float, 1 = a sampled token that enters the loss (action_mask × the row counts)
    old_logprobs: torch.Tensor  # (B, R) float32, log π_old(a_t|s_t) at temperature, 0 on padding (see `plan`)
    ref_logprobs: torch.Tensor  # (B, R) float32, log π_ref(a_t|s_t) at temperature
    values: torch.Tensor  # (B, R) float32, old V(s_t)
    rewards: torch.Tensor  # (B, R) float32, −β·kl_t (+ a teacher's log-ratio) plus the score at the last sampled token
    advantages: torch.Tensor  # (B, R) float32, GAE (whitened if ppo.whiten_advantages)
    returns: torch.Tensor  # (B, R) float32, advantages (unwhitened) + values
    scores: torch.Tensor  # (B,) float32, the score added at the EOS (after normalisation/penalty)
    groups: torch.Tensor  # (B,) long, the group id (the iteration's prompt index k) shared by a prompt's samples
    scored: torch.Tensor | None = None  # (B,) bool, False: no reward source could score the row (its score is 0 and
    # it is out of the loss); None: every row was scored
    layouts: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)
    """`forwards.PackedRollout` of row sets, keyed by their row indices in order: the packed layouts the no-grad
    passes built (`data.packing`), so the update's forwards of the same micro-batch reuse them."""
    forwards: dict[tuple[int, ...], Forward] = field(default_factory=dict, repr=False)
    """Training forwards (`forwards.Forward`, with their graphs) of row sets, keyed as `layouts`: the update's
    first micro-batches' forwards, which the rollout ran at its weights (`UpdatePlan.carry`) and whose detached
    outputs are these rows' old log-probs and values. The update takes each (`PolicyLearner.micro_batches` moves
    it onto its micro-batch) and backpropagates through it once; none is left after the update."""
    plan: UpdatePlan | None = field(default=None, repr=False)
    """The iteration's update (`PolicyLearner.plan`): its micro-batch order and what the rollout folded into it.
    `plan.on_policy`: `old_logprobs` are filled in by the update's own forward (zeros until then)."""
    engine_logprobs: torch.Tensor | None = None
    """(B, R) float32: the sampling engine's own log-probs of the response tokens (after temperature, and top-p:
    renormalised over the nucleus, as the trainer's `old_logprobs` are), 0 on padding; None when the engine gives
    none (`rollout.engine=hf`). `stats.engine_stats` compares them with the trainer's `old_logprobs`."""

    def rows(self, idx: torch.Tensor) -> Experience:
        """The rows `idx` as an Experience of their own (a micro-batch); it keeps their packed layout, if known."""
        kept = ("layouts", "forwards", "plan")
        sliced = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                  for f in fields(self) if f.name not in kept}
        layout = self.layouts.get(tuple(idx.tolist()))
        return Experience(**sliced, layouts={} if layout is None else {tuple(range(len(idx))): layout}, plan=self.plan)

    @property
    def layout(self) -> Any:
        """The packed layout of all rows, in order (a `forwards.PackedRollout`), or None when none was built."""
        return self.layouts.get(tuple(range(self.input_ids.shape[0])))

    @property
    def forward(self) -> Forward | None:
        """The training forward of all rows, in order (a micro-batch's, moved onto it by the update), or None."""
        return self.forwards.get(tuple(range(self.input_ids.shape[0])))

    @property
    def prompt_len(self) -> int:
        """P, the prompt columns: the ids' columns before the R of the action mask."""
        return self.input_ids.shape[1] - self.action_mask.shape[1]
