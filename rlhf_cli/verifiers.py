"""Ready reward functions for verifiable answers, in the convention of `rlhf_cli.rewards` (TRL's `reward_funcs`):

    rlhf train-ppo reward.type=function reward.function=rlhf_cli.verifiers:math_answer data.path=my_math.jsonl

    math_answer   1.0 when the completion's answer equals the row's (`data.answer_key`) as mathematics, by
                  Hugging Face's `math-verify` (LaTeX or plain: `\\frac{1}{2}`, `0.5` and `\\boxed{2/4}` agree);
                  0.0 when it does not or gives none; None (unscorable, `reward/unscorable_frac`) when the
                  row's own answer is missing or cannot be parsed, so a broken label never teaches "wrong"

`math-verify` is an optional extra: `pip install 'rlhf_cli[math]'` (it installs `math-verify[antlr4-9-3]`, the
antlr4 runtime hydra pins). Its parsing and comparison each have a time limit (5 s), enforced with signals: call it
from the main thread, as the trainer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf_cli.errors import ConfigError

MATH_INSTALL = "pip install 'rlhf_cli[math]'"


def _math_verify() -> Any:
    """The `math_verify` module. Raises ConfigError (one line, the install command) when it is missing."""
    try:
        import math_verify
    except ImportError:
        raise ConfigError(f"rlhf_cli.verifiers:math_answer needs the math-verify package: {MATH_INSTALL}") from None
    return math_verify


def _parse_gold(mv: Any, answer: Any) -> list[Any]:
    """The row's answer as math-verify reads it: as written, else as LaTeX math (`$...$`); [] when neither."""
    text = str(answer).strip()
    return mv.parse(text) or mv.parse(f"${text}$")


def math_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                **_: Any) -> list[float | None]:
    """Mathematical equality of each completion's answer and its row's (`math_verify.verify(gold, parsed)`,
    after `math_verify.parse` of both; Kydlíček et al. 2025, Hugging Face Math-Verify): 1.0 equal, 0.0 not
    equal or no answer found in the completion, None where the row has no answer or it cannot be parsed.

    prompts, completions: B strings (the prompts are not read); answer: B answers (`data.answer_key`).

    Raises:
        ConfigError: the math-verify extra is not installed.
    """
    mv = _math_verify()
    out: list[float | None] = []
    for text, gold in zip(completions, answer):
        parsed_gold = _parse_gold(mv, gold) if gold is not None else []
        if not parsed_gold:
            out.append(None)
            continue
        out.append(1.0 if mv.verify(parsed_gold, mv.parse(text)) else 0.0)
    return out
