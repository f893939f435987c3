"""`make demo` before and after a change, stage by stage in alternation, on this machine.

    python benchmarks/demo_ab.py                       # e2822bc (before issue 21) against HEAD, 2 runs
    python benchmarks/demo_ab.py --before REV --after REV --runs N --workdir DIR --out results.json

Both commits are extracted with `git archive` into `--workdir`, and each stage of the demo (the three commands of
scripts/demo.sh: `train-rm`, `train-ppo`, `eval eval.num_prompts=64 eval.max_new_tokens=32`) runs once on each side
as `python -m rlhf_cli ...` with that commit first on `PYTHONPATH`, in this venv, each side with its own
`paths.root`, after an untimed warm-up of each side's caches (`warm_up`). The order alternates: before first in odd
runs, after first in even ones, so a steady drift of the machine's speed cancels over two runs. Each side runs as
its code runs for a user: no allocator environment is added (the after side may set its own in-process), and
nothing else should run meanwhile.

The table gives each stage's wall seconds (process start to exit: imports, loading and saving included) per run and
side, the after/before ratio per run, and the whole demo's over all runs. Same-number checks: each side's
reward-model step-1 loss and PPO iteration-1 score, per run (sampling makes later PPO numbers differ).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ChildResult, Table, check_child, machine_info, run_child, versions, write_outputs  # noqa: E402

STAGES = (
    ("train-rm", ["train-rm"]),
    ("train-ppo", ["train-ppo"]),
    ("eval", ["eval", "eval.num_prompts=64", "eval.max_new_tokens=32"]),  # as scripts/demo.sh runs it
)
BEFORE = "e2822bc"  # the commit before issue 21's first step


def extract(rev: str, dest: Path) -> str:
    """`git archive` of `rev` into `dest` (kept when it is already there); returns the full commit id."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    if not (dest / "rlhf_cli" / "__main__.py").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha


def first_record(root: Path, stage: str, key: str) -> float | None:
    """`key` of the first record of the newest `<root>/<stage>/*/metrics.jsonl` (None when absent)."""
    runs = sorted(root.glob(f"{stage}/*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if not runs:
        return None
    for line in runs[-1].read_text().splitlines():
        rec = json.loads(line)
        if key in rec:
            return float(rec[key])
    return None


def run_stage(src: Path, root: Path, argv: list[str], extra: list[str], log: Path) -> ChildResult:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(src), DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"))
    cmd = [sys.executable, "-m", "rlhf_cli", *argv, f"paths.root={root}", *extra]
    res = run_child(cmd, log, env=env, cwd=src, allocator_env=False)
    check_child(" ".join(argv[:1]) + f" ({src.name})", res)
    return res


def warm_up(src: Path, work: Path, extra: list[str]) -> None:
    """Untimed, per side: the caches a first run on a fresh machine fills (the de-quantised model, each side in its
    own code's format, by a dry run; DeepSpeed's JIT-built ops, which the before side builds at its first start, by
    one step of the tiny model), so that neither side's first timed stage pays for them."""
    for name, argv in (("dry-run", ["train-rm", "dry_run=true", *extra]),
                       ("tiny", ["train-rm", "model=tiny", "rm.max_steps=1"])):
        run_stage(src, work / f"warm.{src.name}", argv, [], work / "logs" / f"warm.{src.name}.{name}.log")


def stage_table(seconds: dict[str, dict[str, list[float]]]) -> Table:
    """The table of `seconds[side][stage]` (one value per run): each stage per run, then the whole demo per run and
    over all runs; columns after, before and after/before."""
    table = Table()
    table.columns, table.keys = ("stage (wall s)", "after", "before", "after/before"), ("after", "before")
    runs = len(seconds["after"][STAGES[0][0]])
    total = {s: [sum(seconds[s][n][i] for n, _ in STAGES) for i in range(runs)] for s in seconds}
    for name, _ in STAGES:
        for i in range(runs):
            table.add(f"{name}.{i + 1}", f"{name}, run {i + 1}", seconds["after"][name][i],
                      seconds["before"][name][i], fmt="{:.1f}")
    for i in range(runs):
        table.add(f"demo.{i + 1}", f"whole demo, run {i + 1}", total["after"][i], total["before"][i], fmt="{:.1f}")
    table.add("demo", "whole demo, all runs", sum(total["after"]), sum(total["before"]), fmt="{:.1f}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default=BEFORE, help=f"the commit before the change (default {BEFORE}: before issue 21)")
    p.add_argument("--after", default="HEAD", help="the commit after it (default HEAD; commit your work first)")
    p.add_argument("--runs", type=int, default=2, help="runs; before goes first in odd ones, after in even (default 2)")
    p.add_argument("--demo-args", default="", help="extra overrides for every stage, e.g. 'model=tiny' (smoke test)")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed warm-up of each side's caches")
    p.add_argument("--workdir", default=None, help="keep sources, run dirs and logs here (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the results as JSON here and as markdown beside it")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="demo-ab-")).resolve()
    extra = args.demo_args.split()
    try:
        sides = {"before": args.before, "after": args.after}
        shas = {side: extract(rev, work / f"src.{side}") for side, rev in sides.items()}
        if not args.no_warm_up:
            for side in sides:
                warm_up(work / f"src.{side}", work, extra)
        seconds: dict[str, dict[str, list[float]]] = {s: {n: [] for n, _ in STAGES} for s in sides}
        checks: list[str] = []
        for run in range(1, args.runs + 1):
            order = ["before", "after"] if run % 2 else ["after", "before"]
            for name, argv in STAGES:
                for side in order:
                    res = run_stage(work / f"src.{side}", work / f"{side}.{run}", argv, extra,
                                    work / "logs" / f"{side}.{run}.{name}.log")
                    seconds[side][name].append(res.wall_s)
                    print(f"run {run} {name:9s} {side:6s} {res.wall_s:7.1f} s", flush=True)
            vals = {side: (first_record(work / f"{side}.{run}", "rm", "rm/loss"),
                           first_record(work / f"{side}.{run}", "ppo", "objective/scores")) for side in sides}
            checks.append(f"run {run}: reward-model step-1 loss {vals['before'][0]} / {vals['after'][0]}, "
                          f"PPO iteration-1 score {vals['before'][1]} / {vals['after'][1]} (before / after)")

        info = machine_info()
        v = versions()
        bf16 = "native" if info["bf16_native"] else "emulated (not native): precision=auto is fp32"
        header = [f"make demo, before ({shas['before'][:7]}) and after ({shas['after'][:7]}), stage by stage, "
                  f"{args.runs} run(s), before first in odd runs",
                  " | ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "deepspeed")),
                  f"machine: {info['gpu'] or info['cpu']}, {info['cores']} cores; bf16 {bf16}"]
        table = stage_table(seconds)
        print("\n".join(header + [""] + table.lines() + [""] + checks))
        write_outputs(args.out, header, table, checks, {"args": vars(args), "machine": info, "commits": shas,
                                                        "seconds": seconds})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
