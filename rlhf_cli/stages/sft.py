"""`rlhf train-sft`: supervised fine-tuning of a causal LM on demonstrations, on DeepSpeed.

The loss is the next-token negative log-likelihood (nats) of response tokens only: an assistant turn's content
and its EOS; the prompt and the chat template's own text are context, never targets. It is aggregated over the
whole optimizer step: Σ NLL over the step's response tokens (all micro-batches, all ranks) / their count, so it
does not depend on how the step is cut into micro-batches and ranks (each micro-batch's sum is divided by the
step's count and `engine.TrainEngine.backward_global` undoes DeepSpeed's average over ranks).

Steps: load tokenizer and demonstrations → build the causal LM (LoRA adapters when `model.lora.r` > 0) →
DeepSpeed engine → (resume) → loop over optimizer steps with held-out loss and perplexity every `sft.eval_every`
steps and checkpoints → final held-out loss → `final/` a plain causal LM in HF format (LoRA merged, its adapter
in `final/adapter/`) → `latest_sft` pointer, which `model.name_or_path` of the next stage accepts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_cli import engine
from rlhf_cli.commands import by_stage
from rlhf_cli.data import load_sft_data
from rlhf_cli.forwards import response_logprobs, sft_collator
from rlhf_cli.lifecycle import Checkpoints, checkpoint_plan, finish_run, prepare_run_dir, seed_everything
from rlhf_cli.models import (
    add_lora,
    count_parameters,
    load_causal_lm,
    lora_enabled,
    save_model,
)
from rlhf_cli.runs import MetricsLogger, atomic_write_json, set_status
from rlhf_cli.stages.common import (
    model_source,
    print_table,
    supervised_data,
    supervised_engine,
    supervised_loop,
    supervised_steps,
    trained_parameters,
)

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry (its name, run-dir kind, pointer)

PROGRESS_KEYS = ["sft/loss", "sft/perplexity", "throughput/tokens_per_s"]


def response_tokens(examples: Sequence[dict[str, Any]]) -> int:
    """The response tokens (loss targets) of demonstrations: the sum of their loss masks."""
    return sum(sum(ex["loss_mask"]) for ex in examples)


@torch.no_grad()
def heldout_loss(model: Any, examples: Sequence[dict[str, Any]], collate: Callable, batch_size: int,
                 precision: str) -> dict[str, float]:
    """`eval/sft/loss` (mean NLL per response token, nats) and `eval/sft/perplexity` (its exp) of held-out
    demonstrations, `batch_size` at a time. Every rank runs every batch (the same forwards on each, as ZeRO-3
    needs)."""
    nll, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        lp = response_logprobs(model, collate(examples[i:i + batch_size]), precision)
        nll, count = nll - float(lp.sum()), count + lp.numel()
    loss = nll / max(count, 1)
    return {"eval/sft/loss": loss, "eval/sft/perplexity": math.exp(min(loss, 700.0))}


def run(cfg: Any, run_dir: Path) -> float | None:
    engine.init_distributed()
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    sc = cfg.sft

    # 1. data
    tokenizer, eos, data = supervised_data(cfg, run_dir, COMMAND.kind, load_sft_data, sc.batch_size,
                                           "sft.batch_size", "demonstrations")
    train, heldout = data.train, data.eval

    # 2. model
    model = load_causal_lm(cfg.model, cfg.precision, cfg.seed, tokenizer=tokenizer)
    n_params = count_parameters(model)
    if lora_enabled(cfg.model.lora):
        add_lora(model, cfg.model.lora, what="policy")
    total_steps, _ = supervised_steps(sc, "sft.batch_size", len(train), "demonstrations")
    print_table(f"{COMMAND.name}: {run_dir}", {
        "model": cfg.model.name, "params (non-embedding)": n_params,
        "trained params": trained_parameters(model, cfg.model.lora),
        "train demonstrations": len(train), "eval demonstrations": len(heldout), "optimizer steps": total_steps,
        "train response tokens": response_tokens(train),
        "batch / micro / world": f"{sc.batch_size} / {sc.micro_batch_size} / {engine.world_size()}",
        "precision": cfg.precision, "zero stage": cfg.deepspeed.zero_stage, "data": data.summary,
        "checkpoint size": checkpoint_plan([model], cfg.paths, cfg.deepspeed.zero_stage, run_dir, total_steps,
                                   sc.save_every),
    })
    if cfg.dry_run:
        set_status(run_dir, "dry_run") if engine.is_main() else None
        return None

    # 3. engine
    eng = supervised_engine(model, cfg, sc, total_steps)
    metrics = MetricsLogger(run_dir, enabled=engine.is_main(), loggers=cfg.logger, tracker=cfg.tracker,
                            config=OmegaConf.to_container(cfg, resolve=True))

    # 4. resume
    ckpts = Checkpoints(run_dir, {"": eng}, cfg.paths.keep_checkpoints, cfg.paths.keep_optimizer)
    step, _ = ckpts.resume(cfg.resume, metrics)

    # 5. loop
    collate = sft_collator(eng.module, tokenizer.pad_token_id, cfg.data.packing)
    per_rank = sc.batch_size // engine.world_size()

    def train_step(mine: list[dict[str, Any]]) -> dict[str, float]:
        t0 = time.perf_counter()
        # the step's response tokens over every rank: each micro-batch's NLL sum is divided by it
        n_step = float(engine.all_reduce_sum(torch.tensor([float(response_tokens(mine))]))[0])
        sums = torch.zeros(4)  # NLL (nats), tokens, real tokens computed, positions
        for m in range(0, per_rank, sc.micro_batch_size):
            batch = collate(mine[m:m + sc.micro_batch_size])
            lp = response_logprobs(eng.module, batch, cfg.precision)  # (N,) float32
            eng.backward_global(-lp.sum() / n_step)
            eng.step()
            sums += torch.tensor([-float(lp.detach().sum()), float(batch["tokens"]),
                                  float(batch["attention_mask"].sum()), float(batch["attention_mask"].numel())])
        dt = time.perf_counter() - t0
        nll, tokens, real, positions = engine.all_reduce_sum(sums).tolist()
        loss = nll / n_step
        return {"sft/loss": loss, "sft/perplexity": math.exp(min(loss, 700.0)), "sft/response_tokens": n_step,
                "lr": eng.lr(), "grad_norm": eng.grad_norm(), "throughput/tokens_per_s": tokens / dt,
                "throughput/padding_fraction": 1 - real / positions,
                "throughput/positions_per_token": positions / tokens}

    def evaluate() -> dict[str, float]:
        eng.eval()
        return heldout_loss(eng.module, heldout, collate, sc.eval_batch_size, cfg.precision)

    step = supervised_loop(eng, cfg, sc, train, step, total_steps, ckpts, metrics, COMMAND.name, PROGRESS_KEYS,
                           train_step, evaluate if heldout else None)

    # 6. final held-out loss, HF checkpoint, pointer
    final_stats: dict[str, float] = {}
    if heldout:
        final_stats = evaluate()
        metrics.log(step, final_stats)
    ckpts.save(step, final=True)
    final = run_dir / "final"
    state_dict = eng.consolidated_state_dict()
    if engine.is_main():
        # the held-out loss goes to rlhf_eval.json only: a config key would be carried into the next stage's model
        # the reference eval compares against: the starting model, as train-ppo and train-dpo record theirs
        reference_spec = {**OmegaConf.to_container(cfg.model, resolve=True), "seed": cfg.seed}
        save_model(eng.module, state_dict, tokenizer, final, model_source(cfg.model),
                   extra_config={"rlhf_stage": COMMAND.kind, "rlhf_reference_model": reference_spec})
        atomic_write_json(final / "rlhf_eval.json", {"eval": final_stats, "steps": step})
        pointer = finish_run(cfg, run_dir, final, COMMAND.kind, steps=step)
        print_table(f"{COMMAND.name} finished", {**{k: v for k, v in final_stats.items()},
                                                 "checkpoint": str(final),
                                                 "pointer": str(pointer or "not moved (a sweep job)")})
    engine.barrier()
    metrics.close()
    return final_stats.get("eval/sft/loss")
