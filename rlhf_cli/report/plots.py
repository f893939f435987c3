"""The report's PNGs, drawn with matplotlib's Agg canvas (no pyplot, no display; imported only when a plot is drawn)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_cli.report.read import Records, is_run_dir, load_records, read_rewards, series


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
    # supervised fine-tuning (`rlhf train-sft`)
    Panel("sft_loss", "SFT loss (response tokens)", ("sft/loss",), "NLL (nats per token)"),
    Panel("sft_perplexity", "SFT perplexity (response tokens)", ("sft/perplexity",), "exp(NLL)"),
    # reward model (`rlhf train-rm`)
    Panel("rm_loss", "RM loss", ("rm/loss",), "-log σ(r_c - r_r) (nats)"),
    Panel("rm_accuracy", "RM pairwise accuracy", ("rm/accuracy",), "fraction r_c > r_r"),
    Panel("rm_margin", "RM margin", ("rm/margin",), "mean r_c - r_r"),
    Panel("rm_rewards", "RM chosen / rejected reward", ("rm/chosen_mean", "rm/rejected_mean"), "mean reward"),
    # direct preference optimisation (`rlhf train-dpo`), held-out overlaid
    Panel("dpo_loss", "DPO loss", ("dpo/loss",), "nats per pair"),
    Panel("dpo_rewards", "DPO implicit rewards", ("dpo/rewards_chosen", "dpo/rewards_rejected"),
          "β log π/π_ref"),
    Panel("dpo_margin", "DPO reward margin", ("dpo/margin",), "chosen - rejected"),
    Panel("dpo_accuracy", "DPO pairwise accuracy", ("dpo/accuracy",), "fraction margin > 0"),
    Panel("dpo_logprobs", "policy log-probs", ("dpo/logprobs_chosen", "dpo/logprobs_rejected"), "nats per response"),
    # Kahneman-Tversky optimisation (`rlhf train-kto`), held-out overlaid
    Panel("kto_loss", "KTO loss", ("kto/loss",), "per row"),
    Panel("kto_kl", "KTO reference point z0", ("kto/kl",), "nats per sequence"),
    Panel("kto_rewards", "KTO implicit rewards", ("kto/rewards_desirable", "kto/rewards_undesirable"),
          "β log π/π_ref"),
    Panel("kto_logprobs", "policy log-probs", ("kto/logprobs_desirable", "kto/logprobs_undesirable"),
          "nats per completion"),
    Panel("lr", "learning rate", ("sft/lr", "rm/lr", "dpo/lr", "kto/lr"), smooth=False),
    Panel("grad_norm", "gradient norm (before clipping)", ("sft/grad_norm", "rm/grad_norm", "dpo/grad_norm",
                                                           "kto/grad_norm")),
    Panel("throughput_pairs", "throughput (pairs)", ("throughput/pairs_per_s",), "pairs per second"),
    Panel("throughput_tokens", "throughput (tokens)", ("throughput/tokens_per_s",), "tokens per second"),
    # policy (`rlhf train-ppo`)
    Panel("ppo_score", "RM score and RLHF reward", ("objective/scores", "objective/rlhf_reward"), "per sequence"),
    Panel("ppo_kl", "KL(policy ‖ reference): k1 (objective/kl) and k3", ("objective/kl", "objective/kl_k3"),
          "nats per sequence"),
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


def plot_run(run_dir: Path | str, out_dir: Path | str, panels: Sequence[str] | None = None,
             rewards: bool = True) -> list[Path]:
    """Write the run's PNGs into `out_dir` and return their paths, in `PANELS` order.

    One PNG per panel of `PANELS` (only those named in `panels`, when given) that has data (`rm_loss.png`,
    `ppo_kl.png`, ...; panels whose metrics are absent or all null are skipped), then `reward_hist.png` when
    `rewards` and the run wrote `rewards.json`. Eval records (`eval/<k>`) are overlaid on their training
    metric `<k>`.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = load_records(run_dir) if is_run_dir(run_dir) else []
    paths = []
    for panel in PANELS:
        path = out_dir / f"{panel.name}.png"
        if (panels is None or panel.name in panels) and _plot_panel(panel, records, path):
            paths.append(path)
    reward_lists = read_rewards(run_dir) if rewards else {}
    if reward_lists:
        paths.append(plot_rewards(reward_lists, out_dir / HIST_FILE))
    return paths


def plot_jobs(name: str, runs: dict[str, Records], path: Path | str, smooth: bool = True) -> list[str]:
    """One metric of several runs overlaid, a line per run (as TensorBoard and W&B overlay runs), into `path`.

    `runs` maps a label (a sweep's job name) to its records. Series longer than `SMOOTH_ABOVE` are drawn
    faint with their EMA on top, when `smooth`. Returns the labels that had values, in `runs` order; nothing
    is written when none had.
    """
    drawn = [(label, *series(records, name)) for label, records in runs.items()]
    drawn = [(label, xs, ys) for label, xs, ys in drawn if xs]
    if not drawn:
        return []
    fig, ax = _figure()
    if all(len(xs) == 1 for _, xs, _ in drawn):  # one value a job: a point per job over the jobs, not a step axis
        for i, (label, _, ys) in enumerate(drawn):
            ax.plot([i], ys, "o", color=f"C{i % 10}", markersize=6, label=label)
        steps = sorted({xs[0] for _, xs, _ in drawn})
        ax.set_xticks(range(len(drawn)), [label for label, _, _ in drawn], rotation=30, ha="right", fontsize="small")
        ax.set_xlim(-0.5, len(drawn) - 0.5)
        ax.set_xlabel("job (its one value, at step " + ", ".join(map(str, steps)) + ")")
        ax.set_title(name)
        ax.grid(alpha=0.3, axis="y")
        fig.subplots_adjust(bottom=0.3)  # room for the slanted job names
        fig.savefig(path)
        return [label for label, _, _ in drawn]
    for i, (label, xs, ys) in enumerate(drawn):
        color = f"C{i % 10}"
        if smooth and len(ys) > SMOOTH_ABOVE:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, _ema(ys, SMOOTH_WEIGHT), color=color, label=label)
        else:
            ax.plot(xs, ys, "-o" if len(ys) < 30 else "-", color=color, markersize=3, label=label)
    ax.set_title(name)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2 if len(drawn) > 6 else 1)
    fig.savefig(path)
    return [label for label, _, _ in drawn]


def plot_length_vs_reward(points: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path | str,
                          ylabel: str = "RM score") -> Path:
    """A scatter of response length (tokens, x) against reward (y), one colour per side (`policy`,
    `reference`), each with its least-squares line: length hacking shows as a policy cloud shifted right
    and up along a rising line. `points` maps a side to (lengths, rewards). Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = _figure()
    for i, (side, (xs, ys)) in enumerate(points.items()):
        ax.scatter(xs, ys, s=12, alpha=0.5, color=f"C{i}", label=f"{side} (n={len(xs)})")
        if len(set(xs)) > 1:
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            lo, hi = min(xs), max(xs)
            ax.plot([lo, hi], [my + slope * (lo - mx), my + slope * (hi - mx)], color=f"C{i}", linewidth=1.5)
    ax.set_title(f"response length vs {ylabel}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path
