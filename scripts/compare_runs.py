"""Compare two `paths.root` trees of the same runs, value by value: the check that a refactor changed no number.

    python scripts/compare_runs.py BEFORE_ROOT AFTER_ROOT [--rename old=new ...] [--registry-renames] [--weights]

Runs are matched by kind (`rm/`, `ppo/`, `eval/`) and start order. Compared: every numeric value of each run's
`metrics.jsonl` (timing, throughput and memory keys left out), `rewards.json` and `eval.json` (paths, times and
run ids left out), and with `--weights` every tensor of every `*.safetensors` under `final/`, bit for bit.
Strings compare with each tree's root and the run ids masked. `--rename old=new` maps a metric renamed between
the two (the old name in BEFORE, the new one in AFTER); `--registry-renames` maps, per run kind, the names the
command registry lists as renamed (`rlhf_cli.commands.Command.renamed_metrics`: the map the report reads old runs
through), from the `rlhf_cli` on the path (AFTER's checkout).
Prints one line per file and exits 1 at the first difference list, 0 when all is equal.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

SKIP_KEYS = ("time/", "throughput/", "timing/", "perf/", "memory/")
SKIP_TEXT = ("path", "dir", "run_id", "created", "date", "host")


def skipped(key: str, value=None) -> bool:
    """Wall times, throughput and memory; and strings that name a place or a moment (paths, dates, hosts)."""
    leaf = key.split(".")[-1]
    return (any(key.startswith(p) or f".{p}" in key for p in SKIP_KEYS)
            or leaf in ("time", "elapsed") or leaf.endswith(("_s", "_seconds", "rss_gib", "_rss"))
            or (isinstance(value, str) and any(t in leaf for t in SKIP_TEXT)))


def flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


RUN_ID = re.compile(r"\d{8}-\d{6}-\d{6}")


def normal(value, root: Path):
    """A string with the tree's root and the time-stamped run ids replaced, so that paths compare."""
    if not isinstance(value, str):
        return value
    return RUN_ID.sub("<run-id>", value.replace(str(root.resolve()), "<root>").replace(str(root), "<root>"))


def equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_values(name: str, before: dict, after: dict, rename: dict[str, str]) -> list[str]:
    before = {rename.get(k, k): v for k, v in before.items() if not skipped(k, v)}
    after = {k: v for k, v in after.items() if not skipped(k, v)}
    diffs = [f"{name}: {k} only before" for k in before.keys() - after.keys()]
    diffs += [f"{name}: {k} only after" for k in after.keys() - before.keys()]
    diffs += [f"{name}: {k} {before[k]!r} -> {after[k]!r}" for k in sorted(before.keys() & after.keys())
              if not equal(before[k], after[k])]
    return diffs


def runs(root: Path) -> dict[str, list[Path]]:
    return {kind.name: sorted(p for p in kind.iterdir() if p.is_dir()) for kind in sorted(root.iterdir())
            if kind.is_dir()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rename", action="append", default=[], help="old=new metric name")
    ap.add_argument("--registry-renames", action="store_true",
                    help="also map each run kind's renamed metrics as the command registry lists them")
    ap.add_argument("--weights", action="store_true", help="also compare final/*.safetensors bit for bit")
    args = ap.parse_args()
    rename = dict(r.split("=", 1) for r in args.rename)
    by_kind: dict[str, dict[str, str]] = {}
    if args.registry_renames:
        from rlhf_cli.commands import COMMANDS

        by_kind = {c.kind: c.renamed_metrics for c in COMMANDS.values()}
        print("registry renames: " + "; ".join(f"{k}: {', '.join(f'{o}->{n}' for o, n in m.items())}"
                                               for k, m in by_kind.items() if m))
    rb, ra = runs(args.before), runs(args.after)
    if {k: len(v) for k, v in rb.items()} != {k: len(v) for k, v in ra.items()}:
        print(f"different runs: {rb} vs {ra}")
        return 1
    diffs: list[str] = []
    counted = 0
    for kind in rb:
        for b, a in zip(rb[kind], ra[kind]):
            for fname in ("metrics.jsonl", "rewards.json", "eval.json"):
                fb, fa = b / fname, a / fname
                if not fb.exists() and not fa.exists():
                    continue
                if fname.endswith(".jsonl"):
                    recb = [json.loads(x) for x in fb.read_text().splitlines() if x.strip()]
                    reca = [json.loads(x) for x in fa.read_text().splitlines() if x.strip()]
                    vb = {f"{i}.{k}": normal(v, args.before) for i, r in enumerate(recb) for k, v in flat(r)}
                    va = {f"{i}.{k}": normal(v, args.after) for i, r in enumerate(reca) for k, v in flat(r)}
                    kind_rename = {**by_kind.get(kind, {}), **rename}
                    ren = {f"{i}.{o}": f"{i}.{n}" for i in range(len(recb)) for o, n in kind_rename.items()}
                else:
                    vb = {k: normal(v, args.before) for k, v in flat(json.loads(fb.read_text()))}
                    va = {k: normal(v, args.after) for k, v in flat(json.loads(fa.read_text()))}
                    ren = rename
                d = compare_values(f"{kind}/{b.name} {fname}", vb, va, ren)
                n = sum(1 for k, v in vb.items() if not skipped(k, v))
                counted += n
                print(f"{kind}/{b.name} vs {a.name} {fname}: {n} values, {len(d)} differ")
                diffs += d
            if args.weights and (b / "final").is_dir():
                from safetensors.torch import load_file

                files_b = {w.relative_to(b / "final") for w in (b / "final").rglob("*.safetensors")}
                files_a = {w.relative_to(a / "final") for w in (a / "final").rglob("*.safetensors")}
                diffs += [f"{kind}/{b.name} final/{f}: only {'before' if f in files_b else 'after'}"
                          for f in sorted(files_b ^ files_a)]
                for wb in sorted((b / "final") / f for f in files_b & files_a):
                    wa = a / "final" / wb.relative_to(b / "final")
                    tb, ta = load_file(str(wb)), load_file(str(wa))
                    bad = [k for k in tb if k not in ta or not tb[k].equal(ta[k])] + [k for k in ta if k not in tb]
                    print(f"{kind}/{b.name} {wb.relative_to(b)}: {len(tb)} tensors, {len(bad)} differ")
                    diffs += [f"{kind}/{b.name} {wb.name}: {k}" for k in bad]
    for line in diffs[:50]:
        print("DIFF", line)
    print(f"{counted} values compared; {'all equal' if not diffs else f'{len(diffs)} differences'}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
