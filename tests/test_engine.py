"""DeepSpeed engine on CPU: a real optimizer step on a tiny model under ZeRO 0 and 2."""

from types import SimpleNamespace

import pytest
import torch
from stage_helpers import tokenizer_override

from rlhf_cli import engine


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("zero_stage", [0, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_engine_step_changes_weights_and_lowers_loss(zero_stage, precision, tmp_path):
    model = _tiny()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ds = SimpleNamespace(zero_stage=zero_stage, offload_optimizer=False, offload_param=False, extra={})
    eng = engine.TrainEngine(model, ds, precision, lr=1e-2, train_batch_size=4, micro_batch_size=2,
                             total_steps=10, max_grad_norm=1.0)
    assert eng.grad_accum == 2
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(engine.device())
    losses = []
    for _ in range(8):  # 4 optimizer steps of 2 micro-batches
        with eng.autocast():
            loss = eng(input_ids=x, labels=x).loss
        losses.append(loss.item())
        eng.backward_mean(loss)
        eng.step()
    assert eng.global_steps == 4
    assert losses[-1] < losses[0]
    after = eng.module.state_dict()
    assert any(not torch.equal(before[k], after[k].float().cpu()) for k in before)
    assert eng.grad_norm() > 0

    # a checkpoint round trip restores weights and client state
    eng.save(str(tmp_path), "step-4", {"step": 4})
    saved = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    with eng.autocast():
        loss = eng(input_ids=x, labels=x).loss
    eng.backward_mean(loss)
    eng.step()
    with eng.autocast():
        loss = eng(input_ids=x, labels=x).loss
    eng.backward_mean(loss)
    eng.step()
    assert eng.load(str(tmp_path), "step-4")["step"] == 4
    for k, v in eng.module.state_dict().items():
        assert torch.equal(v, saved[k])


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16"])
def test_one_rank_without_zero_skips_the_identity_all_reduce(precision):
    """World size 1, ZeRO 0: DeepSpeed's gradient all-reduce is off, and the weights after accumulated steps equal
    those of an engine that runs it (bit for bit: it was an identity); ZeRO 2 keeps it (it reduces into its
    partitions)."""
    ds = lambda stage, extra=None: SimpleNamespace(zero_stage=stage, offload_optimizer=False,  # noqa: E731
                                                   offload_param=False, extra=extra or {})
    kw = dict(lr=1e-2, train_batch_size=4, micro_batch_size=2, total_steps=10, max_grad_norm=1.0, weight_decay=0.1)

    def model():  # with a trained parameter the loss never reaches: DeepSpeed's reduction gives it a zero gradient
        m = _tiny()
        m.unused = torch.nn.Parameter(torch.ones(2, 3))  # 2-D: weight decay applies
        return m

    engines = [engine.TrainEngine(model(), ds(0), precision, **kw) for _ in range(2)]
    assert engines[0].engine.enable_backward_allreduce is False
    engines[1].engine.enable_backward_allreduce = True  # DeepSpeed's default, zero gradients included
    engines[1]._skip_allreduce = False
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(engine.device())
    for eng in engines:
        for _ in range(4):  # 2 optimizer steps of 2 micro-batches
            with eng.autocast():
                loss = eng(input_ids=x, labels=x).loss
            eng.backward_mean(loss)
            eng.step()
    a, b = (e.module.state_dict() for e in engines)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["unused"].cpu(), torch.ones(2, 3, dtype=a["unused"].dtype))  # decayed, as reduced
    assert engines[0].grad_norm() == engines[1].grad_norm()
    assert engine.TrainEngine(_tiny(), ds(2), precision, **kw).engine.enable_backward_allreduce is True
    # a communication dtype or pre-division of the config's own makes the reduction more than an identity: kept
    for extra in ({"communication_data_type": "fp32"}, {"managed_gradient_accumulation": False}):
        kept = engine.TrainEngine(_tiny(), ds(0, extra), precision, **kw)
        assert kept.engine.enable_backward_allreduce is True


@pytest.mark.parametrize("zero_stage,offload", [(1, False), (2, False), (2, True), (3, False), (3, True)],
                         ids=["zero1", "zero2", "zero2-offload", "zero3", "zero3-offload"])
def test_accumulated_micro_batches_on_the_module_match_zero0(zero_stage, offload):
    """Two micro-batches of other rows per optimizer step, run the way the stages run them: the forward on
    `eng.module` (not DeepSpeed's `engine(...)`), then `backward_mean` and `step`. Every ZeRO stage gives ZeRO-0's
    weights: ZeRO-3 once used the last micro-batch's gradient only, and with an offloaded optimizer and several
    gradient buckets a boundary backward's buckets were lost (see `TrainEngine._backward`). Small buckets: the
    tiny model's gradients span many."""
    ds = lambda stage, extra=None: SimpleNamespace(zero_stage=stage, offload_optimizer=offload and stage > 0,  # noqa: E731
                                                   offload_param=False, extra=extra or {})
    kw = dict(lr=1e-2, train_batch_size=4, micro_batch_size=2, total_steps=10, max_grad_norm=1.0, weight_decay=0.1)
    small = {"zero_optimization": {"reduce_bucket_size": 2000, "stage3_prefetch_bucket_size": 2000}}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 12), generator=g).to(engine.device()) for _ in range(4)]  # 2 steps of 2
    weights, norms = [], []
    for eng in (engine.TrainEngine(_tiny(), ds(0), "fp32", **kw),
                engine.TrainEngine(_tiny(), ds(zero_stage, small), "fp32", **kw)):
        assert eng.grad_accum == 2
        for i, x in enumerate(batches):
            loss = eng.module(input_ids=x, labels=x).loss
            eng.backward_mean(loss)
            eng.step()
            if i % 2:  # an optimizer step
                norms.append(eng.grad_norm())
        weights.append({k: v.detach().clone().float().cpu() for k, v in eng.consolidated_state_dict().items()})
    assert eng.global_steps == 2
    assert norms[2:] == pytest.approx(norms[:2], rel=1e-5)
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_l2_norm_is_float64_exact_where_one_float32_pass_drifts():
    """ZeRO-0's grad norm (`engine.l2_norm`) equals a float64 pass, where DeepSpeed's ZeRO norms accumulate; one float32
    `vector_norm` over an embedding-sized gradient with a few large rows misses it by ~3e-4 on a CPU."""
    torch.manual_seed(0)
    big = torch.randn(49152 * 64) * 1e-3
    big[:5000] *= 1000
    tensors = [big.view(49152, 64), torch.randn(7, dtype=torch.bfloat16), torch.randn(4096)]
    exact = float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in tensors])))
    assert engine.l2_norm(tensors) == pytest.approx(exact, rel=1e-6)
    assert abs(float(torch.linalg.vector_norm(big)) / float(torch.linalg.vector_norm(big.double())) - 1) > 1e-5
    assert engine.l2_norm([]) == 0.0 and engine.l2_norm([torch.tensor([3.0, 4.0])]) == 5.0


def test_cpu_init_builds_no_shared_memory_op():
    """On the CPU accelerator DeepSpeed's shm all-reduce op (a C++ JIT build, 40-80 s) is neither built nor loaded."""
    import os
    import subprocess
    import sys

    code = ("import deepspeed.comm.comm as c; from rlhf_cli import engine; engine.init_distributed(); "
            "import torch; t = torch.ones(3); engine.dist.all_reduce(t); "
            "print(c.cdb.shm_comm_op is None, hasattr(torch.ops.deepspeed, 'inference_all_reduce_'), t.tolist())")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}  # the CPU path on a GPU machine too
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "built successfully" not in out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True False [1.0, 1.0, 1.0]"


def test_a_world_destroyed_by_another_library_leaves_no_dead_group_to_the_next_engine():
    """vLLM's in-process shutdown destroys the world through torch, not DeepSpeed; the next run in that process
    (a `-m` sweep, or the engine tests' next case) built its engine on DeepSpeed's clone of the dead world and
    failed in `deepspeed.initialize` ("Group ... is not registered"). In one child, three cases in turn, two runs
    each, every run's world destroyed through torch after it: the next world made by `init_distributed`; made
    first by another library (as an in-process vLLM engine does); made by `init_distributed` on a DeepSpeed that
    has no `_release_process_group_references` (its globals dropped by hand; last, as it deletes the helper)."""
    import os
    import subprocess
    import sys

    code = """
import socket, torch; from types import SimpleNamespace; from rlhf_cli import engine
ds = SimpleNamespace(zero_stage=3, offload_optimizer=False, offload_param=False, extra={})
for case in ("ours", "another library's", "ours, older DeepSpeed"):
    if case == "ours, older DeepSpeed":
        import deepspeed.utils.groups as g; del g._release_process_group_references
    for run in range(2):
        if case == "another library's":
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        engine.init_distributed()
        eng = engine.TrainEngine(torch.nn.Linear(4, 4), ds, "fp32", lr=1e-2, train_batch_size=1, micro_batch_size=1,
                                 total_steps=1, max_grad_norm=1.0)
        print(f"{case}: engine {run}", flush=True)
        torch.distributed.destroy_process_group()  # as vLLM's cleanup_dist_env_and_memory does
"""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.splitlines() == [f"{case}: engine {run}" for case in ("ours", "another library's",
                                                                            "ours, older DeepSpeed")
                                       for run in range(2)]


def test_ds_config_from_groups():
    from omegaconf import OmegaConf

    # as Hydra passes it (`+deepspeed.extra.zero_optimization.overlap_comm=true`): a nested section merges into ours
    # (it replaced the whole `zero_optimization`, stage included, while its values were DictConfigs)
    extra = OmegaConf.create({"zero_optimization": {"overlap_comm": True}, "communication_data_type": "fp32"})
    OmegaConf.set_struct(extra, True)
    ds = SimpleNamespace(zero_stage=3, offload_optimizer=True, offload_param=True, extra=extra)
    conf = engine.ds_config(ds, "bf16", train_batch_size=8, micro_batch_size=2, max_grad_norm=1.0)
    assert conf["bf16"]["enabled"] and conf["gradient_accumulation_steps"] == 8 // (2 * engine.world_size())
    z = conf["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["overlap_comm"] is True
    assert type(z) is dict and conf["communication_data_type"] == "fp32"
    with pytest.raises(ValueError, match="not divisible"):
        engine.ds_config(ds, "fp32", train_batch_size=7, micro_batch_size=2)


def test_lr_schedule_warmup_then_cosine():
    f = engine.lr_lambda("cosine", warmup_steps=2, total_steps=10)
    assert f(0) == 0.5 and f(1) == 1.0 and f(2) == 1.0
    assert abs(f(6) - 0.5) < 1e-9 and f(10) == 0.0
    assert engine.lr_lambda("constant", 0, 10)(5) == 1.0


def test_no_shared_memory_buffer_is_left_behind(tmp_path):
    """DeepSpeed's CPU shm all-reduce buffer (~67 MB in /dev/shm per rank and run) is unlinked after init."""
    import glob
    import os
    import socket
    import subprocess
    import sys

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import glob, os; from rlhf_cli import engine; engine.init_distributed(); "
            "print(len(glob.glob(f'/dev/shm/deepspeed_allreduce_buffer_*_{os.environ[\"MASTER_PORT\"]}_*')))")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0"  # gone while the process still runs
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []


def test_scoring_precision_is_fp32_only_where_the_weights_are(caplog):
    """`scoring_precision=fp32` computes the RL log-probs in fp32 under bf16-autocast (fp32 weights); bf16
    weights stay bf16, and the run is told so."""
    from rlhf_cli.engine import scoring_precision

    assert scoring_precision("bf16-autocast", "fp32") == "fp32"
    assert scoring_precision("bf16-autocast", "same") == "bf16-autocast"
    assert scoring_precision("fp32", "fp32") == scoring_precision("fp32", "same") == "fp32"
    assert not caplog.records
    with caplog.at_level("WARNING"):
        assert scoring_precision("bf16", "fp32") == "bf16"
    assert len(caplog.records) == 1 and "precision=bf16-autocast" in caplog.records[0].getMessage()
    assert scoring_precision("bf16", "same") == "bf16" and len(caplog.records) == 1


def test_hidden_module_cannot_be_imported_inside_the_block_only():
    """`engine._hidden` (DeepSpeed's import without mlflow): inside, the import fails as for a missing package;
    after, the module imports as usual; a module imported already is left alone."""
    import importlib
    import sys

    name = "json.tool"  # a real module this test process has not imported
    sys.modules.pop(name, None)
    with engine._hidden(name):
        with pytest.raises(ImportError):
            importlib.import_module(name)
    assert name not in sys.modules
    assert importlib.import_module(name).__name__ == name
    with engine._hidden(name):  # imported already: stays importable
        assert importlib.import_module(name) is sys.modules[name]
    sys.modules.pop(name)
    with pytest.raises(RuntimeError), engine._hidden(name):  # an error inside: the marker goes all the same
        raise RuntimeError
    assert name not in sys.modules


def test_importing_the_engine_leaves_mlflow_as_installed():
    """DeepSpeed is imported with mlflow hidden (its autotuner would import it, ~1 s); afterwards mlflow is not
    imported, and is importable exactly when it is installed (the mlflow tracker needs it; without mlflow this checks
    that no "not importable" marker is left behind)."""
    import subprocess
    import sys

    find = "import importlib.util; print(importlib.util.find_spec('mlflow') is not None)"
    installed = subprocess.run([sys.executable, "-c", find], capture_output=True, text=True, timeout=120)
    code = f"import sys, rlhf_cli.engine; print('mlflow' in sys.modules); {find}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", installed.stdout.strip()]


def test_the_frozen_weights_fingerprint_makes_no_whole_float64_copy():
    """`_frozen_record` (a LoRA engine's fingerprint of its frozen base) sums in float64 chunks of 1M elements: a
    whole float64 copy of each weight (of SmolLM2's embedding: 2 x 226 MB) stayed in the heap as free holes that the
    training's tensors did not fill, part of a LoRA reward model's extra peak RSS (docs/results.md). The sums are the
    float64 sums of the whole weights, to summation order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(3000, 700), torch.nn.Linear(700, 4))  # 2.1M embedding weights
    model[0].requires_grad_(False)
    largest = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest.extend(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.dtype == torch.float64)  # the copies made
            return out

    with Allocations():
        record = engine._frozen_record(model)
    whole = model[0].weight.detach().double()
    assert max(largest) <= (1 << 20) * 8 < whole.numel() * 8
    assert record["frozen_sum"] == pytest.approx(float(whole.sum()), rel=1e-12, abs=1e-9)
    assert record["frozen_abs_sum"] == pytest.approx(float(whole.abs().sum()), rel=1e-12)
    assert record["frozen_numel"] == 2_100_000 and record["trained"] == ["1.bias", "1.weight"]


def test_adamw_state_is_made_before_the_first_forward_and_changes_no_number():
    """ZeRO-0's torch AdamW gets its moments at construction (zeros, step 0; no weight moved, no gradient left
    behind), so they sit below the first activations in the heap; two optimizer steps then give bit for bit the
    weights of the same AdamW making its state lazily, as torch does."""
    ds = SimpleNamespace(zero_stage=0, offload_optimizer=False, offload_param=False, extra={})
    kw = dict(lr=1e-2, train_batch_size=4, micro_batch_size=2, total_steps=10, warmup_steps=1, scheduler="cosine",
              weight_decay=0.1, betas=(0.9, 0.95))
    model = _tiny()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng = engine.TrainEngine(model, ds, "fp32", **kw)
    params = [p for p in eng.module.parameters() if p.requires_grad]
    assert all(p.grad is None for p in params)
    assert all(torch.equal(v.cpu(), before[k]) for k, v in eng.module.state_dict().items())
    state = eng.engine.optimizer.state
    assert len(state) == len(params)
    for p in params:
        s = state[p]
        assert float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
    assert eng.lr() == pytest.approx(1e-2 * engine.lr_lambda("cosine", 1, 10)(0))  # restored as the schedule set it

    ref = _tiny().to(engine.device())
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    groups = [{"params": [p for p in ref_params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref_params if p.ndim < 2], "weight_decay": 0.0}]
    opt = engine._adamw(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, engine.lr_lambda("cosine", 1, 10))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 12), generator=g) for _ in range(6)]  # 3 steps of 2 micro-batches
    for i, x in enumerate(batches):
        on = x.to(engine.device())
        loss = eng.module(input_ids=on, labels=on).loss
        eng.backward_mean(loss)
        eng.step()
        (ref(input_ids=on, labels=on).loss / 2).backward()
        if i % 2:
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    assert eng.global_steps == 3
    for k, v in ref.state_dict().items():
        assert torch.equal(eng.module.state_dict()[k], v), k


def test_deepspeeds_bf16_optimizer_keeps_its_own_state():
    """precision=bf16 wraps torch's AdamW in DeepSpeed's optimizer, which makes the state with a step of its own
    at construction: that state is left as DeepSpeed made it (step 1), not reset."""
    ds = SimpleNamespace(zero_stage=0, offload_optimizer=False, offload_param=False, extra={})
    eng = engine.TrainEngine(_tiny(), ds, "bf16", lr=1e-2, train_batch_size=4, micro_batch_size=2, total_steps=10)
    inner = eng.engine.optimizer.optimizer
    assert eng.engine.optimizer is not inner
    assert {float(s["step"]) for s in inner.state.values()} == {1.0}


def test_ds_accelerator_cpu_wins_over_a_visible_gpu(monkeypatch):
    """`DS_ACCELERATOR=cpu` on a GPU machine: DeepSpeed keeps tensors on the CPU, so the engine's group, device and
    bf16 check follow it (an NCCL group broadcasting CPU tensors failed every PPO test on an H200, 2026-12-04)."""
    from rlhf_cli import engine

    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine.torch.cuda, "device_count", lambda: 1)
    for value, gpu in (("cpu", False), ("cuda", True), (None, True)):
        if value is None:
            monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        else:
            monkeypatch.setenv("DS_ACCELERATOR", value)
        assert engine._has_gpu() is gpu, value
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert engine.device() == engine.torch.device("cpu")


def test_close_distributed_destroys_an_nccl_group_through_deepspeed(monkeypatch):
    """Only an NCCL group is destroyed at the `rlhf` process's end (it warns at exit otherwise), and through DeepSpeed,
    which drops its own reference to the world group too; a gloo one is left to the exit. Neither is destroyed
    here: the call is recorded."""
    import deepspeed

    from rlhf_cli import engine

    engine.init_distributed()
    calls = []
    monkeypatch.setattr(deepspeed.comm, "destroy_process_group", lambda *a, **k: calls.append("deepspeed"))
    monkeypatch.setattr(engine.dist, "destroy_process_group", lambda *a, **k: calls.append("torch"))
    for backend, expected in (("gloo", []), ("nccl", ["deepspeed"])):
        monkeypatch.setattr(engine.dist, "get_backend", lambda *a, b=backend: b)
        calls.clear()
        engine.close_distributed()
        assert calls == expected, backend


def test_main_given_argv_leaves_the_group(monkeypatch, tmp_path):
    """`cli.main(argv)` (a caller's process, which goes on: tests, notebooks) leaves the process group as it is; only
    the `rlhf` process itself (main() reading sys.argv) closes it."""
    from rlhf_cli import cli, engine

    calls = []
    monkeypatch.setattr(engine, "close_distributed", lambda: calls.append(1))
    cli.main(tokenizer_override(["train-rm", "experiment=smoke", "rm.max_steps=1", f"paths.root={tmp_path}",
                                 "dry_run=true"]))
    assert calls == []
