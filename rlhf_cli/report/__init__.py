"""Reports: self-contained HTML pages (images inline, no network, no JavaScript) of what the runs wrote.

`build_report(path)` accepts

* an eval dir (holds `eval.json`, written by `rlhf eval`): the verdict in plain words with its intervals (did the
  policy beat the reference on the RM, what the ground truth says, the KL spent, a reward-hacking warning), then
  the curves of the RM and PPO runs it came from (found through the recorded parents), reward distributions,
  length vs reward, side-by-side samples and each stage's config (`chain`);
* a run dir (holds `metrics.jsonl`, see `rlhf_cli.runs` for the layout): the run's facts, final metrics, one PNG
  per panel of curves, the reward histograms when the run wrote `rewards.json`, and its config (`pages`); or
* a sweep dir (`<root>/<stage>/sweep-<time>/`, holding job dirs `0/`, `1/`, ...): a table of the swept settings
  and headline metrics, best first, the shared settings folded, and one plot per metric with a line per job
  (`sweep`).

The page is `<path>/report/report.html`; its PNGs are written beside it and embedded as base64 data URIs, so the
page can be mailed or opened anywhere on its own. matplotlib draws through its Agg canvas (no pyplot, no display
needed) and is imported only when a plot is drawn.

Modules: `read` (a run dir's files), `plots` (PNGs), `html` (the page), `pages` (dispatch, run pages), `sweep`,
`chain`.
"""

from rlhf_cli.report.chain import RESPONSES_FILE, chain_runs, eval_headline, is_eval_dir, policy_headline
from rlhf_cli.report.html import Section, Table, fmt, write_html
from rlhf_cli.report.pages import (
    build_report,
    print_summary,
    summary_table,
)
from rlhf_cli.report.plots import PANELS, Panel, plot_rewards, plot_run
from rlhf_cli.report.read import (
    UnreadableFile,
    final_metrics,
    is_run_dir,
    job_dirs,
    load_records,
    metric_names,
    read_config,
    read_overrides,
    read_rewards,
    run_stage,
    series,
)

__all__ = [
    "build_report", "chain_runs", "eval_headline", "final_metrics", "fmt", "is_eval_dir", "is_run_dir", "job_dirs",
    "load_records", "metric_names", "Panel", "PANELS", "plot_rewards", "plot_run", "policy_headline", "print_summary",
    "read_config", "read_overrides", "read_rewards", "RESPONSES_FILE", "run_stage", "Section", "series",
    "summary_table", "Table", "UnreadableFile", "write_html",
]
