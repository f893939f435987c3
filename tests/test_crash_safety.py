"""Output that cannot be written: an unwritable output dir fails before training; a save that fails
half-way (a full disk, simulated by a writer raising ENOSPC) is reported and never leaves a torn
checkpoint marked as good, so `resume=true` continues from the previous complete one.

(test_kill_mid_save.py covers the same checkpoints under a `kill -9` instead of an exception.)
"""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from rlhf_cli.lifecycle import commit_checkpoint
from rlhf_cli.runs import SaveError, check_writable, latest_tag, write_pointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
# 4 optimizer steps of 4 pairs, a DeepSpeed checkpoint at step 2 and (the last one) at step 4
TINY_RM = ["data.builtin.rm_train=16", "data.builtin.rm_eval=4", "rm.batch_size=4", "rm.micro_batch_size=4",
           "rm.max_steps=4", "rm.save_every=2", "rm.eval_every=0", "rm.lr=1e-3"]


def files_under(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ----------------------------------------------------------------------------------------------
# an output dir that cannot be written


@pytest.mark.parametrize("command", ["train_rm", "train_ppo", "eval"])
def test_output_root_under_a_regular_file_fails_before_anything_runs(command, run_stage, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError) as err:
        run_stage(command, ["reward.type=checker"] if command == "train_ppo" else [], root=blocker / "runs")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"output dir '{blocker / 'runs'}")
    assert msg.endswith(f"'{blocker}' is a file, not a directory (set paths.root to a writable directory)")
    assert files_under(tmp_path) == ["a_file"]


def test_output_dir_where_files_cannot_be_created(tmp_path, monkeypatch):
    """As root, chmod does not stop writes: make the probe file's creation fail instead."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError, match=r"^output dir '.*/run' is not writable: Permission denied \(set "
                                              r"paths.root to a writable directory\)$"):
        check_writable(tmp_path / "run")


def test_cli_output_root_under_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "train-rm", "model=tiny", "dry_run=true",
                          f"paths.root={tmp_path / 'a_file' / 'runs'}"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "0"}, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: output dir '{tmp_path / 'a_file' / 'runs'}' cannot be created: '{tmp_path / 'a_file'}' is a file, "
        f"not a directory (set paths.root to a writable directory)"]


def test_cli_sweep_whose_output_root_is_under_a_regular_file_is_one_line_before_any_job(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "train-rm", "-m", "model=tiny", "dry_run=true",
                          "rm.lr=1e-5,2e-5", f"paths.root={tmp_path / 'a_file' / 'runs'}"], cwd=REPO,
                         capture_output=True, text=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "0"}, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: output dir '{tmp_path / 'a_file' / 'runs'}' cannot be created: '{tmp_path / 'a_file'}' is a file, "
        f"not a directory (set paths.root to a writable directory)"]


# ----------------------------------------------------------------------------------------------
# pointer files: a failed write keeps the old pointer


def _fsync_fails(monkeypatch):
    def fsync(fd):
        raise ENOSPC

    monkeypatch.setattr(os, "fsync", fsync)


def test_failed_pointer_write_keeps_the_previous_pointer(tmp_path, monkeypatch):
    old, new = tmp_path / "rm" / "a" / "final", tmp_path / "rm" / "b" / "final"
    write_pointer(tmp_path, "rm", old)
    _fsync_fails(monkeypatch)
    with pytest.raises(SaveError) as err:
        write_pointer(tmp_path, "rm", new)
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == (f"could not write the pointer latest_rm at {tmp_path / 'latest_rm'}: No space left on "
                              f"device; nothing was replaced (free disk space, then rerun with resume=true)")
    assert (tmp_path / "latest_rm").read_text() == f"{old.resolve()}\n"
    assert files_under(tmp_path) == ["latest_rm"]  # no temp file left behind


def test_failed_commit_keeps_ds_latest_and_stale_tags_are_pruned(tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    for step in (2, 4, 6):
        (ds / f"step-{step}").mkdir(parents=True)
    (ds / "latest").write_text("step-2\n")
    _fsync_fails(monkeypatch)
    with pytest.raises(SaveError, match=r"could not write the checkpoint pointer for step-4 at .*ds/latest: No space"):
        commit_checkpoint(tmp_path, "step-4")
    assert latest_tag(tmp_path) == "step-2" and files_under(ds) == ["latest", "step-2", "step-4", "step-6"]
    monkeypatch.undo()
    # resumed from step-2, the run rewrites step-4; step-6 is a leftover of the abandoned attempt
    commit_checkpoint(tmp_path, "step-4")
    assert latest_tag(tmp_path) == "step-4" and files_under(ds) == ["latest", "step-2", "step-4"]
    (ds / "step-5").mkdir()
    commit_checkpoint(tmp_path, "step-5")
    assert files_under(ds) == ["latest", "step-4", "step-5"]  # the two newest are kept
    (ds / "step-6").mkdir()
    commit_checkpoint(tmp_path, "step-6", keep=0)  # paths.keep_checkpoints=0 still keeps the newest while training
    assert files_under(ds) == ["latest", "step-6"]


# ----------------------------------------------------------------------------------------------
# train-rm: the disk fills up during a DeepSpeed checkpoint, then during the final HF save


@pytest.fixture(scope="module")
def finished_root(tmp_path_factory):
    """A paths.root holding one finished tiny train-rm run (its `latest_rm` points at its final/)."""
    from stage_helpers import compose

    from rlhf_cli.preflight import VALIDATORS
    from rlhf_cli.stages import rm

    root = tmp_path_factory.mktemp("finished")
    cfg = compose("train_rm", ["model=tiny", "precision=fp32", f"paths.root={root}", *TINY_RM])
    VALIDATORS["train_rm"](cfg)
    rm.run(cfg, root / "rm" / "first")
    return root


@pytest.fixture
def root(finished_root, tmp_path):
    """A private copy of `finished_root`, its pointer moved to the copy."""
    root = tmp_path / "runs"
    shutil.copytree(finished_root, root)
    write_pointer(root, "rm", root / "rm" / "first" / "final")
    return root


def _steps(run_dir):
    return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "rm/loss" in r]


def test_disk_full_during_a_deepspeed_checkpoint(root, run_stage, monkeypatch):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    real_save = TorchCheckpointEngine.save

    def save(self, state_dict, path):
        if "step-4" in str(path):
            with open(path, "wb") as fh:  # what a full disk leaves: part of a file
                fh.write(b"\x00partial" * 64)
            raise ENOSPC
        return real_save(self, state_dict, path)

    monkeypatch.setattr(TorchCheckpointEngine, "save", save)
    run = root / "rm" / "second"
    with pytest.raises(SaveError,
                       match=r"^could not write the DeepSpeed checkpoint step-4 at .*: No space left") as err:
        run_stage("train_rm", TINY_RM, run_dir=run, root=root)
    assert err.value.errno == errno.ENOSPC
    # the torn step-4 is on disk but not marked good; the previous run's pointer is untouched
    assert (run / "ds" / "step-4").is_dir() and latest_tag(run) == "step-2"
    assert (root / "latest_rm").read_text().strip() == str(root / "rm" / "first" / "final")
    assert not (run / "final").exists()
    assert json.loads((run / "status.json").read_text())["state"] == "running"

    monkeypatch.undo()  # space is free again
    run_stage("train_rm", [*TINY_RM, f"resume={run}"], run_dir=run, root=root)
    assert _steps(run) == [1, 2, 3, 4]  # steps 3 and 4 ran again from step-2, each logged once
    assert latest_tag(run) == "step-4" and (run / "final" / "model.safetensors").is_file()
    assert (root / "latest_rm").read_text().strip() == str((run / "final").resolve())


@pytest.mark.parametrize("keep", [2, 0])
def test_disk_full_during_the_final_save(keep, root, run_stage, monkeypatch):
    """With paths.keep_checkpoints=0 too: ds/ is only deleted once final/ is written."""
    import transformers.modeling_utils as modeling_utils

    def safe_save_file(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as fh:
            fh.write(b"\x00partial" * 64)
        raise ENOSPC

    run = root / "rm" / "second"
    monkeypatch.setattr(modeling_utils, "safe_save_file", safe_save_file)
    args = [*TINY_RM, f"paths.keep_checkpoints={keep}"]
    with pytest.raises(SaveError) as err:
        run_stage("train_rm", args, run_dir=run, root=root)
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == (f"could not write the LlamaForSequenceClassification checkpoint at {run / 'final'}: "
                              f"No space left on device; nothing was replaced (free disk space, then rerun with "
                              f"resume=true)")
    assert not (run / "final").exists() and not list(run.glob(".final*"))  # no torn final/, no temp dir left
    assert (root / "latest_rm").read_text().strip() == str(root / "rm" / "first" / "final")
    assert latest_tag(run) == "step-4"  # the DeepSpeed checkpoint before the final save is complete
    assert json.loads((run / "status.json").read_text())["state"] == "running"

    monkeypatch.undo()
    run_stage("train_rm", [*args, f"resume={run}"], run_dir=run, root=root)
    assert _steps(run) == [1, 2, 3, 4]  # nothing trained again: the run resumed at its last step
    assert (root / "latest_rm").read_text().strip() == str((run / "final").resolve())
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    if keep:
        assert sorted(p.name for p in (run / "ds").iterdir()) == ["latest", "step-2", "step-4"]
    else:
        assert not (run / "ds").exists()


def test_keep_checkpoints_n_keeps_the_newest_n(run_stage):
    _, run, _ = run_stage("train_rm", [*TINY_RM, "rm.save_every=1", "paths.keep_checkpoints=1"])
    assert sorted(p.name for p in (run / "ds").iterdir()) == ["latest", "step-4"] and latest_tag(run) == "step-4"
    _, run, _ = run_stage("train_rm", [*TINY_RM, "rm.save_every=1", "paths.keep_checkpoints=3"])
    assert sorted(p.name for p in (run / "ds").iterdir()) == ["latest", "step-2", "step-3", "step-4"]


# ----------------------------------------------------------------------------------------------
# train-ppo: the final save fails; latest_policy keeps pointing at the previous policy

TINY_PPO = ["reward.type=checker", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4",
            "ppo.max_new_tokens=4", "ppo.iterations=1", "ppo.epochs=1", "data.builtin.ppo_train=8",
            "data.builtin.ppo_eval=4"]


@pytest.mark.parametrize("keep", [2, 0])
def test_ppo_disk_full_during_the_final_save(keep, run_stage, tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    root = tmp_path / "runs"
    _, first, _ = run_stage("train_ppo", TINY_PPO, root=root)
    assert (root / "latest_policy").read_text().strip() == str((first / "final").resolve())

    def safe_save_file(tensors, filename, *args, **kwargs):
        raise ENOSPC

    monkeypatch.setattr(modeling_utils, "safe_save_file", safe_save_file)
    run = root / "ppo" / "second"
    args = [*TINY_PPO, f"paths.keep_checkpoints={keep}"]
    with pytest.raises(SaveError, match=r"^could not write the .* checkpoint at .*: No space left on device"):
        run_stage("train_ppo", args, run_dir=run, root=root)
    assert not (run / "final").exists() and latest_tag(run) == "step-1"
    assert (root / "latest_policy").read_text().strip() == str((first / "final").resolve())

    monkeypatch.undo()
    run_stage("train_ppo", [*args, f"resume={run}"], run_dir=run, root=root)
    assert (root / "latest_policy").read_text().strip() == str((run / "final").resolve())
    if keep:
        assert latest_tag(run) == "step-1"
    else:
        assert not (run / "ds").exists()
