"""Prompts from the `reasoning-gym` package (`data=reasoning_gym`, `data.reasoning_gym.*`): procedurally generated
tasks with their own verifiers, for RL with verifiable rewards (Stojanovski et al. 2025, "Reasoning Gym").

    splits = reasoning_gym_splits(data_cfg)      {"train": [(row, Prompt)], "eval": [(row, Prompt)]}
    checker(prompts, completions, answer, question=..., metadata=...)   a reward function: the package's scores

Each task of `data.reasoning_gym.tasks` gives `size` training prompts from `seed` and `eval_size` held-out ones
from `seed` + `EVAL_SEED_OFFSET` (the package draws item i from seed + i, so the two ranges of seeds are disjoint
for any size below the offset, and the held-out set does not move with `size`). Within a split a question text
is kept once (small tasks repeat questions), and a held-out question that is also a training one is dropped, so
the splits share no text. A prompt is the package's default system prompt (answer inside `<answer></answer>`
tags; `data.system_prompt` replaces it) and the question (each task drawn with the package's settings for it,
overridden by `data.reasoning_gym.task_config.<task>`); its `answer` is the entry's answer and its columns the
whole entry (question, answer, metadata), which the checker and a reward server receive. A few tasks draw their
questions with Python's string hashing too (`HASH_SEEDED`): they need PYTHONHASHSEED fixed, which is checked.

The checker reads the text inside the completion's last `<answer>` tags (the package's `extract_answer`), or,
without tags, the completion's last non-empty line, and scores it with the task's own `score_answer` (1.0 right;
partial credit where the task gives it, e.g. 0.5 for `-4.0` against `-4` in basic_arithmetic; 0.0 wrong, and
0.0 where a task's scorer raises on text it cannot read).

The package is an optional extra (`pip install 'rlhf_cli[reasoning]'`); without it a run stops in one line.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from typing import Any

from rlhf_cli.data.formats import Prompt
from rlhf_cli.errors import ConfigError

INSTALL = "pip install 'rlhf_cli[reasoning]'"
EVAL_SEED_OFFSET = 1_000_003
"""The held-out prompts' generator seed is `data.reasoning_gym.seed` + this: beyond every training item's seed
(seed + i, i < `data.reasoning_gym.size`)."""


def _package() -> Any:
    """The `reasoning_gym` module. Raises ConfigError (one line, the install command) when it is missing."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.reasoning_gym needs the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


HASH_SEEDED = frozenset({"isomorphic_strings", "knight_swap", "list_functions", "polynomial_multiplication",
                         "ransom_note", "word_ladder"})
"""Tasks whose questions depend on Python's string hashing as well as the seed (measured on reasoning-gym
0.1.25: generated under PYTHONHASHSEED=1 and 2, they differ): each process, rank or resume would draw other
questions, and the held-out split could meet training questions. They need PYTHONHASHSEED fixed."""


def check_tasks(tasks: Sequence[str]) -> None:
    """Every name in `tasks` is one of the package's tasks, and one that hashes strings runs under a fixed
    PYTHONHASHSEED (`HASH_SEEDED`). Raises ConfigError naming the first unknown one and the closest names, or the
    task and the variable to set."""
    _package()
    from reasoning_gym.factory import DATASETS  # the package's registry of task names

    for name in tasks:
        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=3)
            raise ConfigError(f"data.reasoning_gym.tasks: no task {name!r} in reasoning-gym"
                              + (f" (did you mean {', '.join(close)}?)" if close else
                                 f" ({len(DATASETS)} tasks: see reasoning_gym.factory.DATASETS)"))
        if name in HASH_SEEDED and os.environ.get("PYTHONHASHSEED", "random") == "random":
            raise ConfigError(f"data.reasoning_gym.tasks: {name} draws its questions with Python's string hashing, "
                              f"so every process would get other ones: run with PYTHONHASHSEED=0 exported")


def task_settings(task: str, settings: Any) -> dict[str, Any]:
    """`data.reasoning_gym.task_config.<task>` as the keyword arguments of the package's config class for `task`:
    plain values, a list given for a field whose default is a tuple made a tuple (the package checks such types).
    Raises ConfigError naming the first unknown field (and the task's fields), or the package's own complaint
    about a value."""
    import dataclasses

    from omegaconf import OmegaConf
    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[task][1]
    fields = {f.name: f for f in dataclasses.fields(config_class) if f.name not in ("size", "seed")}
    given = OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else dict(settings)
    for name in given:
        if name not in fields:
            raise ConfigError(f"data.reasoning_gym.task_config.{task}.{name}: {task} has no setting {name!r} (its "
                              f"settings: {', '.join(fields)})")
    out = {k: tuple(v) if isinstance(v, list) and isinstance(fields[k].default, tuple) else v for k, v in given.items()}
    try:
        made = config_class(**out, size=1, seed=0)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"data.reasoning_gym.task_config.{task}: reasoning-gym refuses {given}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return out


def _entries(task: str, size: int, seed: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_package().create_dataset(task, size=size, seed=seed, **settings))


def reasoning_gym_splits(data_cfg: Any) -> dict[str, list[tuple[int, Prompt]]]:
    """{"train": [...], "eval": [...]}: the (1-based row, `Prompt`) items of `data.reasoning_gym`'s tasks, rows
    numbered per split in generation order (task by task). Raises ConfigError: the package is missing, or a task
    name is unknown."""
    rg = data_cfg.reasoning_gym
    check_tasks(rg.tasks)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = data_cfg.system_prompt if data_cfg.system_prompt is not None else SYSTEM_PROMPTS["default"]
    settings = {t: task_settings(t, rg.task_config.get(t, {})) for t in rg.tasks}
    train = [e for t in rg.tasks for e in _entries(t, rg.size, rg.seed, settings[t])]
    held = [e for t in rg.tasks for e in _entries(t, rg.eval_size, rg.seed + EVAL_SEED_OFFSET, settings[t])]
    seen: set[str] = set()
    out: dict[str, list[tuple[int, Prompt]]] = {}
    for split, entries in (("train", train), ("eval", held)):
        kept = []
        for e in entries:
            if e["question"] not in seen:  # the eval split also drops every training question
                seen.add(e["question"])
                kept.append(e)
        out[split] = [(i, _prompt(e, system)) for i, e in enumerate(kept, 1)]
    return out


def _prompt(entry: dict[str, Any], system: str) -> Prompt:
    columns = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
    return Prompt(messages=[{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}],
                  text=entry["question"], answer=entry["answer"], columns=columns)


def task_checker(data_cfg: Any) -> tuple[str, Any]:
    """(name, reward function) of the checker of the run's prompts (`reward.type=checker`, and `rlhf eval`'s
    accuracy): this module's `checker` with `data.reasoning_gym.tasks`, else the built-in task's final-number rule
    (`rlhf_cli.data.builtin:checker`, which any data with numeric answers can use)."""
    if data_cfg.reasoning_gym.tasks:
        return "rlhf_cli.data.reasoning_gym:checker", checker
    from rlhf_cli.data.builtin import checker as builtin_checker

    return "rlhf_cli.data.builtin:checker", builtin_checker


def extract(completion: str) -> str:
    """The answer a completion gives: the text inside its last `<answer>...</answer>` (the package's
    `extract_answer`), else its last non-empty line, stripped ("" for an empty completion)."""
    from reasoning_gym.utils import extract_answer

    got = extract_answer(completion, tag_name="answer", strip=True)
    if got is not None:
        return got
    lines = [ln.strip() for ln in completion.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def checker(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], *,
            question: Sequence[str] | None = None, metadata: Sequence[dict[str, Any]] | None = None,
            **_: Any) -> list[float | None]:
    """The checker of reasoning-gym prompts as a reward function (TRL's convention; `reward.type=checker` with
    `data.reasoning_gym.tasks`): each completion's answer (`extract`) scored by its task's `score_answer` with the
    row's entry (`question`, `answer`, `metadata`: the row's columns), in [0, 1]. None (unscorable) for a row
    without reasoning-gym metadata: the rows come from elsewhere."""
    pkg = _package()
    n = len(completions)
    question = list(question) if question is not None else [None] * n
    metadata = list(metadata) if metadata is not None else [None] * n
    out: list[float | None] = []
    for text, ans, q, meta in zip(completions, answer, question, metadata):
        if not isinstance(meta, dict) or "source_dataset" not in meta:
            out.append(None)
            continue
        score = pkg.get_score_answer_fn(meta["source_dataset"])
        try:
            out.append(float(score(extract(text), {"question": q, "answer": ans, "metadata": meta})))
        except Exception:  # noqa: BLE001 - some tasks' scorers raise on text they cannot read: a wrong answer
            out.append(0.0)
    return out
