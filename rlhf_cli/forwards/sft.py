"""A causal LM's forward over demonstrations (train-sft): the log-prob of every response token given the tokens
before it in its own sequence, from ONE trunk forward over a batch of `data.SFTCollator`'s padded rows or
`data.PackedSFTCollator`'s packed ones (`sft_collator` picks one for a model). Only the positions that predict a
response token go through the LM head."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import logprobs_from_logits
from rlhf_cli.data import PackedSFTCollator, SFTCollator
from rlhf_cli.forwards.packing import use_packing
from rlhf_cli.models import attention_tokens, lm_of, trunk_hidden


def sft_collator(model: Any, pad_id: int, packing: bool) -> Callable[[Sequence[dict[str, Any]]], dict[str, Any]]:
    """The collator of demonstrations for `model`: `PackedSFTCollator` (isolated segments packed into rows,
    `data.packing=true`) where the model's attention implementation takes a custom 4D mask, else `SFTCollator`
    (an example per padded row), saying once why packing is off (`use_packing`)."""
    return PackedSFTCollator(pad_id, attention_tokens(model)) if use_packing(model, packing) else SFTCollator(pad_id)


def response_logprobs(model: Any, batch: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
    """(N,) float32 log-probs, nats (<= 0), of the batch's N response tokens, in `batch["target"]`'s order:
    entry n is log π(y | the tokens before y in its own demonstration), y the token at `target[n]`, read from the
    logits at `source[n]` (the position of the token before it).

    `model`: a causal LM (a DeepSpeed / DDP wrapper around one is read through `models.lm_of`). `batch`: a collated
    demonstration batch, `target` and `source` (N, 2) long (row, column) in both layouts:
      - `SFTCollator`: input_ids, attention_mask (B, L), 1 = real token, right-padded;
      - `PackedSFTCollator`: input_ids, position_ids (W, L) and `allowed` (W, 1, L, L) bool ([w, 0, q, k] = query q
        may attend key k: k is q or a token before it in q's own demonstration).
    The trunk runs under `engine.autocast(precision)` on `engine.device()`; the log-softmax is float32 whatever the
    trunk's precision (`core.logprobs_from_logits`). Differentiable. The two layouts give the same values to float
    rounding. The next-token loss of SFT is −Σ of these over an optimizer step's response tokens / their count.

    Equals the naive per-demonstration loop (no padding, no packing):

        ids = torch.tensor([input_ids])                                        # (1, n)
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)     # (n - 1, V)
        logp.gather(-1, ids[0, 1:, None])[:, 0][torch.tensor(loss_mask[1:]).bool()]
    """
    dev = engine.device()
    lm = lm_of(model)
    ids = batch["input_ids"].to(dev)
    if "allowed" in batch:
        mask, position_ids = batch["allowed"].to(dev), batch["position_ids"].to(dev)
    else:
        mask, position_ids = batch["attention_mask"].to(dev), None
    target, source = batch["target"].to(dev), batch["source"].to(dev)
    with engine.autocast(precision):
        hidden = trunk_hidden(lm, ids, mask, position_ids)  # (W, L, H)
        logits = lm.lm_head(hidden[source[:, 0], source[:, 1]])  # (N, V)
    return logprobs_from_logits(logits[None], ids[target[:, 0], target[:, 1]][None])[0].float()
