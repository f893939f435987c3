"""Run reports: PNGs from a metrics JSONL, a self-contained HTML, and the sweep summary table."""

import base64
import io
import json
import os
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


def test_an_old_runs_bare_metric_names_read_under_todays_names(tmp_path):
    """Runs written before issue 39 logged `lr`, `grad_norm`, `epoch` bare: the report reads them through the
    registry's old -> new map (`commands.Command.renamed_metrics`), per run kind."""
    from rlhf_cli.report.read import final_metrics, load_records

    old = [{**r, "epoch": 0.5} for r in rm_records(2, only=("rm/loss", "lr", "grad_norm"))]
    recs = load_records(write_run(tmp_path / "rm" / "old", old))
    assert [sorted(k for k in r if k not in ("step", "time")) for r in recs] == [
        ["rm/epoch", "rm/grad_norm", "rm/loss", "rm/lr"]] * 2
    assert recs[0]["rm/lr"] == 1e-5 and recs[1]["rm/grad_norm"] is None and recs[1]["rm/epoch"] == 0.5
    assert final_metrics(recs)["rm/grad_norm"]["final"] == 1.0
    sft = load_records(write_run(tmp_path / "sft" / "old", [{"step": 1, "sft/loss": 1.0, "lr": 2e-5}]))
    assert sft[0] == {"step": 1, "sft/loss": 1.0, "sft/lr": 2e-5}
    ppo = load_records(write_run(tmp_path / "ppo" / "old", [{"step": 1, "objective/kl": 0.1, "lr": 1.0}]))
    assert ppo[0] == {"step": 1, "objective/kl": 0.1, "lr": 1.0}  # train-ppo renamed nothing


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


def test_sweep_report_table_shows_what_was_swept_sorted_best_first(tmp_path):
    sweep = tmp_path / "runs" / "rm" / "sweep-2024-01-01_00-00-00"
    only = ("rm/loss", "rm/accuracy", "eval/rm/accuracy")
    write_run(sweep / "0", rm_records(acc_shift=0.0, only=only), overrides=["rm.lr=1e-5", "model=tiny"])
    write_run(sweep / "1", rm_records(acc_shift=0.1, only=only),
              overrides=["rm.lr=3e-5", "model=tiny", "+rm.margin=true"])
    write_run(sweep / "2", rm_records(acc_shift=0.05, only=only), overrides=["rm.lr=2e-5", "model=tiny"])
    (sweep / "multirun.yaml").write_text("{}\n")

    columns, rows = summary_table(sweep)
    # only the swept keys (model=tiny is the same in every job), then the headline metrics; sorted by held-out
    # accuracy, best first and marked
    assert columns == ["job", "rm.lr", "rm.margin", "held-out acc", "train acc", "loss"]
    assert [r[:3] for r in rows] == [["1 ★", "3e-5", "true"], ["2", "2e-5", ""], ["0", "1e-5", ""]]
    assert [r[3] for r in rows] == [pytest.approx(0.7), pytest.approx(0.65), pytest.approx(0.6)]

    html_path = build_report(sweep)
    assert html_path == sweep / "report" / "report.html"
    text = html_path.read_text()
    assert text.count("<table") == 2  # the jobs' table, and the shared settings (folded)
    assert "<tr class=best><td>1 ★</td>" in text
    shared = text[text.index("<details><summary>settings shared by every job"):]
    assert "override model" in shared[:shared.index("</details>")]
    # one plot per metric, a line per job: the captions name the jobs drawn
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", text)
    assert sorted(c.split(":")[0] for c in captions) == sorted(only)
    assert all(c.endswith("3 of 3 jobs (1, 2, 0)") for c in captions), captions
    assert len(embedded_pngs(text)) == len(captions) == len(list((sweep / "report").glob("*.png")))


def test_sweep_console_table_fits_80_columns(tmp_path):
    from rich.console import Console

    sweep = tmp_path / "runs" / "ppo" / "sweep-2024-01-01_00-00-00"
    for job, (clip, lr, beta) in enumerate([("0.1", "1e-6", "0.05"), ("0.2", "3e-6", "0.1"), ("0.3", "1e-5", "0.2")]):
        recs = [{**r, "objective/rlhf_reward": r["objective/rlhf_reward"] + job} for r in ppo_records()]
        write_run(sweep / str(job), recs, overrides=[f"ppo.clip={clip}", f"ppo.actor_lr={lr}", f"ppo.kl_beta={beta}",
                                                     "experiment=smoke", "model=tiny"])
    columns, rows = summary_table(sweep)
    assert columns == ["job", "ppo.clip", "ppo.actor_lr", "ppo.kl_beta", "reward", "RM score", "KL", "length"]
    console = Console(file=io.StringIO(), width=80)
    print_summary(console, columns, rows, title="sweep")
    out = console.file.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80
    for cell in ("ppo.clip", "ppo.actor_lr", "1e-5", "0.3", "2.495", "RM score", "2 ★"):
        assert cell in out, (cell, out)
    assert "…" not in out


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


# ----------------------------------------------------------------------------------------------
# an eval's page over the chain RM run → PPO run → eval


def policy_results(score_gain=0.5, score_ci=0.1, acc_gain=-0.08, acc_ci=0.05, n=128):
    from rlhf_cli.core import reward_hacking

    r = {"mode": "policy", "policy": "/x/ppo/a/final", "reference": "ref", "prompts": n,
         "score_gain": score_gain, "score_gain_ci95": score_ci, "score_gain_rm_std": score_gain / 0.8,
         "score_gain_rm_std_ci95": score_ci / 0.8, "win_rate": 0.7, "win_rate_ci95_low": 0.62,
         "win_rate_ci95_high": 0.77, "reference/accuracy": 0.11, "policy/accuracy": 0.11 + acc_gain,
         "accuracy_gain": acc_gain, "accuracy_gain_ci95": acc_ci, "kl_k1": 3.1, "kl_k1_ci95": 0.4, "kl_k3": 3.3,
         "kl_k3_ci95": 0.5, "samples": []}
    return {**r, **reward_hacking(r)}


def write_chain(root: Path, results) -> Path:
    """RM run, PPO run and eval dir as the stages leave them, linked through lineage.json files."""
    rm = write_run(root / "rm" / "a", rm_records(only=("rm/loss", "rm/accuracy", "eval/rm/accuracy", "rm/margin")))
    ppo = write_run(root / "ppo" / "b", ppo_records())
    ev = root / "eval" / "c"
    ev.mkdir(parents=True)
    lin = lambda stage, run, parents: json.dumps({"stage": stage, "run_dir": str(run), "parents": parents})  # noqa: E731
    (rm / "lineage.json").write_text(lin("rm", rm, {"model": {"path": "/hub/tiny"}}))
    (ppo / "lineage.json").write_text(lin("ppo", ppo, {"reward_model": {"path": str(rm / "final"), "stage": "rm",
                                                                        "run_dir": str(rm)}}))
    (ev / "lineage.json").write_text(lin("eval", ev, {
        "policy": {"path": str(ppo / "final"), "stage": "ppo", "run_dir": str(ppo)},
        "reward_model": {"path": str(rm / "final"), "stage": "rm", "run_dir": str(rm)}}))
    (ev / "eval.json").write_text(json.dumps({"results": results, "config": {"eval": {"num_samples": 3},
                                                                             "seed": 1}}))
    lines = [{"prompt": f"What is {i} + {i}? " + "long words " * 40, "policy": "The answer is " + "x" * 300,
              "reference": f"REFERENCE-{i} says {2 * i}", "policy_score": 0.1 * i, "reference_score": -0.1 * i,
              "policy_length": 20 + i, "reference_length": 10 + i, "policy_correct": 0.0,
              "reference_correct": 1.0, "policy_function": None, "reference_function": None} for i in range(6)]
    (ev / "responses.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (ev / "rewards.json").write_text(json.dumps({"policy": [x["policy_score"] for x in lines],
                                                 "reference": [x["reference_score"] for x in lines]}))
    return ev


def section_titles(text):
    return re.findall(r"<h2>([^<]*)</h2>", text) + re.findall(r"<summary>([^<]*)</summary>", text)


def test_eval_page_over_the_chain_has_the_headline_and_every_section(tmp_path):
    from rlhf_cli.report import chain_runs

    ev = write_chain(tmp_path, policy_results())
    assert [(s, p.name) for s, p in chain_runs(ev)] == [("rm", "a"), ("ppo", "b")]
    text = build_report(ev).read_text()
    titles = section_titles(text)
    expected = ["Did RLHF help?", "reward-model training", "PPO training", "reward distributions",
                "length vs reward", "samples", "every number of eval.json", "config of the rm run",
                "config of the ppo run", "config of this eval"]
    for want in expected:
        assert any(t.startswith(want) for t in titles), (want, titles)
    headline = text[text.index("<h2>Did RLHF help?</h2>"):text.index("</section>")]
    assert "+0.62 RM std (95 % interval ± 0.12" in headline  # 0.5 / 0.8 RM std
    assert "wins 70% of 128 held-out prompts (95 % interval 62.0%–77.0%)" in headline
    assert "accuracy went from 0.110 for the reference to 0.030 for the policy" in headline
    assert "(a real loss)" in headline
    assert "3.300 ± 0.500 nats of KL" in headline
    assert 3 <= headline.count(". ") + 1 <= 5
    # RM curves with held-out accuracy; the PPO run's curves; each PNG drawn from data
    rm_pngs = sorted(p.name for p in (ev / "report" / "0_rm_a").glob("*.png"))
    assert rm_pngs == ["rm_accuracy.png", "rm_loss.png", "rm_margin.png"]
    ppo_pngs = {p.name for p in (ev / "report" / "1_ppo_b").glob("*.png")}
    assert {"ppo_score.png", "ppo_kl.png", "ppo_kl_beta.png", "ppo_entropy.png", "ppo_length.png", "ppo_eos.png",
            "ppo_clipfrac.png", "ppo_loss.png", "ppo_explained_var.png"} == ppo_pngs
    assert len(embedded_pngs(text)) == len(rm_pngs) + len(ppo_pngs) + 2  # + histogram + length vs reward
    # samples: the first eval.num_samples rows, both columns, scores and the checker's verdict, in a wrapping table
    samples = text[text.index("<h2>samples"):]
    samples = samples[:samples.index("</section>")]
    assert "<table class=wrap>" in samples and samples.count("<tr>") == 1 + 3
    assert "REFERENCE-2 says 4" in samples and "REFERENCE-3" not in samples
    assert samples.count("✓") == 3 and samples.count("✗") == 3


def test_an_eval_against_another_trained_policy_asks_which_is_better_not_whether_rlhf_helped(tmp_path):
    ev = write_chain(tmp_path, policy_results())
    rec = json.loads((ev / "lineage.json").read_text())
    rec["parents"]["reference"] = {"path": "/runs/dpo/x/final", "stage": "dpo", "run_dir": "/runs/dpo/x"}
    (ev / "lineage.json").write_text(json.dumps(rec))
    text = build_report(ev).read_text()
    titles = section_titles(text)
    assert "Does the policy beat the rlhf train-dpo policy?" in titles and "Did RLHF help?" not in titles
    assert "<title>policy eval: /x/ppo/a/final against the rlhf train-dpo policy ref</title>" in text
    assert "rlhf train-dpo: /runs/dpo/x" in text  # the sides table names the run that trained the reference
    # an SFT run is the starting point of RLHF, not a result of it: the question stays
    rec["parents"]["reference"] = {"path": "/runs/sft/y/final", "stage": "sft", "run_dir": "/runs/sft/y"}
    (ev / "lineage.json").write_text(json.dumps(rec))
    text = build_report(ev).read_text()
    assert "Did RLHF help?" in section_titles(text) and "rlhf train-sft: /runs/sft/y" in text


@pytest.mark.parametrize("gains, verdict", [
    ((0.5, 0.1, -0.08, 0.05), "warning"),  # RM up beyond its interval, checker down beyond its interval
    ((0.53, 0.11, -0.04, 0.07), "possible"),  # run B4 of docs/results.md: the checker's interval contains 0
    ((0.05, 0.1, -0.02, 0.05), "possible"),  # both intervals straddle 0, point estimates apart
    ((0.5, 0.1, 0.08, 0.05), "none"),  # both rose
    ((-0.5, 0.1, -0.08, 0.05), "none"),  # the RM score fell too
])
def test_hacking_warning_only_when_the_intervals_move_apart(tmp_path, gains, verdict):
    results = policy_results(*gains)
    assert results["reward_hacking"] == verdict
    text = build_report(write_chain(tmp_path, results)).read_text()
    assert ("<p class=alert>Warning: reward hacking: the RM score rose" in text) == (verdict == "warning")
    assert ("Possible reward hacking:" in text) == (verdict == "possible")


# ----------------------------------------------------------------------------------------------
# the page as a real browser draws it (headless Chromium, 1300 px wide)

CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).is_file()), None)
VIEWPORT = 1300
# runs after every image has loaded and writes what it measured into the DOM, which --dump-dom then prints
PROBE = """<script>
window.addEventListener('load', () => {
  for (const d of document.querySelectorAll('details')) d.open = true;  // folded sections are measured too
  const wide = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).display !== 'inline')
      wide.push(el.tagName + (el.className ? '.' + el.className : '') + ' ' + el.scrollWidth + '>' + el.clientWidth);
  }
  const imgs = [...document.images];
  const cells = [...document.querySelectorAll('td')].filter(td => td.textContent.includes('REFERENCE-0'));
  const out = {
    viewport: window.innerWidth, page: document.documentElement.scrollWidth, wide: wide,
    images: imgs.length, broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    reference_cells: cells.map(td => { const r = td.getBoundingClientRect();
                                       return {left: r.left, right: r.right, width: r.width}; }),
  };
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def render(html_path: Path, tmp_path: Path) -> dict:
    """What Chromium measured on the page at `VIEWPORT` px (see `PROBE`)."""
    import subprocess

    page = tmp_path / "probed.html"
    page.write_text(html_path.read_text().replace("</body>", PROBE + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'chromium'}", f"--window-size={VIEWPORT},900", "--virtual-time-budget=10000",
             "--dump-dom", page.as_uri()]
    out = subprocess.run([CHROMIUM, *flags], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', out.stdout, re.S)
    assert found, f"chromium printed no probe (exit {out.returncode}): {out.stderr[-2000:]}"
    import html as html_lib

    return json.loads(html_lib.unescape(found.group(1)))


@pytest.fixture
def chromium():
    if CHROMIUM is None:
        if os.environ.get("RLHF_REQUIRE_BROWSER"):  # CI installs Debian's chromium: there the test must run
            pytest.fail("RLHF_REQUIRE_BROWSER is set but chromium is not installed")
        pytest.skip("chromium not installed (Debian: apt-get install chromium)")
    return CHROMIUM


def test_eval_page_fits_the_browser_and_every_image_loads(tmp_path, chromium):
    ev = write_chain(tmp_path / "chain", policy_results())
    got = render(build_report(ev), tmp_path)
    assert got["viewport"] == VIEWPORT and got["page"] == VIEWPORT  # nothing wider than the window
    assert got["wide"] == []  # no element scrolls or clips its content: tables wrap
    assert got["images"] == len(embedded_pngs((ev / "report" / "report.html").read_text())) > 10
    assert got["broken"] == []
    (cell,) = got["reference_cells"]  # the reference column of the samples is on screen
    assert cell["width"] > 100 and cell["right"] <= VIEWPORT


def test_browser_check_catches_a_cut_off_table_and_a_broken_image(tmp_path, chromium):
    """The probe can fail: a no-wrap table wider than the page inside an overflow:hidden box, and an image that
    does not decode."""
    from rlhf_cli.report.html import Section, Table, write_html

    page = write_html(tmp_path / "bad" / "report.html", "bad", [Section("samples", tables=[
        Table(["prompt", "policy", "reference"], [["p", "x" * 600, "REFERENCE-0"]])])])
    bad_png = tmp_path / "bad.png"
    bad_png.write_bytes(PNG_MAGIC + b"not a png")
    text = page.read_text().replace("</style>", ".scroll { overflow: hidden; } td { white-space: nowrap; }</style>")
    text = text.replace("</body>", f'<img alt="bad" src="data:image/png;base64,'
                                   f'{base64.b64encode(bad_png.read_bytes()).decode()}"></body>')
    page.write_text(text)
    got = render(page, tmp_path)
    assert any(w.startswith("DIV.scroll") for w in got["wide"])
    assert got["broken"] == ["bad"]
    assert got["reference_cells"][0]["left"] > VIEWPORT  # cut off: beyond the window's right edge


def test_sweep_page_fits_the_browser_and_every_image_loads(tmp_path, chromium):
    sweep = tmp_path / "runs" / "ppo" / "sweep-2024-01-01_00-00-00"
    for job, clip in enumerate(("0.1", "0.2", "0.3")):
        write_run(sweep / str(job), ppo_records(n=60), overrides=[f"ppo.clip={clip}", "model=tiny"])
    html_path = build_report(sweep)
    got = render(html_path, tmp_path)
    assert got["page"] == VIEWPORT and got["wide"] == [] and got["broken"] == []
    assert got["images"] == len(re.findall("<figcaption>", html_path.read_text())) == len(ppo_records(n=1)[0]) - 2


def test_an_older_eval_dir_still_gets_its_page_and_verdict(tmp_path):
    """Written before this page: a boolean verdict, half-width intervals of proportions, no responses.jsonl, and a
    parent entry that is not a record."""
    results = {k: v for k, v in policy_results(acc_gain=-0.2, acc_ci=0.05).items()
               if not k.startswith("win_rate_ci95")}
    results.update(reward_hacking=True, win_rate_ci95=0.08, samples=[
        {"prompt": "old prompt", "policy": "old policy reply", "policy_score": 1.5, "reference": "REFERENCE-0 old",
         "reference_score": 0.5}])
    ev = write_chain(tmp_path, results)
    (ev / "responses.jsonl").unlink()
    rec = json.loads((ev / "lineage.json").read_text())
    rec["parents"]["model"] = None
    (ev / "lineage.json").write_text(json.dumps(rec))
    text = build_report(ev).read_text()
    assert "<p class=alert>Warning: reward hacking: the RM score rose" in text  # recomputed from the gains
    assert "(95 % interval 62.0%–78.0%)" in text
    assert "This eval predates responses.jsonl" in text
    assert "old policy reply" in text and "<h2>samples (the first 1 of 128 held-out prompts)</h2>" in text


def test_a_resumed_sweep_job_keeps_its_swept_value(tmp_path):
    """Hydra rewrites a job's overrides.yaml at each start: a resumed job's holds only `resume=...`; its swept
    value comes from its recorded config."""
    sweep = tmp_path / "runs" / "rm" / "sweep-2024-01-01_00-00-00"
    only = ("rm/loss", "eval/rm/accuracy")
    cfg = lambda lr: {"rm": {"lr": lr}, "model": {"name": "tiny", "lora": {"target_modules": ["q_proj", "v_proj"]}},  # noqa: E731
                      "data": {"packing": False}, "seed": 1}
    shared = ["model=tiny", "data.packing=false", "model.lora.target_modules=[q_proj,v_proj]"]
    write_run(sweep / "0", rm_records(only=only), overrides=["rm.lr=1e-5", *shared], config=cfg(1e-5))
    write_run(sweep / "1", rm_records(acc_shift=0.1, only=only), overrides=[f"resume={sweep / '1'}"],
              config=cfg(3e-5))
    columns, rows = summary_table(sweep)
    assert columns == ["job", "rm.lr", "held-out acc", "loss"]  # the shared overrides read as the recorded values
    assert [r[:2] for r in rows] == [["1 ★", "3e-05"], ["0", "1e-5"]]


def corrupt_yaml(path):
    path.write_text("model: [unclosed\n")


@pytest.mark.parametrize("name, corrupt, message", [
    ("eval/c/eval.json", lambda p: p.write_text('{"results": '), r"eval.json: not valid JSON"),
    ("eval/c/eval.json", lambda p: p.write_text("[1, 2]"), r"eval.json: not a JSON object"),
    ("eval/c/responses.jsonl", lambda p: p.write_text('{"prompt": "a"}\n{"prompt": \n'),
     r"responses.jsonl, line 2: not a JSON value"),
    ("eval/c/rewards.json", lambda p: p.write_text("{policy: 1}"), r"rewards.json: not valid JSON"),
    ("ppo/b/config.yaml", corrupt_yaml, r"config.yaml: not valid YAML"),
    ("rm/a/metrics.jsonl", lambda p: p.write_text('{"step": 1}\ngarbage\n{"step": 2}\n'),
     r"metrics.jsonl, line 2: not a JSON object"),
])
def test_a_file_of_the_chain_that_cannot_be_parsed_is_named(tmp_path, name, corrupt, message):
    """Every file the eval page reads, garbled: one UnreadableFile naming it (and the line), not a traceback from
    deep in the page; `rlhf eval run_dir=` turns it into a one-line error."""
    from rlhf_cli.report import UnreadableFile

    ev = write_chain(tmp_path, policy_results())
    corrupt(tmp_path / name)
    with pytest.raises(UnreadableFile, match=re.escape(str(tmp_path / name)) + r"(, line \d+)?: "):
        build_report(ev)
    with pytest.raises(UnreadableFile, match=message):
        build_report(ev)


def test_rlhf_eval_run_dir_names_the_file_it_cannot_read(tmp_path, run_stage):
    from rlhf_cli.errors import ConfigError

    ev = write_chain(tmp_path, policy_results())
    (ev / "eval.json").write_text('{"results": ')
    want = f"run_dir={ev}: {ev / 'eval.json'}: not valid JSON (Expecting"
    with pytest.raises(ConfigError, match="^" + re.escape(want)):
        run_stage("eval", [f"run_dir={ev}"])


def test_metrics_with_a_torn_last_line_reads_the_complete_records(tmp_path, caplog):
    """A run still writing: its last metrics line is cut mid-record. The complete records are read, the torn one
    is dropped with a warning; the same cut on a line before the last is an error naming the line."""
    from rlhf_cli.report import UnreadableFile, load_records

    complete = '{"step": 1, "rm/loss": 0.7}\n{"step": 2, "rm/loss": 0.6}\n'
    (tmp_path / "metrics.jsonl").write_text(complete + '{"step": 3, "rm/l')
    with caplog.at_level("WARNING"):
        assert load_records(tmp_path) == [{"step": 1, "rm/loss": 0.7}, {"step": 2, "rm/loss": 0.6}]
    assert "line 3 is incomplete" in caplog.text
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rm/loss": 0.7}\n{"step": 2, "rm/l\n{"step": 3}\n')
    with pytest.raises(UnreadableFile, match=r"metrics.jsonl, line 2: not a JSON object"):
        load_records(tmp_path)


def test_a_tie_for_best_is_marked_on_every_tied_job_and_one_point_jobs_plot_over_the_jobs(tmp_path):
    from PIL import Image

    sweep = tmp_path / "runs" / "rm" / "sweep-2024-01-01_00-00-00"
    only = ("rm/loss", "rm/accuracy", "eval/rm/accuracy")
    for job, lr in (("0", "1e-5"), ("1", "3e-5"), ("2", "2e-5")):  # jobs 0 and 1 end equal
        records = rm_records(n=1, acc_shift=0.0 if job != "2" else -0.1, only=only)
        write_run(sweep / job, records, overrides=[f"rm.lr={lr}"])
    (sweep / "multirun.yaml").write_text("{}\n")
    _, rows = summary_table(sweep)
    assert [r[0] for r in rows] == ["0 ★ (tie)", "1 ★ (tie)", "2"]
    text = build_report(sweep).read_text()
    assert "class=best" not in text  # a tie highlights no single job
    png = sweep / "report" / "rm_accuracy.png"
    assert png.is_file() and Image.open(png).size[0] > 0


def test_the_headline_names_the_truncation_share_and_a_critic_that_never_explained_its_returns(tmp_path):
    from rlhf_cli.report.chain import critic_note, policy_headline

    base = {"kl_k1": -0.007, "kl_k3": 0.02, "kl_k3_ci95": 0.01}
    cut = policy_headline({**base, "reference/eos_rate": 0.17, "policy/eos_rate": 0.5})[0]
    assert any("83% of the reference's and 50% of the policy's responses hit the length limit" in s for s in cut)
    assert not any("length limit" in s for s in policy_headline({**base, "reference/eos_rate": 0.95,
                                                                 "policy/eos_rate": 0.92})[0])
    assert any("k1, the training curves' objective/kl" in s for s in cut)  # the KL names both estimators
    run = write_run(tmp_path / "ppo" / "a", [{"step": i, "val/explained_var": v} for i, v in
                                              enumerate((-0.8, -0.3, -0.1), 1)])
    assert "stayed below 0 in all 3 iterations (last -0.10)" in critic_note(run)
    learned = write_run(tmp_path / "ppo" / "b", [{"step": 1, "val/explained_var": -0.4},
                                                  {"step": 2, "val/explained_var": 0.2}])
    assert critic_note(learned) == "" and critic_note(write_run(tmp_path / "grpo", [{"step": 1}])) == ""


def test_the_progress_line_names_the_kl_estimator(caplog):
    import logging

    from rlhf_cli.runs import Progress

    with caplog.at_level(logging.INFO, logger="rlhf_cli.runs"):
        bar = Progress(2, "ppo", ["objective/scores", "objective/kl"])
        bar.update(1, {"objective/scores": 1.5, "objective/kl": -0.14})
        bar.close()
    assert "scores=1.5 kl_k1=-0.14" in caplog.text  # k1 of a small sample may be negative: named so
