"""Preference and prompt data: formats, the built-in arithmetic task, tokenisation, collators.

    load_preference_data(data_cfg, tokenizer, splits=("train", "eval")) -> PreferenceData
    load_prompt_data(data_cfg, tokenizer, split="train") -> PromptData
    load_sft_data(data_cfg, tokenizer, splits=("train", "eval")) -> SFTData
    load_unpaired_data(data_cfg, tokenizer, splits=("train", "eval")) -> UnpairedData
    PairCollator(pad_id), PackedPairCollator(pad_id, attention_tokens), PromptCollator(pad_id)
    SFTCollator(pad_id), PackedSFTCollator(pad_id, attention_tokens)
    epoch_order(n, seeds, epoch, lengths, group_size)
    check_answer(text, answer), check_answers(texts, answers)   # the built-in task's rule-based reward
    task_checker(data_cfg) -> (name, fn)          # the checker of the run's prompts (built-in or reasoning-gym)
"""

from rlhf_cli.registry import lazy_exports

# the names below, each imported from its module on first use: `from rlhf_cli.data.formats import ...` and
# `config`'s checks before a command runs need no torch, which the collators import
_WHERE = {
    "BuiltinProblem": "builtin", "builtin_splits": "builtin", "check_answer": "builtin", "check_answers": "builtin",
    "checker": "builtin", "parse_answer": "builtin", "task_checker": "reasoning_gym",
    "PackedPairCollator": "collate", "PackedSFTCollator": "collate", "PackedTries": "collate",
    "PairCollator": "collate", "PromptCollator": "collate", "SFTCollator": "collate", "epoch_order": "collate",
    "example_length": "collate", "pack_tries": "collate", "pad_sequences": "collate", "row_width": "collate",
    "DataSummary": "datasets", "PreferenceData": "datasets", "PromptData": "datasets", "SFTData": "datasets",
    "load_preference_data": "datasets", "load_prompt_data": "datasets", "load_sft_data": "datasets",
    "UnpairedData": "datasets", "load_unpaired_data": "datasets",
    "read_rows": "datasets", "check_rows": "datasets",
    "DataError": "formats", "Demo": "formats", "Keys": "formats", "Pair": "formats", "Prompt": "formats",
    "detect_format": "formats", "parse_demo": "formats", "parse_pair": "formats", "parse_prompt": "formats",
    "Unpaired": "formats", "parse_unpaired": "formats",
    "Encoder": "tokenize", "last_user_turn": "tokenize", "pair_budget": "tokenize", "truncate_left": "tokenize",
}


__getattr__ = lazy_exports(__name__, _WHERE)


__all__ = [
    "BuiltinProblem", "DataError", "DataSummary", "Demo", "Encoder", "Keys", "PackedPairCollator", "PackedSFTCollator",
    "PackedTries", "Pair", "SFTCollator", "SFTData", "load_sft_data", "parse_demo",
    "PairCollator",
    "PreferenceData", "Prompt", "PromptCollator", "PromptData", "builtin_splits",
    "check_answer", "check_answers", "checker", "detect_format", "epoch_order", "example_length", "pair_budget",
    "last_user_turn",
    "load_preference_data", "load_prompt_data", "pack_tries", "pad_sequences", "parse_answer", "parse_pair",
    "parse_prompt", "read_rows", "row_width", "truncate_left", "check_rows",
    "Unpaired", "UnpairedData", "load_unpaired_data", "parse_unpaired", "task_checker",
]
