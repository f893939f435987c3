"""`rlhf train-rm`: reward-model training (LM trunk + scalar head, Bradley-Terry loss) on DeepSpeed.

Steps: load tokenizer and pairs → build the scalar model → DeepSpeed engine → (resume) → loop over
optimizer steps (one forward per micro-batch over chosen and rejected together) with periodic eval
and checkpoints → final eval and reward statistics → `final/` in HF format (a LoRA model merged, its
adapter in `final/adapter/`) → `latest_rm` pointer.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.commands import by_stage
from rlhf_cli.core import pairwise_loss, sample_std
from rlhf_cli.data import load_preference_data
from rlhf_cli.forwards import forward_pairs, pair_collator, pair_metrics, score_pairs
from rlhf_cli.models import add_lora, count_parameters, load_scalar_model, lora_enabled, with_scoring_template
from rlhf_cli.runs import atomic_write_json
from rlhf_cli.stages.common import SupervisedTrainer, optimizer_stats, throughput_stats

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry (its name, run-dir kind, pointer)

PROGRESS_KEYS = ["rm/loss", "rm/accuracy", "throughput/pairs_per_s"]


def run(cfg: Any, run_dir: Path) -> float | None:
    """`rlhf train-rm` on the composed config `cfg` (conf/train_rm.yaml), writing into `run_dir`: data → scalar model
    → start table (the dry run stops there) → engine → resume → optimizer steps → final held-out eval → `final/`
    and `latest_rm`. Returns the held-out accuracy (`rm/accuracy`), None without held-out pairs or on a dry run.

    Raises:
        ConfigError: a bad key or data (fewer training pairs than `rm.batch_size`), in one line.
    """
    tr = SupervisedTrainer.start(cfg, run_dir, COMMAND, "pairs")
    tokenizer, eos, data = tr.load_data(load_preference_data)
    model, n_params = build_model(cfg)
    dropped = tr.plan(len(data.train))
    start_table(tr, model, n_params, data, dropped)
    if tr.dry_run_exit():
        return None
    eng = tr.build_engine(model)
    tr.resume()
    collate = pair_collator(eng.module, tokenizer.pad_token_id, cfg.data.packing)
    evaluate = partial(heldout_metrics, eng, data.eval, tokenizer.pad_token_id, cfg) if data.eval else None
    tr.loop(data.train, PROGRESS_KEYS, partial(train_step, eng, collate, cfg), evaluate)
    final_stats, score_stats = final_eval(tr, data.eval, tokenizer.pad_token_id)
    save(tr, with_scoring_template(tokenizer, eos), eos, final_stats, score_stats)
    return final_stats.get("rm/accuracy")


def build_model(cfg: Any) -> tuple[Any, int]:
    """The reward model of `cfg.model`: its trunk with a new seeded scalar head `score` (`models.load_scalar_model`),
    LoRA adapters on the trunk when `model.lora.r` > 0 (the head trained in full). Returns (model, its
    non-embedding parameters before any adapter)."""
    model = load_scalar_model(cfg.model, cfg.precision, cfg.seed)
    n_params = count_parameters(model)
    if lora_enabled(cfg.model.lora):  # adapters on the trunk, the head `score` trained in full
        add_lora(model, cfg.model.lora, heads=("score",), what="reward model")
    return model, n_params


def start_table(tr: SupervisedTrainer, model: Any, n_params: int, data: Any, dropped: int) -> None:
    """train-rm's start table (`SupervisedTrainer.start_table`): pairs, steps, the pairs an epoch drops, and the
    held-out scoring precision (`scoring_precision`: fp32 under bf16-autocast by default)."""
    cfg, n_train = tr.cfg, len(data.train)
    tr.start_table(model, n_params, data, {
        "train pairs": n_train, "eval pairs": len(data.eval), "optimizer steps": tr.total_steps,
        "pairs per epoch": f"{n_train - dropped} ({dropped} in a partial batch dropped)" if dropped else n_train,
    }, f"{cfg.precision} (held-out scoring: {engine.scoring_precision(cfg.precision, cfg.scoring_precision)})")


def train_step(eng: engine.TrainEngine, collate: Any, cfg: Any, mine: list[dict[str, Any]]) -> dict[str, float]:
    """One optimizer step on this rank's pairs `mine`, `rm.micro_batch_size` at a time: one packed forward over
    chosen and rejected together (`forwards.forward_pairs`), the Bradley-Terry loss (`core.pairwise_loss`, with
    the per-pair margin when `rm.margin`), plus `rm.center_rewards_coef` · mean((r_c + r_r)²); the engine's
    accumulated backward and step. Returns the step's record: the loss statistics averaged over micro-batches
    and ranks, the learning rate, gradient norm and throughput."""
    rmc = cfg.rm
    t0 = time.perf_counter()
    stats_sum: dict[str, float] = {}
    tokens = torch.zeros(3)  # pair tokens (chosen + rejected sequences), real tokens computed, positions
    for m in range(0, len(mine), rmc.micro_batch_size):
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
    record.update({**optimizer_stats(eng, COMMAND), "throughput/pairs_per_s": rmc.batch_size / dt,
                   **throughput_stats(dt, pair_tok, real, positions)})
    return record


def heldout_scores(eng: engine.TrainEngine, heldout: Any, pad_id: int, cfg: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) float32 each: the reward model's scores of the held-out pairs' chosen and rejected responses, in the
    `scoring_precision`, `rm.eval_batch_size` pairs per forward (`forwards.score_pairs`)."""
    return score_pairs(eng.module, heldout, pad_id, cfg.rm.eval_batch_size,
                       engine.scoring_precision(cfg.precision, cfg.scoring_precision), cfg.data.packing)


def heldout_metrics(eng: engine.TrainEngine, heldout: Any, pad_id: int, cfg: Any) -> dict[str, float]:
    """`eval/rm/*`: `forwards.pair_metrics` (loss, accuracy, margin, ...) of the held-out pairs' scores."""
    return {f"eval/{k}": v for k, v in pair_metrics(*heldout_scores(eng, heldout, pad_id, cfg)).items()}


def final_eval(tr: SupervisedTrainer, heldout: Any, pad_id: int
               ) -> tuple[dict[str, float], tuple[float, float] | None]:
    """The held-out pairs scored once more after the last step: their `pair_metrics` (logged as `eval/rm/*` at
    the run's last step), the scores in `rewards.json` (rank 0), and the (mean, sample std) of all their scores that
    train-ppo normalises with. Returns (the metrics, (mean, std)); ({}, None) without held-out pairs: nothing is
    measured, so no normalisation is stored."""
    if not heldout:
        return {}, None
    chosen, rejected = heldout_scores(tr.eng, heldout, pad_id, tr.cfg)
    final_stats = pair_metrics(chosen, rejected)
    both = torch.cat([chosen, rejected])
    score_stats = float(both.mean()), sample_std(both.tolist()) if both.numel() > 1 else 1.0
    tr.metrics.log(tr.step, {f"eval/{k}": v for k, v in final_stats.items()})
    if engine.is_main():
        atomic_write_json(tr.run_dir / "rewards.json", {"chosen": chosen.tolist(), "rejected": rejected.tolist()})
    return final_stats, score_stats


def save(tr: SupervisedTrainer, tokenizer: Any, eos: tuple[int, ...], final_stats: dict[str, float],
         score_stats: tuple[float, float] | None) -> None:
    """`final/` (`SupervisedTrainer.save`) with the held-out score statistics train-ppo reads (`rlhf_reward_mean`,
    `rlhf_reward_std`; none without held-out pairs), the EOS set, the held-out accuracy, and `rlhf_eval.json`."""
    reward_mean, reward_std = score_stats if score_stats is not None else (None, None)
    stats = {} if reward_mean is None else {"rlhf_reward_mean": reward_mean, "rlhf_reward_std": reward_std}
    tr.save(
        tokenizer,
        {**stats, "rlhf_stage": COMMAND.kind, "eos_token_id": list(eos),
         "rlhf_eval_accuracy": final_stats.get("rm/accuracy")},
        {"eval": final_stats, "reward_mean": reward_mean, "reward_std": reward_std, "steps": tr.step},
        {**{f"eval {k}": v for k, v in final_stats.items()},
         "reward mean/std": ("none (no held-out pairs)" if reward_mean is None
                             else f"{reward_mean:.4g} / {reward_std:.4g}")})
