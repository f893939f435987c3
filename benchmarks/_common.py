"""Helpers shared by the benchmarks (rm_bench.py, sft_bench.py, ppo_bench.py, grpo_bench.py, demo_ab.py).

    require_trl()                          exit with the install hint when trl is missing
    header_lines(precision, trl_precision) versions and machine lines printed above every table
    compose(config_name, overrides)        the config `rlhf <command> <overrides>` would run with
    save_reward_model_init(model_cfg, ...) the base LM + a seeded scalar head, in HF seq-cls layout
    policy_dir(model_cfg, seed, workdir)   an HF dir holding the policy's initial weights
    compare_under(command)                 the `rlhf` command whose allocator settings both tools run under
                                           (bench_main(..., command) calls it)
    run_child(cmd, log_path)               a subprocess with its own wall time and peak RSS (by default with the
                                           allocator settings that command makes, `malloc_env`, for both tools)
    matmul_gflops(m, k, n, dtype)          measured matmul throughput (the hardware-limit row)
    real_response_tokens(responses, eos)   response tokens up to and including the first EOS
    Table                                  console table + markdown + JSON

Top-level imports are the standard library only: the TRL child processes import this module too,
and must not pay for (or be measured with) rlhf_cli's DeepSpeed import.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HH_PATH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
TRL_VERSION = "1.12.0"
PACKAGES = ("torch", "transformers", "deepspeed", "trl", "accelerate")


_COMPARED: list[Any] = []  # the `rlhf` command this benchmark measures and whether it trains LoRA (`compare_under`)


def compare_under(command: str, adapters: bool = False) -> None:
    """Say which `rlhf` command this benchmark measures, and whether its run trains LoRA adapters (`--lora-r`):
    both tools' children run under the malloc settings it makes (`malloc_env`). Called once by each benchmark's
    main."""
    _COMPARED[:] = [command, adapters]


def malloc_env() -> dict[str, str]:
    """glibc's settings that `rlhf <command>` makes in-process (`compare_under`; cli.reuse_freed_memory: large
    blocks from the heap, freed memory kept), as environment variables for every child, ours and TRL's: an
    allocator setting any torch user can make is not counted as ours; with `RLHF_MALLOC=compact` also its
    `GLIBC_TUNABLES`. Empty where that command makes none (its `Command.malloc` is `system`,
    `RLHF_MALLOC=system`, a preloaded allocator). Raises RuntimeError before `compare_under`."""
    from rlhf_cli.cli import MALLOC_MODES, malloc_mode, with_tunables

    if not _COMPARED:
        raise RuntimeError("benchmarks/_common.compare_under(command) first: which command's allocator to use")
    settings, tunables = MALLOC_MODES[malloc_mode(*_COMPARED)]
    # glibc reads mallopt's M_<NAME> from the environment as MALLOC_<NAME>_
    env = {f"MALLOC_{name[2:]}_": str(value) for name, (_, value) in settings.items()}
    if tunables:  # `compact` (a LoRA run's own, or RLHF_MALLOC=compact): ours restarts with them, TRL starts so
        env["GLIBC_TUNABLES"] = with_tunables(tunables)
    return env


# ----------------------------------------------------------------------------------------------
# environment


def require_trl(python: str | None = None) -> None:
    """Exit with one line when trl (the comparison) is not installed or is not the pinned version, in this
    interpreter or in `python` (`--trl-python`), asked in a process of its own: two venvs' interpreters resolve to
    one base binary, so a path comparison cannot tell them apart."""
    if python:
        proc = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('trl'))"],
                              capture_output=True, text=True)
        version = proc.stdout.strip() if proc.returncode == 0 else None
    else:
        try:
            version = importlib.metadata.version("trl")
        except importlib.metadata.PackageNotFoundError:
            version = None
    if version is None:
        sys.exit(f"error: trl is not installed{f' in {python}' if python else ''}; these benchmarks compare against "
                 f"trl=={TRL_VERSION}: pip install -e '.[bench]'")
    if version != TRL_VERSION:
        print(f"warning: trl {version} installed, the benchmarks were written against {TRL_VERSION} "
              f"(pip install -e '.[bench]')", file=sys.stderr)


def quiet() -> None:
    """The CLI's quieting of DeepSpeed and transformers (no per-file progress bars) for this process."""
    from rlhf_cli.cli import quiet_libraries

    quiet_libraries()


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """CPU model, cores, torch threads, GPU (if any) and whether bf16 matmuls are native here."""
    import torch

    from rlhf_cli.engine import bf16_is_fast

    info: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                            "bf16_native": bf16_is_fast()}
    return info


def header_lines(title: str, info: dict[str, Any], precision: str, trl_precision: str | None) -> list[str]:
    """The lines every benchmark prints first: what ran, pinned versions, machine, precision in force. `info` may
    carry a benchmark's own `precision_note` (what ours runs in fp32, if anything) and `layout` line."""
    v = versions()
    device = info["gpu"] or f"{info['cpu']}, {info['cores']} cores (torch threads {info['torch_threads']})"
    bf16 = "native" if info["bf16_native"] else "emulated (not native)"
    trl_mp = "?" if trl_precision is None else repr(trl_precision)
    packing = info.get("packing", "on")
    scoring = info.get("scoring_precision", "fp32")
    malloc = malloc_env()
    scoring_line = info.get("precision_note") or (
        "ours scores, and trains the PPO policy, in fp32 under bf16-autocast: scoring_precision=fp32, its default"
        if scoring == "fp32" else "ours runs every pass in the precision in force, as TRL does: "
        "scoring_precision=same (--scoring-precision same)")
    return [
        title,
        " | ".join(f"{k} {v[k]}" for k in PACKAGES),
        f"machine: {device}; bf16 {bf16}",
        f"precision in force: rlhf_cli precision={precision}, TRL accelerator.mixed_precision={trl_mp} "
        f"(bf16 mixed precision for both only where bf16 is native; {scoring_line})",
        info.get("layout") or (
            f"layout: ours data.packing={str(packing == 'on').lower()} (--packing {packing}: a shared prompt computed "
            f"once, sequences packed into rows; false: each sequence its own padded row), TRL each sequence its own "
            f"padded row"),
        info.get("trained", "trained: every weight (full fine-tuning), both tools"),
        "allocator, both tools: " + ("glibc keeps freed memory for reuse (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_="
                                     "2 GiB, what `rlhf` sets in-process" + (
                                         "; GLIBC_TUNABLES=" + malloc["GLIBC_TUNABLES"] + ", glibc's per-thread "
                                         "cache off as `RLHF_MALLOC=compact` has it" if "GLIBC_TUNABLES" in malloc
                                         else "") + ")"
                                     if malloc else
                                     "glibc's defaults or a preloaded allocator (`rlhf " + _COMPARED[0] + "`'s own, "
                                     "RLHF_MALLOC=system, LD_PRELOAD)"),
    ]


# ----------------------------------------------------------------------------------------------
# configs, models


def compose(config_name: str, overrides: Sequence[str]) -> Any:
    """The config `rlhf <command> <overrides>` runs with (Hydra compose, validated), `precision` resolved.

    Exits with the CLI's one-line message when an override is unknown or out of range.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_cli.config import ConfigError, register_configs
    from rlhf_cli.engine import resolve_precision
    from rlhf_cli.overrides import check_override_keys
    from rlhf_cli.preflight import VALIDATORS

    keep = [o for o in overrides if not o.startswith("hydra.")]
    try:
        check_override_keys(config_name, keep)
        register_configs()
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="rlhf_cli.conf", version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=keep)
        GlobalHydra.instance().clear()
        VALIDATORS[config_name](cfg)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    cfg.precision = resolve_precision(cfg.precision)
    return cfg


def model_label(model_cfg: Any) -> str:
    if model_cfg.init == "random":
        return f"{model_cfg.name} (random init)"
    return f"{model_cfg.name} ({model_cfg.name_or_path or model_cfg.gguf_file})"


def save_reward_model_init(model_cfg: Any, seed: int, out_dir: Path) -> dict[str, Any]:
    """Save the base LM with a new seeded scalar head (our `load_scalar_model`) as an HF
    `*ForSequenceClassification` dir with its tokenizer: the one initial reward model / critic both
    tools load. Returns {path, params, non_embedding_params, hidden_size, intermediate_size}."""
    from rlhf_cli.models import count_parameters, load_scalar_model, load_tokenizer, save_hf

    tokenizer = load_tokenizer(model_cfg)
    model = load_scalar_model(model_cfg, "fp32", seed)
    if not (out_dir / "config.json").is_file():
        save_hf(model, tokenizer, out_dir)
    text = model.config.get_text_config()
    return {"path": str(out_dir), "params": count_parameters(model, non_embedding=False),
            "non_embedding_params": count_parameters(model), "hidden_size": text.hidden_size,
            "intermediate_size": getattr(text, "intermediate_size", 4 * text.hidden_size)}


def policy_dir(model_cfg: Any, seed: int, workdir: Path) -> Path:
    """An HF dir with the policy's initial weights, as `load_causal_lm(model_cfg, seed=seed)` builds them:
    the de-quantised GGUF cache, the named dir, or (random init) a copy saved under `workdir`."""
    from rlhf_cli.models import load_causal_lm, load_tokenizer, resolve_hf_dir, save_hf
    from rlhf_cli.models.loading import dequantized_gguf_dir

    if model_cfg.init != "random" and model_cfg.name_or_path:
        return Path(resolve_hf_dir(model_cfg.name_or_path))
    if model_cfg.init != "random" and model_cfg.gguf_file:
        return dequantized_gguf_dir(model_cfg.gguf_file, model_cfg.cache_dir)[0]
    out = workdir / "policy_init"
    if not (out / "config.json").is_file():
        tokenizer = load_tokenizer(model_cfg)
        save_hf(load_causal_lm(model_cfg, "fp32", seed, tokenizer=tokenizer), tokenizer, out)
    return out


# ----------------------------------------------------------------------------------------------
# processes, timing


@dataclass
class ChildResult:
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    log_path: Path


def run_child(cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path = REPO,
              allocator_env: bool = True) -> ChildResult:
    """Run `cmd` in `cwd` (default: the repository root), output to `log_path`; its own peak RSS from wait4().
    `allocator_env` adds `malloc_env()` (the comparisons with TRL; demo_ab runs each side as it runs for a user).

    wait4 reports the max RSS of that one child (and any children it waited for), so two tools run
    one after the other get separate peaks (RUSAGE_CHILDREN would give the max over both).
    """
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(malloc_env() if allocator_env else {}),
                **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return ChildResult(proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * scale, log_path)


def check_child(name: str, res: ChildResult) -> None:
    """Exit with the tail of the child's log when it failed."""
    if res.returncode == 0:
        return
    tail = "\n".join(res.log_path.read_text(errors="replace").splitlines()[-40:])
    sys.exit(f"{tail}\nerror: {name} exited with status {res.returncode} (full log: {res.log_path})")


def self_rss_bytes() -> int:
    """Peak RSS of this process so far (children use it to report their own peak too)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def steady(values: Sequence[float]) -> list[float]:
    """Drop the first value (warm-up) when there are at least two."""
    return list(values[1:]) if len(values) >= 2 else list(values)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def matmul_gflops(m: int, k: int, n: int, dtype: str, min_time: float = 1.0) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) matmul in `dtype` on this machine's default device.

    2·m·k·n FLOPs per product; one small warm-up, then products until `min_time` seconds have passed
    (at least one), so an emulated bf16 matmul (~1 GFLOP/s on AVX2 CPUs) costs a few seconds, not minutes.
    """
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    a, b = torch.randn(m, k, device=dev).to(dt), torch.randn(k, n, device=dev).to(dt)
    _ = a[:64] @ b  # warm-up (kernel selection)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    sync()
    reps, t0 = 0, time.perf_counter()
    while reps == 0 or time.perf_counter() - t0 < min_time:
        _ = a @ b
        sync()
        reps += 1
    return 2.0 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def real_response_tokens(responses: Any, eos_id: int) -> int:
    """Tokens of (B, R) generated responses up to and including each row's first EOS (all R without one):
    the tokens the policy actually produced, the count `rlhf train-ppo` logs as generated tokens."""
    import torch

    is_eos = (responses == eos_id).long()
    before_or_at = (torch.cumsum(is_eos, dim=1) - is_eos) == 0
    return int(before_or_at.sum())


# ----------------------------------------------------------------------------------------------
# output


class Table:
    """Rows of (metric, ours, TRL, ratio) printed aligned, and written as markdown and JSON (a subclass may set
    more `columns`: `lines`, `markdown` and `note` follow their count)."""

    keys = ("rlhf_cli", "trl")  # the JSON names of the two value columns

    def __init__(self, title: str = "", ours: str = "rlhf_cli") -> None:
        self.title = title  # printed above a table that is not the first
        self.columns = ("metric", ours, "TRL", "ours/TRL")
        self.rows: list[list[str]] = []
        self.data: dict[str, dict[str, Any]] = {}

    def add(self, key: str, label: str, ours: float | None, trl: float | None, fmt: str = "{:.3g}",
            ratio: bool = True) -> None:
        def cell(x: float | None) -> str:
            return "n/a" if x is None or x != x else fmt.format(x)

        r = ours / trl if ratio and ours is not None and trl and ours == ours and trl == trl else None
        self.rows.append([label, cell(ours), cell(trl), "" if r is None else f"{r:.2f}x"])
        self.data[key] = {self.keys[0]: ours, self.keys[1]: trl, "ratio": r}

    def ratio_row(self, key: str, label: str, ratio: float) -> None:
        """A row with a ratio alone (e.g. a median of ratios, which no two columns divide into)."""
        self.rows.append([label, "", "", f"{ratio:.2f}x"])
        self.data[key] = {self.keys[0]: None, self.keys[1]: None, "ratio": ratio}

    def note(self, label: str, text: str) -> None:
        self.rows.append([label, text] + [""] * (len(self.columns) - 2))

    def lines(self) -> list[str]:
        widths = [max(len(r[i]) for r in [list(self.columns)] + self.rows) for i in range(len(self.columns))]

        def fmt(r: list[str]) -> str:
            return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

        return [fmt(self.columns), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in self.rows]

    def markdown(self) -> list[str]:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        return (["| " + " | ".join(self.columns) + " |", "| --- |" + " ---: |" * (len(self.columns) - 1)]
                + ["| " + " | ".join(esc(c) for c in r) + " |" for r in self.rows])


def write_outputs(out: str | None, header: list[str], table: Table, notes: list[str],
                  payload: dict[str, Any], more: Sequence[tuple[str, Table]] = ()) -> None:
    """Write `<out>` as JSON (header, notes, table data, `payload`, and each of `more`, (key, table), under its
    key) and `<out stem>.md` as markdown (the tables of `more` after the first, each under its title)."""
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"header": header, "notes": notes, "table": table.data, **{key: t.data for key, t in more}, **payload}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = path.with_suffix(".md")
    extra = [line for _, t in more for line in ["", f"**{t.title}**", "", *t.markdown()]]
    md.write_text("\n".join([f"**{header[0]}**", ""] + [f"- {h}" for h in header[1:]] + [""] + table.markdown()
                            + extra + [""] + [f"- {n}" for n in notes]) + "\n")
    print(f"results: {path} and {md}")


def emit(args: Any, info: dict[str, Any], header: list[str], table: Table, notes: list[str], precision: str,
         trl_precision: str, ours: tuple[ChildResult, dict[str, Any]], trl: tuple[ChildResult, dict[str, Any]],
         more: Sequence[tuple[str, Table]] = (), **payload: Any) -> None:
    """Print a comparison (header, table, the tables of `more` (key, table) under their titles, notes) and write
    it with `write_outputs`: the run's arguments, machine, versions, precisions, each tool's numbers with its
    process's peak RSS and wall time, `payload`."""
    extra = [line for _, t in more for line in ["", t.title, *t.lines()]]
    print("\n".join(header + [""] + table.lines() + extra + [""] + notes))
    sides = {name: {**numbers, "peak_rss_bytes": child.peak_rss_bytes, "wall_s": child.wall_s}
             for name, (child, numbers) in (("ours", ours), ("trl", trl))}
    write_outputs(args.out, header, table, notes, {
        "args": vars(args), "machine": info, "versions": versions(), "precision": precision,
        "trl_mixed_precision": trl_precision, **payload, **sides}, more)


def require_vllm(args: Any) -> None:
    """`--engine-column` needs vLLM in this venv (`make install-vllm`); exits with that line otherwise."""
    if getattr(args, "engine_column", False):
        try:
            import vllm  # noqa: F401
        except ImportError:
            sys.exit("error: --engine-column needs vLLM in this venv: run `make install-vllm` first")


def engine_table(hf: Sequence[dict[str, Any]], vllm: Sequence[dict[str, Any]], unit: str) -> Table:
    """The engine column: ours on `rollout.engine=vllm` against ours on `hf`, from the steady records of
    `ppo_bench.ours_iterations` (per step or iteration, `unit`): generation and engine-sync seconds (the push and,
    with an fp32 engine beside fp32 scoring, the greedy probe), their sum, the whole step, generated tokens/s, and
    vLLM's mean log-prob gap to the trainer."""
    t = Table("engine column: ours on rollout.engine=vllm vs hf (the same prompts and seeds)")
    t.columns = ("metric", "vllm", "hf", "vllm/hf")
    avg = lambda its, key: mean([x[key] for x in its])  # noqa: E731
    for key, label in (("generation", "generation"), ("engine_sync", "engine sync (push, probe)")):
        t.add(f"{key}_s", f"{label} s / {unit}", avg(vllm, key), avg(hf, key), ratio=key == "generation")
    both = lambda its: avg(its, "generation") + avg(its, "engine_sync")  # noqa: E731
    t.add("sampling_s", f"generation + sync s / {unit}", both(vllm), both(hf))
    whole = lambda its: sum(avg(its, k) for k in ("generation", "engine_sync", "scoring", "training"))  # noqa: E731
    t.add("total_s", f"s / {unit} (generation+sync+scoring+training)", whole(vllm), whole(hf))
    rate = lambda its: sum(x["gen_tokens"] for x in its) / sum(x["generation"] for x in its)  # noqa: E731
    t.add("gen_tokens_per_s", "generated tokens/s", rate(vllm), rate(hf))
    t.add("engine_diff", "mean |engine − trainer| log-prob, nats", avg(vllm, "engine_diff"), None, "{:.2e}",
          ratio=False)
    return t


def engine_overrides(args: Any) -> list[str]:
    """With `--engine-column` on `--model tiny`, every side's model gets a head size vLLM's CPU attention serves
    (hidden 64 / 2 heads = 32; the tiny default's 16 is refused); [] otherwise."""
    if getattr(args, "engine_column", False) and args.model == "tiny":
        return ["model.arch.num_attention_heads=2", "model.arch.num_key_value_heads=2"]
    return []


def add_engine_args(p: Any) -> None:
    """`--engine-column` of grpo_bench and ppo_bench (`engine_table`)."""
    p.add_argument("--engine-column", action="store_true",
                   help="also run ours on rollout.engine=vllm (needs `make install-vllm`) in every round or seed, "
                        "A-B-B-A with ours on hf, and print an engine table: generation and sync s, vllm vs hf")


def on_engine(overrides: list[str], name: str) -> list[str]:
    """Ours' `overrides` with `rollout.engine=<name>` (replacing any engine they set): the TRL comparisons pin
    ours' sampler, as `rollout.engine=auto` picks vLLM wherever it is installed."""
    return [*(o for o in overrides if not o.startswith("rollout.engine=")), f"rollout.engine={name}"]


def supervised_overrides(section: str, args: Any, work: Path) -> list[str]:
    """The keys every supervised comparison sets alike (`config.SupervisedConfig`, under `section`: rm, sft, dpo,
    kto): the batch and micro-batch, AdamW's lr, betas and weight decay, the schedule, clipping, no evaluation or
    checkpoint during the run, the seed and the run root under `work`; from the options each benchmark names alike
    (`--batch-size`, `--micro-batch-size`, `--lr`, `--betas`, ...)."""
    s = section
    return [f"{s}.batch_size={args.batch_size}", f"{s}.micro_batch_size={args.micro_batch_size}",
            f"{s}.lr={args.lr}", f"{s}.betas=[{args.betas[0]},{args.betas[1]}]",
            f"{s}.weight_decay={args.weight_decay}", f"{s}.warmup_ratio={args.warmup_ratio}",
            f"{s}.lr_scheduler={args.lr_scheduler}", f"{s}.max_grad_norm={args.max_grad_norm}", f"{s}.eval_every=0",
            f"{s}.save_every=0", f"seed={args.seed}", f"paths.root={work / 'runs'}"]


def packing_override(args: Any) -> str:
    """Ours' `data.packing=...` override for `--packing`."""
    return f"data.packing={str(args.packing == 'on').lower()}"


def scoring_override(args: Any) -> str:
    """Ours' `scoring_precision=...` override for `--scoring-precision`."""
    return f"scoring_precision={args.scoring_precision}"


def lora_overrides(args: Any) -> list[str]:
    """Ours' `model.lora.*` overrides for `--lora-r` / `--lora-alpha` ([] for full fine-tuning)."""
    if not args.lora_r:
        return []
    return [f"model.lora.r={args.lora_r}", f"model.lora.alpha={lora_alpha(args)}", "model.lora.dropout=0.0",
            "model.lora.target_modules=all-linear"]


def lora_alpha(args: Any) -> float:
    return float(args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r)


def trl_lora_spec(args: Any) -> dict[str, Any] | None:
    """What the TRL child needs to build the same LoRA: peft's LoraConfig arguments, or None."""
    if not args.lora_r:
        return None
    return {"r": args.lora_r, "lora_alpha": lora_alpha(args), "lora_dropout": 0.0, "target_modules": "all-linear"}


def layout_lora_line(args: Any) -> str:
    """The header's line on what is trained: every weight, or LoRA's settings (both tools)."""
    if not args.lora_r:
        return "trained: every weight (full fine-tuning), both tools"
    return (f"trained: LoRA r={args.lora_r} alpha={lora_alpha(args):g} dropout 0 on all linear layers of the trunk, "
            f"both tools (ours model.lora.*, TRL a peft LoraConfig)")


def add_common_args(p: Any) -> None:
    """The options every TRL comparison shares: `--model`, `--workdir`, `--precision`, `--out`, `--packing` (ours'
    `data.packing`: `packing_override(args)`), `--scoring-precision` (`scoring_override(args)`), `--lora-r` /
    `--lora-alpha` (`lora_overrides(args)`, `trl_lora_spec(args)`), and the hidden `--trl-child` of its TRL
    process."""
    p.add_argument("--model", default="smollm2", help="our model config group: smollm2 (default) or tiny (smoke test)")
    p.add_argument("--workdir", default=None, help="keep run dirs and models here (default: a temp dir, removed)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-autocast"],
                   help="both tools' precision: auto (default) is bf16 mixed precision where bf16 is native, "
                        "else fp32; bf16-autocast forces it (on an AVX2-only CPU bf16 is emulated: numerically "
                        "real, ~7-25x slower)")
    p.add_argument("--out", default=None, help="also write the results as JSON here and as markdown beside it")
    p.add_argument("--packing", default="on", choices=["on", "off"],
                   help="ours: data.packing=true (a shared prompt computed once, sequences packed into rows; the "
                        "default) or false (every sequence its own padded row, as TRL lays them out)")
    p.add_argument("--scoring-precision", default="fp32", choices=["fp32", "same"],
                   help="ours' scoring_precision: fp32 (default: under bf16-autocast the log-prob, reference and "
                        "reward passes and the PPO training forward run in fp32) or same (every pass in the "
                        "precision in force, as TRL runs them; no effect in fp32)")
    p.add_argument("--lora-r", type=int, default=0,
                   help="LoRA rank for both tools (0: full fine-tuning, the default): ours model.lora.r, TRL a peft "
                        "LoraConfig with the same r, alpha and target modules (all linear layers of the trunk)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha for both tools (default: 2 x --lora-r)")
    p.add_argument("--trl-python", default=sys.executable,
                   help="the interpreter of the TRL process (default: this one); e.g. the README's venv with "
                        "'.[bench]' when this one is vLLM's (`--engine-column`: vLLM pins an older transformers "
                        "than TRL 1.12's PPOTrainer takes)")
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)


def bench_main(args: Any, trl_child: Callable[[str], None], run: Callable[[Any, Path, dict[str, Any]], None],
               prefix: str, command: str) -> None:
    """The shared entry point: a TRL child process (`--trl-child SPEC`) or the comparison itself, in
    `--workdir` (kept) or a temp dir (removed afterwards); `run(args, work, machine_info())` with logs quiet, both
    tools under the malloc settings of `rlhf <command>` (`compare_under`)."""
    compare_under(command, bool(getattr(args, "lora_r", 0)))
    if args.trl_child:
        trl_child(args.trl_child)
        return
    require_trl(args.trl_python)
    work = Path(args.workdir or tempfile.mkdtemp(prefix=f"{prefix}-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        quiet()
        run(args, work, {**machine_info(), "packing": args.packing, "scoring_precision": args.scoring_precision,
                       "trained": layout_lora_line(args)})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
