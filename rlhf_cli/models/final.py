"""The trained models' final save (a stage's `final/`), in HF format: LoRA models merged with their adapters beside
them, a shared value head beside the policy, a separate critic in `final/critic/`.

    save_model(model, state_dict, tokenizer, out, base=None, **kwargs)   one model (LoRA merged, adapter kept)
    save_policy(final, policy, policy_sd, tokenizer, extra_config, ...)   a policy and its critic

(Its own module, not `models/checkpoint.py`: `save_policy` reads `models.PolicyWithValueHead`, whose head comes
from `models/scalar.py`, which imports `models/checkpoint.py`.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlhf_cli.models.checkpoint import save_hf
from rlhf_cli.models.lora import ADAPTER_DIR, has_lora, merged_state_dict, save_adapter
from rlhf_cli.models.policy import PolicyWithValueHead


def save_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer: Any, out: Path,
               base: str | None = None, **kwargs: Any) -> None:
    """`models.save_hf` of a trained model; a LoRA one (`models.has_lora`) is saved as its merged plain weights
    (`models.merged_state_dict`), its adapter beside them in `out/adapter/` (peft's format, `base` recorded as
    the base model). `kwargs` go to `save_hf` (`extra_config`)."""
    if not has_lora(model):
        save_hf(model, tokenizer, out, state_dict=state_dict, **kwargs)
        return
    save_hf(model, tokenizer, out, state_dict=merged_state_dict(model, state_dict), **kwargs)
    save_adapter(model, state_dict, out / ADAPTER_DIR, base)


def save_policy(
    final: Path,
    policy: torch.nn.Module,
    policy_sd: dict[str, torch.Tensor],
    tokenizer: Any,
    extra_config: dict[str, Any],
    critic: torch.nn.Module | None = None,
    critic_sd: dict[str, torch.Tensor] | None = None,
    base: str | None = None,
    critic_base: str | None = None,
) -> None:
    """Write a trained policy to `final` in HF format (rank 0; the state dicts are consolidated ones).

    A `PolicyWithValueHead` is saved as its causal LM plus `value_head.safetensors` (`score.weight`), so that
    `final/` loads with `AutoModelForCausalLM`; a separate critic goes to `final/critic/` (written beside
    `final/` first, then moved in, so a crash leaves no half-written critic inside `final/`).
    `extra_config` is added to the policy's config.json (the `rlhf_*` lineage keys). LoRA models are merged, and
    their adapters saved in `final/adapter/` and `final/critic/adapter/` (`save_model`; `base`, `critic_base`: the
    models they adapt, recorded in each adapter's config).
    """
    if isinstance(policy, PolicyWithValueHead):
        lm_sd = {k[len("lm."):]: v for k, v in policy_sd.items() if k.startswith("lm.")}
        save_model(policy.lm, lm_sd, tokenizer, final, base, extra_config=extra_config)
        save_file({"score.weight": policy_sd["score.weight"].contiguous()}, str(final / "value_head.safetensors"))
    else:
        save_model(policy, policy_sd, tokenizer, final, base, extra_config=extra_config)
    if critic is not None:
        staging = final.parent / "critic"
        save_model(critic, critic_sd, tokenizer, staging, critic_base)
        if (final / "critic").exists():
            shutil.rmtree(final / "critic")
        os.replace(staging, final / "critic")
