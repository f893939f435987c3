"""A sweep's page (`rlhf train-* -m ...`): one row per job with only what was swept and the headline metrics, sorted
by the first headline metric with the best job marked; the settings every job shared, folded; then one plot per
metric with a line per job.

A sweep dir is `<root>/<stage>/sweep-<time>/` holding job dirs `0/`, `1/`, ... (each a run dir with
`metrics.jsonl` and Hydra's `.hydra/overrides.yaml`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhf_cli.commands import COMMANDS
from rlhf_cli.report.html import Section, Table
from rlhf_cli.report.plots import PANELS, plot_jobs
from rlhf_cli.report.read import (
    Records,
    final_metrics,
    flatten,
    load_records,
    metric_names,
    read_config,
    read_overrides,
    run_stage,
)
from rlhf_cli.runs import get_status


def headline_metrics(stage: str) -> tuple[tuple[str, str, int], ...]:
    """The `commands.Command.headline` of run-dir kind `stage` (none for an unknown one): (metric, short column
    label, direction), +1 higher is better, -1 lower is better, 0 no better side. The sweep table shows those a
    job logged; it is sorted by the first with a direction that any job logged."""
    return next((c.headline for c in COMMANDS.values() if c.kind == stage), ())


@dataclass
class SweepSummary:
    """What a sweep's table shows (cells are raw values; `report.html.fmt` formats them)."""

    columns: list[str]
    rows: list[list[Any]]
    """One per job, sorted best first by `sort_by` (jobs without a value last, in job order)."""
    best: int | None
    """Index into `rows` of the best job (None when no job logged `sort_by`)."""
    sort_by: str | None
    """The metric the rows are sorted by (None: job order)."""
    constant: dict[str, Any]
    """Settings with the same value in every job: the overrides every job shares, then every config leaf."""
    jobs: list[Path]
    """The job dirs, in the rows' order."""
    records: dict[Path, Records]
    """Each job's metrics records (as read for the table; the plots draw them)."""
    labels: dict[Path, str]
    """Each job's legend entry: its name and swept settings (`job_label`)."""


def job_label(job: Path, swept: dict[str, str]) -> str:
    """`<job>: key=value ...` with only the swept keys (a legend entry)."""
    return f"{job.name}: " + " ".join(f"{k}={v}" for k, v in swept.items()) if swept else job.name


def summarize(jobs: list[Path]) -> SweepSummary:
    """The sweep table of `jobs` (run dirs of one sweep, in job order)."""
    overrides = {j: read_overrides(j) for j in jobs}
    configs = {j: flatten(read_config(j)) for j in jobs}
    records = {j: load_records(j) for j in jobs}
    value = {j: _settings(overrides[j], configs[j]) for j in jobs}
    keys = [k for k in dict.fromkeys(k for o in overrides.values() for k in o) if k != "resume"]
    # a resumed job lacks the group choices of its first start (`model=tiny`: no config leaf says it): it does not
    # count against a key it has no value for
    swept = [k for k in keys if len({_canonical(value[j].get(k, "")) for j in jobs
                                     if k in value[j] or "resume" not in overrides[j]}) > 1]
    shared_overrides = {k: value[jobs[0]].get(k, "") for k in keys if k not in swept}
    stage = run_stage(jobs[0], records[jobs[0]])
    logged = set().union(*(metric_names(r) for r in records.values()))
    headline = [h for h in headline_metrics(stage) if h[0] in logged]
    if not headline:  # an unknown stage: the first three metrics logged
        headline = [(n, n, 0) for n in list(dict.fromkeys(n for r in records.values() for n in metric_names(r)))[:3]]
    states = {j: get_status(j).get("state", "") for j in jobs}
    show_state = any(s != "finished" for s in states.values())
    columns = ["job", *(["state"] if show_state else []), *swept, *(label for _, label, _ in headline)]
    finals = {j: final_metrics(records[j]) for j in jobs}
    rows = {j: [j.name, *([states[j]] if show_state else []), *(_text(value[j].get(k, "")) for k in swept),
                *(finals[j].get(m, {}).get("final") for m, _, _ in headline)] for j in jobs}
    sort_by = next(((m, d) for m, _, d in headline if d and any(finals[j].get(m, {}).get("final") is not None
                                                                 for j in jobs)), None)
    order = list(jobs)
    best = None
    if sort_by is not None:
        metric, direction = sort_by
        valued = [j for j in jobs if finals[j].get(metric, {}).get("final") is not None]
        valued.sort(key=lambda j: -direction * finals[j][metric]["final"])
        order = valued + [j for j in jobs if j not in valued]
        top = finals[order[0]][metric]["final"]
        tied = [j for j in valued if finals[j][metric]["final"] == top]
        best = 0 if len(tied) == 1 else None  # a tie marks every tied job alike, and highlights none
        for j in tied:
            rows[j][0] = f"{j.name} ★" if len(tied) == 1 else f"{j.name} ★ (tie)"
    first, *rest = (configs[j] for j in jobs)
    same = {k: v for k, v in first.items() if all(c.get(k, object()) == v for c in rest)}
    labels = {j: job_label(j, {k: _text(value[j].get(k, "")) for k in swept}) for j in jobs}
    return SweepSummary(columns, [rows[j] for j in order], best, sort_by[0] if sort_by else None,
                        {**{f"override {k}": v for k, v in shared_overrides.items()}, **same}, order, records, labels)


def _settings(overrides: dict[str, str], config: dict[str, Any]) -> dict[str, Any]:
    """A job's settings by key: its command-line overrides (text as typed), and for every other key its recorded
    config value (a resumed job's `.hydra/overrides.yaml` holds only `resume=...`: Hydra rewrites it at each
    start)."""
    return {**config, **overrides}


def _text(value: Any) -> str:
    """A setting as the table shows it: an override as typed, a recorded value as YAML writes it."""
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix(
        "\n...").strip()


def _canonical(value: Any) -> Any:
    """A setting as compared across jobs, typed: `1e-5` (typed) and 1e-05 (recorded) are one number, `false` and
    False one boolean, `[q_proj,v_proj]` and the recorded list one list."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    if isinstance(value, str):  # YAML 1.1 reads `1e-5` as text
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def _file_stem(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", metric)


def sweep_sections(sweep: Path, jobs: list[Path], out_dir: Path) -> list[Section]:
    """The sweep page's sections, with one PNG per metric written to `out_dir` (`<metric>.png`, a line per job)."""
    summary = summarize(jobs)
    records, labels = summary.records, summary.labels
    order = "job order" if summary.sort_by is None else f"sorted by {summary.sort_by}, best marked ★"
    sections = [
        Section("summary", text=f"{len(jobs)} jobs of {sweep.resolve()}; {order}. Columns: the swept settings and "
                                "the last logged value of the headline metrics (eval/ metrics: the last evaluation).",
                tables=[Table(summary.columns, summary.rows, marked=summary.best)]),
        Section(f"settings shared by every job ({len(summary.constant)})",
                tables=[Table(["key", "value"], [[k, v] for k, v in summary.constant.items()])], collapsed=True),
    ]
    smooth = {m: p.smooth for p in PANELS for m in p.metrics}
    names = list(dict.fromkeys(n for j in jobs for n in metric_names(records[j])))
    images, captions = [], []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = out_dir / f"{_file_stem(name)}.png"
        drawn = plot_jobs(name, {labels[j]: records[j] for j in summary.jobs}, path,
                          smooth=smooth.get(name.removeprefix("eval/"), True))
        if drawn:
            images.append(path)
            captions.append(f"{name}: {len(drawn)} of {len(jobs)} jobs ({', '.join(lb.split(':')[0] for lb in drawn)})")
    sections.append(Section("curves (one plot per metric, a line per job)", images=images, captions=captions,
                            text="" if images else "no metric logged yet"))
    return sections
