"""`make demo` before and after a change, stage by stage in alternation, on this machine.

    python benchmarks/demo_ab.py                       # e2822bc (before issue 21) against HEAD, 2 runs
    python benchmarks/demo_ab.py --before REV --after REV --runs N --workdir DIR --out results.json

Both commits are extracted with `git archive` into `--workdir` (`src.<commit id>`, byte-compiled), and each stage
of the demo (the three commands of scripts/demo.sh: `train-rm`, `train-ppo`, `eval eval.num_prompts=64
eval.max_new_tokens=32`) runs once on each side as `python -m rlhf_cli ...` with that commit first on `PYTHONPATH`,
in this venv, each side with its own `paths.root`, after an untimed warm-up of each side's caches (`warm_up`). The
order alternates: before first in odd runs, after first in even ones (`--first after` swaps them), so a steady drift
of the machine's speed cancels over two runs. Each side runs as its code runs for a user: no allocator environment
is added (the after side may set its own in-process), and nothing else should run meanwhile. Run it in the
README's venv, without vLLM: with it, `rollout.engine=auto` (the default since 886ae7c) samples a side with vLLM.

The table gives each stage's wall seconds (process start to exit: imports, loading and saving included) per run and
side, the after/before ratio per run, and the whole demo's over all runs. Same-number checks: each side's
reward-model step-1 loss and PPO iteration-1 score, per run (sampling makes later PPO numbers differ). When a stage
fails or the benchmark is stopped, the runs completed so far are still tabulated, and the work dir is kept.
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
import _common as C  # noqa: E402

STAGES = (
    ("train-rm", ["train-rm"]),
    ("train-ppo", ["train-ppo"]),
    ("eval", ["eval", "eval.num_prompts=64", "eval.max_new_tokens=32"]),  # as scripts/demo.sh runs it
)
BEFORE = "e2822bc"  # the commit before issue 21's first step


def extract(rev: str, work: Path) -> tuple[str, Path]:
    """`git archive` of commit `rev` into `<work>/src.<commit id>`, byte-compiled, unless a complete extraction of
    that commit is already there (its `.extracted` marker, written last); returns (full commit id, that dir)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=C.REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = work / f"src.{sha[:12]}"
    if not (dest / ".extracted").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=C.REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        # a user's install has its bytecode: neither side's timed stages should compile modules
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest / "rlhf_cli")], check=True)
        (dest / ".extracted").write_text(sha + "\n")
    return sha, dest


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


def run_stage(src: Path, root: Path, argv: list[str], extra: list[str], log: Path) -> C.ChildResult:
    """`python -m rlhf_cli <argv> paths.root=<root> <extra>` with `src` first on PYTHONPATH and as working dir (the
    caller's PYTHONPATH dropped), output to `log`; exits with the log's tail when the stage fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(src), DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"))
    cmd = [sys.executable, "-m", "rlhf_cli", *argv, f"paths.root={root}", *extra]
    res = C.run_child(cmd, log, env=env, cwd=src, allocator_env=False)
    C.check_child(f"{argv[0]} ({src.name})", res)
    return res


def warm_up(src: Path, work: Path, extra: list[str]) -> None:
    """Untimed, per side: the caches a first run on a fresh machine fills (the de-quantised model and tokenizer under
    `~/.cache/rlhf_cli`, by a dry run; DeepSpeed's JIT-built ops, which the before side builds at its first start, by
    one step of the tiny model), so that neither side's first timed stage pays for them."""
    for name, argv in (("dry-run", ["train-rm", "dry_run=true", *extra]),
                       ("tiny", ["train-rm", "model=tiny", "rm.max_steps=1"])):
        run_stage(src, work / f"warm.{src.name}", argv, [], work / "logs" / f"warm.{src.name}.{name}.log")


def stage_table(seconds: dict[str, dict[str, list[float]]]) -> C.Table:
    """The table of `seconds[side][stage]` (one value per run): each stage per run, then the whole demo per run and
    over all runs; columns after, before and after/before."""
    table = C.Table()
    table.columns, table.keys = ("stage (wall s)", "after", "before", "after/before"), ("after", "before")
    runs = min(len(seconds[side][name]) for side in seconds for name, _ in STAGES)  # complete runs
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
    p.add_argument("--runs", type=int, default=2,
                   help="1 or even; --first goes first in odd runs, the other side in even ones (default 2)")
    p.add_argument("--first", default="before", choices=["before", "after"],
                   help="the side that goes first in odd runs (default before; after: to add an after-first run to "
                        "an earlier one)")
    p.add_argument("--demo-args", default="", help="extra overrides for every stage, e.g. 'model=tiny' (smoke test)")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed warm-up of each side's caches")
    p.add_argument("--workdir", default=None, help="keep sources, run dirs and logs here (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the results as JSON here and as markdown beside it")
    args = p.parse_args()
    if args.runs < 1 or (args.runs > 1 and args.runs % 2):
        p.error(f"--runs must be 1 or even (got {args.runs}): a steady drift cancels over pairs of runs only")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="demo-ab-")).resolve()
    extra = args.demo_args.split()
    sides = ("before", "after")
    first = sides if args.first == "before" else sides[::-1]
    seconds: dict[str, dict[str, list[float]]] = {s: {n: [] for n, _ in STAGES} for s in sides}
    checks: list[str] = []
    shas: dict[str, str] = {}
    finished = False
    try:
        src = {}
        for side in sides:
            shas[side], src[side] = extract(getattr(args, side), work)
        if not args.no_warm_up:
            for side in sides:
                warm_up(src[side], work, extra)
        for run in range(1, args.runs + 1):
            order = first if run % 2 else first[::-1]
            for name, argv in STAGES:
                for side in order:
                    res = run_stage(src[side], work / f"{side}.{run}", argv, extra,
                                    work / "logs" / f"{side}.{run}.{name}.log")
                    seconds[side][name].append(res.wall_s)
                    print(f"run {run} {name:9s} {side:6s} {res.wall_s:7.1f} s", flush=True)
            vals = {side: (first_record(work / f"{side}.{run}", "rm", "rm/loss"),
                           first_record(work / f"{side}.{run}", "ppo", "objective/scores")) for side in sides}
            checks.append(f"run {run}: reward-model step-1 loss {vals['after'][0]} / {vals['before'][0]}, "
                          f"PPO iteration-1 score {vals['after'][1]} / {vals['before'][1]} (after / before)")
        finished = True
    finally:
        if checks:  # the complete runs, also when a stage failed or the benchmark was stopped
            report(args, shas, seconds, checks, finished)
        if args.workdir is None and finished:
            shutil.rmtree(work, ignore_errors=True)
        elif not finished:
            print(f"sources, run dirs and logs kept in {work}", file=sys.stderr)


def report(args: argparse.Namespace, shas: dict[str, str], seconds: dict[str, dict[str, list[float]]],
           checks: list[str], finished: bool) -> None:
    """Print the header, `stage_table(seconds)` and the same-number checks; write them with `--out`."""
    info, v = C.machine_info(), C.versions()
    bf16 = "native" if info["bf16_native"] else "emulated (not native): precision=auto is fp32"
    runs = f"{len(checks)} run(s)" + ("" if finished else f" of {args.runs} (stopped early)")
    header = [f"make demo, before ({shas['before'][:7]}) and after ({shas['after'][:7]}), stage by stage, "
              f"{runs}, {args.first} first in odd runs",
              " | ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "deepspeed")),
              f"machine: {info['gpu'] or info['cpu']}, {info['cores']} cores; bf16 {bf16}"]
    table = stage_table(seconds)
    print("\n".join(header + [""] + table.lines() + [""] + checks))
    C.write_outputs(args.out, header, table, checks, {"args": vars(args), "machine": info, "versions": v,
                                                      "commits": shas, "seconds": seconds})


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the completed runs are reported above
        sys.exit(130)
