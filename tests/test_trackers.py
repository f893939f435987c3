"""The trackers of `logger=[...]` (runs.MetricsLogger): each one, offline, holds the metric names and values of
metrics.jsonl, read back from its own store; a tracker that is missing, does not start or breaks is one warning
and metrics.jsonl still gets every record; ranks other than 0 start nothing; a sweep job is grouped by its sweep.

A tracker whose library is not installed is skipped here, but fails under CI (CI=true), which installs them all
(`.ci/run`: `pip install -e '.[trackers]'`)."""

import importlib.util
import json
import logging
import os
import struct
import subprocess
import sys

import pytest
from stage_helpers import REPO, compose, require, subprocess_env

from rlhf_cli import runs
from rlhf_cli.config import LOGGERS, TrackerConfig
from rlhf_cli.report.read import load_records, series
from rlhf_cli.runs import TRACKERS, MetricsLogger, Tracker, read_metrics

# named like the real records; a NaN (written as null) and a text value reach no tracker
STEPS = [
    (1, {"rm/loss": 0.6931, "objective/kl": 0.0, "lr": 1e-5, "grad_norm": 2.5}),
    (2, {"rm/loss": 0.61, "objective/kl": 0.013, "lr": 2e-5, "grad_norm": float("nan"), "note": "text"}),
    (3, {"rm/loss": 0.55, "objective/kl": 0.021, "lr": 3e-5, "grad_norm": 1.25, "epoch": 1}),
]
CONFIG = {"rm": {"lr": 1e-5, "betas": [0.9, 0.95], "max_steps": None}, "model": {"name": "tiny"}, "seed": 42}
SWEEP = "sweep-20261201-010101-000001"


def need(module: str) -> None:
    require(importlib.util.find_spec(module) is not None, f"{module} is not installed (pip install -e '.[trackers]')")


def log_steps(run_dir, tracker_name, tracker=None):
    """Run a MetricsLogger with logger=[jsonl, <tracker_name>] over STEPS; returns metrics.jsonl's series."""
    run_dir.mkdir(parents=True, exist_ok=True)  # as prepare_run_dir leaves it
    logger = MetricsLogger(run_dir, loggers=["jsonl", tracker_name], tracker=tracker or TrackerConfig(), config=CONFIG)
    assert list(logger.trackers) == [tracker_name]  # it started
    for step, metrics in STEPS:
        logger.log(step, metrics)
    logger.close()
    return jsonl_series(run_dir)


def jsonl_series(run_dir):
    """{metric: [(step, value), ...]} of metrics.jsonl's numbers (nulls left out): what each tracker must hold."""
    out = {}
    for rec in read_metrics(run_dir):
        for name, value in rec.items():
            if name not in ("step", "time") and isinstance(value, float):
                out.setdefault(name, []).append((rec["step"], value))
    return out


def assert_same_series(got, expected, rel=1e-12):
    assert sorted(got) == sorted(expected) == ["epoch", "grad_norm", "lr", "objective/kl", "rm/loss"]
    for name, points in expected.items():
        assert [s for s, _ in got[name]] == [s for s, _ in points], name
        assert [v for _, v in got[name]] == pytest.approx([v for _, v in points], rel=rel), name


def test_the_trackers_are_the_loggers_config_allows():
    assert set(LOGGERS) == {"jsonl", *TRACKERS}


def test_tensorboard_event_files_hold_the_jsonl_metrics(tmp_path):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = log_steps(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert_same_series(got, expected, rel=1e-6)  # TensorBoard stores float32
    assert "config/text_summary" in events.Tags()["tensors"]


def wandb_records(path):
    """wandb's protobuf records (wandb.proto.wandb_internal_pb2.Record) of an offline run's `.wandb` file.

    wandb >= 0.19 writes the file from its Go core and ships no Python reader, so the framing is read here:
    LevelDB's log format after a 7-byte file header (`:W&B`, magic, version): 32 KiB blocks of chunks, each
    chunk crc32c (4 bytes), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = path.read_bytes(), 32768, 7, []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the next block
            pos += block - pos % block
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def test_wandb_offline_run_holds_the_jsonl_metrics_config_and_sweep_group(tmp_path, monkeypatch):
    need("wandb")
    for var, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_DIR", str(tmp_path)),
                       ("WANDB_CONFIG_DIR", str(tmp_path / "config")), ("WANDB_CACHE_DIR", str(tmp_path / "cache"))):
        monkeypatch.setenv(var, value)
    run_dir = tmp_path / "rm" / SWEEP / "1"
    expected = log_steps(run_dir, "wandb")
    import wandb

    # `finish()` can return before wandb's service process has written the run's records (the file then holds its
    # 7-byte header alone: 3 of 6 reads in a row here); a process's exit flushes them, and so does tearing the
    # service down, which this test, reading the file from the process that wrote it, must do first
    wandb.teardown()
    (file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    got, config, run = {}, {}, None
    for record in wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for name, value in items.items():
                if not name.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    got.setdefault(name, []).append((record.history.step.num, float(value)))
    assert_same_series(got, expected)
    assert (run.project, run.display_name, run.run_group) == ("rlhf_cli", "1", SWEEP)
    assert {k: config[k] for k in CONFIG} == CONFIG


@pytest.fixture
def mlflow_uri(monkeypatch):
    """mlflow installed; its process-wide tracking URI (which the tracker sets, and mlflow copies into
    MLFLOW_TRACKING_URI) is reset after the test."""
    need("mlflow")
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored after the reset below
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 opens a `file:` store only with it
    yield
    mlflow.end_run()  # a test that failed half-way leaves its run active (mlflow would end it at exit, elsewhere)
    mlflow.set_tracking_uri(None)


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_mlflow_run_holds_the_jsonl_metrics_and_the_config_as_params(tmp_path, mlflow_uri, store):
    """sqlite: mlflow's default store since mlflow 3 (the `mlflow` extra brings sqlalchemy for it); file: the
    `file:` store."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else f"file:{tmp_path / 'mlruns'}"
    run_dir = tmp_path / "rm" / SWEEP / "0"
    expected = log_steps(run_dir, "mlflow", TrackerConfig(project="rlhf-test", mlflow_tracking_uri=uri))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf-test").experiment_id])
    got = {name: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, name),
                                                        key=lambda m: m.step)]
           for name in run.data.metrics}
    assert_same_series(got, expected)
    assert (run.info.run_name, run.info.status, run.data.tags["sweep"]) == ("0", "FINISHED", SWEEP)
    assert run.data.params == {"rm.lr": "1e-05", "rm.betas": "[0.9, 0.95]", "rm.max_steps": "None",
                               "model.name": "tiny", "seed": "42"}


def test_mlflow_params_are_cut_to_mlflows_length_limit(tmp_path, mlflow_uri):
    from mlflow import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MetricsLogger(tmp_path, loggers=["mlflow"], tracker=TrackerConfig(mlflow_tracking_uri=uri),
                           config={"data": {"system_prompt": "x" * (MAX_PARAM_VAL_LENGTH + 10)}})
    assert list(logger.trackers) == ["mlflow"]  # a longer value would make log_params raise
    logger.close()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf_cli").experiment_id])
    assert run.data.params["data.system_prompt"] == "x" * MAX_PARAM_VAL_LENGTH


TRACKIO_CHILD = """
import json, sys
from pathlib import Path
from rlhf_cli.config import TrackerConfig
from rlhf_cli.runs import MetricsLogger
from trackio.api import Api
from trackio.sqlite_storage import SQLiteStorage

steps, config = json.loads(sys.argv[2]), json.loads(sys.argv[3])
logger = MetricsLogger(Path(sys.argv[1]), loggers=["jsonl", "trackio"], tracker=TrackerConfig(), config=config)
assert list(logger.trackers) == ["trackio"]
run_id = logger.trackers["trackio"].run.id
for step, metrics in steps:
    logger.log(step, metrics)
logger.close()
(run,) = [r for r in Api().runs("rlhf_cli") if r.id == run_id]
stored = {"name": run.name, "config": run.config, "logs": SQLiteStorage.get_logs("rlhf_cli", run_id=run_id)}
Path(sys.argv[4]).write_text(json.dumps(stored))  # not stdout: trackio prints there
"""


def test_trackio_run_holds_the_jsonl_metrics_config_and_sweep_group(tmp_path):
    """In a child process: trackio reads TRACKIO_DIR (its local database's dir) when it is first imported."""
    need("trackio")
    run_dir = tmp_path / "rm" / SWEEP / "2"
    run_dir.mkdir(parents=True)
    steps = [(s, {k: v for k, v in m.items() if v == v}) for s, m in STEPS]  # JSON has no NaN: the child gets none
    out = subprocess.run([sys.executable, "-c", TRACKIO_CHILD, str(run_dir), json.dumps(steps), json.dumps(CONFIG),
                          str(tmp_path / "stored.json")], env=subprocess_env(TRACKIO_DIR=str(tmp_path / "trackio")),
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    stored = json.loads((tmp_path / "stored.json").read_text())
    got = {}
    for row in stored["logs"]:
        for name, value in row.items():
            if name not in ("step", "timestamp"):
                got.setdefault(name, []).append((row["step"], value))
    assert_same_series(got, jsonl_series(run_dir))
    assert stored["name"] == "2" and stored["config"]["_Group"] == SWEEP
    assert {k: stored["config"][k] for k in CONFIG} == CONFIG
    assert (tmp_path / "trackio" / "rlhf_cli.db").is_file()  # nothing written outside TRACKIO_DIR's store


class Recording(Tracker):
    """A stand-in tracker: records what it was given; fails in `log` at `fail_at` (a step)."""

    started, fail_at = [], None

    def start(self, run, record=None):
        Recording.started.append(run)
        self.steps, self.closed = [], False

    def log(self, step, metrics):
        if step == Recording.fail_at:
            raise ConnectionError("server went away\nsecond line")
        self.steps.append((step, metrics))

    def close(self, status="finished"):
        self.closed = status


@pytest.fixture
def recording(monkeypatch):
    """`tensorboard` played by Recording (no library needed)."""
    monkeypatch.setattr(Recording, "started", [])
    monkeypatch.setattr(Recording, "fail_at", None)
    monkeypatch.setitem(runs.TRACKERS, "tensorboard", Recording)
    return Recording


def test_every_tracker_gets_the_finite_numbers_of_the_jsonl_record(tmp_path, recording):
    logger = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard", "tensorboard"], config=CONFIG)
    assert len(recording.started) == 1  # named twice, started once
    for step, metrics in STEPS:
        logger.log(step, metrics)
    adapter = logger.trackers["tensorboard"]
    logger.close()
    assert adapter.closed == "finished" and logger.trackers == {}
    assert adapter.steps[1] == (2, {"rm/loss": 0.61, "objective/kl": 0.013, "lr": 2e-5})  # no NaN, no text
    got = {}
    for step, metrics in adapter.steps:
        for name, value in metrics.items():
            got.setdefault(name, []).append((step, value))
    assert_same_series(got, jsonl_series(tmp_path))
    assert recording.started[0].config == CONFIG


def test_ranks_other_than_0_start_no_tracker_and_write_nothing(tmp_path, recording):
    logger = MetricsLogger(tmp_path / "run", enabled=False, loggers=["jsonl", "tensorboard"], config=CONFIG)
    for step, metrics in STEPS:
        logger.log(step, metrics)
    logger.close()
    assert recording.started == [] and not (tmp_path / "run").exists()


def test_a_sweep_job_is_grouped_by_its_sweep_and_named_by_its_dir(tmp_path, recording):
    MetricsLogger(tmp_path / "rm" / SWEEP / "3", loggers=["tensorboard"])
    MetricsLogger(tmp_path / "rm" / "20261201-010101-000001", loggers=["tensorboard"])
    MetricsLogger(tmp_path / "rm" / SWEEP / "4", loggers=["tensorboard"],
                  tracker=TrackerConfig(project="p", name="lr-1e-5", group="my-sweep"))
    sweep_job, plain, named = recording.started
    assert (sweep_job.project, sweep_job.name, sweep_job.group) == ("rlhf_cli", "3", SWEEP)
    assert (plain.name, plain.group) == ("20261201-010101-000001", None)
    assert (named.project, named.name, named.group) == ("p", "lr-1e-5", "my-sweep")


def test_a_tracker_that_is_not_installed_is_one_warning_and_jsonl_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.runs"):
        logger = MetricsLogger(tmp_path, loggers=["jsonl", "wandb"], config=CONFIG)
        for step, metrics in STEPS:
            logger.log(step, metrics)
        logger.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("logger wandb: not installed (ModuleNotFoundError: ")
    assert line.endswith("; pip install -e '.[wandb]' adds it); the run goes on without it")
    assert logger.trackers == {} and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_tracker_that_does_not_start_is_one_warning(tmp_path, mlflow_uri, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.runs"):
        logger = MetricsLogger(tmp_path, loggers=["jsonl", "mlflow"],
                               tracker=TrackerConfig(mlflow_tracking_uri="nosuchscheme://x"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("logger mlflow: did not start (") and line.endswith("); the run goes on without it")
    assert "\n" not in line and logger.trackers == {}


def test_a_tracker_that_fails_while_logging_is_dropped_after_one_warning(tmp_path, recording, caplog):
    recording.fail_at = 2
    logger = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], config=CONFIG)
    adapter = logger.trackers["tensorboard"]
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.runs"):
        for step, metrics in STEPS:
            logger.log(step, metrics)
    assert [r.getMessage() for r in caplog.records] == [
        "logger tensorboard: failed at step 2 (ConnectionError: server went away); the run goes on without it"]
    assert adapter.closed and [s for s, _ in adapter.steps] == [1] and logger.trackers == {}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_resumed_run_may_change_its_loggers(tmp_path):
    from omegaconf import OmegaConf

    from rlhf_cli.lifecycle import resume_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose("train_rm", ["model=tiny"]), resolve=True))
    cfg = compose("train_rm", ["model=tiny", "logger=[jsonl,tensorboard]", "tracker.project=other"])
    assert resume_config(cfg, run, ["model", "logger", "tracker.project"]) == []
    assert list(cfg.logger) == ["jsonl", "tensorboard"] and cfg.tracker.project == "other"


def test_train_rm_logs_to_tensorboard_from_the_command_line(tmp_path):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "train-rm", "experiment=smoke", "rm.max_steps=2",
                          "logger=[jsonl,tensorboard]", f"paths.root={tmp_path}"], cwd=REPO,
                         env=subprocess_env(HYDRA_FULL_ERROR="0"), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = (tmp_path / "rm").iterdir()
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = jsonl_series(run_dir)
    assert {"rm/loss", "rm/accuracy", "rm/lr", "eval/rm/accuracy"} <= set(expected) and sorted(got) == sorted(expected)
    for name, points in expected.items():
        assert got[name] == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], name
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"max_steps": 2' in config_text and os.path.isfile(run_dir / "config.yaml")


def test_a_tracker_that_cannot_reopen_its_run_says_so_and_replays_the_kept_records(tmp_path, recording, caplog):
    first = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], config=CONFIG)
    for step, metrics in STEPS:
        first.log(step, metrics)
    # the process dies after step 3; the run resumes from the checkpoint at step 2
    again = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], config=CONFIG)
    with caplog.at_level(logging.INFO, logger="rlhf_cli.runs"):
        again.truncate_after(2)
    again.log(3, {"rm/loss": 0.5})
    adapter = again.trackers["tensorboard"]
    assert [s for s, _ in adapter.steps] == [1, 2, 3]  # level with metrics.jsonl: kept records, then the new step
    assert adapter.steps[0][1] == {"rm/loss": 0.6931, "objective/kl": 0.0, "lr": 1e-5, "grad_norm": 2.5}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "logger tensorboard: it cannot reopen a run: started a new run (no id) and replayed steps 1..2 "
                    "of metrics.jsonl into it")]
    assert not (tmp_path / runs.TRACKER_FILE).exists()  # nothing to reopen, nothing recorded


def test_a_resumed_run_continues_tensorboards_curves_without_the_steps_after_the_checkpoint(tmp_path):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], config=CONFIG)
    for step, metrics in STEPS:
        first.log(step, metrics)
    first.close()
    again = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], config=CONFIG)
    again.truncate_after(2)
    again.log(3, {"rm/loss": 0.5})
    again.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("rm/loss")] == [(1, 0.6931), (2, 0.61), (3, 0.5)]


def test_a_run_that_stops_on_an_error_closes_its_trackers_as_failed(tmp_path, recording, mlflow_uri):
    from mlflow import MlflowClient

    from rlhf_cli.runs import close_open_loggers

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard", "mlflow"], config=CONFIG,
                           tracker=TrackerConfig(project="rlhf-fail", mlflow_tracking_uri=uri))
    logger.log(1, {"rm/loss": 0.7})
    adapter = logger.trackers["tensorboard"]
    close_open_loggers("failed")  # what the command line does when a stage raises
    assert adapter.closed == "failed" and logger.trackers == {}
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf-fail").experiment_id])
    assert run.info.status == "FAILED"
    close_open_loggers("failed")  # nothing left open: a no-op


# ----------------------------------------------------------------------------------------------
# a resumed run continues the same tracker run: one run id, one value per step and metric

def ours(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rlhf_cli.runs"]


def resume_after_kill(run_dir, tracker_name, tracker=None):
    """The interrupted attempt: a logger over STEPS (1..3), left open as a kill leaves it (the caller ends the
    tracker's run as the kill would); returns it. The tests then resume from a checkpoint at step 1 or 2."""
    run_dir.mkdir(parents=True, exist_ok=True)
    first = MetricsLogger(run_dir, loggers=["jsonl", tracker_name], tracker=tracker or TrackerConfig(), config=CONFIG)
    for step, metrics in STEPS:
        first.log(step, metrics)
    runs._OPEN.remove(first)  # a killed process closes nothing; this one finishes the run as a kill would leave it
    return first


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_mlflow_resume_reopens_the_run_and_holds_one_value_per_step(tmp_path, mlflow_uri, store, caplog):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else f"file:{tmp_path / 'mlruns'}"
    cfg = TrackerConfig(project="rlhf-resume", mlflow_tracking_uri=uri)
    first = resume_after_kill(tmp_path / "run", "mlflow", cfg)
    run_id = first.trackers["mlflow"].run.info.run_id
    mlflow.end_run(status="KILLED")  # the active run of this process; a killed process leaves it RUNNING
    assert json.loads((tmp_path / "run" / runs.TRACKER_FILE).read_text())["mlflow"]["run_id"] == run_id

    again = MetricsLogger(tmp_path / "run", loggers=["jsonl", "mlflow"], tracker=cfg,
                          config={**CONFIG, "rm": {**CONFIG["rm"], "max_steps": 4}})  # a changed param
    with caplog.at_level(logging.INFO, logger="rlhf_cli.runs"):
        again.truncate_after(1)
    for step in (2, 3, 4):
        again.log(step, {"rm/loss": 0.1 * step, "lr": 1e-6})
    again.close()
    assert ours(caplog) == [
        f"logger mlflow: resumed its run (run_id {run_id}) at step 1; it keeps the interrupted attempt's steps 2..3 "
        "(it cannot remove a logged value) and gets this attempt's steps from 4 (metrics.jsonl holds this "
        "attempt's steps 2..3)"]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf-resume").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    history = {k: [(m.step, round(m.value, 6)) for m in sorted(client.get_metric_history(run_id, k),
                                                               key=lambda m: m.step)] for k in run.data.metrics}
    assert history["rm/loss"] == [(1, 0.6931), (2, 0.61), (3, 0.55), (4, 0.4)]  # one value per step, no gap
    assert history["lr"] == [(1, 1e-5), (2, 2e-5), (3, 3e-5), (4, 1e-6)]
    assert history["grad_norm"] == [(1, 2.5), (3, 1.25)]  # step 2's NaN reached no tracker
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert run.data.params["rm.max_steps"] == "None"  # mlflow keeps a param's first value


def test_mlflow_resume_in_another_experiment_is_a_new_run_in_one_line(tmp_path, mlflow_uri, caplog):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    resume_after_kill(tmp_path / "run", "mlflow", TrackerConfig(project="a", mlflow_tracking_uri=uri))
    mlflow.end_run(status="KILLED")
    again = MetricsLogger(tmp_path / "run", loggers=["jsonl", "mlflow"], config=CONFIG,
                          tracker=TrackerConfig(project="b", mlflow_tracking_uri=uri))
    with caplog.at_level(logging.INFO, logger="rlhf_cli.runs"):
        again.truncate_after(2)
    new_id = again.trackers["mlflow"].run.info.run_id
    again.close()
    (line,) = ours(caplog)
    assert line == (f"logger mlflow: its recorded run is in experiment 'a' at {uri}, not 'b' at {uri}: started a new "
                    f"run (run_id {new_id}) and replayed steps 1..2 of metrics.jsonl into it")
    assert json.loads((tmp_path / "run" / runs.TRACKER_FILE).read_text())["mlflow"]["project"] == "b"


def test_wandb_offline_resume_keeps_the_run_id_and_sends_only_the_steps_it_lacks(tmp_path, monkeypatch, caplog):
    need("wandb")
    for var, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_DIR", str(tmp_path)),
                       ("WANDB_CONFIG_DIR", str(tmp_path / "config")), ("WANDB_CACHE_DIR", str(tmp_path / "cache"))):
        monkeypatch.setenv(var, value)
    import wandb

    run_dir = tmp_path / "run"
    first = resume_after_kill(run_dir, "wandb")
    run_id = first.trackers["wandb"].run.id
    first.trackers["wandb"].close("killed")
    again = MetricsLogger(run_dir, loggers=["jsonl", "wandb"], config=CONFIG)
    with caplog.at_level(logging.INFO, logger="rlhf_cli.runs"):
        again.truncate_after(1)
    for step in (2, 3, 4):
        again.log(step, {"rm/loss": 0.1 * step})
    assert again.trackers["wandb"].run.id == run_id
    again.close()
    wandb.teardown()  # flushes the records (see test_wandb_offline_run_holds_...)
    assert ours(caplog) == [
        f"logger wandb: resumed its run (run_id {run_id}) at step 1; it keeps the interrupted attempt's steps 2..3 "
        "(wandb drops a resumed run's steps at or below its last one) and gets this attempt's steps from 4 "
        "(metrics.jsonl holds this attempt's steps 2..3)"]
    dirs = sorted((run_dir / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, and wandb adds "-1" to the second when both attempts start in the same second
    assert [d.name.split("-")[3] for d in dirs] == [run_id, run_id]  # `wandb sync` appends both to one run
    steps = []
    for d in dirs:
        (file,) = d.glob("run-*.wandb")
        steps.append([r.history.step.num for r in wandb_records(file) if r.WhichOneof("record_type") == "history"])
    assert steps == [[1, 2, 3], [4]]  # together one row per step; steps 2..3 were not sent twice


TRACKIO_RESUME_CHILD = """
import json, logging, sys
from pathlib import Path
from rlhf_cli import runs
from rlhf_cli.config import TrackerConfig
from rlhf_cli.runs import MetricsLogger
from trackio.sqlite_storage import SQLiteStorage

logging.basicConfig(level=logging.INFO)
run_dir, steps, config = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
first = MetricsLogger(run_dir, loggers=["jsonl", "trackio"], tracker=TrackerConfig(), config=config)
for step, metrics in steps:
    first.log(step, metrics)
first.trackers["trackio"].run.finish()  # flushed, as the database holds it after a kill
runs._OPEN.remove(first)
again = MetricsLogger(run_dir, loggers=["jsonl", "trackio"], tracker=TrackerConfig(), config=config)
again.truncate_after(1)
for step in (2, 3, 4):
    again.log(step, {"rm/loss": 0.1 * step})
ids = [first.trackers["trackio"].run.id, again.trackers["trackio"].run.id]
again.close()
rows = SQLiteStorage.get_logs("rlhf_cli", run_id=ids[0])
Path(sys.argv[4]).write_text(json.dumps({"ids": ids, "rows": rows}, default=str))
"""


def test_trackio_resume_reopens_the_run_by_name_and_holds_one_row_per_step(tmp_path):
    need("trackio")
    run_dir = tmp_path / "rm" / "20261201-010101-000001"
    run_dir.mkdir(parents=True)
    steps = [(s, {k: v for k, v in m.items() if v == v}) for s, m in STEPS]
    out = subprocess.run([sys.executable, "-c", TRACKIO_RESUME_CHILD, str(run_dir), json.dumps(steps),
                          json.dumps(CONFIG), str(tmp_path / "stored.json")],
                         env=subprocess_env(TRACKIO_DIR=str(tmp_path / "trackio")), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    stored = json.loads((tmp_path / "stored.json").read_text())
    assert stored["ids"][0] == stored["ids"][1]
    loss = [(row["step"], round(row["rm/loss"], 6)) for row in stored["rows"] if "rm/loss" in row]
    assert sorted(loss) == [(1, 0.6931), (2, 0.61), (3, 0.55), (4, 0.4)]
    assert (f"logger trackio: resumed its run (name 20261201-010101-000001, run_id {stored['ids'][0]}) at step 1; it "
            "keeps the interrupted attempt's steps 2..3 (it cannot remove a logged value)") in out.stderr


@pytest.mark.slow
def test_train_rm_killed_then_resumed_is_one_mlflow_run_with_one_value_per_step(tmp_path):
    """`kill -9` at the second checkpoint (test_kill_mid_save's wrapper): the interrupted attempt logged steps 1..4,
    its checkpoint is step 2; `resume=true` logs 3..6 again. mlflow then holds one run with one value per step of
    every metric, the steps of metrics.jsonl; the steps 3..4 it kept are the interrupted attempt's, the same numbers
    as this attempt's (a resume on CPU repeats them), except the wall-clock throughput."""
    need("mlflow")
    from mlflow import MlflowClient
    from test_kill_mid_save import ARGS, rlhf

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*ARGS, "logger=[jsonl,mlflow]", f"tracker.mlflow_tracking_uri={uri}"]
    assert rlhf(args, tmp_path, kill_at="ds/step-4/").returncode == 137
    (run_dir,) = (tmp_path / "rm").iterdir()
    assert max(r["step"] for r in read_metrics(run_dir)) == 4
    out = rlhf([*args, "resume=true"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in (run_dir / "train_rm.log").read_text().splitlines() if "logger mlflow: " in ln)
    assert "resumed its run (run_id " in line and "at step 2; it keeps the interrupted attempt's steps 3..4" in line

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf_cli").experiment_id])
    assert json.loads((run_dir / runs.TRACKER_FILE).read_text())["mlflow"]["run_id"] == run.info.run_id
    expected = jsonl_series(run_dir)
    assert sorted(run.data.metrics) == sorted(expected) and "rm/loss" in expected
    for name, points in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert [s for s, _ in history] == [s for s, _ in points], name  # one value per step, no gap
        if not name.startswith("throughput/"):
            assert [v for _, v in history] == pytest.approx([v for _, v in points], abs=1e-5), name
    assert run.info.status == "FINISHED"
    steps, _ = series(load_records(run_dir), "rm/loss")
    assert steps == [1, 2, 3, 4, 5, 6]  # the report draws one curve
