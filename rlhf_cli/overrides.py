"""The command line's keys and Hydra's errors, before a stage runs: an override's key must be one of the schema's
(`config.RunConfig`) and one its command reads (`commands.Command.reads`), with the closest key suggested; and
Hydra's or OmegaConf's composition errors said in one line.

    check_override_keys(config_name, overrides) -> warnings   raises ConfigError (one line)
    explain_composition_error(e, overrides) -> str            one line for a composition error
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from rlhf_cli.commands import COMMANDS, Command, by_config
from rlhf_cli.config import CONFIG_GROUPS, RunConfig, reward_sources, schema_keys
from rlhf_cli.errors import ConfigError
from rlhf_cli.registry import ADVANTAGE_ESTIMATORS

# sections a shared list of overrides gives every command: where one does nothing, a warning, not an error
_HARMLESS = ("logger", "tracker")
# keys that no longer exist -> the one line that says what replaced them
_REPLACED = {
    "tensorboard": "tensorboard is no longer a key: TensorBoard is one of the loggers, logger=[jsonl,tensorboard] "
                   "(without `logger`, metrics go to metrics.jsonl only)",
}


def check_override_keys(command: str, overrides: list[str]) -> list[str]:
    """Reject `a.b=...` overrides whose key is not in the command's schema, suggesting the closest, and keys
    of the schema the command does not read (`rlhf train-ppo policy.path=...`, see `Command.reads`), naming
    what the user probably meant; `command` is its primary config's name (`Command.config_name`). Returns a
    warning line for each harmless key the command ignores
    (`logger`, `tracker.*` in `rlhf eval`). A key that was replaced (`_REPLACED`: `tensorboard`) says by what.

    Group selections (`model=tiny`), Hydra's own keys (`hydra.*`), additions (`+k=v`), deletions
    (`~k`) and flags are left to Hydra. Raises ConfigError naming the key and the closest valid one.
    """
    cmd = by_config(command)
    warnings: list[str] = []
    keys = schema_keys(RunConfig)
    groups = set(CONFIG_GROUPS)
    for ov in overrides:
        if ov.startswith("-") or "=" not in ov:
            continue
        key = ov.split("=", 1)[0]
        if key.startswith(("+", "~", "hydra.", "hydra/")) or "/" in key:
            continue
        if key == "paths.typed" or key.startswith("paths.typed."):
            raise ConfigError(f"{key} is written by the command (each model path as typed, before it was resolved); "
                              f"set the model path key itself")
        known = (key.split("@")[0] in groups or key in keys  # a key under an open dict (deepspeed.extra.*) is fine
                 or any(key.startswith(k + ".") and is_dict for k, is_dict in keys.items()))
        if known:
            ignored = _check_command_reads(cmd, key.split("@")[0], keys)
            if ignored:
                warnings.append(ignored)
            continue
        if key in _REPLACED:
            raise ConfigError(_REPLACED[key])
        close = closest_key(key, cmd, keys)
        hint = f"; did you mean '{close}'?" if close else ""
        raise ConfigError(f"unknown config key '{key}' for `{cmd.invocation}`{hint} "
                          f"(`{cmd.invocation} --cfg job` lists every key)")
    return warnings


@dataclass(frozen=True)
class Ignored:
    """A key that the composed config makes do nothing: typed on the command line there, it is refused in one line
    (`check_ignored_keys`); set by a preset (`experiment=...`), it may stay unread."""

    key: str
    """The key, or a section whose every key it covers (`model.arch`)."""
    when: str
    """The setting that makes it do nothing, as the README's table says it."""
    applies: Callable[[Any, Command], bool]
    """Whether the composed config `cfg` of `command` is in that setting."""
    fix: str
    """What to type instead."""


def _critic_free(cfg: Any, command: Command) -> bool:
    return "ppo" in command.reads and not ADVANTAGE_ESTIMATORS[cfg.ppo.advantage_estimator].needs_critic


def _samples_no_policy(cfg: Any, command: Command) -> bool:
    """Whether `command` with `cfg` samples no episodes: train-ppo always does; eval does in its policy mode only
    (`stages.evaluate`'s order: `run_dir`, then `policy.path`, then `reward_model.path`)."""
    if "policy" not in command.reads:  # train-ppo samples every run; no other command reads `rollout`
        return "ppo" not in command.reads
    return cfg.get("run_dir") is not None or (cfg.policy.path is None and cfg.reward_model.path is not None)


def _no_model_reward(cfg: Any, command: Command) -> bool:
    """Whether `command` loads no reward model with `cfg`: it loads one only for a `model` reward source (train-ppo's
    `ModelPath.needs_model_reward`), or, measuring a policy (`policy.path`), only with `reward.type=model`."""
    path = next((m for m in command.model_paths if m.key == "reward_model.path"), None)
    if path is None:
        return False
    if path.needs_model_reward:
        return "model" not in reward_sources(cfg)
    return "policy" in command.reads and cfg.policy.path is not None and cfg.reward.type != "model"


def _no_http_reward(cfg: Any, command: Command) -> bool:
    """Whether `command` reads a reward and no source of it is `http`: train-ppo's sources (`reward_sources`), eval's
    `reward.type` (it does not sum `reward.weights`)."""
    if "reward" not in command.reads:
        return False
    return "http" not in (reward_sources(cfg) if "ppo" in command.reads else {cfg.reward.type})


def _no_judge_reward(cfg: Any, command: Command) -> bool:
    """Whether `command` reads a reward and no source of it is `judge` (as `_no_http_reward` reads them)."""
    if "reward" not in command.reads:
        return False
    return "judge" not in (reward_sources(cfg) if "ppo" in command.reads else {cfg.reward.type})


IGNORED: tuple[Ignored, ...] = (
    Ignored("model.name_or_path", "`model.init=random` (`model=tiny`, `experiment=smoke`): a seeded random model, "
            "no weights loaded", lambda cfg, c: cfg.model.init == "random",
            "add `model=hf` to load the model at the path"),
    Ignored("model.gguf_file", "`model.init=random`, or `model.name_or_path` set (the path is loaded)",
            lambda cfg, c: cfg.model.init == "random" or OmegaConf.select(cfg, "model.name_or_path") is not None,
            "`model=smollm2 model.gguf_file=...` loads a GGUF file"),
    Ignored("model.arch", "`model.init=pretrained`: the shape is the loaded model's",
            lambda cfg, c: cfg.model.init != "random", "`model=tiny` builds a random model of that shape"),
    Ignored("model.lora", "`model.lora.r=0` (no adapters), for every `model.lora.*` key but `r`",
            lambda cfg, c: not cfg.model.lora.r, "set `model.lora.r` > 0 as well"),
    Ignored("reward_model.path", "no `model` reward source (`reward.type`, `reward.weights`) in a command that "
            "trains or measures a policy", lambda cfg, c: _no_model_reward(cfg, c),
            "add `reward.type=model` (or a `reward.weights.model`)"),
    *(Ignored(f"reward.{k}", "no `http` reward source (`reward.type`, `reward.weights`)", _no_http_reward,
              "add `reward.type=http` (or a `reward.weights.http`)")
      for k in ("url", "label_key", "http_batch_size", "max_concurrency", "timeout_s", "retries")),
    Ignored("reward.judge", "no `judge` reward source (`reward.type`, `reward.weights`), for every `reward.judge.*` "
            "key", _no_judge_reward, "add `reward.type=judge` (or a `reward.weights.judge`)"),
    Ignored("reward.teacher.path", "no `teacher` reward source (`reward.type`, `reward.weights`), or a command that "
            "trains no policy",
            lambda cfg, c: "ppo" not in c.reads or "teacher" not in reward_sources(cfg),
            "add `reward.type=teacher` (`experiment=distill`)"),
    Ignored("rm.epochs", "`rm.max_steps` set", lambda cfg, c: cfg.rm.max_steps is not None,
            "set `rm.max_steps=null` to count epochs"),
    Ignored("sft.epochs", "`sft.max_steps` set", lambda cfg, c: cfg.sft.max_steps is not None,
            "set `sft.max_steps=null` to count epochs"),
    Ignored("dpo.epochs", "`dpo.max_steps` set", lambda cfg, c: cfg.dpo.max_steps is not None,
            "set `dpo.max_steps=null` to count epochs"),
    Ignored("kto.epochs", "`kto.max_steps` set", lambda cfg, c: cfg.kto.max_steps is not None,
            "set `kto.max_steps=null` to count epochs"),
    Ignored("ppo.kl_horizon", "`ppo.kl_target=null` (a fixed β)", lambda cfg, c: cfg.ppo.kl_target is None,
            "set `ppo.kl_target` for the adaptive controller"),
    *(Ignored(f"ppo.{k}", "a critic-free `ppo.advantage_estimator` (grpo, dr_grpo, rloo, reinforce_pp, distill)",
              _critic_free, "use `ppo.advantage_estimator=gae`")
      for k in ("critic", "critic_init", "critic_lr", "c1", "value_clip", "lam")),
    Ignored("ppo.gamma", "`ppo.advantage_estimator=distill` (each token is credited with its own teacher log-ratio, "
            "undiscounted)", lambda cfg, c: "ppo" in c.reads and cfg.ppo.advantage_estimator == "distill",
            "use another `ppo.advantage_estimator` to discount"),
    *(Ignored(f"rollout.{k}", "`rollout.is_correction=none`", lambda cfg, c: cfg.rollout.is_correction == "none",
              "set `rollout.is_correction` (tis, icepop, seq_mask)") for k in ("is_low", "is_high")),
    *(Ignored(f"rollout.{k}", "`rollout.env=null` (one response per prompt)", lambda cfg, c: cfg.rollout.env is None,
              "set `rollout.env=FILE.py:Class`")
      for k in ("max_turns", "max_tool_calls", "max_episode_tokens", "max_tool_tokens", "tool_timeout_s")),
    Ignored("rollout.env", "an eval that samples no policy (a reward model's, `reward_model.path` without "
            "`policy.path`, or a past run's report, `run_dir`)", _samples_no_policy, "give `policy.path`"),
)
"""Every key that a setting makes do nothing, checked against the command line (README: "Keys a setting ignores")."""


def ignored_keys(command: Command, overrides: Sequence[str], cfg: Any) -> list[tuple[str, str]]:
    """(key, the one-line refusal) of each key typed in `overrides` that `cfg` (their composition) makes do nothing
    (`IGNORED`, its first rule that applies), in command-line order."""
    out = []
    for ov in overrides:
        if ov.startswith("-") or "=" not in ov or ov.startswith(("+", "~")):
            continue
        key = ov.split("=", 1)[0]
        for rule in IGNORED:
            covered = key == rule.key or key.startswith(rule.key + ".")
            if covered and not (rule.key == "model.lora" and key == "model.lora.r") and rule.applies(cfg, command):
                out.append((key, f"{ov} does nothing in `{command.invocation}` with {rule.when}: {rule.fix}"))
                break
    return out


def check_ignored_keys(command: Command, overrides: Sequence[str], cfg: Any) -> None:
    """Refuse a key typed in `overrides` that `cfg` (their composition) makes do nothing (`IGNORED`), in one line
    naming the key, why and what to type instead: `model.name_or_path=runs/latest_sft` under `model=tiny` would
    train the random init without a word. Keys a preset sets are not checked; a sweep refuses only a key every job
    ignores (`cli.check_sweep`). Raises ConfigError."""
    found = ignored_keys(command, overrides, cfg)
    if found:
        raise ConfigError(found[0][1])


PEER_NAMES = {
    "clip_range": "ppo.clip", "cliprange": "ppo.clip", "epsilon": "ppo.clip", "eps_clip": "ppo.clip",
    "clip_ratio": "ppo.clip", "vf_coef": "ppo.c1",
    "ent_coef": "ppo.c2", "kl_coef": "ppo.kl_beta", "init_kl_coef": "ppo.kl_beta", "num_generations":
    "ppo.n_samples_per_prompt", "n_samples_per_prompt": "ppo.n_samples_per_prompt", "cliprange_value":
    "ppo.value_clip", "vf_clip": "ppo.value_clip", "learning_rate": "{section}.lr", "lr": "{section}.lr",
}
"""A peer's name for a key (TRL's `PPOConfig`/`GRPOConfig`, OpenRLHF's and veRL's flags) -> ours; `{section}` is the
command's own section (`learning_rate` -> `rm.lr`; train-ppo's is `ppo.actor_lr`)."""


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest inserted, deleted or replaced characters that turn `a` into `b`."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def closest_key(key: str, cmd: Command, keys: dict[str, bool]) -> str | None:
    """The key a misspelt `key` most likely meant: ranked by the edit distance of its last component to each of the
    command's own keys' last components and to the peers' names (`PEER_NAMES`, those naming a key the command
    reads), a key of the same section first on a tie, then the shorter (a misspelt `clip_range`, TRL's name, means
    `ppo.clip`); within a third of the name's length. Else the closest whole key by `difflib`, the command's own
    first; None when nothing is close."""
    section, _, leaf = key.rpartition(".")
    own = cmd.section or ""
    lr = f"{own}.lr" if f"{own}.lr" in keys else f"{own}.actor_lr" if f"{own}.actor_lr" in keys else None
    peers = {name: (lr if target == "{section}.lr" else target) for name, target in PEER_NAMES.items()}
    mine = [k for k in keys if k.split(".")[0] in cmd.reads]
    candidates = [(k.rsplit(".", 1)[-1], k) for k in mine] + [(n, t) for n, t in peers.items()
                                                               if t in keys and t.split(".")[0] in cmd.reads]
    scored = sorted((edit_distance(leaf.lower(), name), not k.startswith(section + "."), len(k), k)
                    for name, k in candidates)
    if scored and scored[0][0] <= max(1, len(leaf) // 3):
        return scored[0][3]
    close = (difflib.get_close_matches(key, mine, n=1, cutoff=0.6)
             or difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6))
    return close[0] if close else None


_TYPE_WORDS = {"Float": "a float", "Integer": "an integer"}
# OmegaConf's messages for a value a typed key refuses -> what to say after the key's name
_VALUE_ERRORS = (
    (r"Value '(.*)' of type '\w+' could not be converted to (\w+)",
     lambda key, got, kind: f"must be {_TYPE_WORDS.get(kind, kind.lower())} (got '{got}')"),
    (r"Value '(.*)' is not a valid bool", lambda key, got: f"must be true or false (got '{got}')"),
    (r"Invalid type assigned: \w+ is not a subclass of \w+\. value: (.*)",
     lambda key, got: f"is a section of keys, not a value (got '{got}'): set {key}.<key>=<value>"),
    (r"Cannot convert '\w+' to string: '(.*)'", lambda key, got: f"must be a string (got {got})"),
    (r"Invalid value assigned: \w+ is not a ListConfig, list or tuple",
     lambda key: f"must be a list in brackets, e.g. {key}=[a,b]"),
)


def explain_composition_error(e: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for an error Hydra or OmegaConf raised composing a command's config from its overrides:
    `rm.lr must be a float (got 'abc')`, `no model option 'tinyy' (hf, smollm2, tiny)`, a value with an unquoted
    comma, an override that does not parse (named, found among `overrides`). Anything else: its first line."""
    cause = e.__cause__ or e
    text = str(getattr(cause, "msg", None) or cause).strip()
    first = text.splitlines()[0] if text else type(cause).__name__
    key = getattr(cause, "full_key", None)
    if key in _REPLACED:  # an experiment file that still sets it
        return _REPLACED[key]
    if key:
        for pattern, say in _VALUE_ERRORS:
            m = re.match(pattern, first)
            if m:
                return f"{key} {say(key, *m.groups())}"
        return f"{key}: {first}"
    missing, options = getattr(e, "missing_cfg_file", None), getattr(e, "options", None)
    if missing and "/" in str(missing):
        group, name = str(missing).rsplit("/", 1)
        return f"no {group} option '{name}'" + (f" ({', '.join(options)})" if options else "")
    m = re.match(r"Ambiguous value for argument '([^=]+)=(.*)'$", first)
    if m:
        k, v = m.groups()
        return (f"{k}: the value '{v}' holds a comma, which Hydra reads as a list or a sweep; quote it inside the "
                f"override to keep it as text: \"{k}='{v}'\"")
    if type(e).__name__ == "OverrideParseException":
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser, bad = OverridesParser.create(), "an override"
        for ov in overrides:
            try:
                parser.parse_override(ov)
            except Exception:  # noqa: BLE001 - the one that does not parse
                bad = f"'{ov}'"
                break
        return f"{bad} does not parse as an override ({first}); quote a value holding []{{}}(),=' characters"
    return first


def _check_command_reads(cmd: Command, key: str, keys: dict[str, bool]) -> str | None:
    """Raise ConfigError when `key` (given on the command line) is a key `cmd` does not read, naming what
    the user probably meant (`rlhf train-ppo policy.path=...` -> `model.name_or_path`); for a harmless switch
    (a section in `_HARMLESS`) return a warning line instead. None when the command reads it."""
    section = key.split(".")[0]
    if section in cmd.reads or section not in keys:
        return None
    if section in _HARMLESS:
        return f"{key} has no effect in `{cmd.invocation}` (it writes no training metrics)"
    readers = [c.name for c in COMMANDS.values() if section in c.reads]
    meant = cmd.meant.get(key) or cmd.meant.get(section)
    if meant is not None and "." not in meant:  # a section: its key of the same name, if any
        leaf = key.split(".", 1)[1] if "." in key else ""
        meant = f"{meant}.{leaf}" if f"{meant}.{leaf}" in keys else f"one of the {meant}.* keys"
    if meant is None:
        leaf = key.split(".")[-1]
        mine = [k for k in keys if k.split(".")[0] in cmd.reads]
        close = difflib.get_close_matches(leaf, [k.split(".")[-1] for k in mine], n=1, cutoff=0.8)
        meant = next((k for k in mine if close and k.split(".")[-1] == close[0]), None)
    raise ConfigError(f"`{cmd.invocation}` does not read {key} (" + (f"an `rlhf {' / '.join(readers)}` key" if readers
                      else "no command reads it") + ")" + (f"; did you mean {meant}?" if meant else "")
                      + f" (`{cmd.invocation} --help` lists the keys it reads)")
