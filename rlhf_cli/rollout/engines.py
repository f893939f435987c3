"""The sampling engines' registry: which engine `rollout.engine` names, and building it.

    EngineSettings    the run's settings every engine may read
    GENERATORS        {`rollout.engine` value: engine builder, its module imported on use}
    make_generator    the engine `rollout.engine=<name>` names, built from `EngineSettings`
    resolve_engine    `auto` turned into `hf` or `vllm`, and why; `describe_engine`, the same for a start table
    max_model_len     the longest prompt + completion a run's engine must hold

Apart from `generation.py` (the seam and the `hf` engine) so that an engine's module (`vllm_engine.py`) imports the
seam without an import circle: this module imports the engines, none of them imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli import engine
from rlhf_cli.rollout.generation import Generator, HFGenerator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """What `make_generator` builds an engine from: the run's settings every engine may read."""

    precision: str
    """The run's `precision`: `hf` samples under it; `vllm` takes its dtype from it (`resolve_dtype`)."""
    chunk: int
    """Prompts per engine call, where the engine batches itself (`hf`); the samples do not depend on it."""
    workdir: str | Path | None = None
    """The run dir: an engine with its own copy of the weights (`vllm`) writes its model dir there."""
    kv_cache_gb: int = 2
    """`rollout.kv_cache_gb`: the KV cache of an engine that reserves one (`vllm`), GiB."""
    engine_dtype: str = "auto"
    """`rollout.engine_dtype`: the dtype of an engine that holds its own weights (`vllm`; `resolve_dtype`)."""
    score_precision: str | None = None
    """The precision of the trainer's scoring passes (`engine.scoring_precision`); None: `precision`."""
    max_model_len: int = 2048
    """The longest prompt + response the engine must hold, tokens."""
    verbose: bool = False
    """`rollout.engine_verbose`: an engine's own log on the terminal too (`vllm`), not only in the run's log file."""
    selftest: bool = True
    """`rollout.engine_selftest`: an engine that holds its own weights (`vllm`) tests its push once after it starts."""
    sync_timeout_s: float = 600.0
    """`rollout.sync_timeout_s`: the bound on each push, self-test and probe of an engine that pushes (`vllm`)."""
    prefix_caching: bool = True
    """An engine's prefix cache (`vllm`: reset after every push); no config key: off only where a benchmark measures
    it (`benchmarks/engine_bench.py --prefix-cache`)."""


def max_model_len(cfg: Any, max_new_tokens: int) -> int:
    """Tokens: the longest sequence an engine must hold for a run whose turn is at most `max_new_tokens` long
    (`ppo.max_new_tokens`, `eval.max_new_tokens`). One response: `data.max_prompt_length` + `max_new_tokens`. With
    `rollout.env`, a turn's prompt is the episode so far, up to `rollout.max_episode_tokens` past the prompt, and
    one call's `max_new_tokens` is its longest row's budget, so that bound + `max_new_tokens`."""
    episode = cfg.rollout.max_episode_tokens if cfg.rollout.env is not None else 0
    return int(cfg.data.max_prompt_length + episode + max_new_tokens)


def _hf(settings: EngineSettings) -> Generator:
    return HFGenerator(settings.precision, settings.chunk)


def _vllm(settings: EngineSettings) -> Generator:
    from rlhf_cli.rollout.vllm_engine import VLLMGenerator  # vllm is an optional install: imported on use

    return VLLMGenerator(settings.precision, settings.chunk, workdir=settings.workdir,
                         kv_cache_gb=settings.kv_cache_gb, max_model_len=settings.max_model_len,
                         engine_dtype=settings.engine_dtype, score_precision=settings.score_precision,
                         verbose=settings.verbose, selftest=settings.selftest,
                         sync_timeout_s=settings.sync_timeout_s, prefix_caching=settings.prefix_caching)


GENERATORS: dict[str, Callable[[EngineSettings], Generator]] = {"hf": _hf, "vllm": _vllm}
"""{`rollout.engine` value: the function building that engine from `EngineSettings`} (an engine's module, and its
optional dependency, is imported only when chosen); `config.ROLLOUT_ENGINES` lists the same names (a test keeps
the two equal)."""


def resolve_engine(name: str, *configs: Any) -> tuple[str, str]:
    """The sampling engine a run uses for `rollout.engine=<name>`, and why, in words.

    name: `hf` or `vllm` (returned as named) or `auto`: `vllm` where vLLM is installed and can sample every model
    the run samples (`vllm_engine.unservable`: its architecture, and on the CPU its attention head size), else
    `hf`, so one command line runs in a venv with or without the engine. configs: the `PretrainedConfig` of each
    model sampled (train-ppo's policy; eval's policy and reference).
    """
    if name != "auto":
        return name, "as set"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf", "auto: vLLM is not installed (`make install-vllm`)"
    from rlhf_cli.rollout.vllm_engine import unservable

    try:
        why = next(filter(None, map(unservable, configs)), None)
    except Exception as e:  # an install whose import fails (a wheel for another torch or CUDA): sample with hf
        first = (str(e).splitlines() or [""])[0]
        return "hf", f"auto: vLLM is installed but does not import ({type(e).__name__}: {first})"
    what = "this model" if len(configs) == 1 else "these models"
    return ("hf", f"auto: {why}") if why else ("vllm", f"auto: vLLM is installed and serves {what}")


def describe_engine(name: str, *configs: Any) -> str:
    """`rollout.engine=<name>` as a start table shows it: the engine, and for `auto` why (`resolve_engine`)."""
    used, why = resolve_engine(name, *configs)
    return used if why == "as set" else f"{used} ({why})"


def make_generator(name: str, settings: EngineSettings) -> Generator:
    """The sampling engine `rollout.engine=<name>`, built from `settings`. A `rollout.engine_dtype` that the `hf`
    engine does not read (it samples under the run's precision) is said once."""
    if name not in GENERATORS:
        raise ValueError(f"rollout.engine={name!r} is not one of {', '.join(GENERATORS)}")
    if name == "hf" and settings.engine_dtype != "auto" and engine.is_main():
        log.warning("rollout.engine_dtype=%s does nothing with rollout.engine=hf: it samples with the trainer's "
                    "weights under precision=%s", settings.engine_dtype, settings.precision)
    return GENERATORS[name](settings)
