"""Preference and prompt data: formats, the built-in arithmetic task, tokenisation, collators.

    load_preference_data(data_cfg, tokenizer, splits=("train", "eval")) -> PreferenceData
    load_prompt_data(data_cfg, tokenizer, split="train") -> PromptData
    PairCollator(pad_id), PackedPairCollator(pad_id, attention_tokens), PromptCollator(pad_id)
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
    PackedTries,
    PairCollator,
    PromptCollator,
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
    load_preference_data,
    load_prompt_data,
    read_rows,
)
from rlhf_cli.data.formats import DataError, Keys, Pair, Prompt, detect_format, parse_pair, parse_prompt
from rlhf_cli.data.tokenize import Encoder, last_user_turn, pair_budget, truncate_left

__all__ = [
    "BuiltinProblem", "DataError", "DataSummary", "Encoder", "Keys", "PackedPairCollator", "PackedTries", "Pair",
    "PairCollator",
    "PreferenceData", "Prompt", "PromptCollator", "PromptData", "builtin_splits",
    "check_answer", "check_answers", "checker", "detect_format", "epoch_order", "example_length", "pair_budget",
    "last_user_turn",
    "load_preference_data", "load_prompt_data", "pack_tries", "pad_sequences", "parse_answer", "parse_pair",
    "parse_prompt", "read_rows", "row_width", "truncate_left",
]
