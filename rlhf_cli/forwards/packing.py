"""Packed rollouts (`data.packing`): the rows of a `[prompt | response]` batch become token tries, so that
what rows share from their first token on is computed once: the prompt of a group's `ppo.n_samples_per_prompt`
responses (and the first tokens those responses have in common), and, where it costs less, the chat template's
system prompt of different prompts; tries share rows, so only row tails are padding.

    use_packing(model, packing)                          whether the model can take it (says once when not)
    pack_rollout(input_ids, attention_mask, prompt_len)  the packed layout and where each entry is read

Every response token sees exactly the keys at exactly the positions it sees in its own padded row, so the log-probs,
entropies and values read from a packed forward equal the padded forward's to float rounding (the layout of
`rlhf_cli.data.pack_tries`; prefix sharing, Wang et al. 2024). Every pass of a rollout runs packed
(`rollout.plan.packs_rollout_passes`, `forwards.batched_rewards`); the experience maker builds each micro-batch's
layout once and the update reuses it (`Experience.layouts`).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.data import PackedTries, pack_tries
from rlhf_cli.models import custom_mask_support

log = logging.getLogger(__name__)
_SAID: set[str] = set()


def use_packing(model: Any, packing: bool) -> bool:
    """`packing` where `model`'s attention implementation takes a custom 4D mask (`models.custom_mask_support`);
    False otherwise, with one warning per reason per process."""
    if not packing:
        return False
    reason = custom_mask_support(model)
    if reason is None:
        return True
    if reason not in _SAID and engine.is_main():
        _SAID.add(reason)
        log.warning("data.packing=true is off for this model: %s; every sequence is computed as its own padded row",
                    reason)
    return False


class PackedRollout(NamedTuple):
    """A `[prompt | response]` batch (B rows, P prompt columns, R response columns) packed for one trunk forward.

    packed    the packed rows (`data.PackedTries`: input_ids, position_ids, the 4D mask `allowed`)
    source    (B, R, 2) long: (packed row, column) whose output reads response entry t of row b: the position of
              the token before it, so logits there predict token t and a critic's value there is V(s_t), exactly
              the position `hidden[:, P-1:-1]` reads in the padded layout
    computed  (B, R) bool: entries the padded layout reads from a real token, t <= the response's length (the
              entry right after the EOS included); the others sit on padding and are 0 in the packed outputs
    last      (B, 2) long: (packed row, column) of each sequence's last real token, where a reward model's score
              is read (`models.sequence_rewards`)
    """

    packed: PackedTries
    source: torch.Tensor
    computed: torch.Tensor
    last: torch.Tensor

    def to(self, device: torch.device) -> PackedRollout:
        """The same layout with its tensors on `device` (itself when they are there already)."""
        if self.source.device == torch.device(device):
            return self
        move = lambda x: x.to(device) if torch.is_tensor(x) else x  # noqa: E731
        return PackedRollout(PackedTries(*map(move, self.packed)), *map(move, (self.source, self.computed,
                                                                                self.last)))


def pack_rollout(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                 pad_id: int = 0, attention_tokens: float | None = None) -> PackedRollout:
    """Pack a rollout batch as token tries (`rlhf_cli.data.pack_tries`): rows whose real prompt tokens are equal are
    one group, computed as one trie; groups that begin alike share a trie where that costs less.

    input_ids, attention_mask: (B, P+R) as `rollout_batch` lays them out, prompts left-padded to P = `prompt_len`,
    responses right-padded. `pad_id` fills the packed rows' tails (any id: padding attends only to itself and is
    never read). `attention_tokens` (`models.attention_tokens` of the model that will run it) lets groups share
    tries and rows grow wider than the longest trie where that costs less (`rlhf_cli.data.row_width`). Tensors
    come back on `input_ids`' device. Raises ValueError for a row with no real prompt token or a response whose
    real tokens are not contiguous from column P.
    """
    ids, am = input_ids.cpu(), attention_mask.cpu().bool()
    B, T = ids.shape
    P, R = prompt_len, T - prompt_len
    lengths = am[:, P:].sum(1)
    if not bool((am[:, P:] == (torch.arange(R)[None] < lengths[:, None])).all()):
        raise ValueError("a packed rollout needs right-padded responses starting at the prompt length")
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(B):
        prompt = tuple(ids[b, :P][am[b, :P]].tolist())
        if not prompt:
            raise ValueError(f"row {b} has no prompt token: its first response token has nothing to be read from")
        groups.setdefault(prompt, []).append(b)
    packed = pack_tries([[list(prompt) + ids[b, P:P + int(lengths[b])].tolist() for b in rows]
                         for prompt, rows in groups.items()], pad_id, attention_tokens)
    t = torch.arange(R)
    source = torch.zeros((B, R, 2), dtype=torch.long)
    last = torch.zeros((B, 2), dtype=torch.long)
    for (prompt, rows), paths in zip(groups.items(), packed.paths):
        p = len(prompt)
        for b, (r, cols) in zip(rows, paths):
            # entry t reads the token before response token t (the prompt's last for t = 0); past the response's
            # end (not computed) the prompt's last token stands in
            source[b, :, 0] = r
            source[b, :, 1] = cols[torch.where(t <= lengths[b], p - 1 + t, p - 1)]
            last[b] = torch.tensor([r, int(cols[-1])])
    computed = t[None] <= lengths[:, None]
    dev = input_ids.device
    packed = packed._replace(paths=[])  # read into `source` and `last`; not kept with the layout
    return PackedRollout(PackedTries(*(x.to(dev) if torch.is_tensor(x) else x for x in packed)),
                         source.to(dev), computed.to(dev), last.to(dev))
