"""Preference and prompt data: formats, the built-in arithmetic task, tokenisation, collators.

    load_preference_data(data_cfg, tokenizer, splits=("train", "eval")) -> PreferenceData
    load_prompt_data(data_cfg, tokenizer, split="train") -> PromptData
    load_sft_data(data_cfg, tokenizer, splits=("train", "eval")) -> SFTData
    PairCollator(pad_id), PackedPairCollator(pad_id, attention_tokens), PromptCollator(pad_id)
    SFTCollator(pad_id), PackedSFTCollator(pad_id, attention_tokens)
    epoch_order(n, seeds, epoch, lengths, group_size)
    check_answer(text, answer), check_answers(texts, answers)   # the built-in task's rule-based reward
"""

from rlhf_cli.data.builtin import (
    BuiltinProblem,
    builtin_splits,
    check_answer,
    check_answers,
    checker,
    parse_answer,
)
from rlhf_cli.data.collate import (
    PackedPairCollator,
    PackedSFTCollator,
    PackedTries,
    PairCollator,
    PromptCollator,
    SFTCollator,
    epoch_order,
    example_length,
    pack_tries,
    pad_sequences,
    row_width,
)
from rlhf_cli.data.datasets import (
    DataSummary,
    PreferenceData,
    PromptData,
    SFTData,
    load_preference_data,
    load_prompt_data,
    load_sft_data,
    read_rows,
)
from rlhf_cli.data.formats import (
    DataError,
    Demo,
    Keys,
    Pair,
    Prompt,
    detect_format,
    parse_demo,
    parse_pair,
    parse_prompt,
)
from rlhf_cli.data.tokenize import Encoder, last_user_turn, pair_budget, truncate_left

__all__ = [
    "BuiltinProblem", "DataError", "DataSummary", "Demo", "Encoder", "Keys", "PackedPairCollator", "PackedSFTCollator",
    "PackedTries", "Pair", "SFTCollator", "SFTData", "load_sft_data", "parse_demo",
    "PairCollator",
    "PreferenceData", "Prompt", "PromptCollator", "PromptData", "builtin_splits",
    "check_answer", "check_answers", "checker", "detect_format", "epoch_order", "example_length", "pair_budget",
    "last_user_turn",
    "load_preference_data", "load_prompt_data", "pack_tries", "pad_sequences", "parse_answer", "parse_pair",
    "parse_prompt", "read_rows", "row_width", "truncate_left",
]
