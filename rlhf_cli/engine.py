"""The only module that imports DeepSpeed: process group, engines, backward/step, checkpoints.

One process, `torchrun` and the `deepspeed` launcher all work: rank, world size and the rendezvous
come from the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a lone process
gets a private rendezvous on 127.0.0.1. With no GPU visible DeepSpeed runs on the CPU accelerator
(`DS_ACCELERATOR=cpu`) over gloo.

Loss scaling lives here only. DeepSpeed averages gradients over data-parallel ranks and is never let
divide by the accumulation steps; a stage says which kind of loss it has:
  `backward_mean(loss)`    the mean over one micro-batch's rows (train-rm): scaled by 1 / accumulation
                           steps, so the optimizer sees the mean over the whole global batch;
  `backward_global(loss)`  already normalised over the whole global minibatch, so that the micro-batch
                           losses of every rank sum to it (PPO's token-mean): scaled by the world size,
                           undoing DeepSpeed's average over ranks.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlhf_cli.runs import save_error


def _has_gpu() -> bool:
    """Whether this process trains on a CUDA GPU: one is visible and DeepSpeed's accelerator is not set to the CPU.

    `DS_ACCELERATOR=cpu` on a GPU machine makes DeepSpeed keep every tensor on the CPU; the process group, the
    device and the precision checks must then be the CPU's too (gloo, not NCCL, which takes no CPU tensor).
    """
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


if not _has_gpu():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


@contextlib.contextmanager
def _hidden(module: str) -> Iterator[None]:
    """Inside the block, `import <module>` raises ImportError as if it were not installed (unless it is imported
    already); after it, the module imports as usual."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None  # type: ignore[assignment]  # the import system's "not importable" marker
    try:
        yield
    finally:
        if module in sys.modules and sys.modules[module] is None:
            del sys.modules[module]


# DeepSpeed's autotuner, which nothing here runs, imports mlflow on DeepSpeed's import wherever it is installed
# (the `mlflow` extra): ~1 s at the start of every command and rank. Hidden from that import only; the mlflow
# tracker (`logger=[...,mlflow]`) imports it as usual.
with _hidden("mlflow"):
    import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.base_optimizer import ZeROOptimizer  # noqa: E402

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Join (or create) the process group. Idempotent. Reads LOCAL_RANK/RANK/WORLD_SIZE from env."""
    if not _has_gpu():  # also when the group exists already: deepspeed.initialize may still build its backend
        _skip_shm_comm_op()
    _forget_destroyed_groups()  # also when another library made the new world (an in-process vLLM engine)
    if dist.is_available() and dist.is_initialized():
        if "LOCAL_RANK" not in os.environ and dist.get_world_size() == 1:  # a lone group another library made
            _lone_process_env()  # (an in-process vLLM engine started first): DeepSpeed reads these
        return
    if "RANK" not in os.environ:  # a lone process: rendezvous with itself
        _lone_process_env()
    backend = "nccl" if _has_gpu() else "gloo"
    if _has_gpu():
        torch.cuda.set_device(local_rank())
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    _unlink_shm_buffers()


_DEEPSPEED_GROUPS = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mesh_device", "mpu")
"""DeepSpeed's module-level references to process groups (its `groups` module), dropped by hand where its own
`_release_process_group_references` is missing (older DeepSpeed releases)."""


def _forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached process groups when they belong to a world that is gone: none exists now, or the one
    that does (made by us or by another library) does not hold DeepSpeed's clone. A live clone is kept (each engine
    calls `init_distributed`; re-cloning the world would be a collective on every rank).

    DeepSpeed keeps a clone of the world group (and its data-parallel groups) in module globals and forgets them only
    when the world is destroyed through its own comm module. vLLM's in-process shutdown destroys the world through
    torch (`cleanup_dist_env_and_memory`), so a second run in the same process (a Hydra `-m` sweep, an eval after
    a train) found the dead clone and failed in DeepSpeed's initialize ("Group ... is not registered")."""
    from deepspeed.utils import groups

    clone = getattr(groups, "_WORLD_GROUP", None)
    if clone is None:
        return
    if dist.is_available() and dist.is_initialized():
        try:
            dist.get_process_group_ranks(clone)
            return  # registered in the live world
        except (KeyError, ValueError, RuntimeError):
            pass
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)
        return
    for name in _DEEPSPEED_GROUPS:
        if hasattr(groups, name):
            setattr(groups, name, None)


def close_distributed() -> None:
    """Leave an NCCL process group at the end of a process's command (NCCL warns at exit of every GPU run otherwise),
    through DeepSpeed, which drops its own reference to the world group with it (torch's call alone leaves DeepSpeed
    a destroyed group, and the next engine built in this process fails on it).

    For a process about to exit (`cli.main` as the `rlhf` command), and never on error paths, where a rank must not
    wait for ranks that may never come. A gloo group (CPU) is left to the process's exit: it warns of nothing.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        deepspeed.comm.destroy_process_group()


def _lone_process_env() -> None:
    """The launcher's variables of a process that is the whole world (rank 0 of 1, a free local port)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())


def _skip_shm_comm_op() -> None:
    """Keep DeepSpeed from building and loading its CPU shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed's init_distributed JIT-compiles `deepspeed_shm_comm` (C++, 40-80 s on 2
    cores) into one cache shared by every environment of the user, so each new virtual environment, or another
    one used in between, compiles it again (measured here: 56 s before a run's first step). The op
    serves only DeepSpeed's `inference_all_reduce` (its inference engine), which rlhf_cli never calls; the
    training collectives go through torch.distributed (gloo) either way. Without it, `inference_all_reduce`
    falls back to torch.distributed too, and no shared-memory buffers are created (`_unlink_shm_buffers`
    remains for a DeepSpeed that builds it by another path).
    """
    import importlib

    # by module name: as an attribute, comm.torch of the deepspeed package is the torch package itself
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch_comm, "build_shm_op"):
        ds_torch_comm.build_shm_op = lambda: None


def _unlink_shm_buffers() -> None:
    """Remove the names of DeepSpeed's CPU shared-memory all-reduce buffers once every rank has mapped them.

    On CPU, DeepSpeed's shm comm op creates `/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`
    (~67 MB each) during init_distributed and never unlinks it: every run leaked that much RAM-backed
    tmpfs until the machine ran out of memory. Each rank opens the others' buffers inside init, so after a
    barrier the names can go; the mappings stay valid until the process exits.
    """
    if _has_gpu() or not os.path.isdir("/dev/shm"):
        return
    barrier()
    port = os.environ.get("MASTER_PORT", "")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank()}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    return torch.device(get_accelerator().device_name(local_rank())) if _has_gpu() else torch.device("cpu")


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and world_size() > 1:
        dist.barrier()


def lost_rank(e: BaseException) -> bool:
    """Whether `e` is a collective (or the launcher's store) failing because another rank went away: its process or
    node was killed (gloo: the connection was reset or closed), or it stopped answering past the process group's
    timeout (DeepSpeed's `DEEPSPEED_TIMEOUT`, minutes). Not a fault of this run's code or data: the run stays
    resumable. torch raises gloo's transport errors as plain RuntimeErrors naming their source file."""
    if isinstance(e, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(e, RuntimeError) and "gloo/transport/" in str(e)


WATCHDOG_EXIT = 3
"""The exit status of a process a `watchdog` stopped (a stall: not a user's mistake, 2, nor a crash, 1)."""
WATCHDOG_GRACE = 5.0
"""Seconds a stopping `watchdog` gives its `on_expiry` (writing the run's status) before the process ends."""


@contextlib.contextmanager
def watchdog(seconds: float, what: Callable[[], str], on_expiry: Callable[[str], None] | None = None
             ) -> Iterator[None]:
    """Bound the block's wall time: if it has not finished after `seconds`, a daemon thread writes one line (rank,
    `what()` the block was doing, the limit) to stderr, gives `on_expiry(line)` (e.g. the run's status) at most
    `WATCHDOG_GRACE` seconds in a thread of its own (a hung disk cannot keep the process alive; an error in it is
    ignored), and ends the process with `WATCHDOG_EXIT`, on this rank; under torchrun the launcher then stops the
    other ranks.

    Python cannot interrupt a thread stuck in C (a collective, an engine kernel): only the process can end, and no
    checkpoint is written then, so the last complete one stays as it was. Every rank bounds its own block: a rank
    waiting on a stalled one in a collective is stopped by its own watchdog as well. `seconds` must be finite;
    <= 0: no bound."""
    if seconds <= 0:
        yield
        return
    done = threading.Event()

    def bite() -> None:
        if done.wait(seconds):
            return
        line = (f"rank {rank()}: {what()} did not finish within {seconds:g} s (rollout.sync_timeout_s): stopping "
                f"(the last checkpoint is intact; resume=true continues from it)")
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        if on_expiry is not None:
            def expire() -> None:
                with contextlib.suppress(Exception):
                    on_expiry(line)

            helper = threading.Thread(target=expire, name="rlhf-watchdog-expiry", daemon=True)
            helper.start()
            helper.join(WATCHDOG_GRACE)
        os._exit(WATCHDOG_EXIT)

    thread = threading.Thread(target=bite, name="rlhf-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over ranks (a new tensor on `x`'s device; `x` unchanged). NCCL needs device
    tensors, so the reduction runs on `device()` whatever `x`'s device is."""
    if world_size() == 1:
        return x.detach().clone()
    y = x.detach().to(device(), copy=True)
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y.to(x.device)


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(x) / world_size()


def reduce_stats(stats: dict[str, float]) -> dict[str, float]:
    """Mean of each float stat over ranks (identity for one process)."""
    if world_size() == 1 or not stats:
        return dict(stats)
    keys = sorted(stats)
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
    t = all_reduce_mean(t)
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def all_gather_object(obj: Any) -> list[Any]:
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def bf16_is_fast() -> bool:
    """Whether bf16 matmuls run natively here: a bf16-capable GPU, or a CPU with AVX512-BF16/AMX.

    On an AVX2-only CPU bf16 matmuls are emulated and ~25x slower than fp32 (measured on this
    project's CI machine), so `precision=auto` picks fp32 there.
    """
    if _has_gpu():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - torch without oneDNN
        return False


def resolve_precision(precision: str) -> str:
    """`auto` -> `bf16-autocast` where bf16 is fast (see bf16_is_fast), else `fp32`; others unchanged."""
    if precision != "auto":
        return precision
    return "bf16-autocast" if bf16_is_fast() else "fp32"


def scoring_precision(precision: str, choice: str) -> str:
    """The precision of the scoring passes (config `scoring_precision`: log-probs, KL, reward-model scores)
    under a run's resolved `precision`.

    `choice="fp32"` under `bf16-autocast` gives `fp32` (the weights are fp32 there: the passes just run
    without autocast); otherwise the run's `precision`. Under `bf16` (bf16 weights) an fp32 pass would need
    an fp32 copy of every model, so the passes stay bf16 and this warns (callers call it once per run).
    """
    if choice == "fp32" and precision == "bf16-autocast":
        return "fp32"
    if choice == "fp32" and precision == "bf16":
        log.warning("scoring_precision=fp32 does not apply under precision=bf16 (bf16 weights): log-probs, the KL, "
                    "the ratio and reward scores carry bf16 rounding (docs/results.md, bf16); "
                    "precision=bf16-autocast computes them in fp32")
    return precision


def autocast(precision: str) -> contextlib.AbstractContextManager:
    """torch.autocast(bf16) for `bf16-autocast`, else a no-op."""
    if precision == "bf16-autocast":
        return torch.autocast(device_type=device().type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def ds_config(
    ds_cfg: Any,
    precision: str,
    *,
    train_batch_size: int,
    micro_batch_size: int,
    max_grad_norm: float = 0.0,
) -> dict[str, Any]:
    """DeepSpeed JSON config from our `deepspeed/` group and `precision`.

    train_batch_size is global (all ranks, one optimizer step); gradient accumulation steps are
    derived and must be whole (raises ValueError naming the numbers).
    """
    ws = world_size()
    if train_batch_size % (micro_batch_size * ws):
        raise ValueError(f"batch size {train_batch_size} is not divisible by "
                         f"micro batch {micro_batch_size} × world size {ws}")
    zero: dict[str, Any] = {"stage": int(ds_cfg.zero_stage)}
    if ds_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _has_gpu()}
    if ds_cfg.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": _has_gpu()}
    if zero["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    conf: dict[str, Any] = {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": train_batch_size // (micro_batch_size * ws),
        "gradient_clipping": float(max_grad_norm or 0.0),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    extra = _to_plain(ds_cfg.extra) if ds_cfg.extra else {}  # nested sections too: a DictConfig is no dict
    return _deep_merge(conf, dict(extra))


def _to_plain(x: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(x):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return x


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step s: linear warm-up then cosine/linear/constant."""
    total = max(1, total_steps)

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def _adamw(groups: list[dict[str, Any]], **kw: Any) -> torch.optim.Optimizer:
    """torch's AdamW, fused (one kernel over all tensors) where torch has it for the parameters' device.

    On CPU the default implementation loops over tensors in Python: on SmolLM2-135M that is ~1.9 s per
    step against ~0.25 s fused (2 cores). Same update rule; results differ only by float rounding.
    """
    params = [p for g in groups for p in g["params"]]
    try:  # torch checks fused support only at the first step(): check here, where a fallback is possible
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        fused = all(p.is_floating_point() and p.device.type in _get_fused_kernels_supported_devices() for p in params)
    except ImportError:  # pragma: no cover - a torch without the helper
        fused = False
    if not fused:
        log.info("fused AdamW not available for these parameters: using the foreach implementation")
    return torch.optim.AdamW(groups, fused=True, **kw) if fused else torch.optim.AdamW(groups, foreach=True, **kw)


def l2_norm(tensors: list[torch.Tensor], row: int = 4096) -> float:
    """The L2 norm of `tensors` (any shapes and float dtypes) viewed as one vector, as a Python float; 0.0 for none.

    Each tensor is summed in float32 rows of `row` elements and the rows' squares in float64: as exact as a float64
    pass over every element (DeepSpeed's ZeRO norm; measured within 3e-7 relative on 135M elements) at float32's
    speed (0.03 s for 135M elements on 2 cores against 0.65 s in float64). One float32 `vector_norm` over a whole
    tensor drifts on a CPU: -3e-4 relative on an embedding-sized gradient (49152 x 64), -1.4% on 135M elements.
    """
    squares = [torch.zeros((), dtype=torch.float64)]
    for t in tensors:
        flat = t.detach().reshape(-1).float()
        whole = flat.numel() - flat.numel() % row
        rows = [torch.linalg.vector_norm(flat[:whole].view(-1, row), dim=1)] if whole else []
        if whole < flat.numel():
            rows.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
        squares += [r.double().square().sum().cpu() for r in rows]
    return float(torch.stack(squares).sum().sqrt())


def zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A zero loss attached to every trainable parameter of `model`: what a skipped micro-step backpropagates,
    so that DeepSpeed's gradient accumulation stays in step on every rank."""
    return sum((p.float() * 0).sum() for p in model.parameters() if p.requires_grad)


FROZEN_KEY = "rlhf_frozen"  # a checkpoint's record of the frozen weights it was trained on (see TrainEngine.load)


def _frozen_record(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint that leaves the frozen weights out must match on resume: the names of the trained
    parameters, and the float64 sum and absolute sum of the frozen ones (a different base model, or the same
    path now holding other weights, changes them).

    Summed in float64 chunks of 1M elements (8 MB): a whole float64 copy of each weight (2 x 226 MB for SmolLM2's
    embedding) was freed before training but stayed in the heap (`cli.reuse_freed_memory`) as holes the first
    forwards did not fill: +0.36 GiB of a LoRA reward model's RSS from its engine setup on (docs/results.md)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    total = absolute = 0.0
    with torch.no_grad():
        for p in frozen:
            for chunk in p.detach().reshape(-1).split(1 << 20):
                chunk = chunk.double()
                total += float(chunk.sum())
                absolute += float(chunk.abs().sum())
    return {"trained": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "frozen_sum": total, "frozen_abs_sum": absolute, "frozen_numel": sum(p.numel() for p in frozen)}


def _check_frozen_record(saved: dict[str, Any] | None, now: dict[str, Any], where: str) -> None:
    """Raise ConfigError (one line) when the checkpoint at `where` was trained on other frozen weights or trains
    other parameters than this run's model."""
    from rlhf_cli.errors import ConfigError

    if saved is None:
        raise ConfigError(f"resume: the checkpoint {where} holds every weight (a full fine-tuning run) but this run "
                          f"freezes some (LoRA): resume it with its recorded config")
    if saved["trained"] != now["trained"]:
        extra = sorted(set(saved["trained"]) ^ set(now["trained"]))[:3]
        raise ConfigError(f"resume: the checkpoint {where} trained other parameters than this run's model "
                          f"({len(saved['trained'])} vs {len(now['trained'])}; e.g. {extra}): resume with the "
                          f"recorded model.lora.* settings")
    # float64 sums of the same weights agree to summation order (another torch, another device): a relative
    # 1e-9 of the absolute sum; other weights differ by far more
    tol = 1e-9 * max(now["frozen_abs_sum"], 1.0)
    if (saved["frozen_numel"] != now["frozen_numel"] or abs(saved["frozen_sum"] - now["frozen_sum"]) > tol
            or abs(saved["frozen_abs_sum"] - now["frozen_abs_sum"]) > tol):
        raise ConfigError(f"resume: the frozen base weights this run rebuilt differ from the ones the checkpoint "
                          f"{where} was trained on (sum {now['frozen_sum']:.9g} vs {saved['frozen_sum']:.9g}): the "
                          f"model path or pointer now names other weights; point model.name_or_path at the original")


def _exclude_tied_frozen(ds_engine: Any, model: torch.nn.Module) -> None:
    """Make `exclude_frozen_parameters` leave out every name of a frozen tensor, tied ones included.

    DeepSpeed drops the frozen names `named_parameters()` lists, which names a tied tensor once: a frozen
    embedding tied to the LM head stayed in every checkpoint under the head's name (a third of SmolLM2)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    base = ds_engine.module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        sd = base(*args, **kwargs)
        if kwargs.get("exclude_frozen_parameters"):
            for name in frozen:
                sd.pop(name, None)
        return sd

    ds_engine.module_state_dict = module_state_dict


def _allocate_adamw_state(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Make torch AdamW's moments now, before the first forward, as the first step would have made them: zeros,
    step 0. Made lazily by that step they land in the heap among the first micro-batches' freed activations
    (whether glibc keeps freed blocks, `cli.reuse_freed_memory`, or not), and every later step's activations grow
    the heap around them: train-sft on SmolLM2 (10 steps of 16, bf16-autocast, glibc's defaults) peaked 3.99 GiB
    made lazily, 3.83 made here (docs/results.md). Done by one AdamW step on zero gradients at lr 0, then step
    counts reset to 0: the moments stay exact zeros and every weight is unchanged (w - 0 * (wd * w + m / (sqrt(v)
    + eps)) = w), so no number of the run changes. For torch's own AdamW only (DeepSpeed's wrappers keep theirs)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    for p, g in zip(params, grads):
        p.grad = g


class TrainEngine:
    """A trainable model on DeepSpeed: AdamW, LR schedule, clipping, ZeRO stage, precision.

    Use: `with eng.autocast(): loss = ...`, then `eng.backward_mean(loss)` (or `backward_global`, see the
    module docstring) and `eng.step()` per micro-batch; DeepSpeed applies the optimizer at each
    accumulation boundary (`eng.is_boundary()` before step).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds_cfg: Any,
        precision: str,
        *,
        lr: float,
        train_batch_size: int,
        micro_batch_size: int,
        total_steps: int,
        warmup_steps: int = 0,
        scheduler: str = "constant",
        weight_decay: float = 0.0,
        betas: tuple = (0.9, 0.95),
        max_grad_norm: float = 0.0,
    ) -> None:
        init_distributed()
        self.precision = precision
        self.config = ds_config(ds_cfg, precision, train_batch_size=train_batch_size,
                                micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm)
        has_frozen = any(not p.requires_grad for p in model.parameters())
        frozen_record = _frozen_record(model) if has_frozen else None  # before ZeRO-3 partitions the weights
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        optimizer = _adamw(groups, lr=lr, betas=tuple(betas), eps=1e-8)
        scheduler_ = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(scheduler, warmup_steps, total_steps))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler_, config=self.config,
            dist_init_required=False)
        # torch's AdamW unwrapped (ZeRO-0 in fp32 or bf16-autocast): its state is made lazily. DeepSpeed's bf16 and
        # ZeRO optimizers wrap it and make theirs in their own way (bf16's with a step of its own): left alone
        if self.engine.optimizer is optimizer:
            _allocate_adamw_state(optimizer, params)
        # frozen weights (LoRA's base) are rebuilt from the model's source on resume: checkpoints leave them out,
        # and record a fingerprint of them (and the trained names) that `load` checks
        self.has_frozen, self._frozen_record = has_frozen, frozen_record
        if self.has_frozen:
            _exclude_tied_frozen(self.engine, model)
        self.grad_accum = self.config["gradient_accumulation_steps"]
        self.zero_stage = int(self.config["zero_optimization"]["stage"])
        # One rank without ZeRO has nothing to reduce, yet DeepSpeed's data-parallel all-reduce flattens every
        # gradient into a bucket and copies it back after each boundary's backward (~1 s per step for a 135M model
        # on 2 CPU cores). At world size 1 that is an identity (the sum of one rank, divided by 1) unless the
        # config asks for another communication dtype, a pre-division or boundaries of its own
        # (`managed_gradient_accumulation: false`), so then it is skipped; the one other
        # thing it does, a zero gradient for a trained parameter that got none (so that AdamW still decays it and
        # applies its momentum), `step` does. ZeRO 1-3 reduce into their partitions there, so they keep it.
        self._skip_allreduce = (self.zero_stage == 0 and world_size() == 1 and not any(
            k in self.config for k in ("communication_data_type", "prescale_gradients", "gradient_predivide_factor"))
            and self.config.get("managed_gradient_accumulation", True) is not False)
        if self._skip_allreduce:
            self.engine.enable_backward_allreduce = False
        self._grad_norm = float("nan")

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def backward_mean(self, loss: torch.Tensor) -> None:
        """Backward of a loss averaged over this micro-batch's rows (see the module docstring)."""
        self._backward(loss / self.grad_accum)

    def backward_global(self, loss: torch.Tensor) -> None:
        """Backward of a loss normalised over the whole global minibatch (see the module docstring)."""
        self._backward(loss * world_size())

    def _backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward, with the bookkeeping DeepSpeed's own `engine(...)` forward would have done.

        The stages run their forwards on `module` (a trunk, a head, packed rows: not one `engine(...)` call), so
        DeepSpeed's forward never runs, and with it two things its ZeRO optimizers need before each backward:
          `clear_backward_seen_flag()`  closes the previous micro-batch. ZeRO-3 counts its micro-batches there
              (`micro_step_id`), and it copies a micro-batch's reduced gradient partitions into its buffers at
              count 0 and adds them after: without it each backward overwrote the last, and an optimizer step with
              gradient accumulation used the last micro-batch's gradient only (2 ranks x 2 micro-batches: grad norm
              1.09 for 1.45; docs/results.md);
          `set_gradient_accumulation_boundary(...)`  tells the optimizer, before its gradient hooks fire, whether
              this backward ends the optimizer step. DeepSpeed set it only after the backward, so a boundary
              backward's hooks read the previous one's False, and with an offloaded optimizer (ZeRO-2 and ZeRO-3)
              the gradient buckets reduced during that backward (all but the last, `reduce_bucket_size`) never
              reached the optimizer's fp32 gradients.
        Called here, before the backward rather than before the forward, it is also right when the forwards of
        several micro-batches run first (`ppo.carried_forwards`): it closes exactly one micro-batch per backward.
        """
        opt = self.engine.optimizer
        if isinstance(opt, ZeROOptimizer):  # ZeRO 1-3 and bf16's optimizer; torch's own (ZeRO-0, fp32) keeps none
            opt.clear_backward_seen_flag()
            if self.zero_stage > 0:  # as DeepSpeed: bf16's ZeRO-0 optimizer reads no boundary
                opt.set_gradient_accumulation_boundary(self.engine.is_gradient_accumulation_boundary())
        self.engine.backward(loss, scale_wrt_gas=False)

    def is_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def step(self) -> None:
        """Per micro-batch; the optimizer (with clipping and the LR schedule) runs at boundaries."""
        if self._skip_allreduce and self.is_boundary():
            for p in self.module.parameters():
                if p.requires_grad and p.grad is None and p.numel():
                    p.grad = torch.zeros_like(p)
        if self.zero_stage == 0 and self.is_boundary():  # DeepSpeed records no norm without ZeRO
            self._grad_norm = l2_norm([p.grad for p in self.module.parameters() if p.grad is not None])
        self.engine.step()

    def grad_norm(self) -> float:
        """L2 norm of the last optimizer step's gradients (before clipping)."""
        if self.zero_stage == 0:
            return self._grad_norm
        g = self.engine.get_global_grad_norm()
        return float(g) if g is not None else float("nan")

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    def save(self, ckpt_dir: str, tag: str, client_state: dict[str, Any] | None = None,
             optimizer: bool = True) -> None:
        """Collective: every rank writes its shard of model, optimizer and scheduler state under ckpt_dir/tag.
        Frozen parameters (a LoRA model's base weights) are left out: the stage rebuilds them from the model's
        source before `load`. `optimizer=False` (`paths.keep_optimizer=false`, ZeRO 0-2 only: ZeRO-3's weights
        are the optimizer's partitions) leaves out the optimizer state (AdamW's moments and, with ZeRO or
        precision=bf16, its fp32 master weights): the weights, in the module's dtype, and the LR schedule stay."""
        if not optimizer and self.zero_stage == 3:
            raise ValueError("a ZeRO-3 checkpoint cannot leave out the optimizer state: it holds the weights")
        client_state = dict(client_state or {})
        if self._frozen_record is not None:
            client_state[FROZEN_KEY] = self._frozen_record
        ds, common = self.engine, self.engine._common_checkpoint_state
        zero_files = ds.save_zero_checkpoint
        if not optimizer:  # no ZeRO optimizer files; no optimizer state in the module's file
            ds.save_zero_checkpoint = False
            ds._common_checkpoint_state = lambda *a, **k: {**common(*a, **k), "optimizer": None}
        try:
            ds.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=self.has_frozen)
        except OSError as e:  # disk full, quota...: one line; ds/latest still names the previous checkpoint
            raise save_error(f"the DeepSpeed checkpoint {tag}", os.path.join(ckpt_dir, tag), e) from e
        finally:
            ds.save_zero_checkpoint = zero_files
            if not optimizer:
                del ds._common_checkpoint_state  # the class's method again

    def load(self, ckpt_dir: str, tag: str, optimizer: bool = True) -> dict[str, Any]:
        """Collective: restore model, optimizer, scheduler; returns the client_state saved with them.
        `optimizer=False` (a checkpoint saved without it): the weights and the LR schedule; the optimizer
        restarts (AdamW's moments at zero, fp32 master weights copied from the loaded ones)."""
        path, client_state = self.engine.load_checkpoint(ckpt_dir, tag=tag, load_optimizer_states=optimizer,
                                                         load_lr_scheduler_states=True,
                                                         load_module_strict=not self.has_frozen)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {ckpt_dir}")
        if not optimizer and self.zero_stage == 0 and hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()  # precision=bf16's optimizer: fp32 copies of the loaded weights
        # the next step's LR is this run's schedule at the loaded step: a run extended past its recorded end (more
        # rm.max_steps) would otherwise take its first step at the LR the shorter schedule left (0 for cosine)
        sched = self.scheduler
        for group, base, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)
        client_state = dict(client_state or {})
        saved = client_state.pop(FROZEN_KEY, None)
        if self._frozen_record is not None:
            _check_frozen_record(saved, self._frozen_record, os.path.join(ckpt_dir, tag))
        return client_state

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (un-partitioned) state dict on rank 0 (ZeRO-3 gathers; other stages return module's)."""
        if self.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.module.state_dict()

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Under ZeRO-3, gather all parameters for the block (e.g. for HF generate); no-op otherwise."""
        with self.gathered(list(self.module.parameters())):
            yield

    @contextlib.contextmanager
    def gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """Under ZeRO-3, gather `params` (whole on every rank, read-only) for the block; no-op otherwise. An
        engine's weight push gathers one layer at a time with it (`Generator.update_weights`)."""
        if self.zero_stage == 3 and params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield
        else:
            yield


class FrozenModel:
    """A model used only for inference (reference policy, reward model): no optimizer, no grads,
    eval mode, on the device. It is not partitioned under ZeRO-3 (each rank holds a full copy).

    offload=True keeps the weights in CPU memory and moves them to the device only inside `on_device()`
    (one copy in and out per rollout): device memory for the trained models, at the cost of a transfer.
    On a CPU-only machine it changes nothing.
    """

    def __init__(self, model: torch.nn.Module, precision: str, offload: bool = False) -> None:
        model.requires_grad_(False)
        model.eval()
        self.offload = offload and device().type != "cpu"
        self.module = model.to("cpu" if self.offload else device())
        self.precision = precision

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        """The module on the device for the block (moved there and back when offloaded)."""
        if not self.offload:
            yield self.module
            return
        self.module.to(device())
        try:
            yield self.module
        finally:
            self.module.to("cpu")
            if device().type == "cuda":
                torch.cuda.empty_cache()

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        yield

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
