"""lifecycle.Checkpoints with stand-in engines: where each engine's checkpoint goes, what the state holds,
what resume restores (also from a PPO checkpoint of an earlier version, whose state said "iteration")."""

import random
from pathlib import Path

import pytest
import torch

from rlhf_cli.lifecycle import Checkpoints, mark_failed
from rlhf_cli.runs import find_resumable, get_status, latest_tag, set_status


class FakeEngine:
    """Saves its client state as a file at `<dir>/<tag>/state.pt`, as TrainEngine.save lays out DeepSpeed's."""

    def __init__(self, zero_stage=0):
        self.loaded, self.zero_stage, self.saved = None, zero_stage, []

    def save(self, ckpt_dir, tag, client_state, optimizer=True):
        path = Path(ckpt_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save(client_state, path / "state.pt")
        self.saved.append((tag, optimizer))

    def load(self, ckpt_dir, tag, optimizer=True):
        self.loaded = (ckpt_dir, tag, optimizer)
        return torch.load(Path(ckpt_dir) / tag / "state.pt", weights_only=False)


class FakeMetrics:
    def __init__(self):
        self.truncated = []

    def truncate_after(self, step):
        self.truncated.append(step)


def test_two_engines_each_in_its_folder_the_first_holds_the_state(tmp_path):
    actor, critic = FakeEngine(), FakeEngine()
    ckpts = Checkpoints(tmp_path, {"actor": actor, "critic": critic}, keep=2)
    ckpts.save(3, {"kl_ctl": {"value": 0.1}})
    assert latest_tag(tmp_path) == "step-3"
    state = torch.load(tmp_path / "ds" / "step-3" / "actor" / "state.pt", weights_only=False)
    assert state["step"] == 3 and state["kl_ctl"] == {"value": 0.1} and "rng" in state
    assert torch.load(tmp_path / "ds" / "step-3" / "critic" / "state.pt", weights_only=False) == {}


def test_a_single_unnamed_engine_is_written_at_the_tag_itself(tmp_path):
    Checkpoints(tmp_path, {"": FakeEngine()}, keep=2).save(5)
    assert (tmp_path / "ds" / "step-5" / "state.pt").is_file()  # train-rm's layout


def test_resume_restores_step_state_and_rng_and_truncates_metrics(tmp_path):
    ckpts = Checkpoints(tmp_path, {"actor": FakeEngine()}, keep=2)
    torch.manual_seed(7)
    random.seed(7)
    ckpts.save(2, {"bad_steps": 1})
    want = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    engine, metrics = FakeEngine(), FakeMetrics()
    step, state = Checkpoints(tmp_path, {"actor": engine}, keep=2).resume(str(tmp_path), metrics)
    assert step == 2 and state["bad_steps"] == 1 and metrics.truncated == [2]
    assert engine.loaded == (str(tmp_path / "ds" / "step-2"), "actor", True)
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_resume_without_a_checkpoint_or_without_resume(tmp_path):
    metrics = FakeMetrics()
    assert Checkpoints(tmp_path, {"actor": FakeEngine()}, keep=2).resume(str(tmp_path), metrics) == (0, {})
    assert metrics.truncated == [0]  # a crashed attempt's records before any checkpoint are dropped
    metrics = FakeMetrics()
    Checkpoints(tmp_path, {"actor": FakeEngine()}, keep=2).save(1)
    assert Checkpoints(tmp_path, {"actor": FakeEngine()}, keep=2).resume(None, metrics) == (0, {})
    assert metrics.truncated == []  # a new run: nothing is read, nothing dropped


def test_a_ppo_checkpoint_of_an_earlier_version_resumes_at_its_iteration(tmp_path):
    engine = FakeEngine()
    old = {"iteration": 3, "kl_ctl": {"value": 0.2}, "bad_steps": 0, "rng": None}
    Checkpoints(tmp_path, {"actor": engine}, keep=2).save(3)  # a real rng state, then the old state's keys
    state = torch.load(tmp_path / "ds" / "step-3" / "actor" / "state.pt", weights_only=False)
    torch.save({**old, "rng": state["rng"]}, tmp_path / "ds" / "step-3" / "actor" / "state.pt")
    step, state = Checkpoints(tmp_path, {"actor": FakeEngine()}, keep=2).resume("true", FakeMetrics())
    assert step == 3 and state["kl_ctl"] == {"value": 0.2} and "step" not in state


def test_saving_the_step_latest_already_names_is_a_no_op(tmp_path):
    ckpts = Checkpoints(tmp_path, {"actor": FakeEngine()}, keep=2)
    ckpts.save(4, {"n": 1})
    ckpts.save(4, {"n": 2})
    assert torch.load(tmp_path / "ds" / "step-4" / "actor" / "state.pt", weights_only=False)["n"] == 1


def make_run(root, name, state, tag=None, mtime=0):
    import os

    run = root / "rm" / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    os.utime(run / "config.yaml", (mtime, mtime))  # stage_runs orders runs by their config's time
    set_status(run, state)
    if tag:
        (run / "ds" / tag).mkdir(parents=True)
        (run / "ds" / "latest").write_text(tag + "\n")
    return run


def test_resume_true_picks_the_newest_running_run_with_a_checkpoint(tmp_path):
    interrupted = make_run(tmp_path, "a", "running", "step-4", mtime=1)
    make_run(tmp_path, "b", "failed", "step-2", mtime=2)  # failed: never resumed, even with a checkpoint
    never_saved = make_run(tmp_path, "c", "running", mtime=3)  # killed before its first checkpoint
    make_run(tmp_path, "d", "finished", "step-8", mtime=4)
    assert find_resumable(tmp_path, "rm") == interrupted
    assert find_resumable(tmp_path, "rm", need_checkpoint=False) == never_saved  # eval runs keep no checkpoints
    assert find_resumable(tmp_path, "ppo") is None


def test_mark_failed_changes_only_a_prepared_running_run(tmp_path):
    running = make_run(tmp_path, "a", "running")
    reason = "data.path=x.jsonl: only 3 training pairs"
    mark_failed(running, reason)
    assert get_status(running) | {"time": 0} == {"state": "failed", "reason": reason, "time": 0}
    finished = make_run(tmp_path, "b", "finished")
    mark_failed(finished, "late error")
    assert get_status(finished)["state"] == "finished"
    bare = tmp_path / "rm" / "rejected-config"
    bare.mkdir()
    mark_failed(bare, "bad key")  # the config was refused before the run dir was prepared
    assert not (bare / "status.json").exists()


def recorded_run(tmp_path, overrides):
    """A run dir whose config.yaml records `rlhf train-rm <overrides>`."""
    from omegaconf import OmegaConf
    from stage_helpers import compose

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose("train_rm", overrides), resolve=True))
    return run


def test_resume_keeps_the_recorded_config_where_the_command_line_is_silent(tmp_path):
    from stage_helpers import compose

    from rlhf_cli.lifecycle import resume_config

    run = recorded_run(tmp_path, ["model=tiny", "data.path=pairs.jsonl", "rm.lr=3e-4", "rm.max_steps=10"])
    cfg = compose("train_rm", ["model=tiny", "rm.max_steps=20", f"resume={run}"])  # data.path and rm.lr left out
    kept = resume_config(cfg, run, ["model", "rm.max_steps", "resume"])
    assert sorted(kept) == ["data.path", "rm.lr"]
    assert cfg.data.path == "pairs.jsonl" and cfg.rm.lr == 3e-4  # the recorded run, not today's defaults
    assert cfg.rm.max_steps == 20  # more steps may change


@pytest.mark.parametrize(("given", "needle"), [
    (["data.path=other.jsonl"], "data.path=other.jsonl (recorded: pairs.jsonl)"),
    (["rm.batch_size=4"], "rm.batch_size=4 (recorded: 8)"),
    (["model=smollm2"], "model.name=smollm2 (recorded: tiny)"),
])
def test_resume_refuses_a_given_key_that_differs_from_the_record(tmp_path, given, needle):
    from stage_helpers import compose

    from rlhf_cli.config import ConfigError
    from rlhf_cli.lifecycle import resume_config

    run = recorded_run(tmp_path, ["model=tiny", "data.path=pairs.jsonl", "rm.batch_size=8"])
    overrides = ["model=tiny", "data.path=pairs.jsonl", "rm.batch_size=8"]
    keys = [g.split("=")[0] for g in given]
    overrides = [o for o in overrides if o.split("=")[0] not in keys] + given
    cfg = compose("train_rm", overrides)
    with pytest.raises(ConfigError) as e:
        resume_config(cfg, run, [o.split("=")[0] for o in overrides])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"resume={run}: ") and needle in msg
    assert "only rm.max_steps, rm.epochs, ppo.iterations" in msg
    # the same values given again are fine
    assert resume_config(compose("train_rm", ["model=tiny", "data.path=pairs.jsonl", "rm.batch_size=8"]), run,
                         ["model", "data.path", "rm.batch_size"]) == []


def test_resume_takes_a_value_that_resolves_to_the_recorded_one_as_the_same(tmp_path):
    from stage_helpers import compose

    from rlhf_cli import engine
    from rlhf_cli.lifecycle import resume_config

    rm_run = tmp_path / "rm_run"
    (rm_run / "final").mkdir(parents=True)
    run = recorded_run(tmp_path, ["model=tiny", f"precision={engine.resolve_precision('auto')}",
                                  f"reward_model.path={rm_run / 'final'}"])
    # the command given again: precision=auto and the RM's run dir, which the run recorded resolved
    cfg = compose("train_rm", ["model=tiny", "precision=auto", f"reward_model.path={rm_run}"])
    assert resume_config(cfg, run, ["model", "precision", "reward_model.path"]) == []


def test_a_sweep_job_resumed_in_place_moves_no_pointer(tmp_path):
    from rlhf_cli.lifecycle import is_sweep_job

    assert is_sweep_job(tmp_path / "rm" / "sweep-20261201-010101-000001" / "0")
    assert not is_sweep_job(tmp_path / "rm" / "20261201-010101-000001")


def test_keep_optimizer_false_leaves_it_out_of_the_final_save_only_and_resume_reads_the_mark(tmp_path, caplog):
    eng = FakeEngine()
    ckpts = Checkpoints(tmp_path, {"": eng}, keep=2, keep_optimizer=False)
    ckpts.save(2)
    ckpts.save(4, final=True)
    assert eng.saved == [("step-2", True), ("step-4", False)]
    assert (tmp_path / "ds" / "step-4" / "NO_OPTIMIZER").is_file()
    assert not (tmp_path / "ds" / "step-2" / "NO_OPTIMIZER").exists()
    again = FakeEngine()
    with caplog.at_level("WARNING", logger="rlhf_cli.lifecycle"):
        step, _ = Checkpoints(tmp_path, {"": again}, keep=2).resume(str(tmp_path), FakeMetrics())
    assert step == 4 and again.loaded[2] is False
    assert [r.getMessage() for r in caplog.records] == [
        "step-4 is a final checkpoint saved with paths.keep_optimizer=false (weights and LR schedule only): the "
        "optimizer restarts at step 4 (AdamW's moments from zero)"]


def test_keep_optimizer_false_under_zero_3_says_once_that_it_keeps_it(tmp_path, caplog):
    actor, critic = FakeEngine(zero_stage=3), FakeEngine(zero_stage=3)
    with caplog.at_level("WARNING", logger="rlhf_cli.lifecycle"):
        ckpts = Checkpoints(tmp_path, {"actor": actor, "critic": critic}, keep=2, keep_optimizer=False)
    ckpts.save(4, final=True)
    assert actor.saved == [("actor", True)] and critic.saved == [("critic", True)]  # the optimizer kept
    assert [r.getMessage() for r in caplog.records] == [
        "paths.keep_optimizer=false has no effect under deepspeed.zero_stage=3 (its checkpoint's weights are the "
        "optimizer's fp32 partitions): the final checkpoint keeps the optimizer state"]


def test_a_fresh_run_in_a_used_dir_does_not_reopen_its_tracker_runs(tmp_path):
    """trackers.json names the tracker runs a resume reopens; a run started afresh in the same dir (no resume)
    starts new ones, so it is dropped."""
    from omegaconf import OmegaConf

    from rlhf_cli.lifecycle import prepare_run_dir
    from rlhf_cli.runs import TRACKER_FILE

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACKER_FILE).write_text('{"mlflow": {"run_id": "abc"}}')
    cfg = OmegaConf.create({"precision": "fp32", "resume": None})
    prepare_run_dir(cfg, run_dir)
    assert not (run_dir / TRACKER_FILE).exists()
    (run_dir / TRACKER_FILE).write_text('{"mlflow": {"run_id": "abc"}}')
    prepare_run_dir(OmegaConf.create({"precision": "fp32", "resume": str(run_dir)}), run_dir)
    assert (run_dir / TRACKER_FILE).exists()
