"""The training forward of one micro-batch, with its graph: the one code path of the update's forwards and of the
rollout's forwards of the update's first micro-batches (`rollout.plan.fold_settings`, `rollout.Experience.forwards`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.forwards.policy import critic_values, policy_forward
from rlhf_cli.models import has_value_head


class Forward(NamedTuple):
    """One micro-batch's training forward (`training_forward`), with its autograd graph: response logprobs (B, R)
    float32, entropies (B, R) float32 nats (in the graph only when `entropy_grad`), values (B, R) float32 of the
    shared value head or the separate critic (None when critic-free), and `seconds` of wall time when the rollout
    ran it (0 otherwise)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None
    seconds: float = 0.0


def training_forward(actor: engine.TrainEngine, critic: engine.TrainEngine | None, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, prompt_len: int, temperature: float, entropy_grad: bool,
                     packing: Any, top_p: float = 1.0) -> Forward:
    """The forward every loss of a micro-batch reads: the policy's response logprobs at `temperature`
    (`ppo.temperature`) with their entropies (and the shared head's values) under the actor's autocast, and a
    separate critic's values under its own. input_ids, attention_mask: (B, P+R); `packing`: as `policy_forward`
    takes it; `entropy_grad`: whether the entropy is in the graph (`ppo.c2` != 0; else a statistic, with no
    gradient through its (B, R, V) softmax); `top_p`: `ppo.top_p`, the log-probs and entropies renormalised over
    the nucleus when < 1 (`policy_forward`)."""
    with actor.autocast():
        lp, ent, v = policy_forward(actor.module, input_ids, attention_mask, prompt_len, temperature,
                                    with_entropy=True, with_values=has_value_head(actor.module), packing=packing,
                                    entropy_grad=entropy_grad, top_p=top_p)
    if critic is not None:
        with critic.autocast():
            v = critic_values(critic.module, input_ids, attention_mask, prompt_len, packing=packing)
    return Forward(lp, ent, v)
