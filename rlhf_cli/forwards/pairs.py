"""A causal LM's forward over preference pairs: the summed log-probs of each pair's chosen and rejected response,
from ONE trunk forward over a pair batch (`data.PairCollator`'s padded rows or `data.PackedPairCollator`'s packed
ones, as `forwards.pair_collator` picks them), for the losses that compare a policy's and a reference's
sequence log-probs (DPO: Rafailov et al. 2023, eq. 7)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import logprobs_from_logits
from rlhf_cli.models import lm_of, trunk_hidden

HEAD_CHUNK = 256
"""Response positions per float32 log-softmax in `pair_logprobs`: without grad (the reference, held-out passes) it
bounds the float32 working set to (HEAD_CHUNK, V), 50 MB for a 49k vocabulary; with grad each chunk's float32
logits are kept for the backward, N x V in all, as in one pass."""


def pair_logprobs(model: Any, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs of chosen and of rejected, (B,) float32 each, in nats (<= 0): for pair i,
    sum over its response tokens y_t of log π(y_t | prompt, y_<t), the prompt's own tokens excluded.

    `model`: a causal LM (a DeepSpeed / DDP wrapper or a `PolicyWithValueHead` around one is read through
    `models.lm_of`). `batch`: a collated pair batch of B pairs, `prompt_lengths` (B,) long >= 1 in both layouts:
      - `PairCollator`: input_ids, attention_mask (2B, L), rows [0, B) prompt + chosen and [B, 2B) prompt +
        rejected, attention_mask 1 = real token; row s's response tokens are its real tokens after the first
        prompt_lengths[s mod B];
      - `PackedPairCollator`: packed rows input_ids, position_ids (W, L), pair_attention (W, 1, L, L) bool
        ([w, 0, q, k] = query q may attend key k: k is q or a token before it in q's sequence), chosen_end and
        rejected_end (B, 2) (row, column) of each sequence's EOS. A sequence's tokens are the columns its EOS
        attends to, in column order; its response tokens are those at position >= prompt_lengths[i] (tokens that
        chosen and rejected share, the prompt and any common first response tokens, are computed once).
    Each response token's logits are read at the position of the token before it in its own sequence (the
    prompt's last token for the first one), and only those positions go through the LM head: (N, V) logits, N the
    pairs' response tokens (no padding to the longest response), their float32 log-softmax `HEAD_CHUNK` positions
    at a time. The trunk runs under `engine.autocast(precision)` on `engine.device()`; the log-softmax
    is float32 whatever the trunk's precision (`core.logprobs_from_logits`). Differentiable. A response with no
    token sums to 0. The packed and padded layouts give the same sums to float rounding.

    Equals the naive per-sequence loop (no padding, no packing):

        ids = torch.tensor([prompt + response])                              # (1, n)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]          # (n - P, V)
        logits.float().log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).sum()

    Raises ValueError for a pair without a prompt token (its first response token would have nothing to be read
    from).
    """
    dev = engine.device()
    lm = lm_of(model)
    prompt = batch["prompt_lengths"].to(dev)
    if prompt.numel() and int(prompt.min()) < 1:
        raise ValueError("a pair without a prompt token has no position to read its first response token's log-prob")
    ids = batch["input_ids"].to(dev)
    if "pair_attention" in batch:
        mask, position_ids = batch["pair_attention"].to(dev), batch["position_ids"].to(dev)
        ends = torch.cat([batch["chosen_end"], batch["rejected_end"]]).to(dev)  # (2B, 2)
        rows = ends[:, 0]
        member = mask[rows, 0, ends[:, 1]]  # (2B, L): the columns of each sequence's tokens
    else:
        mask, position_ids = batch["attention_mask"].to(dev), None
        rows = torch.arange(ids.shape[0], device=dev)
        member = mask.bool()
    target, source, real = _response_columns(member, prompt.repeat(2))  # (2B, R) each
    seq = torch.arange(real.shape[0], device=dev)[:, None].expand_as(real)[real]  # (N,) each response token's sequence
    row = rows[seq]
    with engine.autocast(precision):
        hidden = trunk_hidden(lm, ids, mask, position_ids)  # (W, L, H)
        logits = lm.lm_head(hidden[row, source[real]])  # (N, V): the response tokens' positions only
    labels = ids[row, target[real]]  # (N,)
    logprobs = torch.cat([logprobs_from_logits(z[None], y[None])[0]  # (N,) float32, HEAD_CHUNK positions at a time
                          for z, y in zip(logits.split(HEAD_CHUNK), labels.split(HEAD_CHUNK))])
    sums = torch.zeros(real.shape[0], dtype=logprobs.dtype, device=dev).index_add(0, seq, logprobs).float()
    b = sums.shape[0] // 2
    return sums[:b], sums[b:]


def _response_columns(member: torch.Tensor, prompt_lengths: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where S sequences' response tokens are: `member` (S, L) bool marks the columns of sequence s's tokens, in
    token order (padded rows; a packed trie is laid out depth first, so a sequence's tokens are in column order
    too), `prompt_lengths` (S,) long >= 1 its prompt tokens. Returns (S, R) each, R the longest response (at
    least 1): `target` the column of response token t, `source` the column of the token before it, `real` bool,
    True where sequence s has a response token t (elsewhere both columns are valid indices, not to be read)."""
    S, L = member.shape
    cols = torch.arange(L, device=member.device)
    order = torch.where(member, cols, cols + L).argsort(-1)  # (S, L): each sequence's columns first, in order
    lengths = (member.sum(-1) - prompt_lengths).clamp(min=0)  # (S,) response tokens
    t = torch.arange(max(int(lengths.max()) if S else 0, 1), device=member.device)
    real = t[None] < lengths[:, None]  # (S, R)
    index = torch.where(real, prompt_lengths[:, None] + t[None], prompt_lengths[:, None]).clamp(max=L - 1)
    return order.gather(1, index), order.gather(1, (index - 1).clamp(min=0)), real
