"""What a run came from: its data files (with their hashes and row counts) and its parent runs, recorded so that a
resume, a later stage and `rlhf eval` rely on the record instead of today's command line.

Files (rank 0 writes them):

    <run dir>/lineage.json          written when the stage has loaded its data (and checked again on resume)
    <run dir>/final/rlhf_lineage.json  the same record beside the model (`lifecycle.finish_run` copies it)
    <run dir>/final/rlhf_config.yaml   the run's resolved config beside the model

    {"stage": "rm" | "ppo" | "eval", "run_dir": <absolute>,
     "data": {"config": {data.* with absolute paths},
              "files": [{"path": <absolute>, "sha256": <hex>, "bytes": <int>}, ...]   (none for the built-in task;
                        a hub dataset: {"path": <name>, "split": <split>, "sha256": null}),
              "summary": {"rows_read", "kept": {split: n}, "dropped": {reason: n}, "unused", ...}},
     "parents": {<role>: {"path": <absolute or hub id>, "stage", "run_dir", "data_files",
                          "typed": <the pointer or run dir it was given as, when it was one>}}}

Roles: `model` (the weights a stage started from), `reference`, `reward_model`, `policy`. A parent that is not
the output of one of our runs (a hub id, a GGUF file) is recorded by its path alone.

    record(run_dir, cfg, stage, summary, parents)  lineage.json; a resume with a changed data file is refused
    read(model_dir)                                 the record beside a model, or None
    recorded_config(model_dir)                      the resolved config of the run that wrote a model, or None
    eval_data(data_cfg, model_dir, given)           the data an eval of that model reads by default
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf_cli.errors import ConfigError
from rlhf_cli.runs import abs_path, atomic_write_json, pointer_target

FILE = "lineage.json"
MODEL_FILE = "rlhf_lineage.json"
CONFIG_FILE = "rlhf_config.yaml"
DATA_PATH_KEYS = ("path", "eval_path")


# ----------------------------------------------------------------------------------------------
# data files


def fingerprint(path: str, split: str = "train") -> dict[str, Any]:
    """{"path", "sha256", "bytes"} of a local data file, or of a local dataset directory (its files' hashes,
    hashed in path order); {"path", "split", "sha256": None} for a hub dataset name."""
    local = Path(os.path.expanduser(path))
    if local.is_file():
        return {"path": str(local.resolve()), "sha256": _sha256(local), "bytes": local.stat().st_size}
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
        digest = hashlib.sha256()
        for p in files:
            digest.update(f"{p.relative_to(local)}\0{_sha256(p)}\n".encode())
        size = sum(p.stat().st_size for p in files)
        return {"path": str(local.resolve()), "sha256": digest.hexdigest(), "bytes": size}
    return {"path": path, "split": split, "sha256": None}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_files(data_cfg: Any) -> list[dict[str, Any]]:
    """Fingerprints of `data.path` and `data.eval_path` (none for the built-in task)."""
    return [fingerprint(str(data_cfg[k]), data_cfg.split) for k in DATA_PATH_KEYS if data_cfg.get(k)]


def _changed(recorded: Iterable[Mapping[str, Any]], now: Iterable[Mapping[str, Any]]) -> list[str]:
    """'<path> (sha256 <old>… recorded, <new>… now)' for every recorded local file whose hash differs today."""
    today = {f["path"]: f for f in now}
    out = []
    for f in recorded:
        if f.get("sha256") is None:
            continue
        new = today.get(f["path"]) or fingerprint(f["path"])
        if new.get("sha256") != f["sha256"]:
            now_hash = f"{new['sha256'][:12]}…" if new.get("sha256") else "missing"
            out.append(f"{f['path']} (sha256 {f['sha256'][:12]}… recorded, {now_hash} now)")
    return out


# ----------------------------------------------------------------------------------------------
# records


def _data_config(data_cfg: Any) -> dict[str, Any]:
    data = OmegaConf.to_container(data_cfg, resolve=True)
    for k in DATA_PATH_KEYS:
        data[k] = abs_path(data[k])
    return data


def parent(path: str | None) -> dict[str, Any] | None:
    """A parent model as recorded: its absolute path, plus the stage, run dir and data files of the run that
    wrote it when it is one of ours."""
    if not path:
        return None
    entry: dict[str, Any] = {"path": abs_path(str(path))}
    rec = read(path)
    if rec is not None:
        entry.update(stage=rec.get("stage"), run_dir=rec.get("run_dir"),
                     data_files=rec.get("data", {}).get("files", []))
    return entry


def record(run_dir: Path, cfg: Any, stage: str, summary: Any, parents: Mapping[str, str | None],
           write: bool = True) -> dict[str, Any]:
    """The run's lineage, written to `run_dir/lineage.json` when `write` (rank 0); every rank calls this once the
    stage has loaded its data, so that all of them check a resume.

    `summary` is the load's `data.DataSummary`; `parents` maps a role to the model path the stage loaded
    (None: not used). When the run is resumed (`cfg.resume`), its data files must be the ones it started on.

    Raises:
        ConfigError: resuming, a recorded data file's sha256 differs today (one line naming the file).
    """
    files = data_files(cfg.data)
    old = read_run(run_dir)
    if cfg.get("resume") and old is not None:
        changed = _changed(old.get("data", {}).get("files", []), files)
        if changed:
            raise ConfigError(f"resume={run_dir}: the data changed since the run started: {'; '.join(changed)} "
                              f"(a resumed run keeps its data; start a new run to train on the new file)")
    rec = {
        "stage": stage, "run_dir": str(Path(run_dir).resolve()),
        "data": {"config": _data_config(cfg.data), "files": files, "summary": summary.to_dict()},
        "parents": {role: p for role, path in parents.items() if (p := parent(path)) is not None},
    }
    given = OmegaConf.select(cfg, "paths.typed") or {}
    typed = {abs_path(str(OmegaConf.select(cfg, k))): v for k, v in given.items() if OmegaConf.select(cfg, k)}
    for entry in rec["parents"].values():  # the pointer or run dir a parent was given as, next to what it named
        if entry["path"] in typed:
            entry["typed"] = typed[entry["path"]]
    if write:
        atomic_write_json(Path(run_dir) / FILE, rec)
    return rec


def read_run(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _model_dir(path: str | os.PathLike) -> Path | None:
    """A local model dir given as itself, its run dir (`final/` under it) or a pointer file."""
    p = Path(os.path.expanduser(str(path)))
    p = pointer_target(p) or p
    if (p / "final").is_dir():
        p = p / "final"
    return p if p.is_dir() else None


def read(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The lineage beside a model (`final/rlhf_lineage.json`), or None for a model no run of ours wrote."""
    d = _model_dir(model_dir)
    path = d / MODEL_FILE if d is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def recorded_config(model_dir: str | os.PathLike) -> Any | None:
    """The resolved config of the run that wrote a model (`final/rlhf_config.yaml`, else the run dir's
    `config.yaml` above `final/`), or None."""
    d = _model_dir(model_dir)
    if d is None:
        return None
    for path in (d / CONFIG_FILE, d.parent / "config.yaml" if d.name == "final" else None):
        if path is not None and path.is_file():
            return OmegaConf.load(path)
    return None


# ----------------------------------------------------------------------------------------------
# model paths: resolved once, at start

MODEL_PATH_KEYS = {"model.name_or_path": "model", "model.tokenizer": "model", "reference.path": "reference",
                   "reward_model.path": "reward_model", "reward.teacher.path": "teacher", "policy.path": "policy"}
"""The config keys that name a model (or its tokenizer) -> the lineage role of the model they name."""


def resolve_model_path(value: str) -> str:
    """The model dir `value` names now, absolute: a pointer file's target (`runs/latest_sft`: the `final/` dir it
    names), a run dir's `final/`, any other local path made absolute; a hub id, a `pkg:` GGUF spec or a path that
    does not exist unchanged (the loaders and the preflight checks say what is wrong with those)."""
    p = Path(os.path.expanduser(value))
    if not p.exists():
        return value
    if (target := pointer_target(p)) is not None and target.exists():
        p = target
    if p.is_dir() and (p / "final" / "config.json").is_file():
        p = p / "final"
    return str(p.resolve())


def resolve_model_paths(cfg: Any, run_dir: Path | None = None) -> dict[str, str]:
    """Resolve, in place, every model path key of `cfg` (`MODEL_PATH_KEYS`) that names a pointer file, a run dir
    or a relative path to the absolute dir it names now (`resolve_model_path`), and record each value as typed
    (made absolute) in `cfg.paths.typed` (`{"model.name_or_path": "/home/me/runs/latest_sft"}`), so the run's
    config.yaml, its lineage and an eval of its model read the run it started from even after a later run moves
    the pointer.

    A resumed run (`cfg.resume`, with `run_dir` the run being continued) keeps what it recorded: the typed values
    of its config.yaml, and for a pointer recorded before these were resolved (an older run), the run dir its
    `lineage.json` says that pointer named when the run started. Returns {key: value as typed, absolute} of this
    call."""
    typed = dict(OmegaConf.select(cfg, "paths.typed") or {})
    old = read_run(run_dir) if run_dir is not None and cfg.get("resume") else None
    found: dict[str, str] = {}
    for key, role in MODEL_PATH_KEYS.items():
        value = OmegaConf.select(cfg, key)
        if not value:
            continue
        resolved = _recorded_target(old, role, str(value)) or resolve_model_path(str(value))
        if resolved != str(value):
            OmegaConf.update(cfg, key, resolved, merge=False)
            found[key] = os.path.abspath(os.path.expanduser(str(value)))
    if run_dir is not None and cfg.get("resume") and (Path(run_dir) / "config.yaml").is_file():
        recorded = OmegaConf.load(Path(run_dir) / "config.yaml")
        typed = {**dict(OmegaConf.select(recorded, "paths.typed") or {}), **typed}
    typed.update(found)
    if "paths" in cfg:
        cfg.paths.typed = typed
    return found


def _recorded_target(rec: Mapping[str, Any] | None, role: str, value: str) -> str | None:
    """The `final/` dir of the run a pointer `value` named when the run of lineage record `rec` started (its parent
    of `role`), for a record written before model paths were resolved at start; None otherwise."""
    parent_rec = ((rec or {}).get("parents") or {}).get(role) or {}
    p = Path(os.path.expanduser(value))
    if pointer_target(p) is None or parent_rec.get("path") != str(p.resolve()):
        return None
    run = parent_rec.get("run_dir")
    return str(Path(run) / "final") if run and (Path(run) / "final").is_dir() else None


def recorded_model_dir(model_dir: str | os.PathLike, roles: Iterable[str], value: str) -> str | None:
    """The `final/` dir that the pointer `value` named when the run that wrote `model_dir` started, from that run's
    lineage (its parent of the first of `roles` that records `value`): for records older than model paths resolved
    at start, whose config names the pointer itself. None when `value` is no pointer or nothing records it."""
    rec = read(model_dir)
    return next((d for role in roles if (d := _recorded_target(rec, role, value)) is not None), None)


def moved_pointers(model_dir: str | os.PathLike) -> list[str]:
    """For the model at `model_dir`: one line for each pointer its run was started with (`paths.typed` of its
    recorded config) that names another model today than the one the run resolved it to, e.g. `runs/latest_sft
    named .../sft/A/final when this model was trained (model.name_or_path); it now names .../sft/B/final`."""
    rec_cfg = recorded_config(model_dir)
    if rec_cfg is None:
        return []
    lines = []
    for key, typed in dict(OmegaConf.select(rec_cfg, "paths.typed") or {}).items():
        then, now = OmegaConf.select(rec_cfg, key), resolve_model_path(str(typed))
        if then and now != then and pointer_target(str(typed)) is not None:
            lines.append(f"{typed} named {then} when {model_dir} was trained ({key}); it now names {now}")
    return lines


# ----------------------------------------------------------------------------------------------
# eval's default data


def eval_data(data_cfg: Any, model_dir: str | os.PathLike, given: Iterable[str]) -> tuple[Any, str | None]:
    """The `data` section `rlhf eval` reads for the model at `model_dir`: the data it was trained on, unless this
    command chose another source.

    `data_cfg` is the composed section and `given` the keys named on the command line (`data.test_size`, or the
    group `data`). The source is chosen when `data.path` is set (by the command line or an experiment preset) or
    named on the command line (`data.path=null` asks for the built-in task). A chosen file that is not the recorded
    source is evaluated whole (its `data.eval_path` unless one is set: no training split to hold out of it).
    Unless it was chosen and differs from the recorded source, the recorded section is used, with the command
    line's other `data.*` values on top (e.g. `data.test_size=0.2`, or `data.eval_path=<a held-out file>`), so the
    held-out split is the run's own: same file, seed and rows. A model no run of ours wrote, or an older record
    whose relative path is not found from here: `data_cfg`. Returns (data section, a line for the console saying
    which data and why; None when nothing was recorded). A recorded file that changed since is named in that line
    (its held-out rows may differ).
    """
    rec_cfg = recorded_config(model_dir)
    if rec_cfg is None or "data" not in rec_cfg:
        return data_cfg, None
    rec = read(model_dir) or {}
    recorded = OmegaConf.create(rec.get("data", {}).get("config") or OmegaConf.to_container(rec_cfg.data))
    given = [k.removeprefix("data.") for k in given if k == "data" or k.startswith("data.")]
    if data_cfg.get("eval_path") and "eval_path" not in given:  # set by a preset or an in-process caller
        given.append("eval_path")
    chosen = "data" in given or "path" in given or data_cfg.get("path") is not None
    where = recorded.get("path") or "the built-in task"
    if chosen and not _same_path(data_cfg.get("path"), recorded.get("path")):
        if data_cfg.get("path") and not data_cfg.get("eval_path"):  # not the model's data: all of it is held out
            data_cfg = OmegaConf.merge(data_cfg, {"eval_path": data_cfg.path})
            return data_cfg, (f"data: {data_cfg.path} as set, not the model's training data ({where}): all of it is "
                              f"evaluated (data.eval_path), up to eval.num_prompts")
        return data_cfg, (f"data: {data_cfg.path or 'the built-in task'} as set, not the model's training data "
                          f"({where})")
    relative = [recorded[k] for k in DATA_PATH_KEYS if recorded.get(k) and not Path(str(recorded[k])).is_absolute()
                and not Path(os.path.expanduser(str(recorded[k]))).exists()]
    if relative:  # an older record, relative to a working directory we cannot know
        return data_cfg, (f"data: the model's recorded data.path {relative[0]} is relative and not found from here; "
                          f"reading {data_cfg.path or 'the built-in task'} as set (give data.path=...)")
    try:
        merged = OmegaConf.merge(data_cfg, recorded)
    except Exception as e:  # noqa: BLE001 - a record today's schema rejects (an older version's)
        return data_cfg, (f"data: the model's recorded data section is not valid today ({type(e).__name__}); "
                          f"reading {data_cfg.path or 'the built-in task'} as set")
    for k in given:
        if k not in ("data", "path"):
            OmegaConf.update(merged, k, OmegaConf.select(data_cfg, k), merge=False)
    changed = _changed(rec.get("data", {}).get("files", []), data_files(merged))
    note = f"data: the model's training data ({where}, data.seed={merged.seed}, its held-out split)"
    if changed:
        note += f"; changed since it was trained: {'; '.join(changed)}: the held-out rows may differ"
    return merged, note


def _same_path(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs_path(str(a)) == abs_path(str(b))
