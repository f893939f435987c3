"""The forwards of a policy and its critic over `[prompt | response]` batches: response log-probs at the
sampling temperature (with entropy and a shared value head's values), a separate critic's values, and the
per-sequence KL of two policies. Also a LoRA policy's reference (its adapters off), read as a frozen model is.
The models they read (the shared value head, `lm_of`) are `models/policy.py`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import entropy_from_logits, kl_estimate, logprobs_from_logits, nucleus_logits
from rlhf_cli.forwards.packing import PackedRollout, pack_rollout, use_packing
from rlhf_cli.models import attention_tokens, lm_of, response_values, trunk_hidden, unwrap, without_adapters


class FrozenWithoutAdapters:
    """A LoRA model with its adapters off (`models.without_adapters`), read as an `engine.FrozenModel` is
    (`module`, `autocast()`, `on_device()`): the reference policy of a LoRA run (the trained policy's own
    weights), or the reward model under a LoRA critic grown from it (the critic's own weights, its head the
    original that peft keeps). No second copy of the base weights is held; the passes run under no_grad as that
    model's do, and it is never offloaded (its weights are the trained model's)."""

    def __init__(self, model: torch.nn.Module, precision: str) -> None:
        self.module = without_adapters(model)
        self.precision = precision

    def autocast(self) -> contextlib.AbstractContextManager:
        return engine.autocast(self.precision)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[Any]:
        yield self.module


def response_hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                    packing: bool | PackedRollout = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trunk's last hidden states that read the response entries, (B, R, H): entry t is the position of the
    token before response token t (the prompt's last token for t = 0), as `policy_forward` and `critic_values`
    read them. With `packing` (and a model that takes a custom mask: `forwards.use_packing`) the batch runs packed
    (`forwards.pack_rollout`: a shared prompt once, no padding between sequences) and the second result is the
    (B, R) bool mask of entries computed from real tokens; else the padded forward and None. `packing` may be
    the batch's `PackedRollout`, built once for several passes (it must be `pack_rollout` of these rows; it is
    moved to the batch's device for the call)."""
    if use_packing(model, _wants_packing(packing)):
        pk = packing.to(input_ids.device) if isinstance(packing, PackedRollout) else pack_rollout(
            input_ids, attention_mask, prompt_len, attention_tokens=attention_tokens(model))
        hidden = trunk_hidden(model, pk.packed.input_ids, pk.packed.allowed, pk.packed.position_ids)
        return hidden[pk.source[..., 0], pk.source[..., 1]], pk.computed
    return trunk_hidden(model, input_ids, attention_mask)[:, prompt_len - 1:-1], None


def _wants_packing(packing: bool | PackedRollout) -> bool:
    return isinstance(packing, PackedRollout) or bool(packing)


def _zero_outside(x: torch.Tensor | None, computed: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or computed is None else torch.where(computed, x, torch.zeros_like(x))


def policy_forward(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, temperature: float,
    with_entropy: bool = False, with_values: bool = False, packing: bool | PackedRollout = False,
    entropy_grad: bool = True, top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs of the response tokens under the policy at `temperature`, renormalised over the top-p nucleus
    when `top_p` < 1 (`ppo.top_p`: `core.nucleus_logits`, the response token always kept; the entropy is then
    that of the renormalised distribution too); `top_p=1` is the whole softmax.

    input_ids, attention_mask: (B, P+R). Returns logprobs (B, R) float32, entropy (B, R) float32 nats
    (None unless `with_entropy`), and, for a shared critic, values (B, R) float32 or None. Only the R response
    positions go through the LM head; position ids count real tokens, so padding side does not matter.
    `entropy_grad=False` computes the entropy outside the autograd graph (a statistic only: `ppo.c2=0`), sparing
    the backward its (B, R, V) softmax. `packing`
    (`data.packing`, or the batch's `PackedRollout`) runs the batch packed (`response_hidden`): the same
    numbers to float rounding on every entry the padded forward reads from a real token, 0 on the rest (entries
    after a response's EOS, which every loss masks).
    """
    lm = lm_of(model)
    hidden, computed = response_hidden(lm, input_ids, attention_mask, prompt_len, packing)  # (B, R, H)
    logits = lm.lm_head(hidden).float() / temperature  # (B, R, V)
    labels = input_ids[:, prompt_len:]
    if top_p < 1:
        logits = nucleus_logits(logits, labels, top_p)
    logprobs = logprobs_from_logits(logits, labels)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    values = None
    if with_values:
        values = unwrap(model).score(hidden).squeeze(-1).float()
    return _zero_outside(logprobs, computed), _zero_outside(entropy, computed), _zero_outside(values, computed)


@torch.no_grad()
def sequence_kl(policy: Any, reference: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                action_mask: torch.Tensor, temperature: float, batch_size: int, precision: str,
                estimators: Sequence[str] = ("k1",), packing: bool = False,
                top_p: float = 1.0) -> dict[str, torch.Tensor]:
    """KL(policy ‖ reference) per sequence, nats: {estimator: (B,) float32}, the per-token estimate (`core.
    kl_estimate`) summed over the tokens the policy sampled, at `temperature`. With `top_p` < 1 the policy's
    log-probs are its nucleus-renormalised ones (`policy_forward`), the reference's its whole softmax:
    KL(π_p ‖ π_ref), as train-ppo's penalty reads it.

    input_ids, attention_mask: (B, P+R) laid out as `policy_forward` reads them; action_mask: (B, R) float, 1 = a
    token the policy sampled (`rollout.Episodes.action_mask`), whose R gives P; both models run `batch_size` rows
    at a time under `engine.autocast(precision)`, packed or not as `packing` says.
    """
    prompt_len = input_ids.shape[1] - action_mask.shape[1]
    out: dict[str, list[torch.Tensor]] = {k: [] for k in estimators}
    for i in range(0, input_ids.shape[0], batch_size):
        ids, am = input_ids[i:i + batch_size], attention_mask[i:i + batch_size]
        with engine.autocast(precision):
            lp, _, _ = policy_forward(policy, ids, am, prompt_len, temperature, packing=packing, top_p=top_p)
            ref_lp, _, _ = policy_forward(reference, ids, am, prompt_len, temperature, packing=packing)
        mask = action_mask[i:i + batch_size].float()
        for k in estimators:
            out[k].append((kl_estimate(lp, ref_lp, k) * mask).sum(1))
    return {k: torch.cat(v) for k, v in out.items()}


def critic_values(critic: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  packing: bool | PackedRollout = False) -> torch.Tensor:
    """(B, R) float32 values of a separate critic, aligned with `policy_forward`'s logprobs: V(s_t) read at the
    position before response token t, 0 where that position is padding (`models.response_values`); packed or not
    as `packing` says (`response_hidden`), with the same numbers to float rounding."""
    critic = unwrap(critic)
    if not use_packing(critic, _wants_packing(packing)):
        return response_values(critic, input_ids, attention_mask, prompt_len)
    hidden, computed = response_hidden(critic, input_ids, attention_mask, prompt_len, packing)
    return _zero_outside(critic.score(hidden).squeeze(-1).float(), computed)
