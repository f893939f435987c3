"""Two nodes, simulated: two torchrun launchers on 127.0.0.1 (`--nnodes 2 --node_rank 0|1 --nproc_per_node 1`, one
rank each, one shared `paths.root`), as README's multi-node how-to starts them.

Each process is then LOCAL_RANK 0 of its node: code that chose its writer by the local rank would write twice.
train-sft and train-ppo (the `hf` sampler) on two nodes equal the one-node, two-rank run (`--nproc_per_node 2`)
within 1e-5 (fp32), and an audit hook in every rank (Python's `sys.addaudithook`: opens for writing, renames,
mkdirs, deletions) shows global rank 1 writing under `paths.root` only what it removes again (its writability probe,
its Hydra dir: rank 0's is the run's, `lifecycle.prepare_run_dir`) and its own DeepSpeed files under `ds/` (written
from C++: the hook sees their directories).

A killed node (its launcher and its worker SIGKILLed, as a machine that goes away) stops the other within a bound:
its rank's next collective fails on the closed connection (gloo), it says so in one line (`engine.lost_rank`), the
launcher exits non-zero, and the run, still `running`, resumes on two nodes from its last checkpoint (`resume=true`)
to the one-node run's metrics and weights (train-sft's comparison). A node that hangs without closing its
connections is bounded by the process group's timeout instead (DeepSpeed's `DEEPSPEED_TIMEOUT`, minutes; README
"Use several GPUs or nodes"): too long for CI, measured once (`test_a_lost_rank_is_told_from_a_crash`).

This module holds the launchers and the checks; the runs are in test_distributed.py, beside the one-node, two-rank
runs they equal (one run serves both comparisons), and the engine's (`rollout.engine=vllm`) in tests/engine_vllm.
"""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every rank runs the CLI under an audit hook that appends what it writes to `$AUDIT_DIR/rank<RANK>`; with
# `PAUSE_AT=<tag>`, global rank 1 stops (sleeps) once that checkpoint is committed, for the test to kill its node at
# a known step.
WRAPPER = r"""
import os, sys
log = os.path.join(os.environ["AUDIT_DIR"], "rank" + os.environ["RANK"])
out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
EVENTS = {"os.rename": (0, 1), "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "shutil.rmtree": (0,),
          "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,)}

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if not (flags & WRITE_FLAGS or (isinstance(mode, str) and any(c in mode for c in "wax+"))):
            return
        where = (0,)
    elif event in EVENTS:
        where = EVENTS[event]
    else:
        return
    for i in where:
        path = args[i]
        if isinstance(path, (str, bytes, os.PathLike)):
            os.write(out, f"{event} {os.path.abspath(os.fsdecode(path))}\n".encode())

sys.addaudithook(hook)
if os.environ.get("PAUSE_AT") and os.environ["RANK"] == "1":
    import time
    from rlhf_cli import lifecycle
    commit = lifecycle.commit_checkpoint
    def pausing_commit(run_dir, tag, keep=2):
        commit(run_dir, tag, keep)
        if tag == os.environ["PAUSE_AT"]:
            open(os.path.join(os.environ["AUDIT_DIR"], "paused"), "w").close()
            time.sleep(600)
    lifecycle.commit_checkpoint = pausing_commit
from rlhf_cli.cli import main
main(sys.argv[1:])
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, root, audit, nodes, pause_at=None):
    """Launch `args` on `nodes` torchrun launchers (2: one rank each, `--nnodes 2`; 1: one launcher with two ranks)
    under the audit wrapper; returns the launchers (each in a session of its own)."""
    audit.mkdir(parents=True, exist_ok=True)
    wrapper = audit / "wrapper.py"
    wrapper.write_text(WRAPPER)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "AUDIT_DIR": str(audit),
           "TMPDIR": str(audit), "PAUSE_AT": pause_at or ""}  # TMPDIR: torchrun's torchelastic_* log dirs
    run = [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}"]
    if nodes == 1:
        launchers = [[*run, "--nproc_per_node=2"]]
    else:
        launchers = [[*run, "--nnodes=2", f"--node_rank={n}", "--nproc_per_node=1", "--master_addr=127.0.0.1"]
                     for n in range(2)]
    return [subprocess.Popen([*cmd, str(wrapper), *args, f"paths.root={root}"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for cmd in launchers]


def launch(args, root, nodes):
    procs = start(args, root, root / "audit", nodes)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def writes(root, rank):
    """(event, path) of what global rank `rank` opened for writing, renamed, made or deleted under `root`."""
    lines = [line.split(" ", 1) for line in (root / "audit" / f"rank{rank}").read_text().splitlines()]
    return {(event, Path(path)) for event, path in lines
            if root in Path(path).parents and root / "audit" not in (Path(path), *Path(path).parents)}


def assert_only_rank0_writes(root, stage):
    """Rank 1 wrote under `root` only files it removed and its DeepSpeed files in the run's `ds/`."""
    (run,) = list((root / stage).iterdir())
    theirs = {p for event, p in writes(root, 1) if not (event == "os.mkdir" and p in (root / stage, run))}  # exist
    # its writability probe of `paths.root` (runs.check_writable) and its Hydra dir, removed once rank 0's run dir
    # was broadcast: gone
    passing = {p for p in theirs if p.name.startswith(".write-test.")
               or (root / stage) in p.parents and run not in (p, *p.parents)}
    assert passing and not any(p.exists() for p in passing), sorted(passing)
    rest = theirs - passing
    assert rest and all(run / "ds" in p.parents for p in rest), sorted(rest)
    mine = {p for _, p in writes(root, 0)}  # the hook saw rank 0 write the run's files
    assert {run / "metrics.jsonl", run / "status.json"} <= mine
    assert any(p.parent == root and p.name.startswith("latest_") for p in mine)  # the pointer


def assert_same_weights(dir_a, dir_b):
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{dir_b}/{k}: {m}")


def kill_node(launcher):
    """SIGKILL a node: its launcher and the workers it started (in sessions of their own)."""
    import psutil

    victims = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    for p in victims:
        p.send_signal(signal.SIGKILL)


def test_a_lost_rank_is_told_from_a_crash():
    """`engine.lost_rank`: gloo's closed connection (the kill above) and its timeout (a node that hangs: measured with
    DEEPSPEED_TIMEOUT=1, rank 0 stopped 68 s after rank 1 stalled, in this line) leave the run resumable; an error of
    the run's own code does not."""
    from rlhf_cli import engine

    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/{}] {}"
    assert engine.lost_rank(RuntimeError(gloo.format("pair.cc:537", "Read error [127.0.0.1]:6490: Connection reset")))
    assert engine.lost_rank(RuntimeError(gloo.format("unbound_buffer.cc:78", "Timed out waiting 60000ms for recv")))
    assert engine.lost_rank(torch.distributed.DistNetworkError("failed to connect to the store"))
    assert not engine.lost_rank(RuntimeError("shape mismatch in the loss"))
    assert not engine.lost_rank(ValueError(gloo.format("pair.cc:537", "not from torch")))
