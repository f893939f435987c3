"""`rollout.sync_timeout_s`: a push that fails or stalls on one rank stops every rank (issue 60). Run without vLLM:
the engine's push is replaced by a fault, so what is tested is the bound and the cross-rank rule around it
(`engine.watchdog`, `VLLMGenerator._push_everywhere`); the engine job injects the same faults into a real push.

One process and two under torchrun (gloo): a failure stops every rank at once, the failing one naming its error and
the others naming it; a stall is ended by each rank's own watchdog within the bound (exit status 3), the run's
status left `running` by rank 0 (resumable: `resume=true` continues it), the line recorded.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
TIMEOUT = 4.0
"""The bound of a push that should finish (ZeRO-3's partial failure: it must stop on its own, well within)."""
STALL = 2.0
"""The bound of a stalled push: what each stall test waits for."""

SCRIPT = '''
import sys, time
from rlhf_cli import engine
from rlhf_cli.rollout.vllm_engine import VLLMGenerator

fault, bad_rank, workdir, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
engine.init_distributed()
gen = VLLMGenerator("fp32", workdir=workdir, sync_timeout_s=timeout)

def push(model, gather):
    gen._doing = "the weight push (at tensor model.layers.1.mlp.up_proj.weight)"
    if engine.rank() == bad_rank:
        if fault == "fail":
            raise RuntimeError("injected")
        time.sleep(60)

gen._push = push
try:
    gen._push_everywhere(None, None)
except (ValueError, RuntimeError) as e:
    print(f"rank {engine.rank()} raised: {e}", flush=True)
    sys.exit(2)
print(f"rank {engine.rank()} pushed", flush=True)
'''


PARTIAL = '''
import contextlib, sys
import torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from rlhf_cli import engine
from rlhf_cli.rollout.vllm_engine import VLLMGenerator, engine_weight_shapes, tied_names

_, bad_rank, workdir, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
engine.init_distributed()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))


@contextlib.contextmanager
def gather(params):  # ZeRO-3's per-layer gather is a collective: every rank must make each one
    dist.barrier()
    yield


class Engine:  # vLLM's reload that stops reading part-way on one rank (an OOM, say)
    def collective_rpc(self, method, kwargs):
        for i, _ in enumerate(kwargs["weights_iterator"]):
            if i == 2 and engine.rank() == bad_rank:
                raise MemoryError("injected")

    def reset_prefix_cache(self):  # after a whole push (the other rank's)
        return True


gen = VLLMGenerator("fp32", workdir=workdir, sync_timeout_s=timeout)
gen.llm, gen.tied, gen.dtype = Engine(), tied_names(model), torch.float32
gen.names = {n: s for n, s in engine_weight_shapes(model).items() if gen.tied[n] == n}
try:
    gen._push_everywhere(model, gather)
except (ValueError, RuntimeError) as e:
    print(f"rank {engine.rank()} raised: {e}", flush=True)
    sys.exit(2)
print(f"rank {engine.rank()} pushed", flush=True)
'''


def run(tmp_path, fault, ranks, timeout=TIMEOUT):
    script = tmp_path / "push.py"
    script.write_text(PARTIAL if fault == "partial" else SCRIPT)
    cmd = [sys.executable, str(script)]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}",
               str(script)]
    t0 = time.perf_counter()
    out = subprocess.run([*cmd, fault, str(ranks - 1), str(tmp_path), str(timeout)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=120)
    return out, time.perf_counter() - t0


def test_a_push_that_fails_stops_the_run_in_one_line_naming_the_tensor(tmp_path):
    """One process (two ranks: the ZeRO-3 test below, whose failure on rank 1 stops rank 0 too). The push runs in
    this process: a failure raises, and only a stall needs a process of its own (its watchdog exits it)."""
    from rlhf_cli.rollout.vllm_engine import VLLMGenerator

    gen = VLLMGenerator("fp32", workdir=tmp_path, sync_timeout_s=TIMEOUT)

    def push(model, gather):
        gen._doing = "the weight push (at tensor model.layers.1.mlp.up_proj.weight)"
        raise RuntimeError("injected")

    gen._push = push
    with pytest.raises((ValueError, RuntimeError), match=r"^rollout.engine=vllm: rank 0: the weight push \(at tensor "
                       r"model.layers.1.mlp.up_proj.weight\) failed: RuntimeError: injected$"):
        gen._push_everywhere(None, None)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stalled_push_stops_every_rank_within_the_bound(tmp_path, ranks):
    out, seconds = run(tmp_path, "stall", ranks, STALL)
    assert out.returncode != 0 and "pushed" not in out.stdout
    line = (f"error: rank {ranks - 1}: the weight push (at tensor model.layers.1.mlp.up_proj.weight) did not finish "
            f"within {STALL:g} s (rollout.sync_timeout_s)")
    assert line in out.stderr, out.stderr[-3000:]
    if ranks == 2:  # rank 0 pushed, then waited for rank 1 in the all-gather: its own watchdog ends it
        assert "error: rank 0: the weight push (at tensor" in out.stderr
    else:
        assert out.returncode == 3
    assert seconds < STALL + 40  # the interpreter and torch's import included; the sleep is 60 s
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "running" and "did not finish" in status["stopped"]  # resume=true picks it


def test_a_push_that_fails_part_way_under_zero3_still_joins_every_gather_and_stops_every_rank(tmp_path):
    """Two ranks whose push gathers one layer at a time with a collective (ZeRO-3's): rank 1's engine stops reading
    after two tensors. Its rank runs the rest of the stream unpushed, so rank 0's later gathers are met, and both
    stop at once in one line each, well within the bound (no watchdog)."""
    out, seconds = run(tmp_path, "partial", 2)
    said = out.stdout
    assert "rank 1 raised: rollout.engine=vllm: rank 1: the weight push (at tensor" in said, said + out.stderr[-3000:]
    assert "failed: MemoryError: injected" in said
    assert "rank 0 raised: rollout.engine=vllm: the weight push failed on rank 1" in said, said
    assert "did not finish" not in out.stderr
