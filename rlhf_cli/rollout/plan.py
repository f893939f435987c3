"""One plan for an iteration's update: which rows the update visits in which order, and what the rollout may
fold into it. The learner owns it (`PolicyLearner.plan`); the maker asks for it once per iteration, runs its
passes by it and hands it to the update inside the `Experience` (`Experience.plan`).

    update_order(cfg, iteration, groups)   epochs -> minibatches -> micro-batches of row indices
    fold_settings(cfg, ...) -> (on_policy, carry, why_not)   what the rollout folds into the update, once per run
    UpdatePlan                            one iteration's order with those settings
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.config import reward_sources
from rlhf_cli.seeds import derive_seed


def micro_batches_per_minibatch(p: Any) -> int:
    """Micro-batches of `ppo.micro_batch_size` rows in one minibatch on this rank (`ppo.mini_batch_size` over all
    ranks); the optimizer steps once per minibatch (`update_order`)."""
    return -(-(p.mini_batch_size // engine.world_size()) // p.micro_batch_size)


def packs_rollout_passes(cfg: Any) -> bool:
    """Whether the policy, reference and critic passes of a rollout run packed (`data.packing`).

    A packed layout depends on a row's micro-batch, and float rounding on the layout. The update keeps each row in
    one micro-batch for the whole iteration (`update_order`), and the experience maker runs its no-grad passes
    over those micro-batches, so old log-probs, reference log-probs, values and every epoch's training forward of
    a row see one packed layout, and the first ratio is exactly 1 as in the plain layout."""
    return bool(cfg.data.packing)


def update_order(cfg: Any, iteration: int, groups: torch.Tensor) -> list[list[list[torch.Tensor]]]:
    """The rows of this rank's rollout (B = len(groups)) in the order the update visits them: `ppo.epochs` passes,
    each a list of minibatches of `ppo.mini_batch_size` rows (over all ranks), each a list of micro-batches of
    `ppo.micro_batch_size` row indices (long tensors). Shuffles are seeded by (seed, iteration, rank).

    The micro-batches are drawn once per iteration: a shuffle of the rows cut into minibatches, and with
    `ppo.n_samples_per_prompt` > 1 a minibatch's rows ordered by group before the cut into micro-batches, so that
    a group's samples share micro-batches and `data.packing` computes their prompt once (the minibatch, and so the
    update, is the same: its loss is summed over micro-batches). The first epoch visits them in that order; each
    later epoch shuffles the same micro-batches into new minibatches (veRL keeps its micro-batches across epochs,
    and OpenRLHF's packed samples are shuffled whole); when a minibatch is one micro-batch (`ppo.mini_batch_size`
    = `ppo.micro_batch_size` × world size), later epochs visit the same minibatches in a new order. So a row is in
    one micro-batch, with the same rows, in every pass of an iteration: its packed layout, and the float rounding
    that depends on it, is the one the no-grad passes saw (`packs_rollout_passes`). The plain layout
    (`data.packing=false`) takes the same order, so the switch changes no update beyond float rounding."""
    p = cfg.ppo
    n, mini = groups.shape[0], p.mini_batch_size // engine.world_size()
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, iteration, engine.rank()))
    perm = torch.randperm(n, generator=g)
    micro: list[torch.Tensor] = []
    for s in range(0, n, mini):
        rows = perm[s:s + mini]
        if p.n_samples_per_prompt > 1:
            rows = rows[torch.argsort(groups.cpu()[rows], stable=True)]
        micro += [rows[m:m + p.micro_batch_size] for m in range(0, len(rows), p.micro_batch_size)]
    per_mini = micro_batches_per_minibatch(p)
    order = [list(range(len(micro)))] + [torch.randperm(len(micro), generator=g).tolist()
                                         for _ in range(p.epochs - 1)]
    return [[[micro[j] for j in epoch[s:s + per_mini]] for s in range(0, len(micro), per_mini)] for epoch in order]


def fold_settings(cfg: Any, needs_critic: bool, score_precision: str, zero_stage: int,
                  reference_offloaded: bool) -> tuple[bool, int, str | None]:
    """What the rollout folds into the update, decided once per run: (on_policy, carry, why nothing is carried).

    on_policy: the update is one epoch of one minibatch (the whole rollout, one optimizer step), with no critic
    and the KL in the loss, so nothing before the update reads the old log-probs (nor does the bf16 KL check,
    which runs only with `scoring_precision=same` under bf16-autocast and then keeps the pass; nor a teacher's
    reward, `reward.type=teacher`, whose log π_student they are: it keeps the pass too). The rollout then
    runs no policy pass: the old log-probs are the training forward's own, detached (ratio 1, as TRL's GRPO with
    one step per generation), and the rollout's KL statistics come after the update (`rollout.stats.kl_stats`).

    carry: how many of the update's first micro-batches the rollout runs the training forwards of
    (`ppo.carried_forwards`; 0 = none). They are the rollout's first chunks, and the update's first optimizer step
    comes after them: at the rollout's weights their training forwards give the old log-probs and values the
    no-grad passes would. So the maker runs those forwards (`forwards.training_forward`, graphs kept) in place of
    the chunks' no-grad policy and critic passes, takes their outputs (detached) as those rows' old log-probs and
    values, and hands them to the update (`Experience.forwards`): one forward of each trained model per carried
    micro-batch and iteration saved, the same numbers (the same function of the same weights on the same layout;
    their ratios are exactly 1). Capped at the micro-batches of the update's first minibatch. 0 when the
    rollout's passes do not run over the update's micro-batches (`data.packing=false`), when the update is
    on-policy (nothing is left to fold), when an engine runs ZeRO-3 (its partitioned weights are gathered per
    forward and backward, in order) and when the reference is offloaded (`ppo.offload_reference` on a GPU: a
    graph held beside the reference on the device is the memory that setting saves); `why_not` says which.
    """
    p = cfg.ppo
    checks_kl = score_precision == "bf16-autocast" and p.kl_check_rows > 0  # the KL check needs the old pass
    distils = "teacher" in reward_sources(cfg)  # the teacher's reward reads the old log-probs before the update
    on_policy = (p.epochs == 1 and p.mini_batch_size == p.rollout_batch_size * p.n_samples_per_prompt
                 and not needs_critic and p.kl_in == "loss" and not checks_kl and not distils)
    why_not = ("the rollout's passes do not run over the update's micro-batches (data.packing=false)"
               if not packs_rollout_passes(cfg) else
               "the update is on-policy and the maker runs no old-log-prob pass" if on_policy else
               "an engine runs ZeRO-3" if zero_stage >= 3 else
               "the reference is offloaded (ppo.offload_reference)" if reference_offloaded else None)
    carry = 0 if why_not else min(p.carried_forwards, micro_batches_per_minibatch(p))
    return on_policy, carry, why_not


@dataclass
class UpdatePlan:
    """One iteration's update on this rank, computed once (`PolicyLearner.plan`) and carried by its `Experience`."""

    order: list[list[list[torch.Tensor]]]
    """`update_order`: epochs -> minibatches -> micro-batches (long tensors of row indices into the rollout)."""
    packed: bool
    """The rollout's passes run over the first epoch's micro-batches, packed (`packs_rollout_passes`)."""
    on_policy: bool
    """The old log-probs are the update's own training forward's (`fold_settings`): the rollout runs no policy
    pass, and the update writes them into `Experience.old_logprobs`."""
    carry: int
    """How many of the first epoch's first micro-batches' training forwards the rollout runs (`fold_settings`)."""

    @property
    def first_epoch(self) -> list[torch.Tensor]:
        """The first epoch's micro-batches in update order: the chunks of the rollout's packed passes."""
        return [rows for minibatch in self.order[0] for rows in minibatch]
