"""Preference and prompt data: formats, the built-in arithmetic task, tokenisation, collators.

    load_preference_data(data_cfg, tokenizer, splits=("train", "eval")) -> PreferenceData
    load_prompt_data(data_cfg, tokenizer, split="train") -> PromptData
    PairCollator(pad_id), PromptCollator(pad_id), make_sampler(...)
    check_answer(text, answer), check_answers(texts, answers)   # the built-in task's rule-based reward
"""

from rlhf_cli.data.builtin import BuiltinProblem, builtin_splits, check_answer, check_answers, parse_answer
from rlhf_cli.data.collate import (LengthGroupedSampler, PairCollator, PromptCollator, SeededRandomSampler,
                                   example_length, length_grouped_order, make_sampler, pad_sequences)
from rlhf_cli.data.datasets import (DataSummary, PreferenceData, PromptData, load_preference_data,
                                    load_prompt_data, read_rows)
from rlhf_cli.data.formats import DataError, Keys, Pair, Prompt, detect_format, parse_pair, parse_prompt
from rlhf_cli.data.tokenize import Encoder, fit_pair, truncate_left

__all__ = [
    "BuiltinProblem", "DataError", "DataSummary", "Encoder", "Keys", "LengthGroupedSampler", "Pair", "PairCollator",
    "PreferenceData", "Prompt", "PromptCollator", "PromptData", "SeededRandomSampler", "builtin_splits",
    "check_answer", "check_answers", "detect_format", "example_length", "fit_pair", "length_grouped_order",
    "load_preference_data", "load_prompt_data", "make_sampler", "pad_sequences", "parse_answer", "parse_pair",
    "parse_prompt", "read_rows", "truncate_left",
]
