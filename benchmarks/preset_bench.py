"""Two settings of one preset, trained on the same seeds and judged paired: does B learn better than A?

For each of `--seeds` it trains `rlhf train-ppo experiment=<preset>` once with the overrides of `--a` and once
with those of `--b` (A-B-B-A over the seeds: a then b for the 1st, 3rd, ... seed, b then a for the others), then
`rlhf eval experiment=<preset>` samples both final policies on the same held-out prompts with the same per-prompt
noise (b's as the policy, a's as the reference; fp32, the hf sampler). The trainings sample with `hf` too unless
an override names `rollout.engine`. The table gives each seed's checker
accuracies, paired difference (b − a) and training wall seconds, then the accuracies per prompt averaged over the
seeds and their paired difference with a t interval over the prompts: issue 42's "paired by prompt and pooled over
the seeds". Run it on an otherwise idle machine: the wall seconds are half the answer ("no slower").

    python benchmarks/preset_bench.py --b "ppo.filter_groups=true" --seeds 42,1,2 --workdir W [--out r.json]
    python benchmarks/preset_bench.py --a "" --b "ppo.mini_batch_size=8 ppo.clip_high=0.28" --name-b clip_high

With `--workdir`, each finished seed is kept in `seed_<s>/paired_seed.json`, and a later call with the same
settings reads it instead of training that seed again (a run stopped midway, or more seeds added to the pool).
`engine_bench.py --parity` is this comparison with a = `rollout.engine=hf`, b = `rollout.engine=vllm`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Table, check_child, machine_info, run_child, write_outputs  # noqa: E402


def paired_training(seeds: Sequence[int], a: tuple[str, list[str]], b: tuple[str, list[str]], *,
                    preset: str = "grpo", precision: str = "auto", common: Sequence[str] = (),
                    workdir: str | None = None, out: str | None = None) -> dict[str, Any]:
    """Train `experiment=<preset>` with `a`'s and `b`'s overrides (each a (name, overrides) pair) on every seed, judge
    them paired (see the module docstring), print the table and write it to `out` (JSON and markdown). `common`:
    overrides of both trainings and the eval (a model, fewer iterations). Returns the pooled paired difference
    {"mean", "ci95", "prompts", "seeds"} (b − a, checker accuracy)."""
    import torch

    from rlhf_cli.core.paired import mean_ci95

    (na, oa), (nb, ob) = a, b
    if na == nb:
        sys.exit(f"error: the two settings need different names (both {na!r})")
    settings = {"preset": preset, "precision": precision, "common": list(common), "a": [na, oa], "b": [nb, ob]}
    work = Path(workdir or tempfile.mkdtemp(prefix="preset_bench_")).resolve()
    runs: list[dict[str, Any]] = []
    try:
        for k, seed in enumerate(seeds):
            sub = work / f"seed_{seed}"
            rec: dict[str, Any] = {"seed": seed, "settings": settings, "wall_s": {}}
            done = sub / "paired_seed.json"
            kept = json.loads(done.read_text()) if done.is_file() else None
            if kept is not None and kept.get("settings") == settings:
                runs.append(kept)  # a seed finished by an earlier call with these settings: read, not re-run
                print(f"  seed {seed}: read from {done}", file=sys.stderr)
                continue
            for name, overrides in ((a, b) if k % 2 == 0 else (b, a)):
                engine = [] if any(o.startswith("rollout.engine=") for o in [*common, *overrides]) else [
                    "rollout.engine=hf"]  # one sampler for both, in a venv with vLLM too (the default `auto`)
                rec["wall_s"][name] = rlhf(["train-ppo", f"experiment={preset}", *engine, *common, *overrides,
                                            f"seed={seed}", f"precision={precision}", f"paths.root={sub / 'runs'}",
                                            f"hydra.run.dir={sub / name}"], sub / f"{name}.log")
            eval_dir = sub / "eval"
            rlhf(["eval", f"experiment={preset}", *common, "rollout.engine=hf", f"policy.path={sub / nb / 'final'}",
                  f"reference.path={sub / na / 'final'}", "precision=fp32", f"seed={seed}",
                  f"paths.root={sub / 'runs'}", f"hydra.run.dir={eval_dir}"], sub / "eval.log")
            rows = [json.loads(x) for x in (eval_dir / "responses.jsonl").read_text().splitlines()]
            if any(r.get("policy_correct") is None or r.get("reference_correct") is None for r in rows):
                sys.exit(f"error: experiment={preset}'s held-out prompts have no checker answers: the comparison "
                         f"reads checker accuracy (eval: {eval_dir})")
            rec["prompts"] = [r["prompt"] for r in rows]
            rec["correct"] = {nb: [float(r["policy_correct"]) for r in rows],
                              na: [float(r["reference_correct"]) for r in rows]}
            rec["eval"] = json.loads((eval_dir / "eval.json").read_text())["results"]
            done.write_text(json.dumps(rec))
            runs.append(rec)
            print(f"  seed {seed} done", file=sys.stderr)
    finally:
        if not workdir:
            shutil.rmtree(work, ignore_errors=True)
    if any(r["prompts"] != runs[0]["prompts"] for r in runs[1:]):
        sys.exit("error: the seeds' evals answered different held-out prompts; cannot pair them by prompt")
    table = Table(ours=nb)
    table.columns = ("metric", nb, na, f"{nb}/{na}")
    table.keys = (nb, na)
    for r in runs:
        table.add(f"seed_{r['seed']}_accuracy", f"held-out checker accuracy, seed {r['seed']}",
                  r["eval"]["policy/accuracy"], r["eval"]["reference/accuracy"], "{:.3f}", ratio=False)
        table.note(f"  {nb} − {na} (paired), seed {r['seed']}",
                   f"{r['eval']['accuracy_gain']:+.3f} ± {r['eval']['accuracy_gain_ci95']:.3f}")
        table.add(f"seed_{r['seed']}_wall_s", f"training wall s, seed {r['seed']}", r["wall_s"][nb],
                  r["wall_s"][na], "{:.0f}")
    vb = torch.tensor([r["correct"][nb] for r in runs]).mean(0)
    va = torch.tensor([r["correct"][na] for r in runs]).mean(0)
    (mb, cb), (ma, ca) = mean_ci95(vb), mean_ci95(va)
    n = vb.numel()
    table.add("accuracy", f"held-out accuracy, {n} prompts x {len(runs)} seeds", mb, ma, "{:.3f}", ratio=False)
    table.add("accuracy_ci95", f"  ± 95 % (t over the {n} prompts)", cb, ca, "{:.3f}", ratio=False)
    table.add("wall_s", "training wall s, mean over the seeds", sum(r["wall_s"][nb] for r in runs) / len(runs),
              sum(r["wall_s"][na] for r in runs) / len(runs), "{:.0f}")
    d, ci = mean_ci95(vb - va)
    table.note(f"accuracy, {nb} − {na}, by prompt over the {len(runs)} seeds",
               f"{d:+.3f} ± {ci:.3f} ({d - ci:+.3f} to {d + ci:+.3f})")
    pooled = {"mean": d, "ci95": ci, "prompts": n, "seeds": len(runs)}
    table.data["accuracy_diff_by_prompt"] = pooled
    info = machine_info()
    header = [f"`rlhf train-ppo experiment={preset}`, {nb} ({' '.join(ob) or 'the preset'}) vs {na} "
              f"({' '.join(oa) or 'the preset'}), judged paired by `rlhf eval experiment={preset}` (fp32, hf sampler)",
              f"machine: {info.get('cpu', '?')}, {info.get('cores', '?')} cores; precision {precision}; "
              f"seeds {', '.join(map(str, seeds))} (A-B-B-A)"]
    print("\n".join(header + table.lines()))
    write_outputs(out, header, table, [f"{nb}: {' '.join(ob) or 'the preset'}; {na}: {' '.join(oa) or 'the preset'}"],
                  {"seeds": [{k: v for k, v in r.items() if k != "prompts"} for r in runs]})
    return pooled


def rlhf(argv: list[str], log: Path) -> float:
    """`rlhf <argv>` in its own process as a user runs it (`run_child`, no allocator settings of ours), output to
    `log`; its wall seconds. Exits with the log's tail when it fails."""
    res = run_child([sys.executable, "-m", "rlhf_cli", *argv], log, allocator_env=False)
    check_child(f"rlhf {argv[0]}", res)
    return res.wall_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="", help="setting A's overrides, one shell-quoted string (default: the preset)")
    ap.add_argument("--b", required=True, help="setting B's overrides, one shell-quoted string")
    ap.add_argument("--name-a", default="preset", help="A's name in the table (default: preset)")
    ap.add_argument("--name-b", default="candidate", help="B's name in the table (default: candidate)")
    ap.add_argument("--preset", default="grpo", help="the experiment both train (default: grpo)")
    ap.add_argument("--common", default="", help="overrides of both trainings and the eval, keys both commands read "
                    "(`model=tiny`, `data.*`); train-ppo's own keys go in --a and --b")
    ap.add_argument("--precision", default="auto", help="the runs' precision: auto, fp32, bf16-autocast")
    ap.add_argument("--seeds", default="42,1,2", help="the training seeds, comma-separated")
    ap.add_argument("--workdir", default=None, help="keep run dirs here (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="also write the table as JSON and markdown")
    args = ap.parse_args()
    paired_training([int(x) for x in args.seeds.split(",")], (args.name_a, shlex.split(args.a)),
                    (args.name_b, shlex.split(args.b)), preset=args.preset, precision=args.precision,
                    common=shlex.split(args.common), workdir=args.workdir, out=args.out)


if __name__ == "__main__":
    main()
