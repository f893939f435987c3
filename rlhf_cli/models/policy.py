"""A policy as the forwards read it: the shared value head (`ppo.critic=shared`), the causal LM inside a wrapped
policy, and dropout switched off.

    PolicyWithValueHead(lm, seed)   a causal LM with a scalar value head `score` beside its LM head
    unwrap(model)                   the module a DeepSpeed / DDP engine wraps (the model itself otherwise)
    has_value_head(model)           whether `model` is (or wraps) a `PolicyWithValueHead`
    lm_of(model)                    the causal LM of a policy, wrapped or not, with a value head or not
    disable_dropout(model)          every dropout probability set to 0
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli.models.scalar import new_scalar_head


class PolicyWithValueHead(torch.nn.Module):
    """`ppo.critic=shared`: the policy's trunk carries a scalar value head `score` next to its LM head."""

    def __init__(self, lm: torch.nn.Module, seed: int) -> None:
        super().__init__()
        self.lm = lm
        self.score = new_scalar_head(lm.config.get_text_config().hidden_size, seed, next(lm.parameters()))

    @property
    def config(self) -> Any:
        return self.lm.config


def unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def has_value_head(model: Any) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) is a policy carrying a shared value head."""
    return isinstance(unwrap(model), PolicyWithValueHead)


def lm_of(model: Any) -> Any:
    model = unwrap(model)
    return model.lm if isinstance(model, PolicyWithValueHead) else model


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 so that the rollout's old logprobs and values and the
    training forward see the same function (TRL and OpenRLHF do the same)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention modules
            module.attention_dropout = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, key) and isinstance(getattr(model.config, key), float):
            setattr(model.config, key, 0.0)
    return model
