"""Reading a run dir: its metrics records, overrides, config and reward lists (no plotting, no HTML)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from rlhf_cli.commands import COMMANDS, kinds
from rlhf_cli.runs import read_metrics

log = logging.getLogger(__name__)

Records = list[dict[str, Any]]


class UnreadableFile(ValueError):
    """A file of a run that the report cannot parse; the message names the file (and the line)."""


def parse_json(path: Path) -> Any:
    """The JSON document in `path`. Raises UnreadableFile naming the file when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UnreadableFile(f"{path}: not valid JSON ({e})") from None


def parse_jsonl(path: Path, torn_last_ok: bool = False, what: str = "a JSON value") -> list[Any]:
    """One JSON value per non-blank line of `path`. Raises UnreadableFile naming the file and line ("not `what`").
    With `torn_last_ok`, an unparsable last line (a run still writing) is dropped with a warning instead."""
    lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    out = []
    for i, ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError as e:
            if torn_last_ok and i == lines[-1][0]:
                log.warning("%s: line %d is incomplete (run still writing?); ignored", path, i)
                break
            raise UnreadableFile(f"{path}, line {i}: not {what} ({e})") from None
    return out


def parse_yaml(path: Path) -> Any:
    """The YAML document in `path`. Raises UnreadableFile naming the file when it is not YAML."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UnreadableFile(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


def is_run_dir(path: Path | str) -> bool:
    """True when `path` holds a `metrics.jsonl` (a training or eval run dir)."""
    return (Path(path) / "metrics.jsonl").is_file()


def job_dirs(sweep: Path | str) -> list[Path]:
    """The run dirs directly under a sweep dir, in job order (`0, 1, ..., 10`, then other names)."""
    sweep = Path(sweep)
    if not sweep.is_dir():
        return []
    jobs = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".") and is_run_dir(p)]
    return sorted(jobs, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def run_stage(run_dir: Path | str, records: Records | None = None) -> str:
    """The run-dir kind (`rm`, `ppo`, `eval`: `commands.kinds()`) from the run dir's place (`<stage>/<run>` or
    `<stage>/sweep-*/<job>`), else from the metric names (`commands.Command.metric_prefixes`: `rm/...` → rm,
    `objective/...` → ppo), else `""`."""
    run_dir = Path(run_dir).resolve()
    parent = run_dir.parent
    stage = parent.parent.name if parent.name.startswith("sweep-") else parent.name
    if stage in kinds():
        return stage
    names = set().union(*(r.keys() for r in records or []))
    for c in COMMANDS.values():
        if c.metric_prefixes and any(n.startswith(c.metric_prefixes) for n in names):
            return c.kind
    return ""


def load_records(run_dir: Path | str) -> Records:
    """The records of `<run_dir>/metrics.jsonl`, tolerating a torn last line (a run still writing), with old metric
    names read under today's (`renamed`).

    Raises UnreadableFile (a ValueError) naming the file and line when any other line is not JSON.
    """
    path = Path(run_dir) / "metrics.jsonl"
    try:
        records = read_metrics(path)
    except ValueError:
        records = parse_jsonl(path, torn_last_ok=True, what="a JSON object")
    return renamed(records, run_stage(run_dir, records))


def renamed(records: Records, kind: str) -> Records:
    """`records` of a run of kind `kind` with each metric renamed since it was written under today's name
    (`commands.Command.renamed_metrics`: `lr` -> `rm/lr` for a train-rm run), so an old run reads like a new one.
    A record holding both names keeps today's value."""
    renames = next((c.renamed_metrics for c in COMMANDS.values() if c.kind == kind), {})
    if not renames or not any(old in r for r in records for old in renames):
        return records
    return [{**{renames.get(k, k): v for k, v in r.items()}, **{k: v for k, v in r.items() if k in renames.values()}}
            for r in records]


def read_overrides(run_dir: Path | str) -> dict[str, str]:
    """The command-line overrides of a run, `{key: value}`, from `.hydra/overrides.yaml`.

    `+key=v` / `++key=v` count as `key`; a deletion `~key` maps to `"~"`; `hydra.*` keys are dropped.
    Empty when the file is missing.
    """
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    items = parse_yaml(path) or []
    if not isinstance(items, list):
        raise UnreadableFile(f"{path}: not a list of overrides")
    out: dict[str, str] = {}
    for item in items:
        item = str(item)
        if item.startswith("~"):
            key, value = item[1:].split("=", 1)[0], "~"
        else:
            key, _, value = item.partition("=")
        key = key.lstrip("+")
        if not key.startswith("hydra."):
            out[key] = value
    return out


def read_config(run_dir: Path | str) -> dict[str, Any]:
    """The resolved run config (`config.yaml`) as plain dicts; empty when missing."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    cfg = parse_yaml(path)
    return cfg if isinstance(cfg, dict) else {}


def read_rewards(run_dir: Path | str) -> dict[str, list[float]]:
    """The reward lists of `<run_dir>/rewards.json` (`chosen`/`rejected` or `policy`/`reference`);
    keys whose value is not a list of numbers are dropped, nulls and non-finite values removed."""
    path = Path(run_dir) / "rewards.json"
    if not path.is_file():
        return {}
    obj = parse_json(path)
    out = {}
    for k, v in (obj.items() if isinstance(obj, dict) else []):
        if isinstance(v, list) and v and all(is_num(x) or x is None for x in v):
            vals = [float(x) for x in v if is_num(x) and math.isfinite(x)]
            if vals:
                out[k] = vals
    return out


def metric_names(records: Records) -> list[str]:
    """Numeric metric names in order of first appearance, each `eval/k` placed right after `k`."""
    seen: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", "time") and (is_num(v) or v is None):
                seen.setdefault(k, None)
    names = list(seen)
    ordered = [n for n in names if not (n.startswith("eval/") and n[5:] in seen)]
    out = []
    for n in ordered:
        out.append(n)
        if "eval/" + n in seen:
            out.append("eval/" + n)
    return out


def series(records: Records, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping records without it and null / non-finite values."""
    xs, ys = [], []
    for r in records:
        v = r.get(name)
        if is_num(v) and math.isfinite(v):
            xs.append(int(r.get("step", len(xs))))
            ys.append(float(v))
    return xs, ys


def final_metrics(records: Records) -> dict[str, dict[str, Any]]:
    """Per metric: the last non-null value, the step it was logged at, and min/max over the run."""
    out = {}
    for name in metric_names(records):
        xs, ys = series(records, name)
        out[name] = ({"final": ys[-1], "step": xs[-1], "min": min(ys), "max": max(ys)} if ys
                     else {"final": None, "step": None, "min": None, "max": None})
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested config dict; a list (or other non-scalar) leaf as its JSON text."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj if obj is None or isinstance(obj, (int, float, str)) else json.dumps(obj)}


def config_rows(cfg: dict[str, Any], stage: str) -> list[list[Any]]:
    """Flattened `key, value` rows of the config of a run of kind `stage`, without the other training commands'
    own sections (`commands.Command.section`)."""
    skip = ({c.section for c in COMMANDS.values() if c.trains}
            - {c.section for c in COMMANDS.values() if c.kind == stage})
    return [[k, v] for k, v in flatten({k: v for k, v in cfg.items() if k not in skip}).items()]


def is_num(v: Any) -> bool:
    """A real number (int or float, not bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)

