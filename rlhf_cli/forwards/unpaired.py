"""A causal LM's forward over unpaired rows (train-kto): the summed log-prob of each row's completion given its
prompt, from ONE trunk forward over a batch of single sequences, padded (`data.SFTCollator`) or packed
(`data.PackedSFTCollator`: isolated segments, no padding between them), for the losses that compare a policy's
and a reference's sequence log-probs of unpaired completions (KTO: Ethayarajh et al. 2024, eq. 7).

A row is `{prompt_ids, completion_ids}`; `completion_key` names another completion column of the same rows
(train-kto's mismatched pairs of its reference point, `kl_ids`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.forwards.sft import response_logprobs, sft_collator


def unpaired_collator(model: Any, pad_id: int, packing: bool, completion_key: str = "completion_ids"
                      ) -> Callable[[Sequence[dict[str, Any]]], dict[str, Any]]:
    """The collator of unpaired rows for `model`: each row's prompt + `completion_key` as one demonstration whose
    loss mask covers the completion (`forwards.sft_collator`: packed where the model takes a custom 4D mask and
    `packing`, else padded), plus `completion_lengths` (B,) long, each row's completion tokens (> 0), and `tokens`
    the rows' real tokens. Raises ValueError for an empty completion."""
    inner = sft_collator(model, pad_id, packing)

    def collate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        demos = []
        for i, ex in enumerate(rows):
            prompt, completion = list(ex["prompt_ids"]), list(ex[completion_key])
            if not completion or not prompt:
                empty = "prompt_ids" if not prompt else completion_key
                raise ValueError(f"unpaired row {i} of the batch has no {empty} (the data loader keeps only rows "
                                 f"with a prompt and a completion token)")
            demos.append({"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion)})
        batch = inner(demos)
        batch["completion_lengths"] = torch.tensor([len(ex[completion_key]) for ex in rows], dtype=torch.long)
        return batch

    return collate


def completion_logprobs(model: Any, batch: dict[str, Any], precision: str) -> torch.Tensor:
    """(B,) float32 on `engine.device()`: each row's summed completion log-probs, nats (<= 0): for row i,
    sum over its completion tokens y_t of log π(y_t | prompt, y_<t). `batch`: `unpaired_collator`'s, padded or
    packed (the same sums to float rounding). The trunk runs under `engine.autocast(precision)`; the log-softmax
    is float32 (`forwards.response_logprobs`). Differentiable.

    Equals the naive per-row loop (no padding, no packing):

        ids = torch.tensor([prompt + completion])                            # (1, n)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]         # (n - P, V)
        logits.float().log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).sum()
    """
    per_token = response_logprobs(model, batch, precision)  # (N,), row by row, each row's completion in order
    lengths = batch["completion_lengths"].to(per_token.device)
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=per_token.device), lengths)  # (N,)
    return torch.zeros(lengths.numel(), dtype=per_token.dtype, device=engine.device()).index_add(0, row, per_token)
