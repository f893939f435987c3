"""`rollout.engine=vllm`: sampling through vLLM, in this process, beside the trainer (colocated).

The one module that imports `vllm` (an optional install: `make install-vllm`). The engine starts from a model
dir this module writes into the run dir (the policy's weights as the trainer holds them, LoRA merged), samples
from token ids with one seed per prompt, and takes each new policy through vLLM's in-place reload
(`reload_weights`), never by copying into its parameters: on the CPU backend those are packed copies that a
`copy_` would leave stale.

    VLLMGenerator       the engine behind the `Generator` seam (generation.py): start, `update_weights` (the push),
                        `generate`, the push self-test, the greedy probe, `close`
    fingerprint         a tensor's checksum: which tensors a push changed (`VLLMGenerator.tensors_changed`)
    engine_weights      the (name, tensor) pairs the engine loads: the checkpoint names of the trainer's causal LM,
                        LoRA merged under the base names, tied weights under each name; under ZeRO-3 one layer
                        gathered at a time
    check_head_size     the CPU attention's head sizes, checked before the engine starts
    unservable          why this vLLM cannot sample a model (`rollout.engine=auto` then samples with `hf`)

Exactness (measured on the tiny model and SmolLM2, docs/results.md): in fp32 the engine's log-probs of the sampled
tokens equal the trainer's to a few 1e-6 nats, after any number of pushes. The engine is built with
`logprobs_mode="processed_logprobs"` (log-probs after temperature and top-p, renormalised over the nucleus below
`top_p=1` as the trainer's are: `core.nucleus_logits`), the model's own `generation_config` set aside
(`generation_config="vllm"`: no repetition penalty or top-k of the checkpoint's), `skip_tokenizer_init` (ids in,
ids out: the caller tokenizes), without chunked prefill (a prompt's prefill split over two steps discards a
sampled token and rewinds its seeded generator, which the CPU backend cannot do: "CPU Generator does not use
offset", seen at 128 prompts) and, on the CPU, `enforce_eager` (compilation costs minutes and gains nothing at
these sizes).

Prefix caching is on (GRPO's samples of a prompt share the KV of their common prefix; whole blocks only: 128 tokens
on the CPU backend, 16 on a GPU, so the built-in task's ~52-token prompts hit nothing on the CPU), and every push
resets the prefix cache (`LLM.reset_prefix_cache`): its entries hold the keys and values the old weights computed,
and a prompt that hit them after a push would be sampled from the old weights silently, where neither the push's
checks nor a log-prob far from the trainer's would say why. After the reset the first prompt computes its prefix
afresh: a cached prompt after a push samples as a fresh engine from the pushed weights does (tests/engine_vllm).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.errors import ConfigError
from rlhf_cli.rollout.generation import Gather, Generation, Sampling, resolve_dtype, response_mask
from rlhf_cli.runs import set_status

log = logging.getLogger(__name__)


class EngineLog(logging.Handler):
    """Where vLLM's own log records (logger `vllm`) go: to the run's log file (the root logger's file handlers:
    Hydra's `<command>.log`), to the terminal too only with `rollout.engine_verbose=true`, and counted, so that
    the run says in one line which of its warnings it saw and whether they apply (`summary`, after each start and
    push). Errors always reach the terminal too, and so does everything where no log file is open. vLLM installs
    no handler of its own (`VLLM_CONFIGURE_LOGGING=0`, unless the environment sets it). Installed once, at import."""

    KNOWN = (
        ("disabling chunked prefill", "chunked prefill off on purpose, its outputs checked by the probe and "
         "rollout/engine_logprob_diff_mean"),
        ("Tokenizer not available", "ids in and out"), ("Chat template warmup", "ids in and out"),
        ("Using None for EOS", "ids in and out"), ("Failed to load weights", "rotary has no weights"),
        ("global random seed", "a seed per request"), ("LD_PRELOAD", "speed only"),
        ("set_num_threads", "speed only"), ("Triton", "CPU backend"), ("Enforce eager", "CPU backend"),
        ("Inductor", "CPU backend"), ("Model Runner V2", "CPU backend"), ("SSM cache", "CPU backend"),
    )
    """(text in vLLM's warning, why it changes nothing the run samples or trains): chunked prefill is off because a
    split prefill rewinds a seeded CPU generator; the trainer tokenizes and ends responses at the run's EOS set
    (`skip_tokenizer_init`); a rotary embedding has no weights to push, and every pushed name and shape is checked;
    every request carries its own seed (`seeds.derive_seed`); the rest is the CPU backend's speed or features."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.verbose = False
        self.seen: list[str] = []  # the WARNING+ messages since the last `summary`

    def emit(self, record: logging.LogRecord) -> None:
        if logging.WARNING <= record.levelno < logging.ERROR:
            self.seen.append(record.getMessage().splitlines()[0] if record.getMessage() else "")
        handlers = logging.getLogger().handlers
        to_file = any(isinstance(h, logging.FileHandler) for h in handlers)  # none: the terminal is all there is
        loud = self.verbose or record.levelno >= logging.ERROR or not to_file  # errors always reach the terminal
        for handler in handlers:
            if (loud or isinstance(handler, logging.FileHandler)) and record.levelno >= handler.level:
                handler.handle(record)

    def summary(self) -> str | None:
        """One line on the warnings seen since the last call (None when there were none): how many, where they are,
        and for each kind whether it applies; a warning this table does not know is quoted for the reader."""
        seen, self.seen = self.seen, []
        if not seen:
            return None
        verdicts: dict[str, int] = {}
        unknown: list[str] = []
        for message in seen:
            why = next((v for k, v in self.KNOWN if k in message), None)
            if why is None:
                unknown.append(message[:100])
            else:
                verdicts[why] = verdicts.get(why, 0) + 1
        to_file = any(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers)
        where = ("above" if self.verbose or not to_file
                 else "in the run's log file; rollout.engine_verbose=true shows them here")
        known = ", ".join(f"{why} ({n})" for why, n in verdicts.items())
        line = f"vLLM gave {len(seen)} warnings ({where})" + (f"; these change nothing sampled: {known}" if known
                                                               else "")
        return line + (f"; not known to rlhf, read them: {' | '.join(unknown[:3])}" if unknown else "")


ENGINE_LOG = EngineLog()
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records go through ENGINE_LOG, not its own handler
_vllm_logger = logging.getLogger("vllm")
_vllm_logger.addHandler(ENGINE_LOG)
_vllm_logger.propagate = False
_vllm_logger.setLevel(logging.INFO)

PROBE_PROMPTS = 2
"""How many of the run's first prompts the greedy probe decodes after each push (`VLLMGenerator.probes`). A stale
or mis-pushed engine fails on any prompt; each costs the trainer a forward of its prompt (SmolLM2, 2 CPU cores:
~0.13 s for 50 prompt tokens)."""
PROBE_TOKENS = 8
"""How many greedy tokens the probe decodes per prompt."""
SELFTEST_TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 1e-2}
"""Nats, by the engine's dtype: how far the push self-test lets a greedy token's log-prob after the push of the
unchanged starting weights be from the engine's first load (`VLLMGenerator.selftest`). fp32: not at all (the same
weights through the same kernels give the same bits); bf16/fp16: about one rounding step of a log-prob near 1 in
those formats (2^-7), for a backend whose kernels are not bitwise deterministic. Its greedy tokens must be equal in
every dtype."""
PROBE_TOLERANCE = 1e-3
"""Nats: a probe token passes when the trainer's log-prob of it is within this of the engine's and of the
trainer's largest (fp32: the two agree to ~2e-6; a tie between two tokens is not a failure)."""


def cpu_backend() -> bool:
    """Whether vLLM runs on its CPU backend here (no CUDA device)."""
    return not torch.cuda.is_available()


def unserved_head_size(config: Any) -> str | None:
    """Why vLLM's CPU attention cannot serve this model, in words, or None when it can.

    config: the causal LM's `PretrainedConfig`. The head sizes come from vLLM's CPU attention backend (32, 64, 80,
    ..., 512 in vLLM 0.32); a config without a head count passes (the engine decides).
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is None or head_dim in supported:
        return None
    return (f"vLLM's CPU attention serves head sizes {', '.join(map(str, supported))}, and this model's is {head_dim} "
            f"(hidden size {config.hidden_size} / {heads} heads)")


def transformers_backed(archs: Sequence[str]) -> str | None:
    """Why a model of these architectures cannot be sampled colocated, or None: vLLM serves every one it holds
    through its Transformers backend (GPT-NeoX in vLLM 0.32), which decorates transformers' own model classes for
    its compiler, in place, in this process. The trainer's copy of the model, an instance of the same class made
    before the engine, then fails in its next forward ("'GPTNeoXModel' object has no attribute 'do_not_compile'",
    found by the push self-test's probe on the family tests)."""
    from vllm import ModelRegistry

    held = [a for a in archs if a in set(ModelRegistry.get_supported_archs())]
    backed = [a for a in held if getattr(ModelRegistry.models[a], "module_name", "").endswith(".transformers")]
    if not held or len(backed) < len(held):
        return None
    return (f"vLLM serves {', '.join(backed)} only through its Transformers backend, which rewrites transformers' "
            f"own model class in this process and breaks the trainer's copy of the model")


def check_head_size(config: Any) -> None:
    """Refuse, in one line, a model whose attention head size vLLM's CPU attention cannot serve
    (`unserved_head_size`). Raises ConfigError naming the keys that set the head size."""
    why = unserved_head_size(config)
    if why is not None:
        raise ConfigError(
            f"rollout.engine=vllm: {why}: use rollout.engine=hf, or for model=tiny set model.arch.num_attention_heads "
            f"so that model.arch.hidden_size / heads is one of them (e.g. model.arch.num_attention_heads=2 "
            f"model.arch.num_key_value_heads=2)")


def unservable(config: Any) -> str | None:
    """Why this vLLM cannot sample this model beside the trainer, in words, or None when it can: an architecture
    vLLM's model registry does not hold; one it serves only through its Transformers backend (`transformers_backed`);
    or (on the CPU backend) an attention head size its CPU attention does not serve. `rollout.engine=auto` reads it
    to fall back to `hf`, and the engine's start refuses such a model in one line; config: the causal LM's
    `PretrainedConfig`."""
    from vllm import ModelRegistry

    archs = list(getattr(config, "architectures", None) or [])
    supported = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in supported for a in archs):
        return f"vLLM has no implementation of {', '.join(archs)}"
    if (why := transformers_backed(archs)) is not None:
        return why
    return unserved_head_size(config) if cpu_backend() else None


def engine_weights(model: torch.nn.Module, dtype: torch.dtype | None = None,
                   gather: Gather | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights an inference engine loads for a causal LM, under the names of its HF checkpoint.

    model: the trainer's causal LM (`models.lm_of`), with or without LoRA adapters injected by peft
    (`models.lora.add_lora`). Yields (name, tensor) for each name of `state_dict` (`engine_weight_shapes`), layer
    by layer in its order:
      - a LoRA layer's weight merged, W + ΔW with ΔW = peft's `get_delta_weight` (B·A·α/r), under the base name
        (`...q_proj.weight`, never `.base_layer.` or `lora_A/B`);
      - a head peft trains in full (`modules_to_save`) under the original name, with the trained copy's values;
      - a tied tensor (`lm_head.weight` sharing `embed_tokens.weight`) under each of its names: vLLM's in-place
        reload finishes a layer only when its weight arrives, and a push without `lm_head.weight` left the engine's
        head stale, silently (measured: 0.46 nats max log-prob gap after one perturbed push, 2e-6 with it).
    gather: None, the weights are whole as held: tensors are detached views (or casts) on their own device. Else
    `gather(params)` (`TrainEngine.gathered`: ZeRO-3) is opened over one layer's own parameters at a time (a LoRA
    layer's with its adapters), and each tensor is a copy made while they are whole, so a push holds one layer
    gathered, not the model. Tensors are cast to `dtype` when given, else as held.
    """
    from rlhf_cli.models.lora import lora_delta, lora_layers

    lora = set(lora_layers(model))
    whole: list[str] = []  # the prefixes of the LoRA layers yielded with their sub-modules
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(w) for w in whole):
            continue
        if module in lora:
            whole.append(prefix)
            entries = module.state_dict(prefix=prefix, keep_vars=True)
        else:  # the module's own parameters and persistent buffers (its sub-modules are units of their own)
            entries = {k: v for k, v in module.state_dict(prefix=prefix, keep_vars=True).items()
                       if "." not in k[len(prefix):]}
        if not entries:
            continue
        params = [t for t in entries.values() if isinstance(t, torch.nn.Parameter)]
        with gather(params) if gather is not None else contextlib.nullcontext():
            delta = lora_delta(module) if module in lora else None
            for key, tensor in entries.items():
                if "lora_" in key or ".original_module." in key:
                    continue
                base = _base_name(key)
                out = tensor.detach()
                if delta is not None and base == f"{prefix}weight":
                    out = out + delta.to(out.dtype)
                elif gather is not None:
                    out = out.clone()  # the gathered storage is freed when the layer's gather closes
                yield base, (out.to(dtype) if dtype is not None else out)


def engine_weight_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The names and full shapes `engine_weights(model)` yields, without gathering or copying a weight (a ZeRO-3
    parameter's full shape is its `ds_shape`)."""
    return {_base_name(k): tuple(getattr(t, "ds_shape", t.shape))
            for k, t in model.state_dict(keep_vars=True).items()
            if "lora_" not in k and ".original_module." not in k}


def fingerprint(tensor: torch.Tensor, chunk: int = 1 << 20) -> tuple[int, int]:
    """A checksum of `tensor`'s values, on its own device, without a copy of it beside the model: the sum of its
    elements' bit patterns (as integers of the element's width) and their sum weighted by position (mod 65521, plus
    one), both wrapping in int64. Equal tensors give equal fingerprints; a changed value changes the first (unless
    another change cancels it exactly) and a permutation of values the second. `chunk`: elements per step (bounds
    the int64 scratch to 16 MiB)."""
    bits = tensor.detach().contiguous().reshape(-1)
    bits = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
    plain = weighted = 0
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1
        plain += int(part.sum())
        weighted += int((part * pos).sum())
    return plain & (2**64 - 1), weighted & (2**64 - 1)


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{engine weight name: the first name of the tensor it shares} for the names `engine_weights(model)` yields: a
    tied tensor (`lm_head.weight` sharing `embed_tokens.weight`) maps both names to one, so a push counts it once."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if "lora_" in key or ".original_module." in key:
            continue
        name = _base_name(key)
        out[name] = first.setdefault(id(tensor), name)
    return out


def _base_name(key: str) -> str:
    """A state_dict key under its HF checkpoint name: peft's `.base_layer.` and `.modules_to_save.default.` out."""
    return key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def gpu_memory_utilization(free: int, total: int, share: float = 0.9) -> float:
    """vLLM's `gpu_memory_utilization` for an engine colocated with the trainer: `share` of the device memory
    free when the engine starts (the trainer's weights, optimizer state and activations already hold the rest), as a
    fraction of the whole device, rounded down to 0.01 (at least 0.01). vLLM refuses to start when the free memory
    is below utilization × total, and its default (0.9) assumes an empty device; the KV cache itself is sized by
    `rollout.kv_cache_gb` (`kv_cache_memory_bytes`), which this budget must hold.

    free, total: bytes (`torch.cuda.mem_get_info()`). Raises ValueError when total is not positive."""
    if total <= 0:
        raise ValueError(f"gpu_memory_utilization: total device memory {total} bytes")
    return max(0.01, int(100 * share * max(free, 0) / total) / 100)


def architecture(config: Any) -> dict[str, Any]:
    """What of a model's config the engine is built from: every key but the bookkeeping a run adds or a save
    rewrites (`_name_or_path` and other `_` keys, `rlhf_*` lineage, `transformers_version`, the dtype), so a policy
    and its reference of one architecture compare equal and share an engine."""
    skip = ("transformers_version", "torch_dtype", "dtype")
    return {k: v for k, v in config.to_dict().items() if not k.startswith(("_", "rlhf_")) and k not in skip}


def _holds_modules(worker: Any, names: Sequence[str]) -> list[bool]:
    """Run in the engine's worker (`LLM.collective_rpc`): for each weight name, whether the engine's model has the
    module that owns it (`lm_head` for `lm_head.weight`)."""
    model = worker.get_model()
    held = []
    for name in names:
        try:
            model.get_submodule(name.rpartition(".")[0])
            held.append(True)
        except AttributeError:
            held.append(False)
    return held


def selftest_verdict(loaded: Sequence[tuple[list[int], list[dict[int, float]]]],
                     pushed: Sequence[tuple[list[int], list[dict[int, float]]]], tolerance: float
                     ) -> tuple[str | None, float]:
    """The push self-test's comparison of two greedy decodes of the same prompts (`VLLMGenerator._greedy`: ids and
    top-2 log-probs per position), as loaded and after the push: (the first difference in words or None, the
    largest log-prob gap in nats). A token's log-prob may move by `tolerance`; a flipped token passes only as a near
    tie (both runs' top two within `tolerance`; never at 0), and the rest of that decode is not compared."""
    failure, worst = None, 0.0
    for k, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(loaded, pushed)):
        for t, (a, b) in enumerate(zip(ids_a, ids_b)):
            if a != b:
                tie = (tolerance > 0 and b in lp_a[t] and a in lp_b[t] and abs(lp_a[t][a] - lp_a[t][b]) <= tolerance
                       and abs(lp_b[t][b] - lp_b[t][a]) <= tolerance)
                if not tie and failure is None:
                    failure = (f"probe prompt {k}, greedy token {t}: {a} as loaded, {b} after the push (log-probs "
                               f"{lp_a[t][a]:.6f} and {lp_b[t][b]:.6f})")
                break
            gap = abs(lp_a[t][a] - lp_b[t][b])
            worst = max(worst, gap)
            if gap > tolerance and failure is None:
                failure = (f"probe prompt {k}, greedy token {t}: {a}, log-prob {lp_a[t][a]:.6f} as loaded, "
                           f"{lp_b[t][b]:.6f} after the push")
    return failure, worst


def greedy_params() -> Any:
    """vLLM's sampling settings of the probe's and the self-test's greedy decodes: `PROBE_TOKENS` tokens, EOS
    ignored, ids out, the log-probs of the two likeliest tokens at each position."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True, detokenize=False,
                          logprobs=2)


class VLLMGenerator:
    """`rollout.engine=vllm`: a vLLM engine in this process, reloaded with the policy's weights before each rollout.

    precision: the run's `precision`; score_precision: its scoring passes' (`engine.scoring_precision`; None:
    `precision`); engine_dtype: `rollout.engine_dtype` (with precision, the engine's dtype: `resolve_dtype`); chunk:
    unused (vLLM schedules its own batches; the samples do not depend on it); workdir: where the engine's model
    dir is written (the run dir; deleted by `close`); kv_cache_gb: the KV cache, GiB (`rollout.kv_cache_gb`);
    max_model_len: the longest prompt + response, tokens; probe: the greedy probe after each push (where the
    engine and the trainer's scoring passes are fp32: `probes`; see `probe`); selftest: the push self-test at the
    first `generate` after a start (`rollout.engine_selftest`; see `selftest`); sync_timeout_s: the bound on each
    push, self-test and probe (`rollout.sync_timeout_s`; see `_bounded`); prefix_caching: vLLM's prefix caching,
    its cache reset after every push (see the module docstring; off only to measure it: `engine_bench.py`).

    Weights: the first `update_weights(model)` writes `engine_weights(model)` and the model's config to
    `<workdir>/engine_model/` and starts the engine from it; later calls push the same names through vLLM's
    `reload_weights` (checkpoint format, the engine's own name mapping and packing). Under torchrun each rank runs
    its own engine (vLLM's `external_launcher`, one data-parallel replica per rank, as TRL's colocate mode), rank 0
    writing the model dir once. A push must carry exactly
    the names of that first checkpoint (vLLM's first load requires every weight of the model) with the same shapes;
    anything else raises. `sync_seconds`: the seconds of the last `update_weights` (the engine's start, or the push)
    and of the probe (and the self-test) after it; `start_seconds` the engine's last start. `tensors_changed`: how
    many of the engine's tensors the last push changed (see `_push`).
    """

    def __init__(self, precision: str, chunk: int = 32, workdir: str | Path | None = None, kv_cache_gb: int = 2,
                 max_model_len: int = 2048, probe: bool = True, engine_dtype: str = "auto",
                 score_precision: str | None = None, verbose: bool = False, selftest: bool = True,
                 sync_timeout_s: float = 600.0, prefix_caching: bool = True) -> None:
        if workdir is None:
            raise ValueError("VLLMGenerator needs a workdir (the run dir) for its model dir")
        self.precision, self.chunk = precision, int(chunk)
        ENGINE_LOG.verbose = bool(verbose)  # vLLM's own log on the terminal too (`rollout.engine_verbose`)
        self.dtype = resolve_dtype(precision, engine_dtype, score_precision)
        self.probes = bool(probe) and self.dtype == torch.float32 and (score_precision or precision) == "fp32"
        """Whether the greedy probe checks each push: asked for (`probe`), and the engine computes as the trainer's
        scoring passes do (both fp32), so its log-probs are the old log-probs to a few 1e-6 nats. Where it does not,
        train-ppo's drift rule (`EngineDriftGuard`) watches the log-prob diff instead."""
        self.model_dir = Path(workdir) / "engine_model"
        self.kv_cache_gb, self.max_model_len = int(kv_cache_gb), int(max_model_len)
        self.llm: Any = None
        self.lm: Any = None
        self.names: dict[str, tuple[int, ...]] = {}  # the engine's checkpoint: name -> shape
        self.sync_seconds = 0.0
        self.start_seconds = 0.0
        self.probe_prompts: list[list[int]] = []
        self._probe_due = False
        self._run_group = False
        self.architecture: dict[str, Any] = {}
        self.selftests = bool(selftest)
        self.sync_timeout_s = float(sync_timeout_s)
        self.workdir = Path(workdir)
        self._doing = ""  # what the engine's bounded step is doing now, for the watchdog's line
        self._selftest_due = False
        self._gather: Gather | None = None
        self.fingerprints: dict[str, tuple[int, int]] = {}  # the engine's weights now: name -> `fingerprint`
        self.tied: dict[str, str] = {}  # `tied_names` of the model the engine holds
        self.tensors_changed: int | None = None
        """How many of the engine's tensors the last push changed (a tied tensor once; a LoRA layer's merged weight
        once per adapted module), found by `fingerprint`; None after a start, 0 after the self-test's push of the
        unchanged weights. train-ppo logs it as `rollout/engine_tensors_changed`."""
        self.prefix_caching = bool(prefix_caching)  # vLLM's, reset after every push (`_reset_prefix_cache`)
        self.own_weights = True  # the engine's copy: train-ppo pushes with one layer gathered at a time (ZeRO-3)

    # -- weights -------------------------------------------------------------------------------------------
    def update_weights(self, model: Any, gather: Gather | None = None) -> None:
        """Sample from `model`'s current weights from now on: start the engine from them (first call, or a model
        of another architecture than the engine's: eval's reference may be one) or push them (later calls).
        `gather`: ZeRO-3's (see `engine_weights`), one layer's parameters whole at a time. Raises ValueError when
        the weights' names or shapes differ from the engine's checkpoint."""
        self.lm, self._gather = model, gather
        t0 = time.perf_counter()
        if self.llm is not None and architecture(model.config) != self.architecture:
            self._shutdown()  # another architecture: its own engine
        if self.llm is None:
            self._start(model, gather)
            self.tensors_changed, self._selftest_due = None, self.selftests
            self.start_seconds = time.perf_counter() - t0
            if engine.is_main():
                log.info("vLLM engine up from %s (%s) in %.1fs", self.model_dir,
                         str(self.dtype).removeprefix("torch."), self.start_seconds)
        else:
            self._push_everywhere(model, gather)
        said = ENGINE_LOG.summary()  # every rank empties its list; rank 0 says it
        if said and engine.is_main():
            log.info("%s", said)
        self.sync_seconds = time.perf_counter() - t0  # the probe, run at the next generate, adds to it
        self._probe_due = self.probes

    def _start(self, model: Any, gather: Gather | None) -> None:
        from safetensors.torch import save_file

        if cpu_backend():
            check_head_size(model.config)
        if (why := transformers_backed(list(getattr(model.config, "architectures", None) or []))) is not None:
            raise ConfigError(f"rollout.engine=vllm cannot sample this model beside the trainer: {why}; use "
                              f"rollout.engine=hf (auto does)")
        self.tied = tied_names(model)
        # a tied tensor under its first name only, as HF's own checkpoints hold it (vLLM ties the rest itself, and
        # a model without the second module, Gemma 2's `lm_head`, refuses the name)
        weights = {n: t.contiguous().cpu().clone() for n, t in engine_weights(model, self.dtype, gather)
                   if self.tied.get(n, n) == n}
        self.names = {n: tuple(t.shape) for n, t in weights.items()}
        self.fingerprints = {n: fingerprint(t) for n, t in weights.items()}
        self.architecture = architecture(model.config)
        if engine.is_main():  # the run dir is every rank's: one copy, written before any engine reads it
            if self.model_dir.exists():
                shutil.rmtree(self.model_dir)
            self.model_dir.mkdir(parents=True)
            save_file(weights, str(self.model_dir / "model.safetensors"), metadata={"format": "pt"})
            model.config.save_pretrained(self.model_dir)
        del weights
        engine.barrier()
        # in this process (no engine-core subprocess: colocated, and no spawn of the caller's __main__);
        # the CPU backend reads its KV cache size (GiB) from the environment
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict[str, Any] = {}
        if engine.world_size() > 1:  # an engine per rank, each its own data-parallel replica (TRL's colocate mode)
            kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                          data_parallel_size=engine.world_size())
        if cpu_backend():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gb)
        else:  # beside the trainer: the KV cache as asked, and a budget within what the trainer left free
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_gb << 30
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization(*torch.cuda.mem_get_info())
        import torch.distributed as dist
        from vllm import LLM

        self._run_group = dist.is_available() and dist.is_initialized()  # the run's group, which close() keeps
        self.llm = LLM(model=str(self.model_dir), dtype=self.dtype, skip_tokenizer_init=True,
                       logprobs_mode="processed_logprobs", generation_config="vllm",
                       enforce_eager=cpu_backend(), max_model_len=self.max_model_len, seed=0,
                       enable_prefix_caching=self.prefix_caching, enable_chunked_prefill=False,
                       max_num_batched_tokens=max(self.max_model_len, 8192), **kwargs)
        # a push carries a tied tensor under each name the engine's model has a module for: vLLM's in-place reload
        # finishes a layer only when its own weight arrives (Llama's `lm_head`), and refuses a name it has no
        # module for (Gemma 2's)
        extra = sorted(n for n, first in self.tied.items() if n != first)
        held = self.llm.collective_rpc(_holds_modules, args=(extra,))[0] if extra else []
        self.names.update({n: self.names[self.tied[n]] for n, ok in zip(extra, held) if ok})

    def _bounded(self, doing: str) -> contextlib.AbstractContextManager[None]:
        """`engine.watchdog` over one push, self-test or probe: past `rollout.sync_timeout_s` the process writes one
        line naming the rank and what it was doing (`doing`, and the tensor a push had reached), records it in the
        run's status (`stopped`), left `running`: a stall is no fault of the run's, so `resume=true` continues it
        from its last checkpoint; then it exits, and the other ranks' own watchdogs stop them as they wait for it."""
        self._doing = doing

        def stopped(line: str) -> None:
            if engine.is_main():
                set_status(self.workdir, "running", stopped=line)

        return engine.watchdog(self.sync_timeout_s, lambda: self._doing, stopped)

    def _push_everywhere(self, model: Any, gather: Gather | None) -> None:
        """`_push` under `_bounded`, then every rank learns whether any rank's push failed, so that all stop
        together: the failing rank raises its error (one line naming the tensor), the others one line saying
        which ranks failed, instead of waiting for them in their next collective."""
        failure: Exception | None = None
        with self._bounded("the weight push"):
            try:
                self._push(model, gather)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it before anyone raises
                failure = e
                # said at once, in case a peer never reaches the all-gather and the watchdog ends the run
                log.error("rank %d: %s failed: %s: %s", engine.rank(), self._doing, type(e).__name__, e)
            failed = engine.all_gather_object(failure is not None)
        if failure is not None:
            if isinstance(failure, ValueError):  # a push that does not fit the engine: names, shapes
                raise failure
            raise RuntimeError(f"rollout.engine=vllm: rank {engine.rank()}: {self._doing} failed: "
                               f"{type(failure).__name__}: {failure}") from failure
        if any(failed):
            ranks = ", ".join(str(r) for r, f in enumerate(failed) if f)
            raise RuntimeError(f"rollout.engine=vllm: the weight push failed on rank {ranks} (its own line says "
                               f"why); rank {engine.rank()} stops with it")

    def _carried(self, name: str) -> bool:
        """Whether a push carries weight `name`: any untied weight, and a tied one under each name the engine's
        model has a module for (see `_start`)."""
        return name in self.names or self.tied.get(name, name) == name

    def _push(self, model: Any, gather: Gather | None) -> None:
        """Stream `engine_weights(model)` into vLLM's reload. Every name and shape is checked against the engine's
        checkpoint twice: all of them from the model's state_dict before any weight moves, and each pushed tensor
        as it goes (the stream raises on a name the engine does not load or a wrong shape; a name never pushed
        raises after it). Under ZeRO-3 one layer is gathered at a time.

        Each pushed tensor's `fingerprint`, taken as it streams by, against the engine's last gives
        `tensors_changed`: the tensors whose values differ from the previous push (or the start), a tied tensor
        counted once."""
        self.tied = tied_names(model)
        self._check_push({n: s for n, s in engine_weight_shapes(model).items() if self._carried(n)})
        pushed: dict[str, tuple[int, ...]] = {}
        prints: dict[str, tuple[int, int]] = {}
        source = engine_weights(model, self.dtype, gather)

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in source:
                if not self._carried(name):
                    continue
                if self.names.get(name) != tuple(tensor.shape):
                    self._check_push({**self.names, name: tuple(tensor.shape)}, partial=True)
                pushed[name] = tuple(tensor.shape)
                prints[name] = fingerprint(tensor)
                self._doing = f"the weight push (at tensor {name})"
                yield name, tensor

        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checked(),
                                                              "is_checkpoint_format": True})
        except BaseException:
            # the engine stopped reading part-way: run the rest of the stream unpushed, so that under ZeRO-3 this
            # rank still joins every later layer's gather its peers make
            for _ in source:
                pass
            raise
        self._check_push(pushed)
        canonical = {n: self.tied.get(n, n) for n in prints}  # a tied tensor under its first name, counted once
        self.tensors_changed = len({canonical[n] for n, f in prints.items()
                                    if self.fingerprints.get(canonical[n]) != f})
        self.fingerprints = {n: f for n, f in prints.items() if canonical[n] == n}
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Drop the engine's prefix cache after a push (see the module docstring): its KV entries are the old
        weights'. Raises RuntimeError when vLLM cannot (a block still held by a request: none is between calls)."""
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("rollout.engine=vllm: vLLM could not reset its prefix cache after the weight push "
                               "(a request still holds its blocks); sampling on would read the old weights' keys "
                               "and values")

    def _check_push(self, got: dict[str, tuple[int, ...]], partial: bool = False) -> None:
        """Raise ValueError naming the pushed names the engine does not load, the engine weights not pushed (unless
        `partial`: a push under way) and the shapes that differ."""
        unknown = sorted(set(got) - set(self.names))
        missing = [] if partial else sorted(set(self.names) - set(got))
        wrong = sorted(n for n in set(got) & set(self.names) if got[n] != self.names[n])
        if unknown or missing or wrong:
            raise ValueError(
                "vLLM weight push: the policy's weights do not match the engine's checkpoint"
                + (f"; names the engine does not load: {', '.join(unknown[:5])}" if unknown else "")
                + (f"; engine weights not pushed: {', '.join(missing[:5])}" if missing else "")
                + (f"; shapes differ: {', '.join(wrong[:5])}" if wrong else ""))

    # -- sampling ------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], sampling: Sampling) -> Generation:
        """One response per prompt (see `Generator`), responses (B, max_new_tokens) on the CPU, with the engine's
        log-probs (after temperature and top-p) of the sampled tokens. The first call fixes the probe prompts."""
        from vllm import SamplingParams

        if self.llm is None:
            raise RuntimeError("VLLMGenerator.generate before update_weights(model)")
        seeds = [int(s) for s in seeds]
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"VLLMGenerator.generate: {len(seeds)} seeds for {len(prompt_ids)} prompts")
        if not self.probe_prompts:
            self.probe_prompts = [list(map(int, p)) for p in prompt_ids[:PROBE_PROMPTS]]
        if self._selftest_due:
            t0 = time.perf_counter()
            self.selftest()
            self.sync_seconds += time.perf_counter() - t0
        requests = [list(map(int, p)) for p in prompt_ids]
        params = [SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, seed=s % (2**63 - 1), logprobs=0,
                                 stop_token_ids=list(sampling.eos_ids), ignore_eos=False, detokenize=False,
                                 skip_special_tokens=False)
                  for s in seeds]
        probing, self._probe_due = self._probe_due, False
        if probing:  # the probe's greedy requests ride in the same engine call (its batch, not a call of their own)
            requests += self.probe_prompts
            params += [greedy_params()] * len(self.probe_prompts)
        outs = self.llm.generate([{"prompt_token_ids": r} for r in requests], params, use_tqdm=False)
        if probing:
            t0 = time.perf_counter()
            with self._bounded("the greedy probe after the push"):
                self.probe(outs[len(prompt_ids):])
            self.sync_seconds += time.perf_counter() - t0
            outs = outs[:len(prompt_ids)]
        B, R = len(outs), sampling.max_new_tokens
        responses = torch.full((B, R), sampling.pad_id, dtype=torch.long)
        logprobs = torch.zeros(B, R)
        for i, out in enumerate(outs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)[:R]
            responses[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, :len(ids)] = torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, ids)])
        responses, mask, has_eos = response_mask(responses, sampling.eos_ids, sampling.pad_id)
        return Generation(responses, mask, has_eos, logprobs * mask)

    def _greedy(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
        """The engine's greedy decodes of `prompts` (`greedy_params`): per prompt, the token ids and, per position,
        {token id: log-prob} of the two likeliest tokens."""
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], [greedy_params()] * len(prompts),
                                 use_tqdm=False)
        return [(list(out.outputs[0].token_ids),
                 [{int(t): float(lp.logprob) for t, lp in step.items()} for step in out.outputs[0].logprobs])
                for out in outs]

    def selftest(self) -> None:
        """The push self-test, once after each start (`rollout.engine_selftest`): the greedy decodes of the probe
        prompts from the engine as it loaded its model dir, then the same starting weights pushed through
        `reload_weights` (the path every later update takes) and decoded again. Each token's log-prob must be
        within `SELFTEST_TOLERANCE` of its dtype (fp32: equal) and the tokens equal, but where bf16 rounding flips
        a near tie (both runs' top two within the tolerance: the rest of that decode is not compared). It checks the
        push itself, in any dtype, where the greedy probe (`probe`, fp32 only) checks the engine against the
        trainer: a push that maps a name to the wrong tensor or packs a fused weight in the wrong order fails it
        before any rollout. Its push counts `tensors_changed` (0 when the push is sound).

        Raises ConfigError (one line, on every rank: each tests its own engine) naming the first difference, and
        RuntimeError when a decode fails (every rank stops with it)."""
        self._selftest_due = False
        prompts = self.probe_prompts
        tolerance = SELFTEST_TOLERANCE.get(self.dtype, 1e-2)
        failure, error, worst = None, None, 0.0
        with self._bounded("the push self-test"):
            try:
                loaded = self._greedy(prompts)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it before anyone raises
                error = e
            errors = engine.all_gather_object(error is not None)
        if not any(errors):
            self._push_everywhere(self.lm, self._gather)
            with self._bounded("the push self-test"):
                try:
                    failure, worst = selftest_verdict(loaded, self._greedy(prompts), tolerance)
                except Exception as e:  # noqa: BLE001
                    error = e
                verdicts = engine.all_gather_object((error is not None, failure is not None))
            errors = [e for e, _ in verdicts]
            failed = [f for _, f in verdicts]
        else:
            failed = []
        if error is not None:
            raise RuntimeError(f"rollout.engine=vllm: rank {engine.rank()}: the push self-test's greedy decode "
                               f"failed: {type(error).__name__}: {error}") from error
        if any(errors):
            raise RuntimeError(f"rollout.engine=vllm: the push self-test failed on rank "
                               f"{', '.join(str(r) for r, e in enumerate(errors) if e)} (its own line says why)")
        if any(failed):
            raise ConfigError(f"rollout.engine=vllm: the push self-test failed: the engine's starting weights, pushed "
                              f"back unchanged, sample otherwise than as loaded: {failure or 'on another rank'}; the "
                              f"weight push is broken for this model (rollout.engine=hf samples without it)")
        if engine.is_main():
            log.info("vLLM push self-test passed: the starting weights pushed back gave the loaded engine's greedy "
                     "tokens on %d probe prompt(s), log-probs %s (%d tensor(s) changed)", len(prompts),
                     "equal" if worst == 0 else f"within {worst:.2g} nats", self.tensors_changed)

    @torch.no_grad()
    def probe(self, outs: Sequence[Any]) -> None:
        """The greedy probe, after each push where `probes` holds: `outs`, the engine's greedy decodes of the probe
        prompts (`PROBE_TOKENS` each, run in the first `generate` after the push), must be the trainer's greedy
        tokens, with the trainer's log-probs.

        For every position, the trainer's fp32 log-softmax of the engine's token must be within `PROBE_TOLERANCE`
        of both the trainer's largest (a tie is not a failure) and the engine's own log-prob of it. A stale or
        mis-pushed engine fails it even where a small change leaves the greedy tokens as they were.
        Raises ConfigError (one line) naming the first mismatch.
        """
        lm = self.lm
        dev = next(lm.parameters()).device
        was_training = lm.training
        lm.eval()
        failure = None
        rows = [prompt + list(out.outputs[0].token_ids) for prompt, out in zip(self.probe_prompts, outs)]
        width = max(map(len, rows), default=0)  # no rows (a first call without prompts): nothing to check here
        # one right-padded forward for every probe prompt: a real token sees only the tokens before it
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=dev)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=dev)
        try:
            if rows:
                with torch.autocast(device_type=dev.type, enabled=False):  # the scoring passes' fp32
                    logits = lm(input_ids=ids, attention_mask=mask).logits
            for k, (prompt, out) in enumerate(zip(self.probe_prompts, outs)):
                tokens = list(out.outputs[0].token_ids)
                engine_lp = torch.tensor([step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)])
                logp = torch.log_softmax(logits[k, len(prompt) - 1:len(prompt) + len(tokens) - 1].float(), -1).cpu()
                mine = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
                gap = torch.maximum(logp.max(-1).values - mine, (engine_lp - mine).abs())
                if (gap > PROBE_TOLERANCE).any() and failure is None:
                    t = int((gap > PROBE_TOLERANCE).nonzero()[0])
                    failure = (f"probe prompt {k}, greedy token {t}: the engine's is {tokens[t]} (log-prob "
                               f"{float(engine_lp[t]):.4f}), the trainer's {int(logp[t].argmax())} (its log-prob of "
                               f"the engine's: {float(mine[t]):.4f})")
        finally:
            lm.train(was_training)
        # every rank stops together (each probes its own prompts): a rank raising alone would leave the others
        # waiting in their next collective
        if engine.all_reduce_sum(torch.tensor([float(failure is not None)])).item() > 0:
            raise ConfigError(f"rollout.engine=vllm: the engine's weights are not the trainer's: "
                              f"{failure or 'on another rank'}; the weight push went stale or missed a weight")

    def close(self) -> None:
        """Stop the engine and delete its model dir (rank 0).

        vLLM's in-process shutdown destroys the default process group (`cleanup_dist_env_and_memory`), which is the
        run's own when the run made it before the engine started (the stage still saves, reduces and barriers
        after): then the default group is kept through the shutdown, and only vLLM's own groups go."""
        self._shutdown()
        # no barrier: close() runs on error paths too, where another rank may never come; the engines read the dir
        # only at their start
        if engine.is_main():
            shutil.rmtree(self.model_dir, ignore_errors=True)

    def _shutdown(self) -> None:
        import torch.distributed as dist

        if self.llm is not None:
            destroy = dist.destroy_process_group
            if self._run_group:
                dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
            try:
                self.llm.llm_engine.engine_core.shutdown()
            finally:
                dist.destroy_process_group = destroy
            self.llm = None
            gc.collect()
