"""Run reports: PNGs from a metrics JSONL, a self-contained HTML, and the sweep summary table."""

import base64
import io
import json
import re
from pathlib import Path

import pytest

from rlhf_cli.core import sample_std
from rlhf_cli.report import build_report, plot_run, print_summary, read_overrides, summary_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, records, overrides=(), config=None, rewards=None) -> Path:
    """A run dir as the stages leave it: metrics.jsonl, config.yaml, .hydra/overrides.yaml, status.json."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config or {"model": {"name": "tiny", "name_or_path": None}, "data": {"path": None},
                     "rm": {"lr": 2e-5}, "ppo": {"clip": 0.2}, "precision": "fp32", "seed": 1}
    (run_dir / "config.yaml").write_text(json.dumps(cfg))  # JSON is valid YAML
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
    (run_dir / "status.json").write_text(json.dumps({"state": "finished"}))
    if rewards is not None:
        (run_dir / "rewards.json").write_text(json.dumps(rewards))
    return run_dir


def rm_records(n=6, acc_shift=0.0, only=None):
    """RM-style records; `only` keeps just those metric names (fewer panels, faster tests)."""
    recs = []
    for s in range(1, n + 1):
        recs.append({"step": s, "time": 100.0 + s, "rm/loss": 0.7 - 0.05 * s, "rm/accuracy": 0.5 + 0.05 * s + acc_shift,
                     "rm/margin": 0.1 * s, "rm/chosen_mean": 0.05 * s, "rm/rejected_mean": -0.05 * s,
                     "lr": 1e-5, "grad_norm": None if s == 2 else 1.0})  # a null: non-finite grad norm
        if s % 3 == 0:
            recs.append({"step": s, "time": 100.5 + s, "eval/rm/loss": 0.6, "eval/rm/accuracy": 0.6 + acc_shift})
    if only is not None:
        recs = [{k: v for k, v in r.items() if k in ("step", "time", *only)} for r in recs]
    return recs


def ppo_records(n=5):
    return [{"step": s, "time": float(s), "objective/scores": 0.1 * s, "objective/kl": 0.02 * s,
             "objective/kl_beta": 0.05, "objective/rlhf_reward": 0.1 * s - 0.001 * s, "policy/loss": -0.01,
             "policy/clipfrac": 0.1, "policy/approx_kl": 0.001, "policy/entropy": 2.0 - 0.1 * s,
             "val/loss": 0.5, "val/clipfrac": 0.05, "val/explained_var": None if s == 1 else 0.1 * s,
             "response/length_mean": 20.0 + s, "response/eos_frac": 0.9}
            for s in range(1, n + 1)]


def embedded_pngs(html_text: str):
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)]


def test_rm_run_report(tmp_path):
    run = write_run(tmp_path / "runs" / "rm" / "2024-01-01_00-00-00", rm_records(),
                    rewards={"chosen": [0.5, 1.0, 1.5, 0.2], "rejected": [0.1, -0.3, 0.4, None]})
    html_path = build_report(run)

    assert html_path == run / "report" / "report.html"
    pngs = {p.name for p in (run / "report").glob("*.png")}
    assert {"rm_loss.png", "rm_accuracy.png", "rm_margin.png", "rm_rewards.png", "lr.png", "grad_norm.png",
            "reward_hist.png"} <= pngs
    assert not any(n.startswith("ppo_") for n in pngs)  # panels without metrics are skipped
    text = html_path.read_text()
    images = embedded_pngs(text)
    assert len(images) == len(pngs) and all(b.startswith(PNG_MAGIC) for b in images)
    assert not re.search(r'(src|href)="(?!data:)', text)  # no external assets
    assert "rlhf rm report" in text and "eval/rm/accuracy" in text and "precision" in text


def test_ppo_run_plots(tmp_path):
    run = write_run(tmp_path / "ppo" / "run", ppo_records(),
                    rewards={"policy": [1.0, 2.0, 1.5], "reference": [0.5, 0.7, 0.2]})
    paths = plot_run(run, tmp_path / "out")

    names = [p.name for p in paths]
    assert names == ["ppo_score.png", "ppo_kl.png", "ppo_kl_beta.png", "ppo_entropy.png", "ppo_clipfrac.png",
                     "ppo_approx_kl.png", "ppo_loss.png", "ppo_explained_var.png", "ppo_length.png",
                     "ppo_eos.png", "reward_hist.png"]
    assert all(p.parent == tmp_path / "out" and p.read_bytes().startswith(PNG_MAGIC) for p in paths)


def test_run_summary_table_uses_last_non_null(tmp_path):
    run = write_run(tmp_path / "rm" / "run", rm_records(n=6))
    columns, rows = summary_table(run)
    assert columns == ["metric", "final", "step", "min", "max"]
    table = {r[0]: r[1:] for r in rows}
    assert table["eval/rm/accuracy"] == [0.6, 6, 0.6, 0.6]
    assert table["rm/loss"][0] == pytest.approx(0.4) and table["rm/loss"][1] == 6
    names = [r[0] for r in rows]
    assert names.index("eval/rm/loss") == names.index("rm/loss") + 1  # eval metric right after its train metric
    assert "time" not in names and "step" not in names


def test_sweep_report_one_summary_table(tmp_path):
    sweep = tmp_path / "runs" / "rm" / "sweep-2024-01-01_00-00-00"
    only = ("rm/loss", "rm/accuracy", "eval/rm/accuracy")
    write_run(sweep / "0", rm_records(acc_shift=0.0, only=only), overrides=["rm.lr=1e-5", "model=tiny"])
    write_run(sweep / "1", rm_records(acc_shift=0.1, only=only),
              overrides=["rm.lr=3e-5", "model=tiny", "+rm.margin=true"])
    (sweep / "multirun.yaml").write_text("{}\n")

    columns, rows = summary_table(sweep)
    assert columns[:5] == ["job", "state", "rm.lr", "model", "rm.margin"]
    assert [r[:5] for r in rows] == [["0", "finished", "1e-5", "tiny", ""], ["1", "finished", "3e-5", "tiny", "true"]]
    acc = columns.index("eval/rm/accuracy")
    assert [r[acc] for r in rows] == [pytest.approx(0.6), pytest.approx(0.7)]

    html_path = build_report(sweep)
    assert html_path == sweep / "report" / "report.html"
    text = html_path.read_text()
    assert text.count("<table>") == 1  # one summary table; jobs contribute curves only
    for job in ("0", "1"):
        assert sorted(p.name for p in (sweep / "report" / job).glob("*.png")) == ["rm_accuracy.png", "rm_loss.png"]
    assert len(embedded_pngs(text)) == len(list((sweep / "report").rglob("*.png")))

    from rich.console import Console

    console = Console(file=io.StringIO(), width=400)
    print_summary(console, columns, rows, title="sweep")
    out = console.file.getvalue()
    assert "rm.lr" in out and "3e-5" in out and "0.7" in out


def test_overrides_parsing(tmp_path):
    run = write_run(tmp_path / "r", [], overrides=["++ppo.clip=0.1", "~data.eval_path", "hydra.verbose=true",
                                                  "data.path=a=b.jsonl"])
    assert read_overrides(run) == {"ppo.clip": "0.1", "data.eval_path": "~", "data.path": "a=b.jsonl"}


def test_missing_or_empty_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_report(tmp_path / "nope")
    (tmp_path / "empty" / "0").mkdir(parents=True)  # a job dir without metrics.jsonl
    with pytest.raises(FileNotFoundError, match="neither a run dir"):
        build_report(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="neither a run dir"):
        summary_table(tmp_path / "empty")


def test_torn_last_line_is_ignored_but_corrupt_middle_line_names_the_line(tmp_path):
    run = write_run(tmp_path / "rm" / "run", rm_records(n=2))
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "rm/lo')
    _, rows = summary_table(run)
    assert dict((r[0], r[2]) for r in rows)["rm/loss"] == 2

    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2"):
        summary_table(run)


def test_sample_std_is_bessel_corrected_and_zero_below_two_values():
    import statistics

    assert sample_std([1.0, 2.0, 3.0, 4.0]) == pytest.approx((5 / 3) ** 0.5, rel=1e-15)
    values = [0.1 * k ** 1.5 - 3 for k in range(50)]
    assert sample_std(values) == pytest.approx(statistics.stdev(values), rel=1e-12)
    assert sample_std([1e9 + 1, 1e9 + 2, 1e9 + 3]) == pytest.approx(1.0, rel=1e-12)  # no cancellation
    assert sample_std([5.0]) == 0.0 and sample_std([]) == 0.0
