"""Collators (dynamic padding: to the longest sequence in the batch) and length-grouped ordering."""

from __future__ import annotations

import random
from typing import Any, Dict, Iterator, List, Sequence

import torch


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> Dict[str, torch.Tensor]:
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

    def __call__(self, examples: Sequence[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
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

    def __call__(self, examples: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        batch: Dict[str, Any] = pad_sequences([ex["prompt_ids"] for ex in examples], self.pad_id, side="left")
        batch["row"] = [ex.get("row") for ex in examples]
        batch["answer"] = [ex.get("answer") for ex in examples]
        batch["prompt_text"] = [ex.get("prompt_text") for ex in examples]
        return batch


def example_length(ex: Dict[str, Any]) -> int:
    """Tokens of an example: prompt + longer response for pairs, the prompt for prompt examples."""
    n = len(ex["prompt_ids"])
    if "chosen_ids" in ex:
        n += max(len(ex["chosen_ids"]), len(ex["rejected_ids"]))
    return n


def length_grouped_order(lengths: Sequence[int], batch_size: int, seed: int, epoch: int = 0,
                         mega: int = 50) -> List[int]:
    """A seeded permutation of range(len(lengths)) in which consecutive `batch_size` chunks hold
    similar lengths (less padding). Every index appears exactly once.

    As in transformers' LengthGroupedSampler: shuffle (seed + epoch), cut into mega-batches of
    `mega * batch_size`, sort each by length (longest first), cut into batches, then shuffle the batch
    order so an epoch does not run from long to short.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    size = mega * batch_size
    grouped: List[int] = []
    for i in range(0, len(idx), size):
        grouped += sorted(idx[i:i + size], key=lambda j: -lengths[j])
    batches = [grouped[i:i + batch_size] for i in range(0, len(grouped), batch_size)]
    rng.shuffle(batches)
    return [j for b in batches for j in b]


class LengthGroupedSampler(torch.utils.data.Sampler):
    """A torch Sampler yielding `length_grouped_order`; call `set_epoch(e)` for a new order each epoch."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0):
        self.lengths, self.batch_size, self.seed, self.epoch = list(lengths), int(batch_size), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        return iter(length_grouped_order(self.lengths, self.batch_size, self.seed, self.epoch))


class SeededRandomSampler(torch.utils.data.Sampler):
    """A plain seeded shuffle per epoch (seed, epoch), the default when `data.group_by_length=false`."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        idx = list(range(self.n))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(idx)
        return iter(idx)


def make_sampler(examples: Sequence[Dict[str, Any]], batch_size: int, *, group_by_length: bool,
                 seed: int = 0) -> torch.utils.data.Sampler:
    """The sampler `data.group_by_length` asks for: LengthGroupedSampler or SeededRandomSampler."""
    if group_by_length:
        return LengthGroupedSampler([example_length(ex) for ex in examples], batch_size, seed)
    return SeededRandomSampler(len(examples), seed)
