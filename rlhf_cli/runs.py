"""Run directories, atomic files, pointer files, metrics (JSONL and the trackers of `logger`) and console progress.

Layout shared by every stage::

    <paths.root>/<stage>/<run-id>/        one per start (multirun: <stage>/sweep-<time>/<job num>/)
        config.yaml                       the resolved config
        .hydra/                           Hydra's composed config and overrides
        <command>.log                     the log
        metrics.jsonl                     one JSON object per logged step
        tb/, wandb/                       TensorBoard event files, wandb's local files (with those loggers)
        ds/<tag>/                         DeepSpeed checkpoints (every rank writes its shard)
        ds/latest                         tag of the newest complete DeepSpeed checkpoint (atomic)
        final/                            the HF-format model for the next stage
        status.json                       {"state": "running" | "finished" | "failed" | "aborted" | "dry_run", ...}
    <paths.root>/latest_rm, latest_policy pointer files (absolute path of a `final/` dir), atomic
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli.commands import by_kind
from rlhf_cli.config import TrackerConfig, leaves
from rlhf_cli.errors import SaveError

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------------------------
# atomic files


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide run files from other users
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_pointer(root: Path | str, stage: str, final_dir: Path | str) -> Path:
    """Atomically point `<root>/latest_rm` (or latest_policy) at `final_dir`; returns the pointer path.
    Raises SaveError when it cannot be written (the old pointer is then unchanged)."""
    name = by_kind(stage).pointer
    if name is None:
        raise ValueError(f"runs of kind {stage!r} have no pointer (commands.Command.pointer)")
    pointer = Path(root) / name
    try:
        atomic_write_text(pointer, str(Path(final_dir).resolve()) + "\n")
    except OSError as e:
        raise save_error(f"the pointer {pointer.name}", pointer, e) from e
    return pointer


def read_pointer(root: Path | str, stage: str) -> Path | None:
    name = by_kind(stage).pointer
    pointer = Path(root) / name if name else None
    if pointer is None or not pointer.is_file():
        return None
    target = Path(pointer.read_text().strip())
    return target if target.exists() else None


def check_writable(path: Path | str) -> None:
    """Fail before training when the output dir cannot be made or written: creates it (and its
    parents), then creates and removes a probe file in it. Raises PermissionError (a user error: one
    line, exit status 2) naming the dir, the reason and the fix."""
    path = Path(path)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PermissionError(f"output dir '{path}' cannot be created: '{blocker}' is a file, not a directory "
                              f"(set paths.root to a writable directory)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise PermissionError(f"output dir '{path}' is not writable: {e.strerror or e} "
                              f"(set paths.root to a writable directory)") from None


_SAVE_FIXES = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free disk quota",
               errno.EROFS: "move paths.root to a writable file system", errno.EACCES: "fix the permissions"}


def save_error(what: str, path: Path | str, cause: OSError) -> SaveError:
    """A SaveError for a failed write of `what` at `path`, e.g.

        could not write the final model at runs/rm/x/final: No space left on device; nothing was replaced
        (free disk space, then rerun with resume=true)
    """
    fix = _SAVE_FIXES.get(cause.errno, "fix the cause")
    reason = cause.strerror or (os.strerror(cause.errno) if cause.errno else str(cause))
    err = SaveError(f"could not write {what} at {path}: {reason}; nothing was replaced "
                    f"({fix}, then rerun with resume=true)")
    err.errno = cause.errno
    return err


# ----------------------------------------------------------------------------------------------
# run status and resume


def set_status(run_dir: Path | str, state: str, **extra: Any) -> None:
    atomic_write_json(Path(run_dir) / "status.json", {"state": state, "time": time.time(), **extra})


def get_status(run_dir: Path | str) -> dict[str, Any]:
    p = Path(run_dir) / "status.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def stage_runs(root: Path | str, stage: str) -> list[Path]:
    """All run dirs of a stage (plain runs and multirun jobs), oldest first by start time."""
    base = Path(root) / stage
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir() if p.is_dir() and not p.name.startswith("sweep-")]
    for sweep in base.glob("sweep-*"):
        runs += [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    runs = [p for p in runs if (p / "config.yaml").is_file()]
    return sorted(runs, key=lambda p: (p / "config.yaml").stat().st_mtime)


def find_resumable(root: Path | str, stage: str, need_checkpoint: bool = True) -> Path | None:
    """Newest run of `stage` under `root` that is still `running` (it was interrupted or killed: a run that
    failed is marked `failed`, see `lifecycle.mark_failed`) and, with `need_checkpoint`, has a committed
    checkpoint to continue from (`ds/latest`); None when there is none."""
    unfinished = [p for p in stage_runs(root, stage) if get_status(p).get("state") == "running"
                  and (not need_checkpoint or latest_tag(p) is not None)]
    return unfinished[-1] if unfinished else None


def ckpt_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ds"


def latest_tag(run_dir: Path) -> str | None:
    """Tag of the newest complete DeepSpeed checkpoint of a run (written only after a save completes)."""
    p = ckpt_dir(run_dir) / "latest"
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    return tag if (ckpt_dir(run_dir) / tag).is_dir() else None


# ----------------------------------------------------------------------------------------------
# metrics


def abs_path(path: str | None) -> str | None:
    """`path` made absolute when it exists locally (recorded in a model's config so that a later stage finds
    it from any working directory); a hub id or None unchanged."""
    if path is None:
        return None
    p = Path(path)
    return str(p.resolve()) if p.exists() else path


def append_samples(run_dir: Path, iteration: int, samples: dict[str, Any]) -> None:
    """Append one iteration's sampled responses to `run_dir/samples.jsonl`, a JSON line per response:
    {"iteration", "prompt", "response", "score"}. `samples` holds equal-length lists under "prompts",
    "responses" and "scores"."""
    with open(run_dir / "samples.jsonl", "a") as fh:
        for prompt, resp, score in zip(samples["prompts"], samples["responses"], samples["scores"]):
            fh.write(json.dumps({"iteration": iteration, "prompt": prompt, "response": resp, "score": score}) + "\n")
    log.info("sample (iteration %d, score %.3f): %r", iteration, samples["scores"][0], samples["responses"][0][:200])


def sweep_name(run_dir: Path | str) -> str | None:
    """The sweep dir's name (`sweep-<time>`) when `run_dir` is one job of a sweep (`<stage>/sweep-<time>/<job>`),
    else None."""
    parent = Path(run_dir).parent.name
    return parent if parent.startswith("sweep-") else None


@dataclass
class TrackerRun:
    """What every tracker is told about the run it records (`tracker.*` resolved against the run dir)."""

    run_dir: Path
    """Where local files go: TensorBoard's `tb/`, wandb's `wandb/`."""
    project: str
    """`tracker.project`: wandb project, mlflow experiment, trackio project."""
    name: str
    """`tracker.name`, or the run dir's name."""
    group: str | None
    """`tracker.group`, or the sweep dir's name for a sweep job, or None."""
    config: dict[str, Any]
    """The resolved config, nested as config.yaml."""
    mlflow_tracking_uri: str | None
    """`tracker.mlflow_tracking_uri`; None leaves mlflow's own choice (MLFLOW_TRACKING_URI, else its default)."""


class Tracker:
    """One tracker of `logger=[...]`, driven through its own library (imported in `start`, so a missing one
    is found there). `start` opens the tracker's run and raises when it cannot; `log` sends one step's metrics
    (finite floats, the names of metrics.jsonl); `resume` brings a new start of a resumed run level with
    metrics.jsonl; `close` finishes the run with its status (`finished`, `failed`, `killed`)."""

    def start(self, run: TrackerRun) -> None:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def resume(self, step: int, records: list[dict[str, float]]) -> None:
        """After a resume from the checkpoint at `step`: this start is a new run in the tracker, so the records
        metrics.jsonl keeps (steps <= `step`) are replayed into it."""
        for rec in records:
            self.log(int(rec["step"]), _scalars(rec))

    def close(self, status: str = "finished") -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in `<run dir>/tb/` (torch.utils.tensorboard); the config as text under the tag `config`."""

    def start(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(run.run_dir / "tb")
        self.writer = SummaryWriter(log_dir=self.log_dir)
        text = json.dumps(run.config, indent=2, default=str)
        self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))  # a markdown code block

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def resume(self, step: int, records: list[dict[str, float]]) -> None:
        """The same `tb/` dir holds the earlier starts' events: TensorBoard's `purge_step` hides those after the
        checkpoint, so the curves continue from `step` without a second copy."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step + 1)

    def close(self, status: str = "finished") -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A wandb run (files under `<run dir>/wandb/`); offline when the user sets WANDB_MODE=offline (`wandb sync`
    uploads it later). The config is the run's config."""

    def start(self, run: TrackerRun) -> None:
        import wandb

        self.run = wandb.init(project=run.project, name=run.name, group=run.group, config=run.config,
                              dir=str(run.run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)  # wandb marks a non-zero exit `failed`


class MlflowTracker(Tracker):
    """An mlflow run in the experiment `tracker.project`, tagged `sweep=<group>`; the config's leaves are its
    params (dotted keys, values cut to mlflow's length limit)."""

    def start(self, run: TrackerRun) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        if run.mlflow_tracking_uri:
            mlflow.set_tracking_uri(run.mlflow_tracking_uri)
        mlflow.set_experiment(run.project)
        self.run = mlflow.start_run(run_name=run.name, tags={"sweep": run.group} if run.group else None)
        mlflow.log_params({k: str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in leaves(run.config).items()})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import mlflow

        mlflow.log_metrics(metrics, step=step, run_id=self.run.info.run_id)

    def close(self, status: str = "finished") -> None:
        import mlflow

        mlflow.end_run(status=status.upper())  # FINISHED, FAILED, KILLED: mlflow's RunStatus names


class TrackioTracker(Tracker):
    """A trackio run (a local SQLite database under TRACKIO_DIR, by default ~/.cache/huggingface/trackio; no
    dashboard is started: `trackio show` opens one)."""

    def start(self, run: TrackerRun) -> None:
        import trackio

        group = {"group": run.group} if run.group else {}  # older trackio has no groups
        self.run = trackio.init(project=run.project, name=run.name, config=run.config, embed=False, **group)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str = "finished") -> None:
        self.run.finish()  # trackio records no run status


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MlflowTracker, "trackio": TrackioTracker}
"""The trackers `logger` may name besides `jsonl` (config.LOGGERS); each is installed by the extra of its name."""


def _release(adapter: Tracker) -> None:
    """Close a tracker that failed (so a half-opened run does not block the next one, e.g. mlflow's active run);
    it has already been reported, so a second failure here is ignored."""
    with contextlib.suppress(Exception):
        adapter.close("failed")


def _scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The metrics of a metrics.jsonl record that trackers take: its finite numbers, without `step` and `time`."""
    return {k: float(v) for k, v in rec.items() if k not in ("step", "time") and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


_OPEN: list[MetricsLogger] = []
"""The loggers whose trackers are open, for `close_open_loggers`."""


def close_open_loggers(status: str) -> None:
    """Finish the trackers of every logger still open, with `status` (`failed`, `killed`): the command line calls
    this when a run stops on an error or Ctrl-C, so that the trackers record it as such (mlflow would otherwise
    mark it FINISHED at exit)."""
    for logger in list(_OPEN):
        logger.close(status)


def _reason(e: BaseException) -> str:
    """An exception as one line: `Type: first line of its message`."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class MetricsLogger:
    """Append metrics to `<run_dir>/metrics.jsonl` and send them to the trackers of `logger`; rank 0 only.

    Each record is `{"step": int, "time": float, <name>: float, ...}`; non-finite floats are written
    as null so the file stays valid JSON. Every tracker gets the same names with their finite values at `step`.
    A tracker that is not installed or does not start, or that fails while logging, is reported in one
    warning and left out; metrics.jsonl gets every record regardless.

    loggers: `logger` (`jsonl` is always on); tracker: the `tracker.*` section (default: config.TrackerConfig's
    defaults); config: the resolved config (nested dict), the trackers' run parameters.
    """

    def __init__(self, run_dir: Path | str, enabled: bool = True, loggers: Sequence[str] = ("jsonl",),
                 tracker: Any = None, config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.trackers: dict[str, Tracker] = {}
        if not enabled:
            return
        tracker = tracker if tracker is not None else TrackerConfig()
        run = TrackerRun(run_dir=Path(run_dir), project=tracker.project, name=tracker.name or Path(run_dir).name,
                         group=tracker.group or sweep_name(run_dir), config=config or {},
                         mlflow_tracking_uri=tracker.mlflow_tracking_uri)
        for name in dict.fromkeys(n for n in loggers if n != "jsonl"):  # in order, once each
            adapter = TRACKERS[name]()
            try:
                adapter.start(run)
            except Exception as e:  # noqa: BLE001 - a tracker that does not start never stops the run
                hint = f"; pip install -e '.[{name}]' adds it" if isinstance(e, ImportError) else ""
                log.warning("logger %s: %s (%s%s); the run goes on without it", name,
                            "not installed" if isinstance(e, ImportError) else "did not start", _reason(e), hint)
                _release(adapter)
            else:
                self.trackers[name] = adapter
        if self.trackers:
            _OPEN.append(self)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec: dict[str, Any] = {"step": int(step), "time": time.time()}
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                rec[k] = float(v) if math.isfinite(float(v)) else None
            else:
                rec[k] = v
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        scalars = _scalars(rec)
        for name, adapter in list(self.trackers.items()):
            try:
                adapter.log(int(step), scalars)
            except Exception as e:  # noqa: BLE001 - a tracker that breaks is dropped, the run goes on
                log.warning("logger %s: failed at step %d (%s); the run goes on without it", name, step, _reason(e))
                del self.trackers[name]
                _release(adapter)

    def truncate_after(self, step: int) -> None:
        """After resuming from a checkpoint taken at `step`: drop metrics.jsonl's records past `step`, and bring
        each tracker level with it (`Tracker.resume`: TensorBoard purges the later events of its `tb/` dir; a
        resumed run is a new run in wandb, mlflow and trackio, and gets the kept records replayed)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]
        kept = [rec for rec in kept if rec.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(rec) + "\n" for rec in kept))
        for name, adapter in list(self.trackers.items()):
            try:
                adapter.resume(step, kept)
            except Exception as e:  # noqa: BLE001 - as in `log`: the tracker is dropped, the run goes on
                log.warning("logger %s: failed to resume at step %d (%s); the run goes on without it", name, step,
                            _reason(e))
                del self.trackers[name]
                _release(adapter)

    def close(self, status: str = "finished") -> None:
        """Finish every tracker's run with `status` (`finished`, `failed`, `killed`); a failure is one warning."""
        for name, adapter in self.trackers.items():
            try:
                adapter.close(status)
            except Exception as e:  # noqa: BLE001 - the metrics are in metrics.jsonl either way
                log.warning("logger %s: did not close cleanly (%s)", name, _reason(e))
        self.trackers = {}
        if self in _OPEN:
            _OPEN.remove(self)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Records of a metrics JSONL file (a run dir or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


# ----------------------------------------------------------------------------------------------
# console progress


class Progress:
    """A rich progress bar with ETA showing the latest few metrics; silent on ranks other than 0."""

    def __init__(self, total: int, description: str, keys: list[str], enabled: bool = True, start: int = 0) -> None:
        self.enabled = enabled
        self.keys = keys
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._p = RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
            transient=False,
        )
        self._task = self._p.add_task(description, total=total, completed=start, stats="")
        # without a terminal (a log file, CI) a live bar draws nothing until the end: log lines instead
        self._lines = not self._p.console.is_terminal
        self._desc, self._total, self._start, self._done, self._t0 = description, total, start, start, time.time()
        if not self._lines:
            self._p.start()

    def update(self, advance: int = 1, metrics: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        stats = ""
        if metrics:
            stats = " ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in self.keys
                             if isinstance(metrics.get(k), (int, float)))
        self._p.update(self._task, advance=advance, stats=stats)
        if self._lines:
            self._done += advance
            elapsed = time.time() - self._t0
            eta = elapsed / max(self._done - self._start, 1e-9) * (self._total - self._done)
            log.info("%s %d/%d  %s  elapsed %.0fs eta %.0fs", self._desc, self._done, self._total, stats, elapsed, eta)

    def close(self) -> None:
        if self.enabled and not self._lines:
            self._p.stop()
