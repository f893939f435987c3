"""Packed rollouts (`data.packing`): the rows of a `[prompt | response]` batch become token tries, so that
what rows share from their first token on is computed once: the prompt of a group's `ppo.n_samples_per_prompt`
responses (and the first tokens those responses have in common), and, where it costs less, the chat template's
system prompt of different prompts; tries share rows, so only row tails are padding.

    use_packing(model, packing)                          whether the model can take it (says once when not)
    packing_probe(model)                                 whether packed segments stay apart on this model and backend
    pack_rollout(input_ids, attention_mask, prompt_len)  the packed layout and where each entry is read

Every response token sees exactly the keys at exactly the positions it sees in its own padded row, so the log-probs,
entropies and values read from a packed forward equal the padded forward's to float rounding (the layout of
`rlhf_cli.data.pack_tries`; prefix sharing, Wang et al. 2024). Every pass of a rollout runs packed
(`rollout.plan.packs_rollout_passes`, `forwards.batched_scores`); the experience maker builds each micro-batch's
layout once and the update reuses it (`Experience.layouts`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.data import PackedTries, pack_tries
from rlhf_cli.models import custom_mask_support, trunk_hidden

log = logging.getLogger(__name__)
_SAID: set[str] = set()
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> `packing_probe`'s answer

PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}
"""The largest difference `packing_probe` takes for float noise, relative to the largest hidden state, by the dtype
the probe computes in: a packed forward sums in another order (fp32: ~1e-6), and bf16 rounds each sum (~1e-2)."""


def use_packing(model: Any, packing: bool) -> bool:
    """`packing` where `model`'s attention implementation takes a custom 4D mask (`models.custom_mask_support`) and
    keeps packed segments apart on this model (`packing_probe`, run at the model's first call); False otherwise, with
    one warning per reason per process, and the run goes on unpacked."""
    if not packing:
        return False
    reason = custom_mask_support(model)
    if reason is None:
        inner = getattr(model, "module", model)
        if inner not in _PROBED:
            _PROBED[inner] = packing_probe(model)
        reason = _PROBED[inner]
    if reason is None:
        return True
    if reason not in _SAID and engine.is_main():
        _SAID.add(reason)
        log.warning("data.packing=true is off for this model: %s; every sequence is computed as its own padded row",
                    reason)
    return False


def packing_probe(model: Any) -> str | None:
    """A start-up check that packing holds on `model` as it will run (its weights, attention implementation, dtype
    and the caller's autocast): two short segments packed into one row (a block-diagonal causal 4D mask, positions
    restarting at the second), against each segment alone. None when every hidden state agrees to float noise
    (`PROBE_TOLERANCE`, relative to the largest); else the reason, one line. A backend that reads the 4D mask as
    plain causal (transformers PR #46634: an all-ones 2-D mask over packed rows) lets the second segment attend to
    the first, and fails.

    Three forwards of 9 tokens in all, without gradients, in eval mode (dropout off; the mode is restored). Under
    ZeRO-3 every rank runs it (the forwards gather weights), as every rank runs the forward that asks. Only for a
    model that takes a custom 4D mask (`models.custom_mask_support`; `trunk_hidden` raises ValueError otherwise)."""
    inner = getattr(model, "module", model)
    weight = next(iter(inner.parameters()))
    dev, V = weight.device, inner.config.get_text_config().vocab_size
    a = [(37 * i + 11) % V for i in range(1, 6)]
    b = [(53 * i + 7) % V for i in range(1, 5)]
    T = len(a) + len(b)
    seg = torch.tensor([0] * len(a) + [1] * len(b), device=dev)
    allowed = (torch.ones(T, T, dtype=torch.bool, device=dev).tril() & (seg[:, None] == seg[None, :]))[None, None]
    positions = torch.tensor([list(range(len(a))) + list(range(len(b)))], device=dev)
    module = inner if isinstance(inner, torch.nn.Module) else None  # a view (`models.without_adapters`) has no mode
    was_training = module is not None and module.training
    if module is not None:
        module.eval()
    try:
        with torch.no_grad():
            packed = trunk_hidden(model, torch.tensor([a + b], device=dev), allowed, positions)[0].float()
            alone = torch.cat([trunk_hidden(model, torch.tensor([s], device=dev),
                                            torch.ones(1, len(s), dtype=torch.long, device=dev))[0] for s in (a, b)])
    finally:
        if module is not None:
            module.train(was_training)
    alone = alone.float()
    err = ((packed - alone).abs().max() / alone.abs().max().clamp(min=1e-12)).item()
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else weight.dtype
    tol = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.bfloat16])
    if err <= tol:
        return None
    impl = getattr(inner.config, "_attn_implementation", None)
    log.debug("packing probe of %s: hidden states %.3g apart (relative), float noise up to %g", type(inner).__name__,
              err, tol)
    return (f"the packing probe found two packed segments attending to each other under attn_implementation={impl} "
            f"(their hidden states differ from each segment's alone beyond float noise)")


class PackedRollout(NamedTuple):
    """A `[prompt | response]` batch (B rows, P prompt columns, R response columns) packed for one trunk forward.

    packed    the packed rows (`data.PackedTries`: input_ids, position_ids, the 4D mask `allowed`)
    source    (B, R, 2) long: (packed row, column) whose output reads response entry t of row b: the position of
              the token before it, so logits there predict token t and a critic's value there is V(s_t), exactly
              the position `hidden[:, P-1:-1]` reads in the padded layout
    computed  (B, R) bool: entries the padded layout reads from a real token, t <= the response's length (the
              entry right after the EOS included); the others sit on padding and are 0 in the packed outputs
    last      (B, 2) long: (packed row, column) of each sequence's last real token, where a reward model's score
              is read (`models.sequence_scores`)
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
