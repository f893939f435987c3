"""Run reports: curves from a run's metrics JSONL, reward histograms, and one self-contained HTML page.

`build_report(path)` accepts either

* a run dir (holds `metrics.jsonl`, see `rlhf_cli.runs` for the layout): writes
  `<run_dir>/report/report.html` with the run's facts, its final metrics, one PNG per panel of
  curves, the reward histograms when the run wrote `rewards.json`, and its config; or
* a sweep dir (`<root>/<stage>/sweep-<time>/`, holding job dirs `0/`, `1/`, ...): writes
  `<sweep>/report/report.html` with one summary table (a row per job: its overrides and the last
  value of every metric) followed by each job's curves (PNGs under `report/<job>/`).

The PNG files are written beside the HTML, and the HTML embeds them as base64 data URIs, so the page
can be mailed or opened anywhere on its own. matplotlib draws through its Agg canvas (no pyplot,
no display needed) and is imported only when a plot is drawn.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_cli.core import sample_std
from rlhf_cli.runs import atomic_write_text, get_status, read_metrics

log = logging.getLogger(__name__)

Records = list[dict[str, Any]]


@dataclass(frozen=True)
class Panel:
    """One PNG of curves: the metrics drawn on a shared step axis.

    For each metric `k`, `eval/k` is overlaid (dashed, markers) when the run logged it.
    """

    name: str
    """File stem: `<name>.png`."""
    title: str
    metrics: tuple[str, ...]
    ylabel: str = ""
    smooth: bool = True
    """Overlay an EMA on long series (noisy per-batch statistics); off for schedules such as lr."""


PANELS: tuple[Panel, ...] = (
    # reward model (`rlhf train-rm`)
    Panel("rm_loss", "RM loss", ("rm/loss",), "-log σ(r_c - r_r) (nats)"),
    Panel("rm_accuracy", "RM pairwise accuracy", ("rm/accuracy",), "fraction r_c > r_r"),
    Panel("rm_margin", "RM margin", ("rm/margin",), "mean r_c - r_r"),
    Panel("rm_rewards", "RM chosen / rejected reward", ("rm/chosen_mean", "rm/rejected_mean"), "mean reward"),
    Panel("lr", "learning rate", ("lr",), smooth=False),
    Panel("grad_norm", "gradient norm (before clipping)", ("grad_norm",)),
    Panel("throughput_pairs", "throughput (pairs)", ("throughput/pairs_per_s",), "pairs per second"),
    Panel("throughput_tokens", "throughput (tokens)", ("throughput/tokens_per_s",), "tokens per second"),
    # policy (`rlhf train-ppo`)
    Panel("ppo_score", "RM score and RLHF reward", ("objective/scores", "objective/rlhf_reward"), "per sequence"),
    Panel("ppo_kl", "KL(policy ‖ reference)", ("objective/kl",), "nats per sequence"),
    Panel("ppo_kl_beta", "KL coefficient β", ("objective/kl_beta",), smooth=False),
    Panel("ppo_entropy", "policy entropy", ("policy/entropy",), "nats per token"),
    Panel("ppo_clipfrac", "clip fraction", ("policy/clipfrac", "val/clipfrac"), "fraction"),
    Panel("ppo_approx_kl", "approx KL(old ‖ new) per update", ("policy/approx_kl",), "nats per token"),
    Panel("ppo_loss", "policy and value loss", ("policy/loss", "val/loss")),
    Panel("ppo_explained_var", "value explained variance", ("val/explained_var",), "1 - Var[R - V] / Var[R]"),
    Panel("ppo_length", "response length", ("response/length_mean",), "tokens"),
    Panel("ppo_eos", "responses ending in EOS", ("response/eos_frac",), "fraction"),
)

HIST_FILE = "reward_hist.png"
SMOOTH_ABOVE = 50
"""Series longer than this are drawn faint with an exponential moving average on top."""
SMOOTH_WEIGHT = 0.8


# ----------------------------------------------------------------------------------------------
# reading a run


def is_run_dir(path: Path | str) -> bool:
    """True when `path` holds a `metrics.jsonl` (a training or eval run dir)."""
    return (Path(path) / "metrics.jsonl").is_file()


def job_dirs(sweep: Path | str) -> list[Path]:
    """The run dirs directly under a sweep dir, in job order (`0, 1, ..., 10`, then other names)."""
    sweep = Path(sweep)
    if not sweep.is_dir():
        return []
    jobs = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".") and is_run_dir(p)]
    return sorted(jobs, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def run_stage(run_dir: Path | str, records: Records | None = None) -> str:
    """`rm`, `ppo` or `eval` from the run dir's place (`<stage>/<run>` or `<stage>/sweep-*/<job>`),
    else from the metric names (`rm/...` → rm, `objective/...` → ppo), else `""`."""
    run_dir = Path(run_dir).resolve()
    parent = run_dir.parent
    stage = parent.parent.name if parent.name.startswith("sweep-") else parent.name
    if stage in ("rm", "ppo", "eval"):
        return stage
    names = set().union(*(r.keys() for r in records or []))
    if any(n.startswith(("rm/", "eval/rm/")) for n in names):
        return "rm"
    if any(n.startswith("objective/") for n in names):
        return "ppo"
    return ""


def load_records(run_dir: Path | str) -> Records:
    """The records of `<run_dir>/metrics.jsonl`, tolerating a torn last line (a run still writing).

    Raises ValueError naming the file and line when any other line is not JSON.
    """
    path = Path(run_dir) / "metrics.jsonl"
    try:
        return read_metrics(path)
    except ValueError:
        pass
    lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    records = []
    for i, ln in lines:
        try:
            records.append(json.loads(ln))
        except ValueError as e:
            if i == lines[-1][0]:
                log.warning("%s: line %d is incomplete (run still writing?); ignored", path, i)
                break
            raise ValueError(f"{path}, line {i}: not a JSON object ({e})") from None
    return records


def read_overrides(run_dir: Path | str) -> dict[str, str]:
    """The command-line overrides of a run, `{key: value}`, from `.hydra/overrides.yaml`.

    `+key=v` / `++key=v` count as `key`; a deletion `~key` maps to `"~"`; `hydra.*` keys are dropped.
    Empty when the file is missing.
    """
    import yaml

    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    items = yaml.safe_load(path.read_text()) or []
    out: dict[str, str] = {}
    for item in items:
        item = str(item)
        if item.startswith("~"):
            key, value = item[1:].split("=", 1)[0], "~"
        else:
            key, _, value = item.partition("=")
        key = key.lstrip("+")
        if not key.startswith("hydra."):
            out[key] = value
    return out


def read_config(run_dir: Path | str) -> dict[str, Any]:
    """The resolved run config (`config.yaml`) as plain dicts; empty when missing."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    cfg = yaml.safe_load(path.read_text())
    return cfg if isinstance(cfg, dict) else {}


def read_rewards(run_dir: Path | str) -> dict[str, list[float]]:
    """The reward lists of `<run_dir>/rewards.json` (`chosen`/`rejected` or `policy`/`reference`);
    keys whose value is not a list of numbers are dropped, nulls and non-finite values removed."""
    path = Path(run_dir) / "rewards.json"
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    out = {}
    for k, v in (obj.items() if isinstance(obj, dict) else []):
        if isinstance(v, list) and v and all(_is_num(x) or x is None for x in v):
            vals = [float(x) for x in v if _is_num(x) and math.isfinite(x)]
            if vals:
                out[k] = vals
    return out


def metric_names(records: Records) -> list[str]:
    """Numeric metric names in order of first appearance, each `eval/k` placed right after `k`."""
    seen: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", "time") and (_is_num(v) or v is None):
                seen.setdefault(k, None)
    names = list(seen)
    ordered = [n for n in names if not (n.startswith("eval/") and n[5:] in seen)]
    out = []
    for n in ordered:
        out.append(n)
        if "eval/" + n in seen:
            out.append("eval/" + n)
    return out


def series(records: Records, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping records without it and null / non-finite values."""
    xs, ys = [], []
    for r in records:
        v = r.get(name)
        if _is_num(v) and math.isfinite(v):
            xs.append(int(r.get("step", len(xs))))
            ys.append(float(v))
    return xs, ys


def final_metrics(records: Records) -> dict[str, dict[str, Any]]:
    """Per metric: the last non-null value, the step it was logged at, and min/max over the run."""
    out = {}
    for name in metric_names(records):
        xs, ys = series(records, name)
        out[name] = ({"final": ys[-1], "step": xs[-1], "min": min(ys), "max": max(ys)} if ys
                     else {"final": None, "step": None, "min": None, "max": None})
    return out


# ----------------------------------------------------------------------------------------------
# plots


def _figure(width: float = 6.4, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)  # fixed margins: 2x faster than a layout engine
    return fig, fig.add_subplot()


def _ema(ys: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (as TensorBoard's smoothing slider)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys, 1):
        acc = weight * acc + (1 - weight) * y
        out.append(acc / (1 - weight ** i))
    return out


def _plot_panel(panel: Panel, records: Records, path: Path) -> bool:
    """Draw one panel to `path`; False (nothing written) when none of its metrics has a value."""
    lines = []
    for name in panel.metrics:
        for key, evaluated in ((name, False), ("eval/" + name, True)):
            xs, ys = series(records, key)
            if xs:
                lines.append((key, evaluated, xs, ys))
    if not lines:
        return False
    fig, ax = _figure()
    for i, (key, evaluated, xs, ys) in enumerate(lines):
        color = f"C{i}"
        if evaluated:
            ax.plot(xs, ys, "--o", color=color, markersize=4, label=key)
        elif panel.smooth and len(ys) > SMOOTH_ABOVE:
            ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
            ax.plot(xs, _ema(ys, SMOOTH_WEIGHT), color=color, label=f"{key} (EMA {SMOOTH_WEIGHT})")
        else:
            ax.plot(xs, ys, "-o" if len(ys) < 30 else "-", color=color, markersize=3, label=key)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return True


def plot_rewards(rewards: dict[str, list[float]], path: Path | str, title: str = "reward distribution") -> Path:
    """Overlaid histograms (shared bins) of each reward list, e.g. `chosen` vs `rejected`; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    values = [v for vals in rewards.values() for v in vals]
    lo, hi = min(values), max(values)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    bins = min(50, max(10, int(math.sqrt(len(values)))))
    fig, ax = _figure()
    for i, (name, vals) in enumerate(rewards.items()):
        mean = sum(vals) / len(vals)
        ax.hist(vals, bins=bins, range=(lo, hi), alpha=0.5, color=f"C{i}",
                label=f"{name} (n={len(vals)}, mean={mean:.3g})")
        ax.axvline(mean, color=f"C{i}", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel("reward")
    ax.set_ylabel("count")
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def plot_run(run_dir: Path | str, out_dir: Path | str) -> list[Path]:
    """Write the run's PNGs into `out_dir` and return their paths, in `PANELS` order.

    One PNG per panel of `PANELS` that has data (`rm_loss.png`, `ppo_kl.png`, ...; panels whose
    metrics are absent or all null are skipped), then `reward_hist.png` when the run wrote
    `rewards.json`. Eval records (`eval/<k>`) are overlaid on their training metric `<k>`.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = load_records(run_dir) if is_run_dir(run_dir) else []
    paths = []
    for panel in PANELS:
        path = out_dir / f"{panel.name}.png"
        if _plot_panel(panel, records, path):
            paths.append(path)
    rewards = read_rewards(run_dir)
    if rewards:
        paths.append(plot_rewards(rewards, out_dir / HIST_FILE))
    return paths


# ----------------------------------------------------------------------------------------------
# tables


def summary_table(path: Path | str) -> tuple[list[str], list[list[Any]]]:
    """The table a report leads with, as `(columns, rows)`; cells are raw values (float, int, str, None).

    Run dir: a row per metric, columns `metric, final, step, min, max` (`final` = last non-null value).
    Sweep dir: a row per job, columns `job, state, <override keys...>, step, <metric names...>`, with the
    last value of each metric (None where a job never logged it) and `""` for an override a job lacks.
    Raises FileNotFoundError when `path` is neither.
    """
    path = Path(path)
    if is_run_dir(path):
        final = final_metrics(load_records(path))
        return (["metric", "final", "step", "min", "max"],
                [[name, s["final"], s["step"], s["min"], s["max"]] for name, s in final.items()])
    jobs = _jobs_or_raise(path)
    overrides = {j: read_overrides(j) for j in jobs}
    records = {j: load_records(j) for j in jobs}
    keys = list(dict.fromkeys(k for o in overrides.values() for k in o))
    names = list(dict.fromkeys(n for r in records.values() for n in metric_names(r)))
    columns = ["job", "state", *keys, "step", *names]
    rows = []
    for j in jobs:
        final = final_metrics(records[j])
        last_step = max((int(r["step"]) for r in records[j] if "step" in r), default=None)
        rows.append([j.name, get_status(j).get("state", ""), *(overrides[j].get(k, "") for k in keys),
                     last_step, *(final.get(n, {}).get("final") for n in names)])
    return columns, rows


def fmt(value: Any) -> str:
    """A table cell as text: floats to 4 significant digits, None as `–`."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_summary(console, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """Print `(columns, rows)` (as from `summary_table`) as a rich table on `console`."""
    from rich.table import Table as RichTable

    numeric = [any(_is_num(r[i]) for r in rows) for i in range(len(columns))]
    table = RichTable(title=title or None)
    for col, num in zip(columns, numeric):
        table.add_column(str(col), justify="right" if num else "left")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    console.print(table)


# ----------------------------------------------------------------------------------------------
# HTML


@dataclass
class Table:
    """A table of a report section; cells are raw values, formatted with `fmt`."""

    columns: list[str]
    rows: list[list[Any]]
    caption: str = ""


@dataclass
class Section:
    """One `<h2>` part of a report page, drawn in this order: text, tables, images."""

    title: str
    text: str = ""
    """A paragraph of plain text (escaped)."""
    tables: list[Table] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)
    """PNG files; embedded as data URIs, and copied beside the HTML when they live elsewhere."""
    collapsed: bool = False
    """Fold the section behind a `<details>` toggle (long config dumps)."""


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; } tr:nth-child(even) td { background: #fafafa; }
caption { text-align: left; font-weight: bold; padding: 4px 0; }
.images { display: flex; flex-wrap: wrap; gap: 8px; }
.images img { max-width: 640px; width: 100%; border: 1px solid #eee; }
summary { cursor: pointer; font-weight: bold; font-size: 1.1em; margin-top: 1.5em; }
"""


def _table_html(t: Table) -> str:
    caption = f"<caption>{html.escape(t.caption)}</caption>" if t.caption else ""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in t.columns)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if _is_num(v) else ""}>{html.escape(fmt(v))}</td>' for v in row) + "</tr>"
        for row in t.rows
    )
    return f'<div class="scroll"><table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def write_html(out_path: Path | str, title: str, sections: Sequence[Section]) -> Path:
    """Write a self-contained HTML page (no external assets, no JS) and return its path.

    Every image is embedded as a `data:image/png;base64,...` URI; an image outside the page's folder
    is also copied beside it, so the folder holds the PNG files too. Written atomically.
    """
    out_path = Path(out_path)
    out_dir = out_path.parent.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for s in sections:
        inner = [f"<p>{html.escape(s.text)}</p>"] if s.text else []
        inner += [_table_html(t) for t in s.tables]
        if s.images:
            imgs = []
            for img in map(Path, s.images):
                if not img.resolve().is_relative_to(out_dir):
                    shutil.copy2(img, out_dir / img.name)
                data = base64.b64encode(img.read_bytes()).decode("ascii")
                imgs.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(img.stem)}" '
                            f'title="{html.escape(img.name)}">')
            inner.append(f'<div class="images">{"".join(imgs)}</div>')
        if s.collapsed:
            parts.append(f"<details><summary>{html.escape(s.title)}</summary>{''.join(inner)}</details>")
        else:
            parts.append(f"<section><h2>{html.escape(s.title)}</h2>{''.join(inner)}</section>")
    parts.append("</body></html>\n")
    atomic_write_text(out_path, "\n".join(parts))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_path, 0o666 & ~umask)  # atomic_write_text's temp file is 0600; a report is meant to be shared
    return out_path


# ----------------------------------------------------------------------------------------------
# reports


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj if obj is None or isinstance(obj, (int, float, str)) else json.dumps(obj)}


def _config_rows(cfg: dict[str, Any], stage: str) -> list[list[Any]]:
    """Flattened `key, value` rows of the config, without the other training stage's section."""
    skip = {"rm", "ppo"} - {stage}
    return [[k, v] for k, v in _flatten({k: v for k, v in cfg.items() if k not in skip}).items()]


def _jobs_or_raise(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"report: '{path}' does not exist")
    jobs = job_dirs(path)
    if not jobs:
        raise FileNotFoundError(
            f"report: '{path}' is neither a run dir (no metrics.jsonl) nor a sweep dir (no job dirs "
            f"0/, 1/, ... holding metrics.jsonl)")
    return jobs


def _run_sections(run_dir: Path, out_dir: Path, heading: str = "", full: bool = True) -> list[Section]:
    """Facts, final metrics, curves, rewards and config of one run, with PNGs written to `out_dir`;
    only the curves and reward histogram when not `full` (a sweep job, whose numbers are in the summary)."""
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
    prefix = f"{heading}: " if heading else ""
    images = plot_run(run_dir, out_dir)
    curves = [p for p in images if p.name != HIST_FILE]
    sections = []
    if full:
        columns, rows = summary_table(run_dir)
        sections += [Section(f"{prefix}run", tables=[Table(["", "value"], facts)]),
                     Section(f"{prefix}final metrics", text="" if rows else "no metrics logged yet",
                             tables=[Table(columns, rows)] if rows else [])]
    sections.append(Section(f"{prefix}curves", text="" if curves else "no curves: no metric of a known panel logged",
                            images=curves))
    rewards = read_rewards(run_dir)
    if rewards:
        stats = [[k, len(v), sum(v) / len(v), sample_std(v), min(v), max(v)] for k, v in rewards.items()]
        sections.append(Section(f"{prefix}rewards", images=[out_dir / HIST_FILE],
                                tables=[Table(["", "n", "mean", "std", "min", "max"], stats)] if full else []))
    if cfg and full:
        sections.append(Section(f"{prefix}config", tables=[Table(["key", "value"], _config_rows(cfg, stage))],
                                collapsed=True))
    return sections


def build_report(path: Path | str) -> Path:
    """Write the report of a run dir or a sweep dir and return the HTML path.

    Run dir → `<run_dir>/report/report.html` (+ its PNGs). Sweep dir → `<sweep>/report/report.html`
    with one summary table comparing the jobs (see `summary_table`), then each job's sections, its PNGs
    under `<sweep>/report/<job>/`. Raises FileNotFoundError when `path` is neither.
    """
    path = Path(path)
    out_dir = path / "report"
    if is_run_dir(path) or job_dirs(path):
        for stale in out_dir.rglob("*.png"):  # from an earlier report: panels may have changed
            stale.unlink()
    if is_run_dir(path):
        stage = run_stage(path, load_records(path))
        sections = _run_sections(path, out_dir)
        title = f"rlhf {stage or 'run'} report: {path.name}"
    else:
        jobs = _jobs_or_raise(path)
        columns, rows = summary_table(path)
        stage = run_stage(jobs[0], load_records(jobs[0]))
        sections = [Section("summary", text=f"{len(jobs)} jobs of {path.resolve()}; metric values are the "
                                            "last logged (eval/ metrics: the last evaluation).",
                            tables=[Table(columns, rows)])]
        for job in jobs:
            overrides = " ".join(f"{k}={v}" for k, v in read_overrides(job).items())
            heading = f"job {job.name}" + (f" ({overrides})" if overrides else "")
            sections += _run_sections(job, out_dir / job.name, heading, full=False)
        title = f"rlhf {stage or 'sweep'} sweep report: {path.name}"
    html_path = write_html(out_dir / "report.html", title, sections)
    log.info("report written to %s", html_path)
    return html_path


# ----------------------------------------------------------------------------------------------
# small helpers


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def write_policy_report(out: Path, title: str, results: dict[str, Any], samples: list[list[Any]],
                        rewards: dict[str, list[float]] | None) -> None:
    """`out/report.html` of a policy eval: its numbers (`results` less the samples), the RM-score histogram of
    policy and reference when `rewards` has them (`out/reward_hist.png`), and the sample table (rows of
    prompt, policy reply, its score, reference reply, its score)."""
    images = ([] if rewards is None else
              [plot_rewards(rewards, out / "reward_hist.png", "RM score: policy vs reference")])
    numbers = [[k, v] for k, v in results.items() if k != "samples"]
    write_html(out / "report.html", title, [
        Section("results", tables=[Table(["metric", "value"], numbers)], images=images),
        Section("samples", tables=[Table(["prompt", "policy", "score", "reference", "score"], samples)])])


def write_rm_report(out: Path, title: str, results: dict[str, Any], rewards: dict[str, list[float]]) -> None:
    """`out/report.html` of a reward-model eval: its numbers and the chosen/rejected score histogram
    (`out/reward_hist.png`)."""
    hist = plot_rewards(rewards, out / "reward_hist.png", "reward-model scores: chosen vs rejected")
    table = Table(["metric", "value"], [[k, v] for k, v in results.items()])
    write_html(out / "report.html", title, [Section("results", tables=[table], images=[hist])])
