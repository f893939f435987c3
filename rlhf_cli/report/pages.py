"""The report of a run dir or a sweep dir (`build_report`), and the tables they lead with."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_cli.core import sample_std
from rlhf_cli.report.chain import eval_sections, is_eval_dir
from rlhf_cli.report.html import Section, Table, fmt, write_html
from rlhf_cli.report.plots import HIST_FILE, plot_run
from rlhf_cli.report.read import (
    config_rows,
    final_metrics,
    is_num,
    is_run_dir,
    job_dirs,
    load_records,
    read_config,
    read_overrides,
    read_rewards,
    run_stage,
)
from rlhf_cli.report.sweep import summarize, sweep_sections
from rlhf_cli.runs import get_status

log = logging.getLogger(__name__)


def summary_table(path: Path | str) -> tuple[list[str], list[list[Any]]]:
    """The table a report leads with, as `(columns, rows)`; cells are raw values (float, int, str, None).

    Run dir: a row per metric, columns `metric, final, step, min, max` (`final` = last non-null value).
    Sweep dir: a row per job with the swept settings and the headline metrics, best first (`sweep.summarize`).
    Raises FileNotFoundError when `path` is neither.
    """
    path = Path(path)
    if is_run_dir(path):
        final = final_metrics(load_records(path))
        return (["metric", "final", "step", "min", "max"],
                [[name, s["final"], s["step"], s["min"], s["max"]] for name, s in final.items()])
    summary = summarize(_jobs_or_raise(path))
    return summary.columns, summary.rows


def print_summary(console, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """Print `(columns, rows)` (as from `summary_table`) as a rich table on `console`: a rule under the header
    and no vertical borders, so that a sweep's table of ~8 columns fits an 80-column terminal."""
    from rich import box
    from rich.table import Table as RichTable

    numeric = [any(is_num(r[i]) for r in rows) for i in range(len(columns))]
    table = RichTable(title=title or None, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True,
                      show_edge=False)
    for col, num in zip(columns, numeric):
        table.add_column(str(col), justify="right" if num else "left")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    console.print(table)


# ----------------------------------------------------------------------------------------------
# reports


def _jobs_or_raise(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"report: '{path}' does not exist")
    jobs = job_dirs(path)
    if not jobs:
        raise FileNotFoundError(
            f"report: '{path}' is neither a run dir (no metrics.jsonl) nor a sweep dir (no job dirs "
            f"0/, 1/, ... holding metrics.jsonl)")
    return jobs


def _run_sections(run_dir: Path, out_dir: Path) -> list[Section]:
    """Facts, final metrics, curves, rewards and config of one run, with PNGs written to `out_dir`."""
    records = load_records(run_dir)
    stage = run_stage(run_dir, records)
    cfg = read_config(run_dir)
    model = cfg.get("model") or {}
    data = cfg.get("data") or {}
    facts = [["run dir", str(run_dir.resolve())], ["stage", stage or "?"],
             ["state", get_status(run_dir).get("state", "?")],
             ["steps logged", len(records)],
             ["model", model.get("name_or_path") or model.get("name")],
             ["data", data.get("path") or "builtin"], ["precision", cfg.get("precision")], ["seed", cfg.get("seed")]]
    facts += [[f"override {k}", v] for k, v in read_overrides(run_dir).items()]
    images = plot_run(run_dir, out_dir)
    curves = [p for p in images if p.name != HIST_FILE]
    columns, rows = summary_table(run_dir)
    sections = [Section("run", tables=[Table(["", "value"], facts)]),
                Section("final metrics", text="" if rows else "no metrics logged yet",
                        tables=[Table(columns, rows)] if rows else []),
                Section("curves", text="" if curves else "no curves: no metric of a known panel logged", images=curves)]
    rewards = read_rewards(run_dir)
    if rewards:
        stats = [[k, len(v), sum(v) / len(v), sample_std(v), min(v), max(v)] for k, v in rewards.items()]
        sections.append(Section("rewards", images=[out_dir / HIST_FILE],
                                tables=[Table(["", "n", "mean", "std", "min", "max"], stats)]))
    if cfg:
        sections.append(Section("config", tables=[Table(["key", "value"], config_rows(cfg, stage))], collapsed=True))
    return sections


def build_report(path: Path | str) -> Path:
    """Write the report of an eval dir, a run dir or a sweep dir and return the HTML path (`<path>/report/report.html`,
    its PNGs beside it).

    Eval dir (holds `eval.json`): the verdict in plain words, then the runs the evaluated model came from
    (`chain.eval_sections`). Run dir: the run's facts, final metrics, curves, rewards and config. Sweep dir: the jobs'
    table (swept settings and headline metrics, best first), the shared settings folded, and one plot per metric
    with a line per job (`sweep.sweep_sections`). Raises FileNotFoundError when `path` is none of them.
    """
    path = Path(path)
    out_dir = path / "report"
    if is_eval_dir(path) or is_run_dir(path) or job_dirs(path):
        for stale in out_dir.rglob("*.png"):  # from an earlier report: panels may have changed
            stale.unlink()
    if is_eval_dir(path):
        title, sections = eval_sections(path, out_dir)
    elif is_run_dir(path):
        stage = run_stage(path, load_records(path))
        sections = _run_sections(path, out_dir)
        title = f"rlhf {stage or 'run'} report: {path.name}"
    else:
        jobs = _jobs_or_raise(path)
        stage = run_stage(jobs[0], load_records(jobs[0]))
        sections = sweep_sections(path, jobs, out_dir)
        title = f"rlhf {stage or 'sweep'} sweep report: {path.name}"
    html_path = write_html(out_dir / "report.html", title, sections)
    log.info("report written to %s", html_path)
    return html_path
