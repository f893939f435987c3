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
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.commands import by_stage
from rlhf_cli.data import load_sft_data
from rlhf_cli.forwards import response_logprobs, sft_collator
from rlhf_cli.models import add_lora, count_parameters, load_causal_lm, lora_enabled
from rlhf_cli.stages.common import SupervisedTrainer, optimizer_stats, throughput_stats

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
    """`rlhf train-sft` on the composed config `cfg` (conf/train_sft.yaml), writing into `run_dir`: data → causal LM
    → start table (the dry run stops there) → engine → resume → optimizer steps → final held-out loss → `final/`
    and `latest_sft`. Returns the held-out loss (`eval/sft/loss`, nats per response token), None without held-out
    demonstrations or on a dry run.

    Raises:
        ConfigError: a bad key or data (fewer training demonstrations than `sft.batch_size`), in one line.
    """
    tr = SupervisedTrainer.start(cfg, run_dir, COMMAND, "demonstrations")
    tokenizer, _, data = tr.load_data(load_sft_data)
    model, n_params = build_model(cfg, tokenizer)
    tr.plan(len(data.train))
    start_table(tr, model, n_params, data)
    if tr.dry_run_exit():
        return None
    eng = tr.build_engine(model)
    tr.resume()
    collate = sft_collator(eng.module, tokenizer.pad_token_id, cfg.data.packing)
    evaluate = partial(heldout_eval, eng, data.eval, collate, cfg) if data.eval else None
    final_stats = tr.train(data.train, PROGRESS_KEYS, partial(train_step, eng, collate, cfg), evaluate)
    tr.save_policy(tokenizer, final_stats)
    return final_stats.get("eval/sft/loss")


def build_model(cfg: Any, tokenizer: Any) -> tuple[Any, int]:
    """The causal LM of `cfg.model` (`models.load_causal_lm`), LoRA adapters on it when `model.lora.r` > 0.
    Returns (model, its non-embedding parameters before any adapter)."""
    model = load_causal_lm(cfg.model, cfg.precision, cfg.seed, tokenizer=tokenizer)
    n_params = count_parameters(model)
    if lora_enabled(cfg.model.lora):
        add_lora(model, cfg.model.lora, what="policy")
    return model, n_params


def start_table(tr: SupervisedTrainer, model: Any, n_params: int, data: Any) -> None:
    """train-sft's start table (`SupervisedTrainer.start_table`): demonstrations, steps and response tokens trained
    on."""
    tr.start_table(model, n_params, data, {
        "train demonstrations": len(data.train), "eval demonstrations": len(data.eval),
        "optimizer steps": tr.total_steps, "train response tokens": response_tokens(data.train),
    }, tr.cfg.precision)


def train_step(eng: engine.TrainEngine, collate: Callable, cfg: Any, mine: list[dict[str, Any]]) -> dict[str, float]:
    """One optimizer step on this rank's demonstrations `mine`, `sft.micro_batch_size` at a time: each
    micro-batch's summed response NLL (nats) divided by the step's response tokens over every rank
    (`engine.TrainEngine.backward_global`), the engine's step. Returns the step's record: `sft/loss` (NLL per
    response token), `sft/perplexity`, `sft/response_tokens`, the learning rate, gradient norm and throughput."""
    sc = cfg.sft
    t0 = time.perf_counter()
    # the step's response tokens over every rank: each micro-batch's NLL sum is divided by it
    n_step = float(engine.all_reduce_sum(torch.tensor([float(response_tokens(mine))]))[0])
    sums = torch.zeros(4)  # NLL (nats), tokens, real tokens computed, positions
    for m in range(0, len(mine), sc.micro_batch_size):
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
            **optimizer_stats(eng, COMMAND), **throughput_stats(dt, tokens, real, positions)}


def heldout_eval(eng: engine.TrainEngine, heldout: Sequence[dict[str, Any]], collate: Callable, cfg: Any
                 ) -> dict[str, float]:
    """`heldout_loss` of the held-out demonstrations with the engine's model in eval mode (the loop puts it back
    in train mode), `sft.eval_batch_size` per forward."""
    eng.eval()
    return heldout_loss(eng.module, heldout, collate, cfg.sft.eval_batch_size, cfg.precision)
