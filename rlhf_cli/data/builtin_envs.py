"""The built-in task's environments (`rollout.env`, issue 57 part C): a calculator the policy may call, and a
checker that asks once more after a wrong answer.

    Calculator   `rollout.env=rlhf_cli.data.builtin_envs:Calculator`: one tool, `calculate(expression)`; the run's
                 reward sources score the final answer (`reward.type=checker`: the policy's sampled words, never
                 the tool's result)
    Retry        `rollout.env=rlhf_cli.data.builtin_envs:Retry`: no tools; a wrong answer gets one reply, "That is
                 not right. Try again.", and the episode's last answer is the one scored
    calculate    the arithmetic `Calculator.calculate` evaluates: numbers, + - * / // % **, parentheses
    calculator_schema  the calculator's JSON schema, as the environment runner shows it to the model

`Calculator` follows TRL's `environment_factory` interface (`rollout/environments.py`), so TRL runs it unchanged;
`Retry` uses this project's general form (`env_response`), which TRL has no counterpart for. The
tool demonstrations `train-sft` learns the call from are written by `data.builtin.tool_calls=true`
(`data/datasets.py`); `experiment=tools` selects both.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rlhf_cli.data.builtin import check_answer

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200
"""Characters of an expression `calculate` reads; a longer one is refused."""
MAX_POWER = 64
"""The largest exponent `**` takes (a huge power would hold the tool past `rollout.tool_timeout_s`)."""
MAX_MAGNITUDE = 10**100
"""The largest magnitude of any value along the way (nested powers stay small)."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic `expression`: integers and decimals, `+ - * / // % **` and parentheses, Python's
    precedence. A whole-valued result is an int (a float's only below 2**53, where it is exact).

    Raises:
        ValueError: anything else (a name, a call, a string), an expression over `MAX_EXPRESSION` characters, an
            exponent over `MAX_POWER`, a value over `MAX_MAGNITUDE`, a division by zero, a complex result; the
            message is what the model reads.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("give an arithmetic expression, such as 12 * 7")
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip().replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _value(tree.body)
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"an exponent over {MAX_POWER}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("a number too large") from None
        if isinstance(value, complex):
            raise ValueError("a complex result")
        return _bounded(value)
    raise ValueError("only numbers, + - * / // % ** and parentheses")


def _bounded(value: int | float) -> int | float:
    if abs(value) > MAX_MAGNITUDE or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("a number too large")
    return value


class Calculator:
    """The built-in task with a calculator: the policy may call `calculate` and then answers; the run's checker
    scores that answer (no `get_reward`)."""

    def reset(self, **row: Any) -> None:
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the question's arithmetic, in numbers with + - * / and parentheses
        """
        value = calculate(expression)
        return f"{value:.12g}" if isinstance(value, float) else str(value)


def calculator_schema() -> dict[str, Any]:
    """`Calculator.calculate`'s JSON schema as the environment runner describes it to the model (transformers'
    `get_json_schema`): the `tools` of the task's tool demonstrations."""
    from transformers.utils import get_json_schema

    return get_json_schema(Calculator().calculate)


RETRY = "That is not right. Try again."
"""`Retry`'s reply to a wrong first answer."""


class Retry:
    """The built-in task in two turns at most, the general form without tools (`env_response`): a wrong first
    answer (`data.builtin.check_answer`) gets `RETRY` as the next user message; a right one, or any second answer,
    ends the episode. The checker then scores the episode's last answer (`builtin.parse_answer`: the last "answer
    is N" of the policy's words)."""

    def reset(self, answer: Any = None, **row: Any) -> None:
        self.answer, self.replied = answer, False
        return None

    def env_response(self, messages: list[dict[str, Any]]) -> str | None:
        if self.replied or check_answer(str(messages[-1].get("content") or ""), self.answer) == 1.0:
            return None
        self.replied = True
        return RETRY
