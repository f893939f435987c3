"""Models: loading (hub id, local dir, GGUF, tiny random), scalar-head reward/value models, LoRA adapters, a policy's
shared value head (`models/policy.py`), saving (`models/checkpoint.py`) and the trained models' final save
(`models/final.py`)."""

from rlhf_cli.registry import lazy_exports

# the names below, each imported from its module on first use: the preflight checks read config.json files
# (`models.checkpoint`) before torch loads, which the model modules import
_WHERE = {
    "is_scalar_model_dir": "checkpoint", "read_score_stats": "checkpoint", "require_scalar_model_dir": "checkpoint",
    "save_hf": "checkpoint", "with_scoring_template": "checkpoint",
    "save_model": "final", "save_policy": "final",
    "ModelSourceError": "loading", "configure_training": "loading", "count_parameters": "loading",
    "load_causal_lm": "loading", "load_generation_config": "loading", "load_tokenizer": "loading",
    "resolve_hf_dir": "loading", "auto_tokenizer": "loading", "torch_dtype_for": "loading",
    "with_attention_fallback": "loading",
    "ADAPTER_DIR": "lora", "adapters_disabled": "lora", "add_lora": "lora", "has_lora": "lora",
    "lora_enabled": "lora", "merged_state_dict": "lora", "parameter_counts": "lora", "save_adapter": "lora",
    "without_adapters": "lora",
    "PolicyWithValueHead": "policy", "disable_dropout": "policy", "has_value_head": "policy", "lm_of": "policy",
    "planned_trained_models": "policy", "unwrap": "policy",
    "Float32Head": "scalar", "attention_tokens": "scalar", "custom_mask_support": "scalar",
    "last_token_index": "scalar", "load_scalar_model": "scalar", "new_scalar_head": "scalar",
    "response_values": "scalar", "scalar_from_causal_lm": "scalar", "scalar_skeleton": "scalar",
    "scores_at": "scalar", "sequence_scores": "scalar", "token_values": "scalar", "trunk_hidden": "scalar",
}


__getattr__ = lazy_exports(__name__, _WHERE)

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
    "planned_trained_models",
    "attention_tokens", "custom_mask_support",
    "is_scalar_model_dir",
    "last_token_index",
    "load_causal_lm",
    "load_generation_config",
    "load_scalar_model",
    "load_tokenizer",
    "auto_tokenizer",
    "new_scalar_head",
    "read_score_stats",
    "require_scalar_model_dir",
    "resolve_hf_dir",
    "response_values",
    "scores_at",
    "save_hf", "with_scoring_template",
    "save_model",
    "save_policy",
    "scalar_from_causal_lm",
    "scalar_skeleton",
    "sequence_scores",
    "token_values",
    "torch_dtype_for",
    "trunk_hidden",
    "with_attention_fallback",
    "unwrap",
]
