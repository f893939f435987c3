"""Run directories, atomic files, pointer files, metrics (JSONL and the trackers of `logger`) and console progress.

Layout shared by every stage::

    <paths.root>/<stage>/<run-id>/        one per start (multirun: <stage>/sweep-<time>/<job num>/)
        config.yaml                       the resolved config
        .hydra/                           Hydra's composed config and overrides
        <command>.log                     the log
        metrics.jsonl                     one JSON object per logged step
        tb/, wandb/                       TensorBoard event files, wandb's local files (with those loggers)
        trackers.json                     the wandb, mlflow and trackio runs it logs to, reopened on resume
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


POINTER_PREFIX = "latest_"
"""Every pointer file's name starts with it (`latest_rm`, `latest_sft`, ...: `commands.Command.pointer`)."""


def pointer_target(path: Path | str) -> Path | None:
    """The path a pointer file names (`<root>/latest_sft` holds the absolute path of a `final/` dir), whether or
    not that path exists now; None when `path` is no pointer file: not a file, not named `latest_*`, over 4 KiB,
    or not text. The one reader of pointer files: the loaders, lineage and eval all ask it."""
    p = Path(os.path.expanduser(str(path)))
    if not (p.name.startswith(POINTER_PREFIX) and p.is_file()) or p.stat().st_size > 4096:
        return None
    try:
        text = p.read_text().strip()
    except (UnicodeDecodeError, ValueError):
        return None
    return Path(text) if text else None  # an empty file names nothing (`Path("")` would be the current dir)


def read_pointer(root: Path | str, stage: str) -> Path | None:
    """The existing target of run kind `stage`'s pointer under `root`, or None (no pointer, or its target is
    gone)."""
    name = by_kind(stage).pointer
    target = pointer_target(Path(root) / name) if name else None
    return target if target is not None and target.exists() else None


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
    is found there). `start` opens the tracker's run (or reopens the one an earlier start of the run dir
    recorded) and raises when it cannot; `log` sends one step's metrics (finite floats, the names of
    metrics.jsonl); `resume` brings it level with metrics.jsonl after a resume; `close` finishes the run with
    its status (`finished`, `failed`, `killed`).

    A tracker that can reopen its run returns what it needs from `record` (kept in `<run dir>/trackers.json`)
    and sets `reopened` when `start` reopened one; it cannot remove a value once logged, so `held` says what the
    reopened run already holds, and `send` never logs a metric again at a step it holds."""

    reopened = False
    """Whether `start` reopened the run `record` named (else: a new run)."""
    reopen_error: str | None = None
    """Why the recorded run could not be reopened (`start` then opened a new one); None otherwise."""
    skip: dict[str, int] = {}
    """After `resume`: the last step at which the reopened run holds each metric (`send` leaves those out)."""

    def start(self, run: TrackerRun, record: dict[str, Any] | None = None) -> None:
        raise NotImplementedError

    def record(self) -> dict[str, Any] | None:
        """What reopens this tracker's run at a later start of the run dir (JSON); None: a new run every start."""
        return None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def send(self, step: int, metrics: dict[str, float]) -> None:
        """`log`, without the metrics the reopened run already holds at `step` (see `resume`)."""
        metrics = {k: v for k, v in metrics.items() if step > self.skip.get(k, -1)}
        if metrics:
            self.log(step, metrics)

    def held(self, logged: list[dict[str, Any]]) -> dict[str, int]:
        """The last step at which the reopened run holds each metric, read back from the tracker. The default:
        what metrics.jsonl's records `logged` by the earlier starts say it was sent."""
        last: dict[str, int] = {}
        for rec in logged:
            for k in _scalars(rec):
                last[k] = max(last.get(k, -1), int(rec["step"]))
        return last

    def resume(self, step: int, kept: list[dict[str, Any]], logged: list[dict[str, Any]], name: str) -> str:
        """After a resume from the checkpoint at `step`, bring the tracker level with metrics.jsonl, whose
        records `kept` (steps <= `step`) stay and whose later ones (the interrupted attempt's: `logged` holds
        them all) this attempt logs again. Returns the one line that says what the tracker did.

        A reopened run keeps what it holds (`held`): the kept records it lacks are sent, and `send` leaves out
        the later steps it holds, which keep the interrupted attempt's values (the tracker cannot remove them;
        a second value would make two rows of one step). A new run gets every kept record."""
        ident = ", ".join(f"{k} {v}" for k, v in (self.record() or {}).items() if k not in ("project", "tracking_uri"))
        if self.reopened:
            self.skip = self.held(logged)
        for rec in kept:
            self.send(int(rec["step"]), _scalars(rec))
        if not self.reopened:
            why = self.reopen_error or (f"no earlier run of it is recorded in {TRACKER_FILE}" if self.record()
                                        else "it cannot reopen a run")
            return (f"logger {name}: {why}: started a new run ({ident or 'no id'}) and replayed steps 1..{step} "
                    f"of metrics.jsonl into it")
        last = max(self.skip.values(), default=step)
        if last <= step:
            return f"logger {name}: resumed its run ({ident}) at step {step}"
        return (f"logger {name}: resumed its run ({ident}) at step {step}; it keeps the interrupted attempt's "
                f"steps {step + 1}..{last} ({self.cannot}) and gets this attempt's steps from {last + 1} "
                f"(metrics.jsonl holds this attempt's steps {step + 1}..{last})")

    cannot = "it cannot remove a logged value"
    """Why a reopened run keeps the interrupted attempt's steps after the checkpoint (the resume line)."""

    def close(self, status: str = "finished") -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in `<run dir>/tb/` (torch.utils.tensorboard); the config as text under the tag `config`.
    A resumed run writes into the same dir (nothing to record)."""

    def start(self, run: TrackerRun, record: dict[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(run.run_dir / "tb")
        self.writer = SummaryWriter(log_dir=self.log_dir)
        text = json.dumps(run.config, indent=2, default=str)
        self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))  # a markdown code block

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def resume(self, step: int, kept: list[dict[str, Any]], logged: list[dict[str, Any]], name: str) -> str:
        """The same `tb/` dir holds the earlier starts' events: TensorBoard's `purge_step` hides those after the
        checkpoint, so the curves continue from `step` without a second copy: the steps after it are replaced."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step + 1)
        self.reopened = True
        return f"logger {name}: resumed in {self.log_dir} at step {step} (the later steps' events are purged)"

    def close(self, status: str = "finished") -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A wandb run (files under `<run dir>/wandb/`); offline when the user sets WANDB_MODE=offline (`wandb sync`
    uploads it later). The config is the run's config. A resumed run reopens the recorded run id in the same
    project (`wandb.init(id=..., resume="allow")`; offline: a new `offline-run-*-<id>` dir that `wandb sync`
    appends to that run). wandb drops a resumed run's steps at or below its last one, so those keep the
    interrupted attempt's values; what it was sent is read from metrics.jsonl (an offline run cannot be asked)."""

    cannot = "wandb drops a resumed run's steps at or below its last one"

    def start(self, run: TrackerRun, record: dict[str, Any] | None = None) -> None:
        import wandb

        self.project = run.project
        again = {}
        if record and record.get("project") == run.project:
            again, self.reopened = {"id": record["run_id"], "resume": "allow"}, True
        elif record:
            self.reopen_error = f"its recorded run is in project {record.get('project')!r}, not {run.project!r}"
        self.run = wandb.init(project=run.project, name=run.name, group=run.group, config=run.config,
                              dir=str(run.run_dir), **again)
        if again and self.run.id != record["run_id"]:
            self.reopened, self.reopen_error = False, f"wandb gave run id {self.run.id}, not {record['run_id']}"

    def record(self) -> dict[str, Any] | None:
        return {"run_id": self.run.id, "project": self.project}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)  # wandb marks a non-zero exit `failed`


class MlflowTracker(Tracker):
    """An mlflow run in the experiment `tracker.project`, tagged `sweep=<group>`; the config's leaves are its
    params (dotted keys, values cut to mlflow's length limit). A resumed run reopens the recorded run id
    (`mlflow.start_run(run_id=...)`) when the experiment and tracking URI are the recorded ones; mlflow cannot
    delete a logged value (a second one at a step makes a second point), so the steps the run holds (its metric
    histories) are not logged again, and params keep their first values (mlflow cannot change a param)."""

    def start(self, run: TrackerRun, record: dict[str, Any] | None = None) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        if run.mlflow_tracking_uri:
            mlflow.set_tracking_uri(run.mlflow_tracking_uri)
        self.project, self.uri = run.project, mlflow.get_tracking_uri()
        experiment = mlflow.set_experiment(run.project)
        params = {k: str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in leaves(run.config).items()}
        if record and (record.get("project"), record.get("tracking_uri")) == (run.project, self.uri):
            try:
                self.run = mlflow.start_run(run_id=record["run_id"])
            except Exception as e:  # noqa: BLE001 - deleted, or another store: a new run, said by `resume`
                self.reopen_error = f"could not reopen run {record['run_id']} ({_reason(e)})"
            else:
                self.reopened = True
                params = {k: v for k, v in params.items() if k not in self.run.data.params}
        elif record:
            self.reopen_error = (f"its recorded run is in experiment {record.get('project')!r} at "
                                 f"{record.get('tracking_uri')}, not {run.project!r} at {self.uri}")
        if not self.reopened:
            self.run = mlflow.start_run(run_name=run.name, experiment_id=experiment.experiment_id,
                                        tags={"sweep": run.group} if run.group else None)
        mlflow.log_params(params)

    def record(self) -> dict[str, Any] | None:
        return {"run_id": self.run.info.run_id, "project": self.project, "tracking_uri": self.uri}

    def held(self, logged: list[dict[str, Any]]) -> dict[str, int]:
        """Each metric's last step in the run's own histories (what it holds, whatever reached it)."""
        from mlflow import MlflowClient

        client, run_id = MlflowClient(self.uri), self.run.info.run_id
        return {key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1)
                for key in client.get_run(run_id).data.metrics}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import mlflow

        mlflow.log_metrics(metrics, step=step, run_id=self.run.info.run_id)

    def close(self, status: str = "finished") -> None:
        import mlflow

        mlflow.end_run(status=status.upper())  # FINISHED, FAILED, KILLED: mlflow's RunStatus names


class TrackioTracker(Tracker):
    """A trackio run (a local SQLite database under TRACKIO_DIR, by default ~/.cache/huggingface/trackio; no
    dashboard is started: `trackio show` opens one). A resumed run reopens the recorded run by its name
    (`trackio.init(name=..., resume="must")`, trackio's only way) and checks its id; trackio cannot delete a
    logged value, so the steps the run holds (its stored logs) are not logged again."""

    def start(self, run: TrackerRun, record: dict[str, Any] | None = None) -> None:
        import trackio

        self.project = run.project
        group = {"group": run.group} if run.group else {}  # older trackio has no groups
        if record and record.get("project") == run.project:
            try:
                self.run = trackio.init(project=run.project, name=record["name"], config=run.config, embed=False,
                                        resume="must", **group)
            except Exception as e:  # noqa: BLE001 - deleted: a new run, said by `resume`
                self.reopen_error = f"could not reopen run {record['name']!r} ({_reason(e)})"
            else:
                self.reopened = self.run.id == record["run_id"]
                if not self.reopened:
                    self.reopen_error = (f"its run named {record['name']!r} is now {self.run.id}, not "
                                         f"{record['run_id']}")
                    self.run.finish()
        elif record:
            self.reopen_error = f"its recorded run is in project {record.get('project')!r}, not {run.project!r}"
        if not self.reopened:
            self.run = trackio.init(project=run.project, name=run.name, config=run.config, embed=False, **group)

    def record(self) -> dict[str, Any] | None:
        return {"name": self.run.name, "run_id": self.run.id, "project": self.project}

    def held(self, logged: list[dict[str, Any]]) -> dict[str, int]:
        """Each metric's last step in the run's stored logs (what it holds, whatever reached it)."""
        from trackio.sqlite_storage import SQLiteStorage

        last: dict[str, int] = {}
        for row in SQLiteStorage.get_logs(self.project, run_id=self.run.id):
            for k in row:
                if k not in ("step", "timestamp"):
                    last[k] = max(last.get(k, -1), int(row["step"]))
        return last

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


TRACKER_FILE = "trackers.json"
"""The run dir's record of its trackers' runs ({logger name: `Tracker.record()`}), read by a resumed run's start."""

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
        records_path = Path(run_dir) / TRACKER_FILE
        recorded = json.loads(records_path.read_text()) if records_path.is_file() else {}
        for name in dict.fromkeys(n for n in loggers if n != "jsonl"):  # in order, once each
            adapter = TRACKERS[name]()
            try:
                adapter.start(run, recorded.get(name))
            except Exception as e:  # noqa: BLE001 - a tracker that does not start never stops the run
                hint = f"; pip install -e '.[{name}]' adds it" if isinstance(e, ImportError) else ""
                log.warning("logger %s: %s (%s%s); the run goes on without it", name,
                            "not installed" if isinstance(e, ImportError) else "did not start", _reason(e), hint)
                _release(adapter)
            else:
                self.trackers[name] = adapter
        records = {**recorded, **{n: a.record() for n, a in self.trackers.items() if a.record() is not None}}
        if records != recorded:
            atomic_write_json(records_path, records)
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
                adapter.send(int(step), scalars)
            except Exception as e:  # noqa: BLE001 - a tracker that breaks is dropped, the run goes on
                log.warning("logger %s: failed at step %d (%s); the run goes on without it", name, step, _reason(e))
                del self.trackers[name]
                _release(adapter)

    def truncate_after(self, step: int) -> None:
        """After resuming from a checkpoint taken at `step`: drop metrics.jsonl's records past `step` (this
        attempt logs those steps again), and bring each tracker level with it, saying in one line what it did
        (`Tracker.resume`: TensorBoard purges the later events of its `tb/` dir; wandb, mlflow and trackio reopen
        the run of `trackers.json` and keep the steps it holds; a tracker without one starts a new run and gets
        the kept records replayed)."""
        if not self.enabled:
            return
        logged = read_metrics(self.path)
        kept = [rec for rec in logged if rec.get("step", 0) <= step]
        if self.path.is_file():
            atomic_write_text(self.path, "".join(json.dumps(rec) + "\n" for rec in kept))
        for name, adapter in list(self.trackers.items()):
            try:
                line = adapter.resume(step, kept, logged, name)
                (log.info if adapter.reopened else log.warning)(line)
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


PROGRESS_LABELS = {"objective/kl": "kl_k1"}
"""A metric's label in the progress line where its last name part would hide what it is: `objective/kl` is the k1
estimate, which a small sample can make negative (its k3, `objective/kl_k3`, never is)."""


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
            stats = " ".join(f"{PROGRESS_LABELS.get(k, k.split('/')[-1])}={metrics[k]:.4g}" for k in self.keys
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
