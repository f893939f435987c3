"""Reward-model scores: of whole sequences (a rollout's, an eval's responses) and of preference pairs
(train-rm's training forward and held-out eval, `rlhf eval` of a reward model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import pairwise_loss
from rlhf_cli.data import PackedPairCollator, PairCollator
from rlhf_cli.forwards.packing import pack_rollout, use_packing
from rlhf_cli.models import attention_tokens, last_token_index, scores_at, sequence_scores


@torch.no_grad()
def batched_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int,
                   precision: str, prompt_len: int | None = None, packing: bool = False,
                   eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """Reward-model scores (N,) float32 of N sequences, `batch_size` rows per forward, under the run's
    precision; on the inputs' device. See models.sequence_scores for where each score is read.

    With `packing` (`data.packing`) and `prompt_len` (the batch laid out `[prompt | response]` as
    `rollout_batch` gives it), each forward runs packed (`forwards.pack_rollout`: a prompt shared by several
    rows once, no padding between sequences): the same scores to float rounding.

    Identical sequences (the same real tokens) are scored once and share that score, so they tie exactly in any
    layout: a group whose samples are all the same is flat (`core.group_stats`), not a group with a spread of
    rounding errors that a group std would blow up.

    `eos_ids`: the run's EOS set (`eos.eos_ids`, the tokenizer's EOS first). A reward model reads its score at the
    tokenizer's EOS, where train-rm's responses end (`data.Encoder`); a sequence whose last real token is another id
    of the set (a policy that ended its turn with `<|end|>`) is scored with that token read as the tokenizer's EOS.
    The caller's tensors are not changed."""
    if len(eos_ids) > 1:
        last = last_token_index(attention_mask)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        other = torch.isin(input_ids[rows, last], torch.tensor(eos_ids[1:], device=input_ids.device))
        input_ids = input_ids.clone()
        input_ids[rows[other], last[other]] = eos_ids[0]
    keys = [tuple(row[m.bool()].tolist()) for row, m in zip(input_ids.cpu(), attention_mask.cpu())]
    first: dict[tuple[int, ...], int] = {}  # a sequence -> its first row
    for b, k in enumerate(keys):
        first.setdefault(k, b)
    slot = {k: j for j, k in enumerate(first)}
    inverse = torch.tensor([slot[k] for k in keys], dtype=torch.long, device=input_ids.device)
    unique = torch.tensor(list(first.values()), dtype=torch.long, device=input_ids.device)
    input_ids, attention_mask = input_ids[unique], attention_mask[unique]
    out = []
    pack = prompt_len is not None and use_packing(model, packing)
    with engine.autocast(precision):
        for i in range(0, input_ids.shape[0], batch_size):
            ids, am = input_ids[i:i + batch_size], attention_mask[i:i + batch_size]
            if pack:
                pk = pack_rollout(ids, am, prompt_len, attention_tokens=attention_tokens(model))
                out.append(scores_at(model, pk.packed.input_ids, pk.packed.allowed, pk.last,
                                     pk.packed.position_ids).float())
            else:
                out.append(sequence_scores(model, ids, am).float())
    return torch.cat(out)[inverse]


def pair_collator(model: Any, pad_id: int, packing: bool) -> Callable[[Sequence[dict[str, Any]]], dict[str, Any]]:
    """The collator of preference pairs for `model`: `PackedPairCollator` (prompt computed once, pairs
    packed, `data.packing=true`) where the model's attention implementation takes a custom 4D mask, else
    `PairCollator` (chosen and rejected as two padded rows), saying once why packing is off (`use_packing`)."""
    return PackedPairCollator(pad_id, attention_tokens(model)) if use_packing(model, packing) else PairCollator(pad_id)


def forward_pairs(model: Any, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (B,) float32 of chosen and of rejected from ONE trunk forward over a collated batch:
    `PairCollator`'s (2B, L) rows, or `PackedPairCollator`'s packed rows (each score read at its own EOS)."""
    dev = engine.device()
    ids = batch["input_ids"].to(dev)
    with engine.autocast(precision):
        if "pair_attention" in batch:
            index = torch.cat([batch["chosen_end"], batch["rejected_end"]]).to(dev)
            scores = scores_at(model, ids, batch["pair_attention"].to(dev), index, batch["position_ids"].to(dev))
        else:
            scores = sequence_scores(model, ids, batch["attention_mask"].to(dev))
    b = scores.shape[0] // 2
    return scores[:b].float(), scores[b:].float()


@torch.no_grad()
def score_pairs(model: Any, pairs: Sequence[dict[str, Any]], pad_id: int, batch_size: int,
                precision: str, packing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every pair's chosen and rejected response, sharded over ranks, gathered in order;
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
