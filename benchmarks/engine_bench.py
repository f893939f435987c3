"""The sampling engines side by side: `rollout.engine=hf` against `rollout.engine=vllm` on the same prompts.

Needs vLLM in the venv (`make install-vllm`). Each engine runs in its own process (vLLM binds OpenMP threads and
replaces `torch.set_num_threads` process-wide), in the order A-B-B-A over `--rounds` (hf, vllm, vllm, hf, ...),
on SmolLM2-135M-Instruct (or `--model tiny`) in the run's precision, vLLM in the dtype `rollout.engine_dtype`
gives it (`--engine-dtype`; auto: on the CPU train-ppo's beside its scoring passes' precision, fp32 under the
default bf16-autocast, and eval's in the run's precision), at three shapes:

    grpo   32 rollouts x 48 new tokens (grpo_bench: 4 prompts x 8 completions), one push before
    ppo    16 rollouts x 32 new tokens (ppo_bench), one push before
    eval   128 prompts x 2 sides x 48 new tokens (`rlhf eval`): start + policy + push + reference, the engine's
           start and warm-up included (once per run, as an eval pays them)

Per shape: generation seconds (warm, except eval's), sync seconds (the push of the policy's weights after a
change, vLLM's in-place reload, and the greedy probe's check after it where the engine is exact; 0 for hf, which
samples from the live module), the check's share of the sync (the probe's greedy requests ride in the
generation), generated tokens and tokens/s, and vllm/hf ratios. The built-in task's prompts, rendered and
tokenized by `rlhf_cli.data`; seeds per prompt.

    python benchmarks/engine_bench.py                       # bf16-autocast where native, else fp32 (precision=auto)
    python benchmarks/engine_bench.py --precision fp32 --rounds 1 --out results/engine_bench.json
    python benchmarks/engine_bench.py --engine-dtype bf16   # a bf16 engine beside the bf16-autocast hf sampler

`--parity` answers the other question, whether training on the engine learns as well: for each of `--seeds` it
trains `rlhf train-ppo experiment=grpo` once per engine (A-B-B-A over the seeds: hf then vllm for the 1st, 3rd,
... seed, vllm then hf for the others), then `rlhf eval experiment=grpo` samples both final policies on the same
held-out prompts with the same per-prompt noise (the vllm-trained one as the policy, the hf-trained one as the
reference, fp32 on the hf sampler). The table gives each seed's accuracies and paired difference, the accuracies
per prompt averaged over the seeds and their paired difference (vllm − hf) with a t interval over the prompts,
and each engine's training wall seconds.

    python benchmarks/engine_bench.py --parity --seeds 42,1 [--workdir DIR] [--out results/engine_parity.json]

`--prefix-cache` measures vLLM's prefix caching (on by default, reset after every push), on against off, at
grpo_bench's shape: `--iterations` GRPO iterations of 4 prompts x 8 samples x 48 new tokens, each after a push of
changed weights, the vLLM engine only, each setting in its own process in the order on off off on (`--rounds`).
It gives the generation seconds per iteration and the share of prompt tokens read from the cache. vLLM caches
whole KV blocks (128 tokens on the CPU backend, 16 on a GPU): the built-in task's prompts (~52 tokens) fill none
on the CPU, so `--system-prompt-words N` puts a system prompt of N words before each prompt (a long shared
prefix, as an agent's instructions or a multi-turn history give).

    python benchmarks/engine_bench.py --prefix-cache [--iterations 4] [--system-prompt-words 120]

With `--workdir`, each finished seed is kept in `seed_<s>/paired_seed.json`, and a later call at the same
`--precision` reads it instead of training that seed again (a run stopped midway, or more seeds added to the pool).
This comparison is `preset_bench.py`'s, with a = `rollout.engine=hf` and b = `rollout.engine=vllm`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, Table, compose, machine_info, model_label, write_outputs  # noqa: E402

SHAPES = {"grpo": (32, 48), "ppo": (16, 32), "eval": (128, 48)}
TINY_HEADS = ["model.arch.num_attention_heads=2", "model.arch.num_key_value_heads=2"]
"""`--model tiny`'s heads, made fewer and wider: vLLM's CPU attention needs a head size of 32 or more."""


def setup(model: str, precision: str, engine_dtype: str, extra: tuple[str, ...] = ()
          ) -> tuple[Any, str, Any, Any, list[list[int]]]:
    """A worker's train-ppo config (`extra` overrides added), its resolved precision, tokenizer, fp32 policy (autocast
    does the rest) and the built-in task's training prompts as ids."""
    from rlhf_cli.data import load_prompt_data
    from rlhf_cli.engine import resolve_precision
    from rlhf_cli.models import load_causal_lm
    from rlhf_cli.models.loading import load_tokenizer

    overrides = [f"model={model}", f"precision={precision}", "data.builtin.ppo_train=256",
                 f"rollout.engine_dtype={engine_dtype}", *extra]
    if model == "tiny":
        overrides += TINY_HEADS
    cfg = compose("train_ppo", overrides)
    tok = load_tokenizer(cfg.model)
    lm = load_causal_lm(cfg.model, "fp32", cfg.seed, tokenizer=tok)
    prompts = [p["prompt_ids"] for p in load_prompt_data(cfg.data, tok, "train")]
    return cfg, resolve_precision(cfg.precision), tok, lm, prompts


def nudge(lm: Any) -> None:
    """A policy update's worth of change to every weight, so the next push has something to carry."""
    import torch

    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(1.0 + 1e-4)


def run_workers(order: list[str], worker_args: Any, progress: Any = lambda name, result: f"({name}) done"
                ) -> dict[str, list[dict[str, Any]]]:
    """Each name of `order` in its own process (`--worker` followed by `worker_args(name)`, and a dir of its own),
    in that order, each done said on stderr (`progress(name, result)`); every worker's RESULT by name. Exits naming
    the worker that failed, with its stderr's tail."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in order}
    with tempfile.TemporaryDirectory(prefix="engine_bench_") as tmp:
        for i, name in enumerate(order):
            cmd = [sys.executable, __file__, "--worker", *worker_args(name), "--worker-dir",
                   str(Path(tmp) / f"{i}-{name}")]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ})
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"error: the {name} worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[name].append(json.loads(line[-1][len("RESULT "):]))
            print(f"  run {i + 1}/{len(order)} {progress(name, results[name][-1])}", file=sys.stderr)
    return results


def worker(engine_name: str, model: str, precision: str, workdir: Path, engine_dtype: str = "auto"
           ) -> dict[str, Any]:
    """One engine's measurements in this process (see the module docstring)."""
    from rlhf_cli.engine import scoring_precision
    from rlhf_cli.rollout import EngineSettings, Sampling, dtype_setting, make_generator

    cfg, precision, tok, lm, prompts = setup(model, precision, engine_dtype)

    def build(score_precision: str | None) -> Any:
        """The engine as the commands build it: train-ppo's beside its scoring passes' precision, eval's with
        none (nothing trains on its samples; `rollout.engine_dtype=auto` gives it the run's precision)."""
        return make_generator(engine_name, EngineSettings(
            precision=precision, chunk=32, workdir=workdir, max_model_len=cfg.data.max_prompt_length + 64,
            engine_dtype=cfg.rollout.engine_dtype, score_precision=score_precision))

    def dtype_of(gen: Any) -> str:  # as `rollout.engine_dtype` names it; hf samples under the run's precision
        return dtype_setting(gen.dtype) if hasattr(gen, "dtype") else precision

    gen = build(None)

    def sampling(n: int) -> Sampling:
        return Sampling(eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, max_new_tokens=n, temperature=1.0,
                        top_p=1.0)

    def timed(fn: Any, *args: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    def generated(batch: list[list[int]], seeds: list[int], n: int) -> tuple[Any, float, float]:
        """`gen.generate` timed: (generation, its seconds, the greedy probe's seconds). An exact engine (fp32
        beside fp32 scoring) probes in the first call after a push and adds it to `sync_seconds`: that is the
        sync's time, not the generation's."""
        before = gen.sync_seconds
        g, t = timed(gen.generate, batch, seeds, sampling(n))
        probe = gen.sync_seconds - before
        return g, t - probe, probe

    out: dict[str, Any] = {"engine": engine_name, "precision": precision, "engine_dtype": dtype_of(gen)}
    # eval first: a fresh engine pays its start and warm-up, as `rlhf eval` does
    rows, n = SHAPES["eval"]
    batch, seeds = prompts[:rows], list(range(rows))
    _, start = timed(lambda: gen.update_weights(lm))
    pol, t_pol, probe = generated(batch, seeds, n)
    start += probe
    nudge(lm)
    _, sync = timed(lambda: gen.update_weights(lm))
    ref, t_ref, probe = generated(batch, seeds, n)
    sync += probe
    out["eval"] = {"start": start, "generation": t_pol + t_ref, "sync": sync, "probe": probe,
                   "total": start + t_pol + sync + t_ref, "tokens": int(pol.mask.sum() + ref.mask.sum())}
    gen.close()
    # train-ppo's engine, started and warmed up untimed: grpo and ppo time a push and a warm rollout
    gen = build(scoring_precision(precision, cfg.scoring_precision))
    out["train_engine_dtype"] = dtype_of(gen)
    gen.update_weights(lm)
    gen.generate(prompts[:8], list(range(8)), sampling(8))
    for shape in ("grpo", "ppo"):
        rows, n = SHAPES[shape]
        batch, seeds = prompts[rows:2 * rows], list(range(rows))
        nudge(lm)
        _, sync = timed(gen.update_weights, lm)
        g, t, probe = generated(batch, seeds, n)
        sync += probe
        out[shape] = {"generation": t, "sync": sync, "probe": probe, "total": t + sync, "tokens": int(g.mask.sum())}
    gen.close()
    return out


GROUP_SHAPE = (4, 8, 48)
"""`--prefix-cache`: prompts per iteration, samples per prompt, new tokens (grpo_bench's defaults)."""


def prefix_cache_worker(on: bool, model: str, precision: str, workdir: Path, engine_dtype: str, iterations: int,
                        system_words: int) -> dict[str, Any]:
    """`--prefix-cache`: train-ppo's vLLM engine with prefix caching `on` or off, in this process: started and
    warmed up untimed, then `iterations` GRPO iterations (a push of changed weights, then 4 prompts x 8 samples, a
    seed each), timed as the grpo shape is (generation seconds without the probe's check)."""
    from rlhf_cli.engine import scoring_precision
    from rlhf_cli.rollout import EngineSettings, Sampling, dtype_setting, make_generator

    extra = ()
    if system_words:  # a fixed instruction of that many words, the same before every prompt
        words = ("Think step by step and give the final answer as a number " * system_words).split()[:system_words]
        extra = (f"data.system_prompt='{' '.join(words)}.'",)
    cfg, precision, tok, lm, prompts = setup(model, precision, engine_dtype, extra)
    P, G, n = GROUP_SHAPE
    gen = make_generator("vllm", EngineSettings(
        precision=precision, chunk=32, workdir=workdir, max_model_len=max(map(len, prompts)) + n + 8,
        engine_dtype=cfg.rollout.engine_dtype, score_precision=scoring_precision(precision, cfg.scoring_precision),
        prefix_caching=on))
    sampling = Sampling(eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, max_new_tokens=n, temperature=1.0,
                        top_p=1.0)
    gen.update_weights(lm)
    gen.generate(prompts[:8], list(range(8)), sampling)  # the start's self-test and warm-up, untimed
    cached = [0, 0]  # prompt tokens read from the prefix cache, prompt tokens, over the timed calls
    llm_generate = gen.llm.generate

    def counted(*args: Any, **kwargs: Any) -> Any:
        outs = llm_generate(*args, **kwargs)
        cached[0] += sum(o.num_cached_tokens or 0 for o in outs)
        cached[1] += sum(len(o.prompt_token_ids) for o in outs)
        return outs

    gen.llm.generate = counted
    seconds = []
    for it in range(iterations):
        nudge(lm)
        gen.update_weights(lm)
        batch = [prompts[8 + it * P + k] for k in range(P) for _ in range(G)]  # a group of G per prompt
        before, t0 = gen.sync_seconds, time.perf_counter()
        gen.generate(batch, list(range(it * P * G, (it + 1) * P * G)), sampling)
        seconds.append(time.perf_counter() - t0 - (gen.sync_seconds - before))
    gen.close()
    return {"prefix_caching": on, "precision": precision, "engine_dtype": dtype_setting(gen.dtype),
            "generation": seconds, "cached_frac": cached[0] / max(cached[1], 1),
            "prompt_tokens": sum(len(prompts[8 + k]) for k in range(P * iterations)) / (P * iterations)}


def prefix_cache(args: argparse.Namespace) -> None:
    """`--prefix-cache` (see the module docstring): on off off on, each in its own process; a table of the means."""
    order = ["on", "off", "off", "on"] * args.rounds
    results = run_workers(order, lambda name: [f"prefix-{name}", "--model", args.model, "--precision", args.precision,
                                               "--engine-dtype", args.engine_dtype, "--iterations",
                                               str(args.iterations), "--system-prompt-words",
                                               str(args.system_prompt_words)],
                          lambda name, r: f"(prefix caching {name}): {[round(x, 2) for x in r['generation']]} s")

    def mean(name: str, key: str) -> float:
        vals = [x for r in results[name] for x in (r[key] if isinstance(r[key], list) else [r[key]])]
        return sum(vals) / len(vals)

    P, G, n = GROUP_SHAPE
    table = Table(ours="on")
    table.columns = ("metric", "on", "off", "on/off")
    table.add("generation", f"grpo ({P} prompts x {G} samples x {n}): generation per iteration, s",
              mean("on", "generation"), mean("off", "generation"))
    table.add("cached_frac", "prompt tokens read from the prefix cache", mean("on", "cached_frac"),
              mean("off", "cached_frac"), ratio=False)
    first = results["on"][0]
    report(args.out, table, results,
           f"vLLM prefix caching, on vs off: {args.model}, {first['precision']}, engine {first['engine_dtype']}, "
           f"prompts {first['prompt_tokens']:.0f} tokens (system prompt {args.system_prompt_words} words)",
           f"order: {' '.join(order)} ({args.iterations} iterations per run, each after a push)",
           ["the vLLM engine only; a push of changed weights before each iteration"])


def parity(args: argparse.Namespace) -> None:
    """`--parity` (see the module docstring): experiment=grpo trained on each engine, per seed, judged paired
    (`preset_bench.paired_training` with a = hf, b = vllm)."""
    from preset_bench import paired_training

    paired_training([int(x) for x in args.seeds.split(",")], ("hf", ["rollout.engine=hf"]),
                    ("vllm", ["rollout.engine=vllm", f"rollout.engine_dtype={args.engine_dtype}"]),
                    precision=args.precision, workdir=args.workdir, out=args.out)


def report(out: str | None, table: Any, results: dict[str, Any], title: str, order: str, notes: list[str]) -> None:
    """Print the table under its header (title, machine, order) and write it to `out` with every run's figures."""
    info = machine_info()
    header = [title, f"machine: {info.get('cpu', '?')}, {info.get('cores', '?')} cores", order]
    print("\n".join(header))
    print("\n".join(table.lines()))
    write_outputs(out, header, table, notes, {"runs": results})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny (a smoke test of the script)")
    ap.add_argument("--precision", default="auto", help="the run's precision: auto, fp32, bf16-autocast")
    ap.add_argument("--engine-dtype", default="auto", help="vLLM's rollout.engine_dtype: auto, fp32, bf16")
    ap.add_argument("--rounds", type=int, default=1, help="A-B-B-A rounds (each runs both engines twice)")
    ap.add_argument("--out", default=None, help="also write the table as JSON and markdown")
    ap.add_argument("--parity", action="store_true", help="train experiment=grpo on each engine and judge them paired")
    ap.add_argument("--seeds", default="42,1", help="--parity: the training seeds, comma-separated")
    ap.add_argument("--workdir", default=None, help="--parity: keep run dirs here (default: a temp dir, removed)")
    ap.add_argument("--prefix-cache", action="store_true", help="vLLM's prefix caching on vs off at the grpo shape")
    ap.add_argument("--iterations", type=int, default=4, help="--prefix-cache: GRPO iterations per run")
    ap.add_argument("--system-prompt-words", type=int, default=0,
                    help="--prefix-cache: a system prompt of this many words before every prompt (0: none)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker and args.worker.startswith("prefix-"):
        print("RESULT " + json.dumps(prefix_cache_worker(args.worker == "prefix-on", args.model, args.precision,
                                                         Path(args.worker_dir), args.engine_dtype, args.iterations,
                                                         args.system_prompt_words)))
        return
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model, args.precision, Path(args.worker_dir),
                                            args.engine_dtype)))
        return
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.exit("error: engine_bench needs vLLM in this venv: run `make install-vllm` first")
    if args.parity:
        parity(args)
        return
    if args.prefix_cache:
        prefix_cache(args)
        return
    order = ["hf", "vllm", "vllm", "hf"] * args.rounds
    results = run_workers(order, lambda name: [name, "--model", args.model, "--precision", args.precision,
                                               "--engine-dtype", args.engine_dtype])

    def mean(name: str, shape: str, key: str) -> float:
        vals = [r[shape][key] for r in results[name]]
        return sum(vals) / len(vals)

    table = Table(ours="vllm")
    table.columns = ("metric", "vllm", "hf", "vllm/hf")
    for shape, (rows, n) in SHAPES.items():
        what = f"{rows} x 2 sides x {n}" if shape == "eval" else f"{rows} x {n}"
        if shape == "eval":
            table.add(f"{shape}_start", f"{shape} ({what}): engine start, s", mean("vllm", shape, "start"),
                      mean("hf", shape, "start"), ratio=False)
        table.add(f"{shape}_generation", f"{shape} ({what}): generation, s", mean("vllm", shape, "generation"),
                  mean("hf", shape, "generation"))
        table.add(f"{shape}_sync", f"{shape}: sync (push + probe), s", mean("vllm", shape, "sync"),
                  mean("hf", shape, "sync"), ratio=False)
        table.add(f"{shape}_probe", f"{shape}: of it, the probe's check, s", mean("vllm", shape, "probe"),
                  mean("hf", shape, "probe"), ratio=False)
        table.add(f"{shape}_total", f"{shape}: total, s" + (" (start, both sides, push)" if shape == "eval" else ""),
                  mean("vllm", shape, "total"), mean("hf", shape, "total"))
        table.add(f"{shape}_tps", f"{shape}: generated tokens/s",
                  mean("vllm", shape, "tokens") / mean("vllm", shape, "generation"),
                  mean("hf", shape, "tokens") / mean("hf", shape, "generation"))
    cfg = compose("train_ppo", [f"model={args.model}", *(TINY_HEADS if args.model == "tiny" else [])])
    precision = results["hf"][0]["precision"]
    report(args.out, table, results,
           f"sampling engines, hf vs vllm: {model_label(cfg.model)}, {precision}, vLLM's weights: eval "
           f"{results['vllm'][0]['engine_dtype']}, grpo and ppo {results['vllm'][0]['train_engine_dtype']}",
           f"order: {' '.join(order)} (means over {args.rounds * 2} runs per engine)",
           ["each engine in its own process; temperature 1, top-p 1, one seed per prompt",
            "eval: a fresh engine, its start and first-call warm-up included; grpo and ppo: warm, after a push"])


if __name__ == "__main__":
    main()
