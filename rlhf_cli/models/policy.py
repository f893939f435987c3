"""A policy as the forwards read it: the shared value head (`ppo.critic=shared`), the causal LM inside a wrapped
policy, and dropout switched off.

    PolicyWithValueHead(lm, seed)   a causal LM with a scalar value head `score` beside its LM head
    unwrap(model)                   the module a DeepSpeed / DDP engine wraps (the model itself otherwise)
    has_value_head(model)           whether `model` is (or wraps) a `PolicyWithValueHead`
    lm_of(model)                    the causal LM of a policy, wrapped or not, with a value head or not
    disable_dropout(model)          every dropout probability set to 0
    planned_trained_models(cfg, policy, needs_critic, rm_path)   what train-ppo will train, for a dry run
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli.models.lora import add_lora, lora_enabled
from rlhf_cli.models.scalar import new_scalar_head, scalar_skeleton


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


def planned_trained_models(cfg: Any, policy: torch.nn.Module, needs_critic: bool, rm_path: str | None
                           ) -> list[torch.nn.Module]:
    """The models `rlhf train-ppo` will train, each as one engine checkpoints it, known without loading more
    weights (`rlhf train-ppo --dry-run`'s checkpoint size): `policy` (loaded, its LoRA adapters added) alone for a
    critic-free estimator (`needs_critic` false); with its value head (`PolicyWithValueHead`) under
    `ppo.critic=shared`; else `policy` and the critic's `scalar_skeleton` (meta device, no weights), of the
    reward model at `rm_path` under `ppo.critic_init=reward_model` and of `reference.path`, or the policy's
    architecture, otherwise; with `model.lora.r` > 0 the critic gets adapters as train-ppo adds them (its head
    trained in full). Mirrors the choices of `stages/ppo.py`'s `build_models`."""
    p = cfg.ppo
    if not needs_critic:
        return [policy]
    if p.critic == "shared":
        return [PolicyWithValueHead(policy, cfg.seed)]
    use_rm = p.critic_init == "reward_model" and rm_path is not None
    critic = scalar_skeleton(rm_path if use_rm else (cfg.reference.path or policy), cfg.precision)
    if lora_enabled(cfg.model.lora):
        add_lora(critic, cfg.model.lora, heads=("score",), what="critic")
    return [policy, critic]
