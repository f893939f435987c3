"""Models: loading (hub id, local dir, GGUF, tiny random), scalar-head reward/value models, LoRA adapters, a policy's
shared value head (`models/policy.py`), saving (`models/checkpoint.py`) and the trained models' final save
(`models/final.py`)."""

from rlhf_cli.models.checkpoint import (
    is_scalar_model_dir,
    read_reward_stats,
    require_scalar_model_dir,
    save_hf,
    with_scoring_template,
)
from rlhf_cli.models.final import save_model, save_policy
from rlhf_cli.models.loading import (
    ModelSourceError,
    configure_training,
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    resolve_hf_dir,
    torch_dtype_for,
)
from rlhf_cli.models.lora import (
    ADAPTER_DIR,
    adapters_disabled,
    add_lora,
    has_lora,
    lora_enabled,
    merged_state_dict,
    parameter_counts,
    save_adapter,
    without_adapters,
)
from rlhf_cli.models.policy import PolicyWithValueHead, disable_dropout, has_value_head, lm_of, unwrap
from rlhf_cli.models.scalar import (
    Float32Head,
    attention_tokens,
    custom_mask_support,
    last_token_index,
    load_scalar_model,
    new_scalar_head,
    response_values,
    rewards_at,
    scalar_from_causal_lm,
    sequence_rewards,
    token_values,
    trunk_hidden,
)

__all__ = [
    "ADAPTER_DIR",
    "add_lora",
    "adapters_disabled",
    "has_lora",
    "lora_enabled",
    "merged_state_dict",
    "parameter_counts",
    "save_adapter",
    "without_adapters",
    "Float32Head",
    "ModelSourceError",
    "PolicyWithValueHead",
    "configure_training",
    "count_parameters",
    "disable_dropout",
    "has_value_head",
    "lm_of",
    "attention_tokens", "custom_mask_support",
    "is_scalar_model_dir",
    "last_token_index",
    "load_causal_lm",
    "load_scalar_model",
    "load_tokenizer",
    "new_scalar_head",
    "read_reward_stats",
    "require_scalar_model_dir",
    "resolve_hf_dir",
    "response_values",
    "rewards_at",
    "save_hf", "with_scoring_template",
    "save_model",
    "save_policy",
    "scalar_from_causal_lm",
    "sequence_rewards",
    "token_values",
    "torch_dtype_for",
    "trunk_hidden",
    "unwrap",
]
