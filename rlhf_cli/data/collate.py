"""Collators (dynamic padding: to the longest sequence in the batch) and length-grouped ordering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf_cli.seeds import derive_seed


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> dict[str, torch.Tensor]:
    """Pad token-id lists to the longest: {input_ids (N, L) long, attention_mask (N, L) long, 1 = real token}."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right' (got {side!r})")
    n, length = len(seqs), max((len(s) for s in seqs), default=0)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not len(s):
            continue
        sl = slice(length - len(s), length) if side == "left" else slice(0, len(s))
        input_ids[i, sl] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, sl] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


class PairCollator:
    """Preference examples -> ONE right-padded batch, chosen rows first, then rejected rows.

        input_ids       (2B, L) long  rows [0, B) = prompt + chosen, rows [B, 2B) = prompt + rejected
        attention_mask  (2B, L) long  1 = real token; a row's last real token is its EOS
        margin          (B,) float    only when every example has a `margin`

    With right padding the EOS of row i sits at `attention_mask[i].sum() - 1`.
    """

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [ex["prompt_ids"] + ex["chosen_ids"] for ex in examples]
        seqs += [ex["prompt_ids"] + ex["rejected_ids"] for ex in examples]
        batch = pad_sequences(seqs, self.pad_id, side="right")
        has_margin = ["margin" in ex for ex in examples]
        if any(has_margin):
            if not all(has_margin):
                raise ValueError("some examples in the batch have a margin and some do not")
            batch["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float32)
        return batch


class PromptCollator:
    """Prompt examples -> a LEFT-padded batch for generation (new tokens append on the right).

        input_ids       (B, P) long
        attention_mask  (B, P) long, 1 = real token
        row             list[int]
        answer          list (None where unknown)
        prompt_text     list[str]
    """

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = pad_sequences([ex["prompt_ids"] for ex in examples], self.pad_id, side="left")
        batch["row"] = [ex.get("row") for ex in examples]
        batch["answer"] = [ex.get("answer") for ex in examples]
        batch["prompt_text"] = [ex.get("prompt_text") for ex in examples]
        return batch


def example_length(ex: dict[str, Any]) -> int:
    """Tokens of an example: prompt + longer response for pairs, the prompt for prompt examples."""
    n = len(ex["prompt_ids"])
    if "chosen_ids" in ex:
        n += max(len(ex["chosen_ids"]), len(ex["rejected_ids"]))
    return n


def epoch_order(n: int, seeds: Sequence[int], epoch: int, lengths: Sequence[int] | None = None,
                group_size: int = 0) -> list[int]:
    """A seeded permutation of range(n) for one epoch (the same on every rank and on resume), drawn from
    `derive_seed(*seeds, epoch)`; the stages pass `seeds=(data.seed, seed)`.

    With `lengths` and `group_size`, rows are sorted by length inside shuffled windows of
    `group_size * 8` rows and the resulting groups shuffled again (less padding, every row once).
    """
    g = torch.Generator().manual_seed(derive_seed(*seeds, epoch))
    order = torch.randperm(n, generator=g).tolist()
    if lengths is None or group_size <= 0:
        return order
    window = group_size * 8
    chunks = []
    for i in range(0, n, window):
        w = sorted(order[i:i + window], key=lambda j: lengths[j])
        chunks += [w[k:k + group_size] for k in range(0, len(w), group_size)]
    perm = torch.randperm(len(chunks), generator=g).tolist()
    return [j for c in perm for j in chunks[c]]
