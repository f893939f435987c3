"""GPU check: the precision tests, a 1-GPU train-rm -> train-ppo -> eval chain, and bf16 throughput, as one JSON.

Run through `benchmarks/gpu_check.sh` on a machine with one CUDA GPU and no network (see that script for the
wheel folder it installs from). No model weights travel: the chain uses the tiny random model and the
throughput runs a random-init model of SmolLM2-135M's shape, both over the SmolLM2 tokenizer carried in
the wheel folder. Each step appends to the JSON as it ends, so a run cut short still reports what it did.

    python benchmarks/gpu_check.py --tokenizer .whl/tokenizer --out gpu_check.json [--work DIR]

JSON: machine (GPU, torch, CUDA, bf16 support, what precision=auto resolves to), then per step its
command(s), exit codes, seconds and numbers:
  tests        the precision tests and tests/test_engine.py (pytest -k ...) on this machine: passed / failed counts,
               the summary line and each failure's pytest line (test id and message)
  chain        train-rm -> train-ppo -> eval, tiny model, precision=auto: exit codes, final metrics
  rm_step      SmolLM2-shaped RM steps in bf16-autocast: s/step, tokens/s (steps after the first)
  ppo_iter     SmolLM2-shaped PPO iterations in bf16-autocast, scoring passes in fp32 (the default) and in
               bf16 (`scoring_precision=same`): generation/scoring/training s per iteration, reported KL and,
               for `same`, the fp32 KL of the same rows (the noise floor)
  engine       the fp32-scoring PPO iterations again on `rollout.engine=vllm`: generation and engine-sync s
               per iteration beside hf's generation s, and the engine's log-prob gap to the trainer; skipped
               (with the reason) where `import vllm` fails: the CUDA `vllm` wheel does not travel in the wheel
               folder (hundreds of MB), so this step runs where the GPU machine has vllm installed
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

REPO = C.REPO
SMOLLM2_SHAPE = ["model.arch.num_hidden_layers=30", "model.arch.hidden_size=576", "model.arch.intermediate_size=1536",
                 "model.arch.num_attention_heads=9", "model.arch.num_key_value_heads=3"]
PRECISION_TESTS = ["tests/models/test_models_scalar.py", "tests/stages/test_stage_ppo.py",
                   "tests/stages/test_stage_rm.py", "tests/test_engine.py"]
PRECISION_K = "bf16 or ratio_is_exactly_one or small_step or scoring_precision or its_precision or test_engine.py"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="an HF tokenizer dir (SmolLM2's; made by gpu_wheels.sh)")
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--work", default=None, help="run dirs here (default: a temp dir)")
    p.add_argument("--rm-steps", type=int, default=6)
    p.add_argument("--ppo-iterations", type=int, default=3)
    p.add_argument("--shape", default="smollm2", choices=["smollm2", "tiny"],
                   help="model shape of the throughput steps (tiny: a dry run of this script on a CPU)")
    return p.parse_args()


def machine() -> dict[str, Any]:
    import torch

    from rlhf_cli.engine import resolve_precision

    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
            "precision_auto": resolve_precision("auto"), "python": sys.version.split()[0]}


def run(cmd: Sequence[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run `cmd` from the repository root, output to `log`; returns its exit code and seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(list(cmd), cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}


def rlhf(command: str, overrides: Sequence[str], root: Path, log: Path, env: dict[str, str]) -> dict[str, Any]:
    return run([sys.executable, "-m", "rlhf_cli", command, *overrides, f"paths.root={root}"],
               log, env)


def records(root: Path, stage: str) -> list[dict[str, Any]]:
    """metrics.jsonl records of the newest run of `stage` under `root` ([] when there is none)."""
    from rlhf_cli.runs import read_metrics

    runs = sorted((root / stage).glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    return read_metrics(runs[-1]) if runs else []


def mean(xs: Sequence[Any]) -> float:
    """Mean of the values that were logged (None: a metric missing from a record)."""
    return C.mean([x for x in xs if x is not None])


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = str(Path(args.tokenizer).resolve())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RLHF_TEST_TOKENIZER": tok, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    out: dict[str, Any] = {"machine": machine(), "work": str(work), "shape": args.shape}
    path = Path(args.out)

    def save() -> None:
        path.write_text(json.dumps(out, indent=1))

    save()
    # 1. the precision tests, on the GPU where the code under test uses the engine's device
    res = run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-k", PRECISION_K,
               *PRECISION_TESTS], work / "tests.log", env)
    lines = (work / "tests.log").read_text().splitlines()
    summary = [ln for ln in lines if re.search(r"\d+ (passed|failed)", ln)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|skipped)", summary[-1] if summary else "")}
    failures = [ln[:400] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    out["tests"] = {**res, **counts, "summary": summary[-1] if summary else None, "failures": failures}
    save()

    # 2. the chain on the tiny model, precision=auto (bf16-autocast on a bf16 GPU)
    tiny = ["experiment=smoke", "precision=auto", f"model.tokenizer={tok}"]
    root = work / "chain"
    chain = {"train_rm": rlhf("train-rm", tiny, root, work / "chain_rm.log", env)}
    chain["train_ppo"] = rlhf("train-ppo", tiny, root, work / "chain_ppo.log", env)
    chain["eval"] = rlhf("eval", tiny, root, work / "chain_eval.log", env)
    rm_last, ppo_last = (records(root, "rm") or [{}])[-1], (records(root, "ppo") or [{}])[-1]
    chain["rm_eval_accuracy"] = rm_last.get("eval/rm/accuracy", rm_last.get("rm/accuracy"))
    chain["ppo_last"] = {k: ppo_last.get(k) for k in ("objective/scores", "objective/kl", "policy/clipfrac")}
    evals = sorted((root / "eval").glob("*/eval.json"), key=lambda p: p.stat().st_mtime)
    chain["eval_json"] = json.loads(evals[-1].read_text()) if evals else None
    out["chain"] = chain
    save()

    # 3. throughput of SmolLM2's shape in bf16-autocast: RM steps
    shape = ["model=tiny", f"model.tokenizer={tok}", *(SMOLLM2_SHAPE if args.shape == "smollm2" else []),
             "precision=bf16-autocast"]
    root = work / "rm_step"
    res = rlhf("train-rm", [*shape, f"rm.max_steps={args.rm_steps}", "rm.batch_size=16", "rm.micro_batch_size=16",
                            "rm.eval_every=0", "rm.log_every=1", "paths.keep_checkpoints=0"], root,
               work / "rm_step.log", env)
    steps = [r for r in records(root, "rm") if "throughput/pairs_per_s" in r][1:]
    out["rm_step"] = {**res, "steps_timed": len(steps),
                      "s_per_step": mean([16 / r["throughput/pairs_per_s"] for r in steps]),
                      "tokens_per_s": mean([r.get("throughput/tokens_per_s") for r in steps])}
    save()

    # 4. PPO iterations: log-prob passes in fp32 (default) and in bf16 (`same`), side by side
    out["ppo_iter"] = {}
    for lp in ("fp32", "same"):
        root = work / f"ppo_{lp}"
        res = rlhf("train-ppo", [*shape, f"scoring_precision={lp}", "rollout.engine=hf", "reward.type=checker",
                                 f"ppo.iterations={args.ppo_iterations}", "ppo.rollout_batch_size=16",
                                 "ppo.mini_batch_size=8", "ppo.micro_batch_size=8", "ppo.max_new_tokens=32",
                                 "ppo.actor_lr=1e-6", "ppo.kl_check_rows=16", "paths.keep_checkpoints=0"],
                   root, work / f"ppo_{lp}.log", env)
        its = records(root, "ppo")
        timed = its[1:] or its
        out["ppo_iter"][lp] = {
            **res, "iterations_timed": len(timed),
            **{f"{k}_s": mean([r.get(f"time/{k}") for r in timed]) for k in ("generation", "scoring", "training")},
            "kl_reported": [r.get("objective/kl") for r in its], "kl_fp32": [r.get("objective/kl_fp32") for r in its]}
        save()

    # 5. the same PPO iterations sampled by vLLM (CUDA `vllm`, where this machine has it): generation and sync
    # seconds beside step 4's hf figures, and the engine's log-prob gap to the trainer
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure: a CPU-only wheel, a CUDA mismatch)
        out["engine"] = {"skipped": f"vllm is not importable here ({type(e).__name__}: {e})"}
    else:
        root = work / "ppo_vllm"
        res = rlhf("train-ppo", [*shape, "rollout.engine=vllm", "reward.type=checker",
                                 f"ppo.iterations={args.ppo_iterations}", "ppo.rollout_batch_size=16",
                                 "ppo.mini_batch_size=8", "ppo.micro_batch_size=8", "ppo.max_new_tokens=32",
                                 "ppo.actor_lr=1e-6", "paths.keep_checkpoints=0"], root, work / "ppo_vllm.log", env)
        its = records(root, "ppo")
        timed = its[1:] or its
        out["engine"] = {
            **res, "iterations_timed": len(timed),
            **{f"{k}_s": mean([r.get(f"time/{k}") for r in timed]) for k in ("generation", "engine_sync", "scoring",
                                                                              "training")},
            "hf_generation_s": out["ppo_iter"]["fp32"].get("generation_s"),
            "diff_mean": [r.get("rollout/engine_logprob_diff_mean") for r in its],
            "diff_max": [r.get("rollout/engine_logprob_diff_max") for r in its]}
    save()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
