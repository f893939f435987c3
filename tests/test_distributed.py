"""Two processes under torchrun (gloo, CPU) train the same model as one process on the same global batch."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ARGS = ["train-rm", "experiment=smoke", "deepspeed=zero2", "tensorboard=false", "rm.max_steps=6"]


def _metrics(root):
    (path,) = list(root.glob("rm/*/metrics.jsonl"))
    return [json.loads(ln) for ln in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_match_one_rank_zero2(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", *ARGS, f"paths.root={one}"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                          "-m", "rlhf_cli", *ARGS, f"paths.root={two}"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(list((two / "rm").iterdir())) == 1  # one run dir for both ranks
    a, b = _metrics(one), _metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("rm/loss", "rm/accuracy", "grad_norm", "eval/rm/loss", "eval/rm/accuracy"):
            if ra.get(key) is not None:
                assert rb[key] == pytest.approx(ra[key], abs=1e-4, rel=1e-4), (ra["step"], key)
    assert (two / "latest_rm").is_file()
