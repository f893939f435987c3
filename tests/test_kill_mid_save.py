"""A `kill -9` in the middle of writing a checkpoint: the previous one stays loadable and `resume=true` finishes.

The kill is made deterministic: a wrapper process patches the file writers (torch.save for DeepSpeed
checkpoints, safetensors for the final HF save) so that the first write whose path matches
`KILL_AT` writes half a file of garbage and then `os._exit(137)`s: no exception, no `finally`, no
signal handler, no flush; what a SIGKILL at that instant would leave behind.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ARGS = ["train-rm", "experiment=smoke", "rm.max_steps=6", "rm.save_every=2", "rm.eval_every=0"]

WRAPPER = r"""
import os, sys, torch, safetensors.torch, transformers.modeling_utils as mu
needle = os.environ["KILL_AT"]

def die_if_match(path):
    if needle in str(path):
        with open(path, "wb") as f:  # a torn file, as a kill mid-write leaves it
            f.write(b"\x00garbage" * 64)
        os._exit(137)

real_save, real_st = torch.save, safetensors.torch.save_file
def save(obj, f, *a, **k):
    die_if_match(f)
    return real_save(obj, f, *a, **k)
def st_save(tensors, filename, *a, **k):
    die_if_match(filename)
    return real_st(tensors, filename, *a, **k)
torch.save, safetensors.torch.save_file, mu.safe_save_file = save, st_save, st_save
from rlhf_cli.cli import main
main(sys.argv[1:])
"""


def rlhf(args, root, kill_at=None):
    env = {**ENV, **({"KILL_AT": kill_at} if kill_at else {})}
    cmd = [sys.executable, "-c", WRAPPER] if kill_at else [sys.executable, "-m", "rlhf_cli"]
    return subprocess.run([*cmd, *args, f"paths.root={root}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def losses(run):
    return {r["step"]: r["rm/loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "rm/loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    out = rlhf(ARGS, root)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = list((root / "rm").iterdir())
    return losses(run)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, previous", [
    ("ds/step-4/", "step-2"),  # the second DeepSpeed checkpoint, first file
    ("model.safetensors", "step-6"),  # the final HF save, after the last DeepSpeed checkpoint
])
def test_kill_9_mid_save_then_resume_finishes(tmp_path, uninterrupted, kill_at, previous):
    out = rlhf(ARGS, tmp_path, kill_at=kill_at)
    assert out.returncode == 137, out.stderr[-3000:]
    (run,) = list((tmp_path / "rm").iterdir())
    assert (run / "ds" / "latest").read_text().strip() == previous  # the torn checkpoint was never marked good
    assert not (run / "final").exists() and not (tmp_path / "latest_rm").exists()
    assert json.loads((run / "status.json").read_text())["state"] == "running"

    out = rlhf([*ARGS, "resume=true"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert (tmp_path / "latest_rm").read_text().strip() == str(run / "final")
    got = losses(run)
    assert sorted(got) == sorted(uninterrupted)  # every step logged once
    for step, loss in uninterrupted.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step
