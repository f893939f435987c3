"""A command's config checks: the config's own (`rlhf_cli.config.CHECKS`), then the local model paths it
names, read from their config.json files; both before any model loads. `config.py` stays a leaf; this module
knows where models live.

    VALIDATORS[command](cfg, world_size=1)   raises ConfigError (one line) on the first problem
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf.errors import MissingMandatoryValue

from rlhf_cli.config import CHECKS, model_path_keys, reward_sources
from rlhf_cli.core import ESTIMATORS
from rlhf_cli.errors import ConfigError, ModelSourceError
from rlhf_cli.models.checkpoint import model_architectures, require_scalar_model_dir
from rlhf_cli.models.loading import looks_like_hub_id
from rlhf_cli.rewards import load_reward_function
from rlhf_cli.runs import read_pointer


def check_model_paths(cfg: Any, command: str) -> None:
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
    path = cfg.reward_model.path
    if path is None:
        target = read_pointer(cfg.paths.root, "rm")
        if target is None:
            raise ConfigError(f"no reward model: set reward_model.path=<run dir or HF dir>, or run `rlhf train-rm` "
                              f"first (no {Path(cfg.paths.root) / 'latest_rm'}), or use reward.type=checker")
        path = str(target)
    return require_scalar_model_dir(path, "reward model")


def check_estimator(cfg: Any) -> None:
    """`ppo.n_samples_per_prompt` is at least what `ppo.advantage_estimator` is defined for (a group baseline
    needs 2 samples of a prompt). Raises ConfigError."""
    est, n = ESTIMATORS[cfg.ppo.advantage_estimator], cfg.ppo.n_samples_per_prompt
    if n < est.min_group_size:
        raise ConfigError(f"ppo.advantage_estimator={est.name} compares the samples of one prompt: it needs "
                          f"ppo.n_samples_per_prompt >= {est.min_group_size} (got {n}; 4-16 is usual)")


def validate(command: str, cfg: Any, world_size: int = 1) -> None:
    """`command`'s config checks, then its model paths. Raises ConfigError."""
    CHECKS[command](cfg, world_size=world_size)
    if command == "train_ppo":
        check_estimator(cfg)
    if cfg.reward.function and ("function" in reward_sources(cfg) or command == "eval"):
        load_reward_function(str(cfg.reward.function))  # a missing file or name fails here, before any model loads
    check_model_paths(cfg, command)


VALIDATORS: dict[str, Callable[..., None]] = {command: partial(validate, command) for command in CHECKS}
