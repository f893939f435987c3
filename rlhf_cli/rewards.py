"""Reward functions: code that scores completions, named by `reward.function=<module or file.py>:<callable>`.

    fn = load_reward_function("my_rewards.py:exact_match")        ConfigError when it cannot be loaded
    scores = call_reward_function(fn, name, prompts, completions, answers, rows)   (B,) float32 tensor

The calling convention is TRL's (`GRPOTrainer(reward_funcs=...)`), so a TRL reward function works unchanged::

    def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
        return [1.0 if c.strip().endswith(str(a)) else 0.0 for c, a in zip(completions, answer)]

prompts and completions are lists of str (the prompt as the model saw it, chat template included; the decoded
completion without special tokens); `answer` is the list of the rows' answers (`data.answer_key`, or the
built-in task's), None where a row has none. It returns one float per completion, or None (or NaN) for a
completion it cannot score: that row is *unscorable* (advantage 0, no weight in the loss, left out of every
reward statistic and counted in `reward/unscorable_frac`; `reward.max_unscorable_frac` stops a run with too many,
see `rollout/maker.py`). Anything else (an exception, the wrong count, a non-number, ±inf) raises RewardError
naming the function and the data row, so a run never trains on it.

Like TRL, the data rows' other columns come as keyword arguments (lists) to a function that takes `**kwargs` (or
names them). The built-in checker is such a function: `rlhf_cli.data.builtin:checker`, and reasoning-gym's
(`rlhf_cli.data.reasoning_gym:checker`), which reads the `question` and `metadata` columns.

Under an environment (`rollout.env`), `reward.function` gets TRL's conversational form instead, so a TRL reward
function written for environments runs unchanged: each prompt is its list of messages (as the episode began,
system prompt and `reset`'s observation included), each completion the list of messages after it (assistant
turns, as TRL's response parser gives them: `content` without the tool calls, the calls in `tool_calls`; tool
results; the environment's replies), and `environments=` the episodes' environment instances.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_cli.errors import ConfigError, RewardError

if TYPE_CHECKING:  # pragma: no cover
    import torch

RewardFn = Callable[..., Sequence[float]]


@cache
def load_reward_function(spec: str, key: str = "reward.function") -> RewardFn:
    """The callable `spec` names: `path/to/file.py:name` (a file, imported under a private module name) or
    `package.module:name` (imported from the environment). Loaded once per process.

    Raises:
        ConfigError: malformed spec, missing file or module, an import that raised, or no callable `name`.
    """
    fn = load_object(spec, key)
    if not callable(fn):
        module = spec.rpartition(":")[0]
        raise ConfigError(f"{key}={spec}: {module} has no callable {spec.rpartition(':')[2]!r}")
    return fn


@cache
def load_object(spec: str, key: str) -> Any:
    """What `spec` names (`path/to/file.py:name` or `package.module:name`, as `load_reward_function` reads it),
    callable or not (`rollout.env`'s dict of environment classes). Loaded once per process.

    Raises:
        ConfigError: malformed spec, missing file or module, an import that raised, or no `name` in it.
    """
    module, sep, name = spec.rpartition(":")
    if not (sep and module and name):
        raise ConfigError(f"{key}={spec!r} is not <module or path/to/file.py>:<callable name>")
    if module.endswith(".py") or "/" in module:
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{key}={spec}: no file {path}")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
        loader_spec = importlib.util.spec_from_file_location(f"rlhf_cli_reward_{digest}", path)
        mod = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - the user's module: report it in one line
            raise ConfigError(f"{key}={spec}: importing {path} raised {type(e).__name__}: {e}") from None
    else:
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - ImportError, or whatever the module raises at import
            raise ConfigError(f"{key}={spec}: cannot import {module} ({type(e).__name__}: {e})") from None
    if not hasattr(mod, name):
        raise ConfigError(f"{key}={spec}: {module} has no callable {name!r}")
    return getattr(mod, name)


def _column_kwargs(fn: RewardFn, columns: Sequence[dict[str, Any] | None] | None) -> dict[str, list[Any]]:
    """The data rows' columns as keyword arguments, one list each (None where a row lacks it), as TRL passes a
    dataset's columns: those `fn` takes by name, or all when it takes `**kwargs`; never `prompts`, `completions`,
    `answer` or the names of `fn`'s first two positional parameters (the call fills them: a column `prompt` and a
    `def f(prompt, completion, ...)` do not clash)."""
    if not columns or not any(columns):
        return {}
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return {}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = {"prompts", "completions", "answer"} | {p.name for p in positional[:2]}  # filled by the call
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    keys = dict.fromkeys(k for c in columns if c for k in c)
    return {k: [(c or {}).get(k) for c in columns] for k in keys if k not in taken and (takes_all or k in named)}


def call_reward_function(fn: RewardFn, name: str, prompts: Sequence[Any], completions: Sequence[Any],
                         answers: Sequence[Any], rows: Sequence[Any],
                         columns: Sequence[dict[str, Any] | None] | None = None) -> torch.Tensor:
    """`fn(prompts, completions, answer=answers, **columns)` checked: (B,) float32 scores, NaN where the function
    returned None or NaN (an unscorable completion).

    prompts and completions: B strings, or B lists of messages (TRL's conversational form, under `rollout.env`).
    `name` is how messages name the function (the `reward.function` spec); `rows[i]` is completion i's data
    row number (1-based) for messages; `columns[i]` the data row's columns (a data file's, or a reasoning-gym
    entry's), passed as keyword lists where `fn` takes them (`**kwargs`, or by name).

    Raises:
        RewardError: the function raised, returned something that is not B numbers (None allowed), or ±inf.
    """
    n = len(completions)
    try:
        out = fn(list(prompts), list(completions), answer=list(answers), **_column_kwargs(fn, columns))
    except Exception as e:  # noqa: BLE001 - the user's function: one line, then stop
        raise RewardError(f"reward function {name} raised {type(e).__name__}: {e} (scoring {n} completions, "
                          f"the first of data row {rows[0] if rows else '?'})") from None
    try:
        values = [math.nan if v is None else float(v) for v in out]
    except (TypeError, ValueError):
        raise RewardError(f"reward function {name} returned {type(out).__name__} {str(out)[:80]!r}, not a list of "
                          f"{n} floats (None for a completion it cannot score)") from None
    if len(values) != n:
        raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions "
                          f"(data rows {rows[0]}..{rows[-1]}): return one float per completion")
    for i, v in enumerate(values):
        if math.isinf(v):
            raise RewardError(f"reward function {name} returned {v} for the completion of data row {rows[i]} "
                              f"({_preview(completions[i])!r}): return a finite float per completion, or None for "
                              f"one it cannot score")
    import torch  # here, not at the top: the preflight checks load reward functions before torch

    return torch.tensor(values, dtype=torch.float32)


def _preview(completion: Any) -> str:
    """A completion's first 60 characters for a message: its text, or its last message's content."""
    if isinstance(completion, list):
        completion = str(completion[-1].get("content", "")) if completion else ""
    return str(completion)[:60]
