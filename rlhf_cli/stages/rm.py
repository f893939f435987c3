"""`rlhf train-rm`: reward-model training (LM trunk + scalar head, Bradley-Terry loss) on DeepSpeed.

Steps: load tokenizer and pairs → build the scalar model → DeepSpeed engine → (resume) → loop over
optimizer steps (one forward per micro-batch over chosen and rejected together) with periodic eval
and checkpoints → final eval and reward statistics → `final/` in HF format (a LoRA model merged, its
adapter in `final/adapter/`) → `latest_rm` pointer.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_cli import engine
from rlhf_cli.commands import by_stage
from rlhf_cli.core import pairwise_loss, sample_std
from rlhf_cli.data import load_preference_data
from rlhf_cli.forwards import forward_pairs, pair_collator, pair_metrics, score_pairs
from rlhf_cli.lifecycle import Checkpoints, checkpoint_plan, finish_run, prepare_run_dir, seed_everything
from rlhf_cli.models import (
    add_lora,
    count_parameters,
    load_scalar_model,
    lora_enabled,
    save_model,
    with_scoring_template,
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

PROGRESS_KEYS = ["rm/loss", "rm/accuracy", "throughput/pairs_per_s"]


def run(cfg: Any, run_dir: Path) -> float | None:
    engine.init_distributed()
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    rmc = cfg.rm

    # 1. data
    tokenizer, eos, data = supervised_data(cfg, run_dir, COMMAND.kind, load_preference_data, rmc.batch_size,
                                           "rm.batch_size", "pairs")
    train, heldout = data.train, data.eval

    # 2. model; held-out pairs are scored in `scoring_precision` (fp32 under bf16-autocast by default)
    model = load_scalar_model(cfg.model, cfg.precision, cfg.seed)
    n_params = count_parameters(model)
    if lora_enabled(cfg.model.lora):  # adapters on the trunk, the head `score` trained in full
        add_lora(model, cfg.model.lora, heads=("score",), what="reward model")
    score_precision = engine.scoring_precision(cfg.precision, cfg.scoring_precision)
    total_steps, dropped = supervised_steps(rmc, "rm.batch_size", len(train), "pairs")
    print_table(f"{COMMAND.name}: {run_dir}", {
        "model": cfg.model.name, "params (non-embedding)": n_params,
        "trained params": trained_parameters(model, cfg.model.lora),
        "train pairs": len(train), "eval pairs": len(heldout), "optimizer steps": total_steps,
        "pairs per epoch": f"{len(train) - dropped} ({dropped} in a partial batch dropped)" if dropped else len(train),
        "batch / micro / world": f"{rmc.batch_size} / {rmc.micro_batch_size} / {engine.world_size()}",
        "precision": f"{cfg.precision} (held-out scoring: {score_precision})",
        "zero stage": cfg.deepspeed.zero_stage, "data": data.summary,
        "checkpoint size": checkpoint_plan([model], cfg.paths, cfg.deepspeed.zero_stage, run_dir, total_steps,
                                   rmc.save_every),
    })
    if cfg.dry_run:
        set_status(run_dir, "dry_run") if engine.is_main() else None
        return None

    # 3. engine
    eng = supervised_engine(model, cfg, rmc, total_steps)
    metrics = MetricsLogger(run_dir, enabled=engine.is_main(), loggers=cfg.logger, tracker=cfg.tracker,
                            config=OmegaConf.to_container(cfg, resolve=True))

    # 4. resume
    ckpts = Checkpoints(run_dir, {"": eng}, cfg.paths.keep_checkpoints, cfg.paths.keep_optimizer)
    step, _ = ckpts.resume(cfg.resume, metrics)

    # 5. loop
    collate = pair_collator(eng.module, tokenizer.pad_token_id, cfg.data.packing)
    per_rank = rmc.batch_size // engine.world_size()

    def train_step(mine: list[dict[str, Any]]) -> dict[str, float]:
        t0 = time.perf_counter()
        stats_sum: dict[str, float] = {}
        tokens = torch.zeros(3)  # pair tokens (chosen + rejected sequences), real tokens computed, positions
        for m in range(0, per_rank, rmc.micro_batch_size):
            batch = collate(mine[m:m + rmc.micro_batch_size])
            tokens += torch.tensor([float(batch["pair_tokens"]), float(batch["attention_mask"].sum()),
                                    float(batch["attention_mask"].numel())])
            chosen, rejected = forward_pairs(eng.module, batch, cfg.precision)
            margin = batch["margin"].to(chosen.device) if rmc.margin and "margin" in batch else None
            loss, stats = pairwise_loss(chosen, rejected, margin)
            if rmc.center_rewards_coef:
                center = rmc.center_rewards_coef * ((chosen + rejected) ** 2).mean()
                loss = loss + center
                stats["rm/center_loss"] = float(center)
            eng.backward_mean(loss)
            eng.step()
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v / eng.grad_accum
        dt = time.perf_counter() - t0
        pair_tok, real, positions = engine.all_reduce_sum(tokens).tolist()
        record = engine.reduce_stats(stats_sum)
        record.update({"lr": eng.lr(), "grad_norm": eng.grad_norm(), "throughput/pairs_per_s": rmc.batch_size / dt,
                       "throughput/tokens_per_s": pair_tok / dt, "throughput/padding_fraction": 1 - real / positions,
                       "throughput/positions_per_token": positions / pair_tok})
        return record

    def evaluate() -> dict[str, float]:
        stats = pair_metrics(*score_pairs(eng.module, heldout, tokenizer.pad_token_id, rmc.eval_batch_size,
                                          score_precision, cfg.data.packing))
        return {f"eval/{k}": v for k, v in stats.items()}

    step = supervised_loop(eng, cfg, rmc, train, step, total_steps, ckpts, metrics, COMMAND.name, PROGRESS_KEYS,
                           train_step, evaluate if heldout else None)

    # 6. final eval, reward statistics, HF checkpoint, pointer
    final_stats: dict[str, float] = {}
    reward_mean = reward_std = None  # no held-out pairs: nothing measured, so no normalisation is stored
    if heldout:
        chosen, rejected = score_pairs(eng.module, heldout, tokenizer.pad_token_id, rmc.eval_batch_size,
                                       score_precision, cfg.data.packing)
        final_stats = pair_metrics(chosen, rejected)
        both = torch.cat([chosen, rejected])
        reward_mean, reward_std = float(both.mean()), sample_std(both.tolist()) if both.numel() > 1 else 1.0
        metrics.log(step, {f"eval/{k}": v for k, v in final_stats.items()})
        if engine.is_main():
            atomic_write_json(run_dir / "rewards.json", {"chosen": chosen.tolist(), "rejected": rejected.tolist()})
    ckpts.save(step, final=True)
    final = run_dir / "final"
    state_dict = eng.consolidated_state_dict()
    if engine.is_main():
        stats = {} if reward_mean is None else {"rlhf_reward_mean": reward_mean, "rlhf_reward_std": reward_std}
        save_model(eng.module, state_dict, with_scoring_template(tokenizer, eos), final, model_source(cfg.model),
                   extra_config={**stats, "rlhf_stage": COMMAND.kind, "eos_token_id": list(eos),
                                 "rlhf_eval_accuracy": final_stats.get("rm/accuracy")})
        atomic_write_json(final / "rlhf_eval.json", {"eval": final_stats, "reward_mean": reward_mean,
                                                     "reward_std": reward_std, "steps": step})
        pointer = finish_run(cfg, run_dir, final, COMMAND.kind, steps=step)
        print_table(f"{COMMAND.name} finished", {**{f"eval {k}": v for k, v in final_stats.items()},
                                          "reward mean/std": ("none (no held-out pairs)" if reward_mean is None
                                                              else f"{reward_mean:.4g} / {reward_std:.4g}"),
                                          "checkpoint": str(final),
                                          "pointer": str(pointer or "not moved (a sweep job)")})
    engine.barrier()
    metrics.close()
    return final_stats.get("rm/accuracy")

