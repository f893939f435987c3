"""Collators (dynamic padding: to the longest sequence in the batch) and length-grouped ordering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from rlhf_cli.seeds import derive_seed


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> dict[str, torch.Tensor]:
    """Pad token-id lists to the longest: {input_ids (B, L) long, attention_mask (B, L) long, 1 = real token}."""
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
        prompt_lengths  (B,) long     pair i's prompt tokens: the first prompt_lengths[i] real tokens of rows i
                                      and B+i; the rest are its chosen and its rejected response
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
        batch["prompt_lengths"] = _prompt_lengths(examples)
        _add_margin(batch, examples)
        return batch


def _prompt_lengths(examples: Sequence[dict[str, Any]]) -> torch.Tensor:
    """(B,) long: each example's prompt tokens (where its responses begin, for a forward that reads only them)."""
    return torch.tensor([len(ex["prompt_ids"]) for ex in examples], dtype=torch.long)


def _add_margin(batch: dict[str, torch.Tensor], examples: Sequence[dict[str, Any]]) -> None:
    """`batch["margin"]` (B,) float32 when every example has a margin; ValueError when only some have one."""
    has_margin = ["margin" in ex for ex in examples]
    if any(has_margin):
        if not all(has_margin):
            raise ValueError("some examples in the batch have a margin and some do not")
        batch["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float32)


class PackedPairCollator:
    """Preference examples -> packed rows: every shared prefix computed once, no padding between pairs.

    Each pair's two sequences, prompt + chosen and prompt + rejected, are one token trie: the prompt (and
    any first tokens chosen and rejected have in common) once, then each one's own tokens (`pack_tries`).
    Positions are each token's index in its own sequence, and a token attends to exactly the tokens of its own
    sequence before it. Where the model's `attention_tokens` says it costs less, pairs that begin alike (the
    chat template's system prompt) share one trie too, and rows may hold several tries (`row_width`); only each
    row's tail is padding. So every chosen and rejected token sees exactly the keys, at exactly the positions,
    it sees in `PairCollator`'s two rows, and each score is read at its own EOS: the same scores up to float
    rounding, from far fewer positions than those two rows hold (the prompt twice, both responses and padding;
    prefix sharing: Wang et al. 2024, "Accelerating Direct Preference Optimization with Prefix Sharing").

        input_ids        (W, L) long   W <= B rows
        position_ids     (W, L) long   0 on padding
        attention_mask   (W, L) long   1 = real token (counts what is computed)
        pair_attention   (W, 1, L, L) bool  [w, 0, q, k] = query q may attend key k; a padding
                                       position attends to itself only (no empty softmax row)
        chosen_end       (B, 2) long   (row, column) of pair i's chosen EOS
        rejected_end     (B, 2) long   (row, column) of pair i's rejected EOS
        pair_tokens      () long       tokens of the unpacked pairs: per pair, 2 × prompt + chosen + rejected
        prompt_lengths   (B,) long     pair i's prompt tokens: a token of its chosen or rejected sequence at
                                       position >= prompt_lengths[i] is a response token
        margin           (B,) float    only when every example has a `margin`

    Raises ValueError when a pair has an empty chosen or rejected response.
    """

    def __init__(self, pad_id: int, attention_tokens: float | None = None):
        self.pad_id = int(pad_id)
        self.attention_tokens = attention_tokens  # tries and row widths: the model's `models.attention_tokens`

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        for ex in examples:
            if not ex["chosen_ids"] or not ex["rejected_ids"]:
                raise ValueError("a pair with an empty chosen or rejected response cannot be scored")
        packed = pack_tries([[list(ex["prompt_ids"]) + list(ex[key]) for key in ("chosen_ids", "rejected_ids")]
                             for ex in examples], self.pad_id, self.attention_tokens)
        ends = torch.tensor([[[r, int(cols[-1])] for r, cols in paths] for paths in packed.paths],
                            dtype=torch.long).view(-1, 2, 2)
        batch: dict[str, torch.Tensor] = {
            "input_ids": packed.input_ids, "position_ids": packed.position_ids,
            "attention_mask": packed.attention_mask, "pair_attention": packed.allowed,
            "chosen_end": ends[:, 0], "rejected_end": ends[:, 1],
            "pair_tokens": torch.tensor(sum(2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"])
                                            for ex in examples)),
            "prompt_lengths": _prompt_lengths(examples),
        }
        _add_margin(batch, examples)
        return batch


class PackedTries(NamedTuple):
    """Groups of sequences packed as token tries (`pack_tries`). W rows of L columns.

        input_ids       (W, L) long   pad id on padding
        position_ids    (W, L) long   a token's index in its sequence (its depth in the trie); 0 on padding
        attention_mask  (W, L) long   1 = real token
        allowed         (W, 1, L, L) bool  [w, 0, q, k]: query q may attend key k, that is k is q or a token
                                      before it in a sequence through q; a padding position attends to itself only
        paths           per group, per sequence: (row, (n,) long columns of its n tokens, in order)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    allowed: torch.Tensor
    paths: list[list[tuple[int, torch.Tensor]]]


MAX_GROUPS_PER_TRIE = 16
"""At most this many groups share one trie (`pack_tries`): bounds the search and a trie's length."""


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


class _Trie:
    """Token trie of sequences: node n holds `token[n]` at depth `depth[n]`; children in insertion order."""

    def __init__(self) -> None:
        self.token: list[int] = []
        self.depth: list[int] = []
        self.children: list[dict[int, int]] = [{}]  # [0] is the root (no token); node n is children index n + 1

    def add(self, seq: Sequence[int]) -> list[int]:
        """Insert `seq`; returns the node of each of its tokens."""
        path, at = [], 0
        for d, tok in enumerate(map(int, seq)):
            nxt = self.children[at].get(tok)
            if nxt is None:
                nxt = len(self.token)
                self.token.append(tok)
                self.depth.append(d)
                self.children.append({})
                self.children[at][tok] = nxt
            path.append(nxt)
            at = nxt + 1
        return path

    def layout(self) -> tuple[list[int], list[int]]:
        """Depth-first pre-order: (column of each node, column just past its subtree)."""
        col, end = [0] * len(self.token), [0] * len(self.token)
        stack, c = [(child, False) for child in reversed(list(self.children[0].values()))], 0
        while stack:
            n, done = stack.pop()
            if done:
                end[n] = c
                continue
            col[n], c = c, c + 1
            stack.append((n, True))
            stack.extend((child, False) for child in reversed(list(self.children[n + 1].values())))
        return col, end


def _merge_groups(groups: Sequence[Sequence[Sequence[int]]], attention_tokens: float | None) -> list[list[int]]:
    """Which groups share a trie: runs of groups in order of their first sequence, chosen to minimise the summed
    cost L × (1 + L / `attention_tokens`) of the tries (L: a trie's nodes; `row_width`'s cost), at most
    `MAX_GROUPS_PER_TRIE` groups to a trie. A merged trie is no longer than the larger of the longest group's own
    trie and `attention_tokens` / 8 positions: the rows' attention (its FLOPs, its 4D mask, and under eager
    attention its stored scores) grows only while it adds at most an eighth to a position's cost.
    None (or <= 0): every group its own trie."""
    n = len(groups)
    if attention_tokens is None or attention_tokens <= 0 or n <= 1:
        return [[i] for i in range(n)]
    order = sorted(range(n), key=lambda i: (list(groups[i][0]), i))
    own = []
    for g in groups:
        trie = _Trie()
        for seq in g:
            trie.add(seq)
        own.append(len(trie.token))
    cap = max(max(own), attention_tokens / 8)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the first j groups in `order`
    cut = [0] * (n + 1)
    for i in range(n):
        trie = _Trie()
        for j in range(i, min(n, i + MAX_GROUPS_PER_TRIE)):
            for seq in groups[order[j]]:
                trie.add(seq)
            size = len(trie.token)
            if j > i and size > cap:
                break
            cost = best[i] + size * (1 + size / attention_tokens)
            if cost < best[j + 1]:
                best[j + 1], cut[j + 1] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


def pack_tries(groups: Sequence[Sequence[Sequence[int]]], pad_id: int,
               attention_tokens: float | None = None) -> PackedTries:
    """Pack groups of sequences so that a prefix that sequences of one trie share is computed once.

    A group's sequences (a pair's prompt + chosen and prompt + rejected; a prompt's sampled responses) always
    share one token trie, laid out depth first: a token is computed once for all the sequences that begin with
    the same tokens up to it, sits at position = its index in them, and attends to exactly the tokens before
    it in those sequences, so each sequence sees exactly the tokens and positions of its own padded row.
    Given `attention_tokens` (`models.attention_tokens`), groups that begin alike (e.g. the chat template's
    system prompt) share a trie where the cost model says so (`_merge_groups`), and tries are placed first-fit,
    longest first, into rows of `row_width`; else each group is its own trie in rows of the longest. Only row
    tails are padding. The layout of `PackedPairCollator` and of packed rollouts (`forwards.pack_rollout`).
    Raises ValueError on no groups, an empty group or an empty sequence.
    """
    if not groups or any(not g for g in groups) or any(not len(s) for g in groups for s in g):
        raise ValueError("every packed group needs at least one sequence of at least one token")
    tries, paths = [], [[] for _ in groups]  # paths[group][seq] = (trie index, nodes)
    for run in _merge_groups(groups, attention_tokens):
        trie = _Trie()
        for g in run:
            paths[g] = [(len(tries), trie.add(seq)) for seq in groups[g]]
        tries.append(trie)
    lengths = [len(t.token) for t in tries]
    width = row_width(lengths, attention_tokens)
    rows = _first_fit(lengths, width)
    input_ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    end = torch.arange(1, width + 1).repeat(len(rows), 1)  # column just past each column's subtree (padding: itself)
    where: list[tuple[int, list[int]]] = [(0, [])] * len(tries)  # (row, column of each node)
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            col, stop = tries[i].layout()
            cols = torch.tensor(col, dtype=torch.long) + offset
            input_ids[r, cols] = torch.tensor(tries[i].token, dtype=torch.long)
            position_ids[r, cols] = torch.tensor(tries[i].depth, dtype=torch.long)
            real[r, cols] = 1
            end[r, cols] = torch.tensor(stop, dtype=torch.long) + offset
            where[i] = (r, [c + offset for c in col])
            offset += lengths[i]
    q = torch.arange(width)
    # k is q or an ancestor of q: the trie's depth-first order puts q inside k's subtree [k, end[k])
    allowed = ((q[None, None, :] <= q[None, :, None]) & (q[None, :, None] < end[:, None, :]))[:, None]
    columns = [[(where[t][0], torch.tensor([where[t][1][n] for n in nodes], dtype=torch.long))
                for t, nodes in g] for g in paths]
    return PackedTries(input_ids, position_ids, real, allowed, columns)


def _targets(examples: Sequence[dict[str, Any]], columns: Sequence[tuple[int, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 2) long `target` and `source` of demonstrations laid out at `columns` (per example: its row, (n,) long
    column of each of its n tokens): every token with loss_mask 1, in example then token order, and the column of
    the token before it in its own sequence."""
    target, source = [], []
    for ex, (row, cols) in zip(examples, columns):
        t = torch.tensor([i for i, m in enumerate(ex["loss_mask"]) if m], dtype=torch.long)
        if t.numel() and int(t.min()) < 1:
            raise ValueError("a demonstration's first token cannot be a target: nothing precedes it")
        target.append(torch.stack([torch.full_like(t, row), cols[t]], -1))
        source.append(torch.stack([torch.full_like(t, row), cols[t - 1]], -1))
    empty = torch.zeros((0, 2), dtype=torch.long)
    return torch.cat(target) if target else empty, torch.cat(source) if source else empty


class SFTCollator:
    """Demonstrations (`data.load_sft_data` examples) -> ONE right-padded batch, an example per row.

        input_ids       (B, L) long  pad id on padding
        attention_mask  (B, L) long  1 = real token
        target          (N, 2) long  (row, column) of each response token (loss_mask 1), example by example
        source          (N, 2) long  (row, column) whose logits predict it: the token before it in its row
        tokens          () long      real tokens of the examples
    """

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = pad_sequences([ex["input_ids"] for ex in examples], self.pad_id, side="right")
        columns = [(i, torch.arange(len(ex["input_ids"]))) for i, ex in enumerate(examples)]
        batch["target"], batch["source"] = _targets(examples, columns)
        batch["tokens"] = batch["attention_mask"].sum()
        return batch


class PackedSFTCollator:
    """Demonstrations -> packed rows with isolated segments (`pack_tries`, one sequence per group): a token
    attends to exactly the tokens before it in its own demonstration, at positions counted from its start, so
    every log-prob equals `SFTCollator`'s to float rounding; where the model's `attention_tokens` says it costs
    less, demonstrations that begin alike (the chat template's system prompt) compute their common first tokens
    once, and rows hold several of them, only row tails being padding.

        input_ids       (W, L) long
        position_ids    (W, L) long         0 on padding
        attention_mask  (W, L) long         1 = real token (counts what is computed)
        allowed         (W, 1, L, L) bool   [w, 0, q, k] = query q may attend key k
        target, source  (N, 2) long         as `SFTCollator`'s, in the packed rows
        tokens          () long             real tokens of the unpacked examples
    """

    def __init__(self, pad_id: int, attention_tokens: float | None = None):
        self.pad_id = int(pad_id)
        self.attention_tokens = attention_tokens

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        packed = pack_tries([[list(ex["input_ids"])] for ex in examples], self.pad_id, self.attention_tokens)
        target, source = _targets(examples, [paths[0] for paths in packed.paths])
        return {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                "attention_mask": packed.attention_mask, "allowed": packed.allowed, "target": target,
                "source": source, "tokens": torch.tensor(sum(len(ex["input_ids"]) for ex in examples))}


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
    """Tokens of an example: prompt + longer response for pairs, the prompt for prompt examples, the whole
    sequence for demonstrations."""
    if "input_ids" in ex:  # a demonstration
        return len(ex["input_ids"])
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
