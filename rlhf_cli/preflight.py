"""A command's config checks: the config's own (its `commands.Command.validator`), then the local model paths
it names, read from their config.json files; both before any model loads. `config.py` stays a leaf; this module
knows where models live.

    VALIDATORS[config_name](cfg, world_size=1)   raises ConfigError (one line) on the first problem
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf.errors import MissingMandatoryValue

from rlhf_cli.commands import COMMANDS, Command, by_config, by_kind, quote
from rlhf_cli.config import reward_sources
from rlhf_cli.errors import ConfigError, ModelSourceError
from rlhf_cli.models.checkpoint import model_architectures, require_scalar_model_dir
from rlhf_cli.models.loading import looks_like_hub_id
from rlhf_cli.registry import ADVANTAGE_ESTIMATORS
from rlhf_cli.reward_http import check_reachable
from rlhf_cli.reward_judge import JudgeReward
from rlhf_cli.rewards import load_reward_function
from rlhf_cli.runs import read_pointer


def model_path_keys(cfg: Any, command: Command) -> list[tuple[str, str | None, str]]:
    """(key, kind, what to set instead) of the model paths `command` loads: `model.name_or_path`, then its
    `Command.model_paths` (a reward model's only when a reward source is `model`); kind `reward` (scalar head),
    `lm` or None."""
    root = Path(str(cfg.paths.root))
    keys = [("model.name_or_path", None, "set it to a hub id, an HF model dir or a run dir")]
    model_reward = "model" in reward_sources(cfg)
    return keys + [(m.key, m.kind, quote(m.hint, root=root)) for m in command.model_paths
                   if model_reward or not m.needs_model_reward]


def check_model_paths(cfg: Any, command: Command) -> None:
    """Every local model path `command` will load exists, holds a model, and the right kind of model: a
    reward model has a scalar head (`*ForSequenceClassification`), a policy or reference has not.

    Runs before anything is loaded or trained; reads config.json files only. Hub ids are left to the
    loader. Raises ConfigError naming the key, what is wrong and what to set instead.
    """
    for key, kind, hint in model_path_keys(cfg, command):
        section, name = key.split(".")
        try:
            value = getattr(getattr(cfg, section), name)
        except MissingMandatoryValue:  # `???`: Hydra reports it where it is read
            continue
        if value is None:
            continue
        value = str(value)
        if not Path(value).expanduser().exists():
            if not looks_like_hub_id(value):
                raise ConfigError(f"{key}={value} does not exist; {hint}")
            continue
        try:
            archs = model_architectures(value)
        except ModelSourceError as e:
            raise ConfigError(f"{key}={value}: {e}; {hint}") from None
        scalar = any(a.endswith("ForSequenceClassification") for a in archs)
        if kind == "reward" and archs and not scalar:
            what = "a causal LM" if any(a.endswith("ForCausalLM") for a in archs) else "a model"
            raise ConfigError(f"{key}={value} holds {what} ({', '.join(archs)}), not a reward model with a "
                              f"scalar head: {hint}")
        if kind == "lm" and scalar:
            raise ConfigError(f"{key}={value} holds a reward model ({', '.join(archs)}), not a causal LM: {hint}")


def resolve_reward_model(cfg: Any) -> str | None:
    """The reward model a run scores with: `reward_model.path`, else the `latest_rm` pointer under
    `paths.root`; None when no reward source is `model`. Raises ConfigError when a model is needed and none
    is set or found, or the path does not hold a reward model."""
    if "model" not in reward_sources(cfg):
        return None
    return reward_model_dir(cfg, "no reward model", ", or use reward.type=checker")


def reward_model_dir(cfg: Any, missing: str, alternative: str = "") -> str:
    """`reward_model.path`, else the reward model the `latest_rm` pointer under `paths.root` names, as an HF
    reward-model dir. Raises ConfigError "<missing>: set reward_model.path=..., or run train-rm first<alternative>"
    when neither names one, or when the path does not hold a reward model."""
    path = cfg.reward_model.path
    if path is None:
        rm = by_kind("rm")
        target = read_pointer(cfg.paths.root, rm.kind)
        if target is None:
            raise ConfigError(f"{missing}: set reward_model.path=<run dir or HF dir>, or run `{rm.invocation}` "
                              f"first (no {Path(cfg.paths.root) / rm.pointer}){alternative}")
        path = str(target)
    return require_scalar_model_dir(str(path), "reward model")


def resolve_teacher(cfg: Any) -> str | None:
    """The teacher a run distils from (`reward.type=teacher`): `reward.teacher.path`, else the `latest_sft` pointer
    under `paths.root`; None when no reward source is `teacher`. Raises ConfigError (one line) when none is set or
    found, or the path does not hold a causal LM."""
    if "teacher" not in reward_sources(cfg):
        return None
    path, sft = cfg.reward.teacher.path, by_kind("sft")
    if path is None:
        target = read_pointer(cfg.paths.root, sft.kind)
        if target is None:
            raise ConfigError(f"no teacher: set reward.teacher.path=<run dir or HF causal-LM dir>, or run "
                              f"`{sft.invocation}` first (no {Path(cfg.paths.root) / sft.pointer})")
        path = str(target)
    if Path(str(path)).expanduser().exists():
        try:
            archs = model_architectures(path)
        except ModelSourceError as e:
            raise ConfigError(f"reward.teacher.path={path}: {e}") from None
        if any(a.endswith("ForSequenceClassification") for a in archs):
            raise ConfigError(f"reward.teacher.path={path} holds a reward model ({', '.join(archs)}), not a causal "
                              "LM: the teacher scores the policy's tokens with its own log-probs")
    elif not looks_like_hub_id(str(path)):
        raise ConfigError(f"reward.teacher.path={path} does not exist; set it to a causal LM (a run dir or an HF "
                          f"dir), or leave it unset for {Path(cfg.paths.root) / sft.pointer}")
    return str(path)


def check_estimator(cfg: Any) -> None:
    """`ppo.n_samples_per_prompt` is at least what `ppo.advantage_estimator` is defined for (a group baseline
    needs 2 samples of a prompt). Raises ConfigError."""
    est, n = ADVANTAGE_ESTIMATORS[cfg.ppo.advantage_estimator], cfg.ppo.n_samples_per_prompt
    if n < est.min_group_size:
        raise ConfigError(f"ppo.advantage_estimator={est.name} compares the samples of one prompt: it needs "
                          f"ppo.n_samples_per_prompt >= {est.min_group_size} (got {n}; 4-16 is usual)")


def validate(config_name: str, cfg: Any, world_size: int = 1) -> None:
    """The checks of the command whose primary config is `config_name`: its validator, the estimator's group
    size and the teacher where it reads `ppo`, `reward.function` where it loads it, a reward server's `reward.url`
    accepting connections where a source is `http` (the judge's `reward.judge.base_url` where one is `judge`), then
    its model paths. Raises ConfigError."""
    command = by_config(config_name)
    command.validator(cfg, world_size=world_size)
    if "ppo" in command.reads:
        check_estimator(cfg)
        if cfg.reward.teacher.path is not None:  # a teacher that is not there, or not a causal LM (unset: the run
            resolve_teacher(cfg)               # reads latest_sft, as it reads latest_rm)
    if cfg.reward.function and ("function" in reward_sources(cfg) or command.reward_function_always):
        load_reward_function(str(cfg.reward.function))  # a missing file or name fails here, before any model loads
    if "reward" in command.reads and "http" in reward_sources(cfg):
        check_reachable(str(cfg.reward.url), float(cfg.reward.timeout_s))  # a server that is down: one line now
    if "reward" in command.reads and "judge" in reward_sources(cfg):
        JudgeReward.from_config(cfg.reward.judge, cfg.seed).check_reachable()
    check_model_paths(cfg, command)


class _Validators(Mapping):
    """{primary config name: its command's checks (`validate`)}, read from the registry at each look-up."""

    def __getitem__(self, config_name: str) -> Callable[..., None]:
        by_config(config_name)  # KeyError for an unknown one
        return partial(validate, config_name)

    def __iter__(self) -> Iterator[str]:
        return iter([c.config_name for c in COMMANDS.values()])

    def __len__(self) -> int:
        return len(COMMANDS)


VALIDATORS: Mapping[str, Callable[..., None]] = _Validators()
