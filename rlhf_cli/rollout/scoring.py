"""Reward-model scores: of whole sequences (a rollout's, an eval's responses) and of preference pairs
(train-rm's training forward and held-out eval, `rlhf eval` of a reward model)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import pairwise_loss
from rlhf_cli.data import PackedPairCollator, PairCollator
from rlhf_cli.models import custom_mask_support, rewards_at, sequence_rewards

log = logging.getLogger(__name__)
_SAID: set[str] = set()


@torch.no_grad()
def batched_rewards(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int,
                    precision: str) -> torch.Tensor:
    """Reward-model scores (N,) float32 of N sequences, `batch_size` rows per forward, under the run's
    precision; on the inputs' device. See models.sequence_rewards for where each score is read."""
    with engine.autocast(precision):
        return torch.cat([sequence_rewards(model, input_ids[i:i + batch_size], attention_mask[i:i + batch_size]).float()
                          for i in range(0, input_ids.shape[0], batch_size)])


def pair_collator(model: Any, pad_id: int, packing: bool) -> Callable[[Sequence[dict[str, Any]]], dict[str, Any]]:
    """The collator of preference pairs for `model`: `PackedPairCollator` (prompt computed once, pairs
    packed, `data.packing=true`) where the model's attention implementation takes a custom 4D mask, else
    `PairCollator` (chosen and rejected as two padded rows), saying once why packing is off."""
    if not packing:
        return PairCollator(pad_id)
    reason = custom_mask_support(model)
    if reason is None:
        return PackedPairCollator(pad_id)
    if reason not in _SAID and engine.is_main():
        _SAID.add(reason)
        log.warning("data.packing=true is off for this model: %s; chosen and rejected are computed as two "
                    "padded rows each", reason)
    return PairCollator(pad_id)


def forward_pairs(model: Any, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (B,) float32 of chosen and of rejected from ONE trunk forward over a collated batch:
    `PairCollator`'s (2B, L) rows, or `PackedPairCollator`'s packed rows (each score read at its own EOS)."""
    dev = engine.device()
    ids = batch["input_ids"].to(dev)
    with engine.autocast(precision):
        if "pair_attention" in batch:
            index = torch.cat([batch["chosen_end"], batch["rejected_end"]]).to(dev)
            rewards = rewards_at(model, ids, batch["pair_attention"].to(dev), index, batch["position_ids"].to(dev))
        else:
            rewards = sequence_rewards(model, ids, batch["attention_mask"].to(dev))
    b = rewards.shape[0] // 2
    return rewards[:b].float(), rewards[b:].float()


@torch.no_grad()
def score_pairs(model: Any, pairs: Sequence[dict[str, Any]], pad_id: int, batch_size: int,
                precision: str, packing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of every pair's chosen and rejected response, sharded over ranks, gathered in order;
    `batch_size` pairs per forward, laid out as `pair_collator(model, pad_id, packing)` says.

    Returns two float32 tensors of shape (N,) on CPU, identical on every rank.
    """
    was_training = model.training
    model.eval()
    collate = pair_collator(model, pad_id, packing)
    ws = engine.world_size()
    mine = list(range(engine.rank(), len(pairs), ws))
    # every rank runs the same number of forwards (ZeRO-3 gathers weights collectively): pad the
    # shard with a repeat of pair 0 and drop its scores
    per_rank = -(-len(pairs) // ws)
    padded = mine + [0] * (per_rank - len(mine))
    out: list[tuple[int, float, float]] = []
    for i in range(0, len(padded), batch_size):
        idx = padded[i:i + batch_size]
        c, r = forward_pairs(model, collate([pairs[j] for j in idx]), precision)
        real = len(mine) - i
        out += list(zip(idx[:max(real, 0)], c.cpu().tolist(), r.cpu().tolist()))
    if was_training:
        model.train()
    merged = sorted(x for part in engine.all_gather_object(out) for x in part)
    chosen = torch.tensor([x[1] for x in merged], dtype=torch.float32)
    rejected = torch.tensor([x[2] for x in merged], dtype=torch.float32)
    return chosen, rejected


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Loss, accuracy (ties not correct), tie count, margin and reward means of scored pairs."""
    _, stats = pairwise_loss(chosen, rejected)
    stats["rm/ties"] = float((chosen == rejected).sum())
    stats["rm/count"] = float(chosen.numel())
    return stats
