"""Collators (dynamic padding: to the longest sequence in the batch) and length-grouped ordering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

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
        pair_tokens     () long       real tokens, sum of attention_mask
        margin          (B,) float    only when every example has a `margin`

    With right padding the EOS of row i sits at `attention_mask[i].sum() - 1`.
    """

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [ex["prompt_ids"] + ex["chosen_ids"] for ex in examples]
        seqs += [ex["prompt_ids"] + ex["rejected_ids"] for ex in examples]
        batch = pad_sequences(seqs, self.pad_id, side="right")
        batch["pair_tokens"] = batch["attention_mask"].sum()
        _add_margin(batch, examples)
        return batch


def _add_margin(batch: dict[str, torch.Tensor], examples: Sequence[dict[str, Any]]) -> None:
    """`batch["margin"]` (B,) float32 when every example has a margin; ValueError when only some have one."""
    has_margin = ["margin" in ex for ex in examples]
    if any(has_margin):
        if not all(has_margin):
            raise ValueError("some examples in the batch have a margin and some do not")
        batch["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float32)


class PackedPairCollator:
    """Preference examples -> packed rows: the prompt computed once per pair, no padding between pairs.

    Each pair is ONE segment `[prompt | chosen | rejected]`; segments are placed first-fit, longest
    first, into rows as long as the longest segment of the batch, or wider where the model's
    `attention_tokens` says that costs less (`row_width`), and only each row's tail is padding. In a
    segment, positions run 0..P-1 over the prompt, P..P+C-1 over chosen and restart at P over
    rejected; a token attends to the tokens of its own segment at or before its column, except that
    rejected never sees chosen. So every chosen and rejected token sees exactly the keys, at exactly
    the positions, it sees in `PairCollator`'s two rows, and each score is read at its own EOS: the
    same scores up to float rounding, computed from P + C + R tokens instead of 2P + C + R plus
    padding (prefix sharing: Wang et al. 2024,
    "Accelerating Direct Preference Optimization with Prefix Sharing").

        input_ids        (R, L) long   R <= B rows
        position_ids     (R, L) long   0 on padding
        attention_mask   (R, L) long   1 = real token (counts what is computed)
        pair_attention   (R, 1, L, L) bool  [r, 0, q, k] = query q may attend key k; a padding
                                       position attends to itself only (no empty softmax row)
        chosen_end       (B, 2) long   (row, column) of pair i's chosen EOS
        rejected_end     (B, 2) long   (row, column) of pair i's rejected EOS
        pair_tokens      () long       tokens of the unpacked pairs: sum of (P + C) + (P + R)
        margin           (B,) float    only when every example has a `margin`

    Raises ValueError when a pair has an empty chosen or rejected response.
    """

    def __init__(self, pad_id: int, attention_tokens: float | None = None):
        self.pad_id = int(pad_id)
        self.attention_tokens = attention_tokens  # row widths (`row_width`): the model's `models.attention_tokens`

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        for ex in examples:
            if not ex["chosen_ids"] or not ex["rejected_ids"]:
                raise ValueError("a pair with an empty chosen or rejected response cannot be scored")
        packed = pack_shared_prefixes([(ex["prompt_ids"], [ex["chosen_ids"], ex["rejected_ids"]]) for ex in examples],
                                      self.pad_id, self.attention_tokens)
        ends = torch.tensor([[[r, c + len(ex[key]) - 1] for key, (r, c) in zip(("chosen_ids", "rejected_ids"), cols)]
                             for ex, cols in zip(examples, packed.branch_starts)], dtype=torch.long).view(-1, 2, 2)
        batch: dict[str, torch.Tensor] = {
            "input_ids": packed.input_ids, "position_ids": packed.position_ids,
            "attention_mask": packed.attention_mask, "pair_attention": packed.allowed,
            "chosen_end": ends[:, 0], "rejected_end": ends[:, 1],
            "pair_tokens": torch.tensor(sum(2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"])
                                            for ex in examples)),
        }
        _add_margin(batch, examples)
        return batch


class PackedPrefixes(NamedTuple):
    """Segments `[prefix | branch 1 | branch 2 | ...]` packed into rows (`pack_shared_prefixes`). W rows of L columns.

        input_ids       (W, L) long   pad id on padding
        position_ids    (W, L) long   a prefix at 0..P-1, each branch continuing at P; 0 on padding
        attention_mask  (W, L) long   1 = real token
        allowed         (W, 1, L, L) bool  [w, 0, q, k]: query q may attend key k (its segment's prefix and its
                                      own branch, causally); a padding position attends to itself only
        branch_starts   list per segment of (row, column) of each branch's first token
        prefix_starts   list per segment of (row, column) of its prefix's first token
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    allowed: torch.Tensor
    branch_starts: list[list[tuple[int, int]]]
    prefix_starts: list[tuple[int, int]]


def _first_fit(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Segment indices per row: first-fit, longest first, into rows of `width` (>= the longest segment)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def row_width(lengths: Sequence[int], attention_tokens: float | None) -> int:
    """The packed row length for segments of `lengths` tokens: the one of least estimated cost.

    A row of L positions costs L × (1 + L / `attention_tokens`) (the linear layers per position, plus attention
    over up to L keys; `models.attention_tokens`: the key count at which they cost the same). Wider rows leave
    less padding at the rows' tails but make attention dearer. Candidates: the longest segment, and the total
    spread evenly over k rows (up to 16 values of k, and 10 % wider), whose attention memory (rows × L², the
    4D mask and, under eager attention, the scores) is at most twice that of rows of the longest segment.
    None, or a value <= 0: the longest segment. Raises ValueError on no segments.
    """
    if not lengths:
        raise ValueError("no segments to pack")
    longest, total, n = max(lengths), sum(lengths), len(lengths)
    if attention_tokens is None or attention_tokens <= 0:
        return longest
    ks = {1 + round(i * (n - 1) / 15) for i in range(16)} if n > 16 else set(range(1, n + 1))
    candidates = {longest} | {max(longest, -(-total * f // (10 * k))) for k in ks for f in (10, 11)}
    rows = {w: len(_first_fit(lengths, w)) for w in candidates}
    memory = 2 * rows[longest] * longest ** 2
    return min((w for w in candidates if rows[w] * w ** 2 <= memory),
               key=lambda w: (rows[w] * w * (1 + w / attention_tokens), w))


def pack_shared_prefixes(segments: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                         pad_id: int, attention_tokens: float | None = None) -> PackedPrefixes:
    """Pack segments (prefix ids, [branch ids, ...]) so that each prefix is computed once for all its branches.

    Each branch sees exactly the tokens and positions it would see as its own row `prefix + branch`: the prefix
    at positions 0..P-1, the branch at P.., and no other branch. Segments are placed first-fit, longest first,
    into rows of `row_width(lengths, attention_tokens)` (as long as the longest segment when `attention_tokens`
    is None; wider when that leaves less padding for less cost), so only row tails are padding. The layout of
    `PackedPairCollator` (a pair: prompt, [chosen, rejected]) and of a rollout group (a prompt, [its n
    responses]: `rollout.packing`). Empty prefixes and branches are allowed; a segment must hold at least one
    token. Raises ValueError on an empty segment.
    """
    lengths = [len(pre) + sum(len(b) for b in branches) for pre, branches in segments]
    if not segments or min(lengths) == 0:
        raise ValueError("every packed segment needs at least one token")
    width = row_width(lengths, attention_tokens)
    rows = _first_fit(lengths, width)
    input_ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.zeros((len(rows), width), dtype=torch.long)  # segment index + 1; 0 = padding
    part = torch.zeros((len(rows), width), dtype=torch.long)  # 0 = prefix, j + 1 = branch j
    branch_starts: list[list[tuple[int, int]]] = [[] for _ in segments]
    prefix_starts: list[tuple[int, int]] = [(0, 0)] * len(segments)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            prefix, branches = segments[i]
            p = len(prefix)
            prefix_starts[i] = (r, col)
            input_ids[r, col:col + p] = torch.as_tensor(list(prefix), dtype=torch.long)
            position_ids[r, col:col + p] = torch.arange(p)
            segment[r, col:col + lengths[i]] = i + 1
            col += p
            for j, branch in enumerate(branches):
                branch_starts[i].append((r, col))
                n = len(branch)
                input_ids[r, col:col + n] = torch.as_tensor(list(branch), dtype=torch.long)
                position_ids[r, col:col + n] = torch.arange(p, p + n)
                part[r, col:col + n] = j + 1
                col += n
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] > 0)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    visible = (part[:, None, :] == 0) | (part[:, None, :] == part[:, :, None])  # the prefix, or the query's branch
    pad_self = torch.eye(width, dtype=torch.bool) & (segment == 0)[:, :, None]
    allowed = ((same & causal & visible) | pad_self)[:, None]
    return PackedPrefixes(input_ids, position_ids, (segment > 0).long(), allowed, branch_starts, prefix_starts)


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
