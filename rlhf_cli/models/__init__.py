"""Models: loading (hub id, local dir, GGUF, tiny random), scalar-head reward/value models, saving."""

from rlhf_cli.models.checkpoint import (
    is_scalar_model_dir,
    read_reward_stats,
    require_scalar_model_dir,
    save_hf,
    with_scoring_template,
)
from rlhf_cli.models.loading import (
    ModelSourceError,
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    resolve_hf_dir,
    torch_dtype_for,
)
from rlhf_cli.models.scalar import (
    Float32Head,
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
    "Float32Head",
    "ModelSourceError",
    "count_parameters",
    "custom_mask_support",
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
    "scalar_from_causal_lm",
    "sequence_rewards",
    "token_values",
    "torch_dtype_for",
    "trunk_hidden",
]
