"""The built-in arithmetic task: disjoint seeded splits, reply formats, and the answer checker."""

import re

import pytest
from data_fixtures import make_cfg  # noqa: F401 (pytest fixtures)

from rlhf_cli.config import BuiltinTaskConfig
from rlhf_cli.data import (
    builtin_splits,
    check_answer,
    check_answers,
    load_preference_data,
    load_prompt_data,
    parse_answer,
)

REPLY = re.compile(r"^\w+ has \d+ [-+*] \d+ = (\d+) \w+( left)?\. The answer is (\d+)\.$")
RESULT = re.compile(r"(= |answer is )\d+")


@pytest.fixture(scope="module")
def splits():
    return builtin_splits(BuiltinTaskConfig())


def test_splits_have_documented_sizes_and_are_disjoint(splits):
    cfg = BuiltinTaskConfig()
    assert {k: len(v) for k, v in splits.items()} == {"rm_train": cfg.rm_train, "rm_eval": cfg.rm_eval,
                                                      "ppo_train": cfg.ppo_train, "ppo_eval": cfg.ppo_eval}
    questions = [p.question for v in splits.values() for p in v]
    assert len(set(questions)) == len(questions)


def test_splits_are_seeded():
    a = builtin_splits(BuiltinTaskConfig(seed=7, rm_train=20, rm_eval=5, ppo_train=5, ppo_eval=5))
    b = builtin_splits(BuiltinTaskConfig(seed=7, rm_train=20, rm_eval=5, ppo_train=5, ppo_eval=5))
    c = builtin_splits(BuiltinTaskConfig(seed=8, rm_train=20, rm_eval=5, ppo_train=5, ppo_eval=5))
    assert a == b and a != c


def test_chosen_correct_rejected_wrong_mostly_in_the_same_format(splits):
    pairs = splits["rm_train"] + splits["rm_eval"]
    assert check_answers([p.chosen for p in pairs], [p.answer for p in pairs]) == [1.0] * len(pairs)
    assert check_answers([p.rejected for p in pairs], [p.answer for p in pairs]) == [0.0] * len(pairs)
    same_format = 0
    for p in pairs:
        m = REPLY.match(p.chosen)
        assert m and int(m.group(1)) == int(m.group(3)) == p.answer
        r = REPLY.match(p.rejected)
        if r:
            same_format += 1
            assert int(r.group(1)) == int(r.group(3)) != p.answer
            # identical to the chosen reply except for the result
            assert RESULT.sub(r"\1#", p.rejected) == RESULT.sub(r"\1#", p.chosen)
    assert same_format >= len(pairs) / 2


def test_prompt_and_reply_are_short(splits, tokenizer):
    p = max(splits["rm_train"], key=lambda p: len(p.question) + len(p.rejected))
    msgs = [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.rejected}]
    assert len(tokenizer.apply_chat_template(msgs, tokenize=False)) < 400
    assert len(tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False))["input_ids"]) < 120


@pytest.mark.parametrize("text,answer,score", [
    ("Tom has 3 + 4 = 7 apples. The answer is 7.", 7, 1.0),
    ("Tom has 3 + 4 = 8 apples. The answer is 8.", 7, 0.0),
    ("The answer is 7, not 8.", 7, 1.0),                  # the "answer is" phrase beats the last number
    ("3 + 4 = 7", "7", 1.0),                              # last number; string answers
    ("I think it is 7.0", 7, 1.0),
    ("The total is 1,234 coins.", 1234, 1.0),
    ("The answer is: -5", -5, 1.0),
    ("5 - 10 = -5. So the answer is -5.", -5, 1.0),
    ("Pages 3-5 are missing", -5, 0.0),                   # a range, not a negative number
    ("Pages 3-5 are missing", 5, 1.0),
    ("#### 22\nThe answer is: 22", 22, 1.0),
    ("Final answer = **12**", 12, 1.0),
    ("I don't know.", 7, 0.0),
    ("", 0, 0.0),
    ("7 apples", None, 0.0),
    ("7 apples", "seven", 0.0),
])
def test_check_answer_hand_written(text, answer, score):
    assert check_answer(text, answer) == score


def test_parse_answer_and_batch_helper():
    assert parse_answer("no numbers here") is None
    assert parse_answer("x2 and 3.5") == 3.5
    assert check_answers(["= 4", "= 5"], [4, 4]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        check_answers(["a", "b"], [1])


def test_builtin_is_the_default_data(make_cfg, tokenizer):
    cfg = make_cfg(builtin__rm_train=16, builtin__rm_eval=4, builtin__ppo_train=8, builtin__ppo_eval=6)
    data = load_preference_data(cfg, tokenizer)
    assert (len(data.train), len(data.eval)) == (16, 4) and data.summary.dropped == {}
    assert data.summary.rows_read == 20 and "builtin" in data.summary.line()
    prompts = load_prompt_data(cfg, tokenizer, split="train")
    evals = load_prompt_data(cfg, tokenizer, split="eval")
    assert (len(prompts), len(evals)) == (8, 6)
    problems = builtin_splits(cfg.builtin)
    for ex in evals:
        p = problems["ppo_eval"][ex["row"] - 1]
        assert ex["answer"] == p.answer and p.question in ex["prompt_text"]
    assert all(len(ex["prompt_ids"]) < 80 for ex in prompts)


def test_plain_dataclass_config_works_too(tokenizer):
    from rlhf_cli.config import BuiltinTaskConfig, DataConfig

    cfg = DataConfig(max_samples=3, builtin=BuiltinTaskConfig(seed=5, rm_train=10, rm_eval=4, ppo_train=4, ppo_eval=4))
    data = load_preference_data(cfg, tokenizer, splits=("eval",))
    assert data.train == [] and len(data.eval) == 3 and data.summary.unused == 1
    assert len(load_prompt_data(cfg, tokenizer)) == 3
