"""The built-in task: short arithmetic word problems whose answers code can check (no download).

`rlhf train-rm` / `train-ppo` / `eval` with `data.path=null` use it. From `data.builtin.seed` the
generator draws unique problems and deals them into four DISJOINT splits (no question text appears in
two splits), with sizes from `BuiltinTaskConfig`:

    split      default size   used by
    rm_train   512 pairs      reward-model training
    rm_eval    128 pairs      reward-model accuracy
    ppo_train  256 prompts    PPO rollouts
    ppo_eval   128 prompts    policy evaluation (checker accuracy, RM score)

A problem is one step of +, - or × on small numbers, e.g.

    prompt    "Tom has 3 apples. Tom gets 4 more. How many apples does Tom have now?"
    chosen    "Tom has 3 + 4 = 7 apples. The answer is 7."
    rejected  "Tom has 3 + 4 = 8 apples. The answer is 8."      (75%: a wrong result, same format)
              "I am not sure. You should count the apples yourself."   (25%: unhelpful, no answer)

so a reward model has to learn whether the equation is right, not which style is preferred. Every
chosen reply scores 1.0 under `check_answer` and every rejected reply 0.0, so the checker doubles as a
rule-based reward (`reward.type=checker`). A prompt is about 50 tokens and prompt + reply at most
about 80 with SmolLM2's chat template (its default system prompt included), which keeps CPU PPO fast.

`data.builtin.difficulty=hard` draws every problem as a 3-digit × 2-digit product instead ("Tom has 347 boxes with
28 apples in each box. ..."): the split meant for a calculator (`builtin_envs.Calculator`), where SmolLM2 without the
tool scores 0.000, after tool SFT 0.859 and after GRPO on top 0.977 (docs/results.md, "Tools").

Difficulty, measured: SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantised), chat template, greedy decoding,
max_new_tokens=48, on the first 64 ppo_eval prompts (by row) of seed 1234 answers 21/64 = 32.8%
correctly (by operation: × 57%, + 16%, − 12%). It tends to write "a + b = c ... The answer is: c" and
gets c wrong. That is inside the 20–70% band the task is designed for, so PPO with either the checker or
a trained reward model has room to improve it. Re-measure with
`pytest -m slow tests/data/test_data_builtin_difficulty.py -s` (~8 min on a shared 2-core CPU).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SPLITS = ("rm_train", "rm_eval", "ppo_train", "ppo_eval")

NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Ella",
         "Noah", "Ava", "Finn", "Ruby")
ITEMS = ("apples", "pears", "books", "coins", "marbles", "stickers", "cards", "pens", "eggs", "shells",
         "stamps", "cookies")

WRONG_FRACTION = 0.75
"""Share of rejected replies that are a wrong result in the chosen format; the rest are unhelpful."""

UNHELPFUL = (
    "I am not sure. You should count the {item} yourself.",
    "That is a nice question about {item}. Maybe ask {name}?",
    "It depends on how many {item} {name} really wants.",
    "Sorry, I cannot help with math questions.",
)


@dataclass(frozen=True)
class BuiltinProblem:
    """One arithmetic word problem with a correct (chosen) and an incorrect (rejected) reply."""

    question: str
    answer: int
    chosen: str
    rejected: str
    op: str
    """`+`, `-` or `*`."""
    expression: str = ""
    """The problem's arithmetic, e.g. "3 + 4": what a tool demonstration passes to `calculate`."""


def _make_problem(rng: random.Random, difficulty: str = "easy") -> BuiltinProblem:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    op = rng.choice("+-*") if difficulty == "easy" else "*"
    if difficulty == "hard":
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        c = a * b
        question = f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?"
        fmt = "{name} has {a} * {b} = {c} {item}. The answer is {c}."
    elif op == "+":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        c = a + b
        question = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        fmt = "{name} has {a} + {b} = {c} {item}. The answer is {c}."
    elif op == "-":
        a = rng.randint(10, 50)
        b = rng.randint(2, a - 2)
        c = a - b
        question = f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?"
        fmt = "{name} has {a} - {b} = {c} {item} left. The answer is {c}."
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = a * b
        question = f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?"
        fmt = "{name} has {a} * {b} = {c} {item}. The answer is {c}."
    chosen = fmt.format(name=name, a=a, b=b, c=c, item=item)
    if rng.random() < WRONG_FRACTION:
        wrong = c
        while wrong == c or wrong < 0:
            wrong = c + rng.choice((-10, -2, -1, 1, 2, 10))
        rejected = fmt.format(name=name, a=a, b=b, c=wrong, item=item)
    else:
        rejected = rng.choice(UNHELPFUL).format(name=name, item=item)
    return BuiltinProblem(question=question, answer=c, chosen=chosen, rejected=rejected, op=op,
                          expression=f"{a} {op} {b}")


@functools.lru_cache(maxsize=8)
def _generate(seed: int, sizes: tuple, difficulty: str = "easy") -> dict[str, tuple]:
    rng = random.Random(seed)
    seen: set = set()
    out: dict[str, list] = {}
    for split, n in zip(SPLITS, sizes):
        problems: list = []
        tries = 0
        while len(problems) < n:
            tries += 1
            if tries > 100 * n + 1000:
                raise ValueError(f"built-in task: cannot draw {n} distinct problems for split '{split}'")
            p = _make_problem(rng, difficulty)
            if p.question in seen:
                continue
            seen.add(p.question)
            problems.append(p)
        out[split] = tuple(problems)
    return out


def builtin_splits(builtin_cfg: Any) -> dict[str, list[BuiltinProblem]]:
    """The four disjoint splits {rm_train, rm_eval, ppo_train, ppo_eval} for a BuiltinTaskConfig.

    Deterministic in `builtin_cfg.seed`, the sizes and `difficulty` (no two splits share a question).
    """
    sizes = tuple(int(getattr(builtin_cfg, s)) for s in SPLITS)
    for s, n in zip(SPLITS, sizes):
        if n < 0:
            raise ValueError(f"data.builtin.{s} must be >= 0 (got {n})")
    difficulty = str(getattr(builtin_cfg, "difficulty", "easy"))
    return {k: list(v) for k, v in _generate(int(builtin_cfg.seed), sizes, difficulty).items()}


# ----------------------------------------------------------------------------------------------
# checker

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(r"(?<![\w.])" + _NUMBER)
_FINAL_RE = re.compile(r"answer\s*(?:is|:|=)\W{0,3}?(" + _NUMBER + ")", re.IGNORECASE)


def _to_float(s: str) -> float:
    return float(s.replace(",", ""))


def parse_answer(text: str) -> float | None:
    """The final numeric answer in free text, or None.

    The last "answer is N" / "answer: N" wins; otherwise the last number in the text. Handles thousands
    separators ("1,234"), negative numbers ("-5", but not the "5" of "3-5" as negative) and decimals.
    """
    finals = _FINAL_RE.findall(text)
    if finals:
        return _to_float(finals[-1])
    nums = _NUMBER_RE.findall(text)
    return _to_float(nums[-1]) if nums else None


def check_answer(response_text: str, answer: Any) -> float:
    """1.0 if the response's final number (see `parse_answer`) equals `answer`, else 0.0.

    `answer` may be an int, float or numeric string. Usable directly as a rule-based reward.
    """
    got = parse_answer(response_text)
    if got is None or answer is None:
        return 0.0
    try:
        want = _to_float(str(answer).strip())
    except ValueError:
        return 0.0
    return 1.0 if abs(got - want) < 1e-6 else 0.0


def check_answers(responses: Sequence[str], answers: Sequence[Any]) -> list[float]:
    """`check_answer` over a batch: one 1.0/0.0 per (response, answer) pair."""
    if len(responses) != len(answers):
        raise ValueError(f"check_answers: {len(responses)} responses but {len(answers)} answers")
    return [check_answer(r, a) for r, a in zip(responses, answers)]


def checker(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_: Any) -> list[float]:
    """The checker as a reward function (`reward.type=checker` is `reward.function=rlhf_cli.data.builtin:checker`):
    1.0 where a completion's final number equals its row's answer, else 0.0 (see `check_answer`; a row without
    an answer scores 0.0). TRL's reward-function convention; works on any data whose rows carry numeric answers
    (`data.answer_key`)."""
    return check_answers(completions, answer)
