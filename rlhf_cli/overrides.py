"""The command line's keys and Hydra's errors, before a stage runs: an override's key must be one of the schema's
(`config.RunConfig`) and one its command reads (`commands.Command.reads`), with the closest key suggested; and
Hydra's or OmegaConf's composition errors said in one line.

    check_override_keys(config_name, overrides) -> warnings   raises ConfigError (one line)
    explain_composition_error(e, overrides) -> str            one line for a composition error
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from rlhf_cli.commands import COMMANDS, Command, by_config
from rlhf_cli.config import CONFIG_GROUPS, RunConfig, schema_keys
from rlhf_cli.errors import ConfigError

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
        known = (key.split("@")[0] in groups or key in keys  # a key under an open dict (deepspeed.extra.*) is fine
                 or any(key.startswith(k + ".") and is_dict for k, is_dict in keys.items()))
        if known:
            ignored = _check_command_reads(cmd, key.split("@")[0], keys)
            if ignored:
                warnings.append(ignored)
            continue
        if key in _REPLACED:
            raise ConfigError(_REPLACED[key])
        mine = [k for k in keys if k.split(".")[0] in cmd.reads]  # the command's own first
        close = (difflib.get_close_matches(key, mine, n=1, cutoff=0.5)
                 or difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5))
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown config key '{key}' for `{cmd.invocation}`{hint} "
                          f"(`{cmd.invocation} --cfg job` lists every key)")
    return warnings


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
