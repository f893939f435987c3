"""An eval's page: did RLHF help? The verdict in plain words first, then the runs the evaluated model came from.

`eval_sections(eval_dir, out_dir)` reads what `rlhf eval` wrote into its run dir:

    eval.json          {"results": {...}, "config": {...}}   (the numbers; `mode` is `policy` or `reward_model`)
    responses.jsonl    policy eval: a line per held-out prompt, {"prompt", "policy", "reference",
                       "policy_score", "reference_score", "policy_length", "reference_length",
                       "policy_correct", "reference_correct", "policy_function", "reference_function"}
                       (null where not measured); with `rollout.env` also "policy_conversation" and
                       "reference_conversation", each episode's messages after the prompt
    rewards.json       the score lists of the histogram (policy/reference, or chosen/rejected)
    lineage.json       the parents it evaluated (see `rlhf_cli.lineage`)

and walks the recorded parents (eval → policy's PPO run → its reward model's RM run) to draw each training run's
curves. Sections, in order: the headline (3–5 sentences, and a red box when reward hacking is shown); the models
compared (policy, reference, reward model), each with the command and run that trained it; each training run's
curves in registry order (SFT, RM: loss, accuracy with held-out accuracy, margin; DPO; PPO); the reward
distributions; length
vs reward; side-by-side samples with their scores and the checker's verdict; every number; each stage's resolved
config, folded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_cli import lineage
from rlhf_cli.commands import COMMANDS, reporter
from rlhf_cli.core import reward_hacking
from rlhf_cli.report.html import Messages, Section, Table
from rlhf_cli.report.plots import HIST_FILE, plot_length_vs_reward, plot_rewards, plot_run
from rlhf_cli.report.read import (
    UnreadableFile,
    config_rows,
    flatten,
    load_records,
    parse_json,
    parse_jsonl,
    read_config,
    read_rewards,
    series,
)

EVAL_FILE = "eval.json"
RESPONSES_FILE = "responses.jsonl"


def stage_panels() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{run-dir kind: its `commands.Command.report`}, in registry order: the section's name and the `plots.PANELS`
    it draws (RM accuracy overlays held-out accuracy; the PPO loss panel holds the value loss)."""
    return {c.kind: c.report for c in COMMANDS.values() if c.report}


SAMPLE_WIDTHS = ["18%", "28%", "7%", "7%", "26%", "7%", "7%"]


def is_eval_dir(path: Path | str) -> bool:
    """True when `path` is the run dir of an `rlhf eval` (holds `eval.json`)."""
    return (Path(path) / EVAL_FILE).is_file()


def read_eval(eval_dir: Path | str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, config) of `<eval_dir>/eval.json`. Raises UnreadableFile naming the file when it is not a JSON
    object."""
    path = Path(eval_dir) / EVAL_FILE
    obj = parse_json(path)
    if not isinstance(obj, dict):
        raise UnreadableFile(f"{path}: not a JSON object")
    return obj.get("results") or {}, obj.get("config") or {}


def read_responses(eval_dir: Path | str) -> list[dict[str, Any]]:
    """The per-prompt lines of `<eval_dir>/responses.jsonl` (empty when missing: an RM eval, or an older eval)."""
    path = Path(eval_dir) / RESPONSES_FILE
    if not path.is_file():
        return []
    return parse_jsonl(path)


def chain_runs(run_dir: Path | str) -> list[tuple[str, Path]]:
    """The training runs a run's models came from, as recorded in `lineage.json` files: [(stage, run dir)],
    in registry order (SFT, reward-model, then PPO runs), each once; runs whose dir is gone are left out."""
    found: dict[Path, str] = {}
    queue = [_lineage(Path(run_dir))]
    while queue:
        rec = queue.pop(0)
        parents = rec.get("parents") if isinstance(rec, dict) else None
        for parent in (parents.values() if isinstance(parents, dict) else []):
            if not isinstance(parent, dict):
                continue
            run, stage = parent.get("run_dir"), parent.get("stage")
            if not isinstance(run, str) or stage not in stage_panels() or not Path(run).is_dir() or Path(run) in found:
                continue
            found[Path(run)] = stage
            queue.append(_lineage(Path(run)))
    order = list(stage_panels())
    return sorted(((stage, run) for run, stage in found.items()), key=lambda x: order.index(x[0]))


def _lineage(run_dir: Path) -> Any:
    """A run's lineage record, or None when it is missing or unreadable (a parent's files are not the eval's)."""
    try:
        return lineage.read_run(run_dir)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# the headline


def _interval(gain: float, half: float) -> str:
    return f"{gain:+.3f} ± {half:.3f}"


def _moved(gain: float, half: float, up: str, down: str, flat: str) -> str:
    return up if gain - half > 0 else down if gain + half < 0 else flat


def _bounds(r: dict[str, Any], key: str) -> str:
    """` (95 % interval a–b)` of a proportion from `<key>_ci95_low/_high`, or from an older eval's `<key>_ci95`
    half-width; "" when neither was stored."""
    if f"{key}_ci95_low" in r and f"{key}_ci95_high" in r:
        low, high = r[f"{key}_ci95_low"], r[f"{key}_ci95_high"]
    elif f"{key}_ci95" in r:
        low, high = r[key] - r[f"{key}_ci95"], r[key] + r[f"{key}_ci95"]
    else:
        return ""
    return f" (95 % interval {low:.1%}–{high:.1%})"


def score_names(r: dict[str, Any]) -> tuple[str, str]:
    """(the scorer in words, the column/axis label) of a policy eval's `score` figures, from its `reward_source`
    (`stages.evaluate.score_source`): a reward model (and an older eval without the field), a reward server, a judge
    or an environment's `get_reward`."""
    source = str(r.get("reward_source") or "reward model")
    for start, name, label in (("reward server", "the reward server", "server score"),
                               ("judge", "the judge", "judge score"),
                               ("environment", "the environment's get_reward", "environment reward")):
        if source.startswith(start):
            return name, label
    return "the reward model", "RM score"


def policy_headline(r: dict[str, Any]) -> tuple[list[str], str]:
    """(sentences, alert) summing up a policy eval's `results` in plain words, at most 5 sentences: whether the
    policy beats the reference on the reward model (gain in RM std when known), what the ground truth says
    (checker, reward function), the KL spent, the reward-hacking verdict (`core.reward_hacking`, read from the
    intervals: the alert for a "warning", a sentence for a "possible"), and a small-sample caution. Every number
    comes with its 95 % interval (paired: policy − reference). An older eval's results (a boolean verdict) get
    the verdict recomputed from their gains."""
    out = []
    scorer, label = score_names(r)
    units = "RM units" if label == "RM score" else "its units"
    if "score_gain" in r:
        if "score_gain_rm_std" in r:
            amount = (f"{r['score_gain_rm_std']:+.2f} RM std (95 % interval ± {r['score_gain_rm_std_ci95']:.2f}; "
                      f"{_interval(r['score_gain'], r['score_gain_ci95'])} in RM units)")
        else:
            amount = f"{_interval(r['score_gain'], r['score_gain_ci95'])} in {units} (95 % interval)"
        verb = _moved(r["score_gain"], r["score_gain_ci95"], "beats", "loses to", "does not measurably beat")
        wins = (f", and it wins {r['win_rate']:.0%} of {r.get('prompts')} held-out prompts{_bounds(r, 'win_rate')}"
                if "win_rate" in r else "")
        out.append(f"On {scorer}, the policy {verb} the reference: paired score gain {amount}{wins}.")
    else:
        out.append("No reward model scored these samples, so this eval says nothing about RM score.")
    cut = [f"{1 - r[f'{side}/eos_rate']:.0%} of the {side}'s" for side in ("reference", "policy")
           if f"{side}/eos_rate" in r]
    if any(1 - r.get(f"{side}/eos_rate", 1.0) > TRUNCATED_SHARE for side in ("reference", "policy")):
        out.append(f"{' and '.join(cut)} responses hit the length limit without an EOS (eval.max_new_tokens): a "
                   f"gain may be partly a change in how often a response ends.")
    truths = []
    if "accuracy_gain" in r:
        change = _moved(r["accuracy_gain"], r["accuracy_gain_ci95"], "a real gain", "a real loss", "within noise")
        truths.append(f"checker accuracy went from {r['reference/accuracy']:.3f} for the reference to "
                      f"{r['policy/accuracy']:.3f} for the policy, a paired change of "
                      f"{_interval(r['accuracy_gain'], r['accuracy_gain_ci95'])} ({change})")
    if "function_gain" in r:
        change = _moved(r["function_gain"], r["function_gain_ci95"], "a real gain", "a real loss", "within noise")
        truths.append(f"reward.function's mean went from {r['reference/function_mean']:.3f} to "
                      f"{r['policy/function_mean']:.3f}, a paired change of "
                      f"{_interval(r['function_gain'], r['function_gain_ci95'])} ({change})")
    unscored = [f"{r[f'{side}/{key}_unscorable']} of the {side}'s completions by the {what}"
                for key, what in (("score", "reward source"), ("function", "reward.function"))
                for side in ("policy", "reference") if r.get(f"{side}/{key}_unscorable")]
    if unscored:  # left out of their means and of the paired figures
        out.append(f"Unscorable (None or NaN) and left out: {'; '.join(unscored)}.")
    if truths:
        out.append(f"The ground truth says: {'; '.join(truths)}.")
    else:
        out.append("There is no ground truth for these prompts (no answers for the checker, no reward.function "
                   f"given to {reporter().invocation}): {scorer} is the only judge.")
    if "kl_k3" in r:
        out.append(f"The policy spent {r['kl_k3']:.3f} ± {r['kl_k3_ci95']:.3f} nats of KL from the reference per "
                   f"response (k3 estimator, never negative; k1, the training curves' objective/kl, reads "
                   f"{r['kl_k1']:.3f}).")
    verdict, line = r.get("reward_hacking"), r.get("headline")
    if not isinstance(verdict, str):  # an eval written before the verdict was read from intervals
        verdict, line = (lambda v: (v.get("reward_hacking"), v.get("headline")))(reward_hacking(r))
    alert = ""
    if verdict == "warning":
        alert = f"Warning: {line}. Both moves lie beyond their 95 % intervals."
    elif verdict == "possible":
        out.append(f"Possible reward hacking: the {label} went up while the ground truth went down, but at least one "
                   "of the two intervals contains 0; more held-out prompts (eval.num_prompts) would tell.")
    if r.get("warning"):
        out.append(f"Caution: {r['warning']}.")
    return out, alert


TRUNCATED_SHARE = 0.10
"""A side whose responses end without an EOS more often than this has its truncation share in the headline."""


def critic_note(run: Path) -> str:
    """A sentence on a PPO run whose critic never explained its returns (`val/explained_var` below 0 at every
    logged iteration: its values predict the returns worse than their mean, so GAE's advantages are mostly its
    noise); "" otherwise, and for a run without a critic."""
    _, values = series(load_records(run), "val/explained_var")
    if not values or max(values) >= 0:
        return ""
    return (f"Warning: the critic's explained variance stayed below 0 in all {len(values)} iterations (last "
            f"{values[-1]:.2f}): its values predict the returns worse than their mean, so the advantages were "
            f"mostly its noise; train longer, raise ppo.critic_lr, or use a critic-free ppo.advantage_estimator.")


def rm_headline(r: dict[str, Any]) -> list[str]:
    """Sentences summing up a reward-model eval's `results`: held-out pairwise accuracy with its interval, ties,
    and the mean margin."""
    out = [f"The reward model ranks the chosen response above the rejected one on {r['accuracy']:.1%} of "
           f"{r.get('pairs')} held-out pairs{_bounds(r, 'accuracy')}; ties count as wrong: {r.get('ties', '?')}.",
           f"Its mean margin (chosen − rejected) is {r.get('margin_mean', float('nan')):.3f} and its Bradley-Terry "
           f"loss {r.get('loss', float('nan')):.3f} nats (0.693 is a coin)."]
    if r.get("warning"):
        out.append(f"Caution: {r['warning']}.")
    return out


def eval_headline(eval_dir: Path | str) -> list[str]:
    """The headline sentences of an eval dir's page (the alert first when there is one)."""
    results, _ = read_eval(eval_dir)
    if results.get("mode") == "reward_model":
        return rm_headline(results)
    sentences, alert = policy_headline(results)
    return [alert, *sentences] if alert else sentences


# ----------------------------------------------------------------------------------------------
# sections


def _verdict(correct: Any) -> str:
    return "–" if correct is None else "✓" if correct >= 0.5 else "✗"


def _samples(rows: list[dict[str, Any]], n: int, score_label: str = "RM score") -> Table:
    """The first `n` prompts side by side: each reply with its score (`score_label`: what scored it,
    `score_names`; reward.function's when nothing else scored them) and the checker's verdict. An episode of several
    turns (`rollout.env`) is its conversation, the tool calls, results and environment replies set apart
    (`html.Messages`)."""
    key, label = ("function", "function") if rows and rows[0].get("policy_score") is None \
        and rows[0].get("policy_function") is not None else ("score", score_label)
    columns = ["prompt", "policy", label, "checker", "reference", label, "checker"]

    def reply(x: dict[str, Any], side: str) -> Any:
        conversation = x.get(f"{side}_conversation")
        return Messages(conversation) if isinstance(conversation, list) else x.get(side)

    return Table(columns, [[x.get("prompt"), reply(x, "policy"), x.get(f"policy_{key}"),
                            _verdict(x.get("policy_correct")), reply(x, "reference"), x.get(f"reference_{key}"),
                            _verdict(x.get("reference_correct"))] for x in rows[:n]], widths=SAMPLE_WIDTHS)


def _length_vs_reward(rows: list[dict[str, Any]], out_dir: Path, score_label: str = "RM score") -> Section:
    title = "length vs reward"
    for key, label in (("score", score_label), ("function", "reward.function")):
        if rows and all(x.get(f"policy_{key}") is not None for x in rows):
            points = {side: ([x[f"{side}_length"] for x in rows], [x[f"{side}_{key}"] for x in rows])
                      for side in ("policy", "reference")}
            path = plot_length_vs_reward(points, out_dir / "length_vs_reward.png", label)
            return Section(title, images=[path], text=(
                "Each dot is one held-out response (tokens on x), with a least-squares line per side. A policy "
                "cloud shifted right along a rising line is the commonest hack: longer, not better."))
    if not rows:
        return Section(title, text=f"This eval predates {RESPONSES_FILE}: run `{reporter().invocation}` again for this "
                                      "plot.")
    return Section(title, text="No per-response reward to plot (no reward model and no reward.function).")


def _sides(eval_dir: Path, results: dict[str, Any]) -> Section:
    """The models a policy eval compared, each with the command and run that trained it (from the eval's
    `lineage.json`): the policy, its reference (another trained policy, or the starting model) and the judge."""
    parents = _parents(eval_dir)
    rows = []
    for side, what in (("policy", "policy (measured)"), ("reference", "reference (compared with)"),
                       ("reward_model", "reward model (judge)")):
        parent = parents.get(side, {})
        cmd = _made_by(parent)
        run = f"{cmd}: {parent.get('run_dir')}" if cmd else "not a run of ours"
        if results.get(side) is not None:
            typed = f" (given as {parent['typed']})" if parent.get("typed") else ""
            rows.append([what, f"{results[side]}{typed}", run])
    return Section("policy and reference", tables=[Table(["side", "model", "trained by"], rows)])


def _parents(eval_dir: Path) -> dict[str, dict[str, Any]]:
    """{side: its lineage record} of the models an eval compared (`policy`, `reference`, `reward_model`), from the
    eval's `lineage.json`; a side without a readable record is absent."""
    rec = _lineage(eval_dir)
    parents = rec.get("parents") if isinstance(rec, dict) and isinstance(rec.get("parents"), dict) else {}
    return {side: p for side, p in parents.items() if isinstance(p, dict)}


def _made_by(parent: dict[str, Any]) -> str | None:
    """The command that trained a parent model (`rlhf train-ppo`, ...), or None when it is not a run of ours."""
    return {c.kind: c.invocation for c in COMMANDS.values()}.get(parent.get("stage"))


RLHF_STAGES = ("ppo", "dpo", "kto")
"""The stages whose policy is an RLHF result: a reference trained by one of them makes an eval a comparison of two
RLHF policies (an SFT run's policy is a starting point, and the question stays "did RLHF help?")."""


def _trained_reference(eval_dir: Path) -> str | None:
    """The command that trained a policy eval's reference when its lineage records an RLHF run of ours
    (`RLHF_STAGES`), else None (the starting model, an SFT run, or not a run of ours)."""
    ref = _parents(eval_dir).get("reference", {})
    return _made_by(ref) if ref.get("stage") in RLHF_STAGES else None


def eval_sections(eval_dir: Path, out_dir: Path) -> tuple[str, list[Section]]:
    """(page title, sections) of an eval's page, its PNGs written into `out_dir` (see the module docstring)."""
    results, config = read_eval(eval_dir)
    runs = chain_runs(eval_dir)
    if results.get("mode") == "reward_model":
        title = f"reward model eval: {results.get('reward_model')}"
        sections = [Section("Is the reward model any good?", text=" ".join(rm_headline(results)))]
    else:
        sentences, alert = policy_headline(results)
        trained = _trained_reference(eval_dir)
        if trained is None:
            title, question = f"policy eval: did RLHF help? ({results.get('policy')})", "Did RLHF help?"
        else:  # two trained policies: the question is which is better, not whether training helped
            title = f"policy eval: {results.get('policy')} against the {trained} policy {results.get('reference')}"
            question = f"Does the policy beat the {trained} policy?"
        sections = [Section(question, text=" ".join(sentences), alert=alert), _sides(eval_dir, results)]
    for i, (stage, run) in enumerate(runs):
        name, panels = stage_panels()[stage]
        images = plot_run(run, out_dir / f"{i}_{stage}_{run.name}", panels=panels, rewards=False)
        critic = critic_note(run)
        if critic and sections:
            sections[0].alert = " ".join(a for a in (sections[0].alert, critic) if a)
        sections.append(Section(f"{name}: {run}", images=images, alert=critic,
                                text="" if images else "this run logged none of these metrics"))
    if not runs:
        sections.append(Section("training runs", text="No training run of ours was found through the recorded "
                                                      "parents (lineage.json): only this eval's numbers are shown."))
    rewards = read_rewards(eval_dir)
    if rewards:
        what = f"{score_names(results)[1]}: policy vs reference" if "policy" in rewards else \
            "RM scores: chosen vs rejected"
        sections.append(Section("reward distributions", images=[plot_rewards(rewards, out_dir / HIST_FILE, what)]))
    rows = read_responses(eval_dir)
    if results.get("mode") != "reward_model":
        sections.append(_length_vs_reward(rows, out_dir, score_names(results)[1]))
        n = int((config.get("eval") or {}).get("num_samples", 8))
        shown = rows or [{"prompt": x.get("prompt"), "policy": x.get("policy"), "reference": x.get("reference"),
                          "policy_score": x.get("policy_score"), "reference_score": x.get("reference_score")}
                         for x in results.get("samples") or []]  # an older eval: its stored samples
        of = f"{len(rows)} held-out prompts" if rows else f"{results.get('prompts')} held-out prompts"
        table = _samples(shown, n, score_names(results)[1])
        sections.append(Section(f"samples (the first {min(n, len(shown))} of {of})", tables=[table],
                                text="Both sides answer the same prompt with the same sampling noise."))
    numbers = [[k, v] for k, v in flatten({k: v for k, v in results.items() if k != "samples"}).items()]
    sections.append(Section("every number of eval.json", tables=[Table(["metric", "value"], numbers)],
                            collapsed=True))
    for stage, run in runs:
        sections.append(Section(f"config of the {stage} run ({run.name})",
                                tables=[Table(["key", "value"], config_rows(read_config(run), stage))],
                                collapsed=True))
    if config:
        own = config_rows(config, reporter().kind)
        sections.append(Section("config of this eval", tables=[Table(["key", "value"], own)], collapsed=True))
    return title, sections
