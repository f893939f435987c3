"""Run README.md's how-to recipes that fit a 2-core CPU, as a newcomer would paste them, with smoke settings.

    python scripts/run_recipes.py --list                 # every recipe, its commands, and run or skip (why)
    python scripts/run_recipes.py                        # run the CPU ones with this interpreter, a log per recipe
    python scripts/run_recipes.py --only "Train with LoRA"
    python scripts/run_recipes.py --fresh-venv /tmp/rv   # first a clean venv by the README's own install line

Each recipe runs in its own temporary directory (its `paths.root` is `<dir>/runs`), with the files its commands
name (`my_pairs.jsonl`, `demos.jsonl`, and every `# my_rewards.py` block of the README's recipes) written there
first.
Every `rlhf <command>` line runs as `python -m rlhf_cli <command> ... experiment=smoke` (the tiny random model, a
few steps), with `<run-id>`, `sweep-<time>` and `<job>` filled in from the runs already made. A command that needs
a reward model and whose recipe trains none gets one trained first. Skipped: recipes and lines that need a GPU,
several nodes, another venv, an interrupted run, data outside the repository or a long preset; the log names
each with the reason. The exit status is 1 when any command that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SECTION = "## How-to recipes"
SMOKE = "experiment=smoke"


@dataclass
class Recipe:
    """A `###` recipe of the README's how-to section: its bash command lines (continuations joined, here-documents
    kept whole) and the Python files its blocks define (`# name.py` on the first line)."""

    title: str
    commands: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


def logical_lines(block: str) -> list[str]:
    """A bash block's commands: `\\`-continued lines joined, a here-document kept with its body, comments dropped."""
    out, lines, i = [], block.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            end = heredoc.group(1)
            body = [line]
            while i + 1 < len(lines) and lines[i].strip() != end:
                i += 1
                body.append(lines[i])
            out.append("\n".join(body))
            i += 1
            continue
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
        code = strip_comment(line).strip()
        if code:
            out.append(code)
        i += 1
    return out


def strip_comment(line: str) -> str:
    """`line` without its trailing `# comment` (a `#` outside quotes that starts a word)."""
    quote = None
    for j, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (j == 0 or line[j - 1].isspace()):
            return line[:j]
    return line


def extract(text: str) -> list[Recipe]:
    """The README's recipes, in order: each `###` under `## How-to recipes` up to the next `## `."""
    if SECTION not in text:
        raise SystemExit(f"README.md has no '{SECTION}' section")
    body = text.split(SECTION, 1)[1]
    body = re.split(r"\n## ", body, maxsplit=1)[0]
    recipes = []
    for chunk in re.split(r"\n### ", body)[1:]:
        title, rest = chunk.split("\n", 1)
        recipe = Recipe(title.strip())
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", rest, flags=re.S):
            if lang == "bash":
                recipe.commands += logical_lines(block)
            elif lang == "python" and re.match(r"# (\S+\.py)\b", block):
                recipe.files[re.match(r"# (\S+\.py)\b", block).group(1)] = block
        recipes.append(recipe)
    return recipes


# Why a recipe or a line does not run here. A recipe not named here fails `--list` (the tests call it): a new
# recipe is classified when it is added.
SKIP_RECIPE = {
    "Use several GPUs or nodes": "launchers for several GPUs or nodes (tests/test_distributed.py runs 2 CPU ranks)",
    "Sample with vLLM": "needs `make install-vllm` in a venv of its own (CI's vLLM job runs tests/engine_vllm)",
    "Resume a run": "needs an interrupted run (tests/test_kill_mid_save.py and the resume tests interrupt one)",
    "Score with plain transformers": "no command block (tests/stages/test_stage_rm.py runs the snippet)",
    "GRPO on reasoning-gym tasks, or math answers": "full-size GRPO presets (tests/stages/"
                                                    "test_stage_reasoning_gym.py runs train-ppo and eval on them)",
    "Score with a reward server": "a server that runs until stopped (tests/test_serve_rm.py serves a tiny RM, "
                                  "tests/test_reward_http.py trains and resumes against a server)",
    "Score with an LLM judge": "needs an OpenAI-compatible endpoint (tests/test_reward_judge.py and "
                               "tests/stages/test_stage_judge.py train and evaluate against a fake one)",
    "Distil a model on-policy": "full-size presets (SmolLM2's SFT, then experiment=distill: hours on a CPU); "
                                "tests/stages/test_stage_distill.py runs a tiny distillation through latest_sft",
    "Train a model that uses tools": "full-size presets (SmolLM2's tool SFT, then GRPO with the calculator); "
                                     "tests/data/test_builtin_tools.py runs the calculator and composes "
                                     "experiment=tools, tests/stages/test_environments.py trains and evaluates with "
                                     "an environment",
}
RUN_RECIPE = {
    "Train on your own data", "SFT, then RM, then PPO on your own files", "Train with LoRA",
    "DPO on your pairs, then against RM → PPO", "KTO on thumbs-up / thumbs-down rows",
    "GRPO or RLOO with your own reward function", "Sweep a setting and compare the runs",
    "Evaluate a policy or a reward model", "Try a setting in seconds", "Log to TensorBoard, wandb, mlflow or trackio",
}
PREPARE = {  # runs a recipe's commands read that it does not make itself, made first (logged as "prepare")
    "Evaluate a policy or a reward model": ["rlhf train-rm", "rlhf train-ppo"],
}
SKIP_LINE = [  # (pattern, why): a line of a recipe that runs, skipped
    (r"\bdata=hh\b", "HH-RLHF lies in ../shared/data, outside the repository"),
    (r"experiment=(grpo|checker|hh_smollm2)\b", "a full-size preset (minutes to hours on a CPU), not a smoke run"),
    (r"^pip install", "installs packages (the recipe runs with what is installed)"),
    (r"^make install", "installs packages"),
]


def plan(recipe: Recipe) -> tuple[str | None, list[tuple[str, str | None]]]:
    """`(why the recipe is skipped or None, [(command, why it is skipped or None)])`."""
    if recipe.title in SKIP_RECIPE:
        return SKIP_RECIPE[recipe.title], [(c, None) for c in recipe.commands]
    if recipe.title not in RUN_RECIPE:
        raise SystemExit(f"recipe '{recipe.title}' is neither run nor skipped: classify it in scripts/run_recipes.py")
    lines = []
    for command in recipe.commands:
        why = next((why for pattern, why in SKIP_LINE if re.search(pattern, command)), None)
        if why is None and not re.match(r"(\w+=\S+ )*rlhf ", command):
            why = "not an `rlhf` command"
        lines.append((command, why))
    return None, lines


# ---------------------------------------------------------------------------------------------- running

def fixtures(cwd: Path, files: dict[str, str]) -> None:
    """The data files recipes name, tiny and valid: 40 arithmetic rows each, and every `# name.py` block."""
    rows = [(f"What is {a} + {b}?", a + b) for a in range(2, 10) for b in range(3, 8)][:40]
    pairs = [{"prompt": q, "question": q, "chosen": f"{q[8:-1]} = {s}.", "rejected": f"{q[8:-1]} = {s + 1}."}
             for q, s in rows]
    data = {
        "pairs.jsonl": pairs, "my_pairs.jsonl": pairs,
        "prompts.jsonl": [{"prompt": q, "answer": s} for q, s in rows],
        "my_prompts.jsonl": [{"prompt": q, "answer": s} for q, s in rows],
        "demos.jsonl": [{"prompt": q, "completion": f"{q[8:-1]} = {s}."} for q, s in rows],
        "feedback.jsonl": [{"prompt": q, "completion": f"{q[8:-1]} = {s + i % 2}.", "label": i % 2 == 0}
                           for i, (q, s) in enumerate(rows)],
    }
    for name, items in data.items():
        (cwd / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    for name, text in files.items():
        (cwd / name).write_text(text)


def newest(pattern: str, cwd: Path) -> str | None:
    hits = sorted(cwd.glob(pattern), key=lambda p: p.stat().st_mtime)
    return str(hits[-1].relative_to(cwd)) if hits else None


def fill(command: str, cwd: Path) -> str:
    """`<run-id>`, `sweep-<time>` and `<job>` filled in from the runs already made under `cwd/runs`."""
    for stage in ("sft", "rm", "dpo", "kto", "ppo", "eval"):
        if f"runs/{stage}/sweep-<time>" in command:
            sweep = newest(f"runs/{stage}/sweep-*", cwd)
            command = command.replace(f"runs/{stage}/sweep-<time>", sweep or f"runs/{stage}/sweep-<time>")
        if f"runs/{stage}/<run-id>" in command:
            run = newest(f"runs/{stage}/[0-9]*/final", cwd)
            command = command.replace(f"runs/{stage}/<run-id>", str(Path(run).parent) if run else "<run-id>")
    if "/<job>" in command:
        command = command.replace("/<job>", "/0")
    return command


def smoke(command: str, python: str, root: Path, rm_path: str | None) -> str:
    """`rlhf <cmd> args` as `python -m rlhf_cli <cmd> args experiment=smoke paths.root=<root>` (and the set-up reward
    model where a train-ppo or a policy eval needs one and the recipe has trained none)."""
    env, rest = re.match(r"((?:\w+=\S+ )*)rlhf (.*)", command, flags=re.S).groups()
    extra = [] if "experiment=" in rest or "--cfg" in rest else [SMOKE]
    extra.append(f"paths.root={root}")
    needs_rm = (rest.startswith("train-ppo") and "reward.type=" not in rest and "reward.weights" not in rest
                or rest.startswith("eval") and "reward_model.path" not in rest and "run_dir" not in rest)
    if needs_rm and rm_path and "checker" not in rest:
        extra.append(f"reward_model.path={rm_path}")
    if "reward.weights" in rest and rm_path:
        extra.append(f"reward_model.path={rm_path}")
    return f"{env}{shlex.quote(python)} -m rlhf_cli {rest} {' '.join(extra)}"


def run_recipe(recipe: Recipe, python: str, log, setup_rm: str | None, files: dict[str, str]) -> bool:
    why, lines = plan(recipe)
    if why:
        log(f"SKIP recipe '{recipe.title}': {why}")
        return True
    ok = True
    with tempfile.TemporaryDirectory(prefix="recipe-") as tmp:
        cwd = Path(tmp)
        fixtures(cwd, {**files, **recipe.files})
        trains_rm = any("train-rm" in c for c, w in lines if w is None) or any(
            "train-rm" in c for c in PREPARE.get(recipe.title, []))
        for command, why in [(c, "prepare") for c in PREPARE.get(recipe.title, [])] + lines:
            if why == "prepare":
                why = None
                log(f"  prepare: {command}")
            if why:
                log(f"  skip `{command.splitlines()[0]}`: {why}")
                continue
            rm = None if trains_rm and (cwd / "runs" / "latest_rm").exists() else setup_rm
            full = smoke(fill(command, cwd), python, cwd / "runs", rm)
            start = time.time()
            out = subprocess.run(full, shell=True, cwd=cwd, capture_output=True, text=True, env=child_env(),
                                 executable="/bin/bash")
            status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
            log(f"  {status} in {time.time() - start:.0f} s: {full}")
            if out.returncode:
                ok = False
                log("    " + "\n    ".join((out.stdout + out.stderr).strip().splitlines()[-15:]))
    return ok


def child_env() -> dict[str, str]:
    """The commands' environment: this checkout first on the path, offline, DeepSpeed on the CPU without a GPU."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def train_setup_rm(python: str, root: Path, log) -> str:
    """One smoke reward model for the recipes that need one and train none; its `final/` dir."""
    cmd = [python, "-m", "rlhf_cli", "train-rm", SMOKE, f"paths.root={root}"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root.parent, env=child_env())
    if out.returncode:
        raise SystemExit("the set-up reward model failed:\n" + (out.stdout + out.stderr)[-3000:])
    final = (root / "latest_rm").read_text().strip()
    log(f"set-up reward model: {final}")
    return final


def fresh_venv(path: Path, log) -> str:
    """A clean venv made by the README's own install line (run from the repository root); its python."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("python3 -m venv .venv"))
    line = line.replace(".venv", shlex.quote(str(path)))
    log(f"fresh venv: {line}")
    subprocess.run(line, shell=True, cwd=REPO, check=True, executable="/bin/bash")
    return str(path / "bin" / "python")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every recipe and what would run or be skipped")
    parser.add_argument("--only", action="append", help="run only the recipe with this title (repeatable)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run the commands with")
    parser.add_argument("--fresh-venv", type=Path, help="make a clean venv here first (the README's install line)")
    parser.add_argument("--log", type=Path, help="also write the log to this file")
    args = parser.parse_args(argv)
    recipes = extract(README.read_text())
    files = {name: text for r in recipes for name, text in r.files.items()}  # a recipe may use another's file
    sink = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed at the end

    def log(msg: str) -> None:
        print(msg, flush=True)
        if sink:
            sink.write(msg + "\n")

    if args.list:
        for r in recipes:
            why, lines = plan(r)
            log(f"{'SKIP' if why else 'RUN '} {r.title}" + (f": {why}" if why else ""))
            for command in PREPARE.get(r.title, []) if not why else []:
                log(f"     prep {command}")
            for command, line_why in lines:
                mark = "-   " if why else "skip" if line_why else "run "
                log(f"     {mark} {command.splitlines()[0]}" + (f"  ({line_why})" if line_why else ""))
        return 0
    if args.only:
        unknown = set(args.only) - {r.title for r in recipes}
        if unknown:
            raise SystemExit(f"no recipe titled {sorted(unknown)}; `--list` shows them")
        recipes = [r for r in recipes if r.title in args.only]
    python = fresh_venv(args.fresh_venv, log) if args.fresh_venv else args.python
    ok = True
    with tempfile.TemporaryDirectory(prefix="recipes-rm-") as tmp:
        setup = None
        if any(plan(r)[0] is None for r in recipes):
            setup = train_setup_rm(python, Path(tmp) / "runs", log)
        for r in recipes:
            log(f"recipe '{r.title}'")
            ok = run_recipe(r, python, log, setup, files) and ok
    log("all recipes that ran succeeded" if ok else "some recipes FAILED")
    if sink:
        sink.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
