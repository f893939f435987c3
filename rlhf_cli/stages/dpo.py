"""`rlhf train-dpo`: direct preference optimisation of a causal LM on preference pairs, on DeepSpeed.

The policy is trained on the pairs train-rm reads (every `data.format`, the same truncation and lineage; with no
`data.*` keys the built-in task's pairs) against a frozen reference, its own starting weights: the loss of
`dpo.loss` (`core.DPO_LOSSES`: DPO, IPO, SLiC) of each pair's log-ratio gap, plus RPO's NLL term on the chosen
responses (`dpo.sft_weight`), averaged over the optimizer step's pairs (each micro-batch's sum is divided by the
step's pair count and `engine.TrainEngine.backward_global` undoes DeepSpeed's average over ranks, so the update
does not depend on how the step is cut). A pair's chosen and rejected responses share its prompt, computed once
in a packed forward (`forwards.pair_logprobs`).

The reference runs in eval mode with no gradient: a frozen copy of the starting model, or under LoRA the policy
with its adapters off (`forwards.FrozenWithoutAdapters`, no second copy). With `dpo.precompute_reference` its
log-probs of every training and held-out pair are computed once before the first step (and before a resume loads
its checkpoint), from the starting policy itself: no reference is held while training. Dropout is off in the
policy (LoRA's own `model.lora.dropout` aside), and policy, reference and held-out passes all run in `precision`
(`scoring_precision` is not read), so at the first step policy and reference are one function: the loss is log 2
(sigmoid) and every margin 0.

Steps: load tokenizer and pairs → build the policy (LoRA adapters when `model.lora.r` > 0) and its reference →
DeepSpeed engine → (precompute the reference) → (resume) → loop over optimizer steps with held-out statistics
every `dpo.eval_every` steps and checkpoints → final held-out statistics → `final/` a plain causal LM in HF format
(LoRA merged, its adapter in `final/adapter/`; `rlhf_reference_model` records the starting model, for
`rlhf eval`) → `latest_dpo` pointer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.commands import by_stage
from rlhf_cli.core import dpo_loss
from rlhf_cli.data import load_preference_data
from rlhf_cli.forwards import pair_collator, pair_logprobs
from rlhf_cli.stages.common import SupervisedTrainer, optimizer_stats, policy_and_reference, throughput_stats

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry (its name, run-dir kind, pointer)

PROGRESS_KEYS = ["dpo/loss", "dpo/accuracy", "dpo/margin", "throughput/pairs_per_s"]


@torch.no_grad()
def reference_logprobs(reference: Any, examples: Sequence[dict[str, Any]], collate: Callable, batch_size: int,
                       precision: str) -> torch.Tensor:
    """(N, 2) float32 on `engine.device()`: the summed response log-probs (nats) of each example's chosen (column 0) and
    rejected (column 1) response under `reference`, `batch_size` pairs per forward (`forwards.pair_logprobs`).
    `reference` is read in eval mode whatever its mode (restored after): a causal LM, a DeepSpeed engine's
    module, or `FrozenWithoutAdapters.module`. Every rank runs every batch (the same forwards on each, as ZeRO-3
    needs)."""
    module = reference if isinstance(reference, torch.nn.Module) else None  # the LoRA view has no mode
    was_training = module is not None and module.training
    if module is not None:
        module.eval()
    try:
        out = [torch.stack(pair_logprobs(reference, collate(examples[i:i + batch_size]), precision), -1)
               for i in range(0, len(examples), batch_size)]
    finally:
        if module is not None:
            module.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 2, device=engine.device())


class Reference:
    """The frozen reference of a run: its log-probs of a batch of pairs, from `model` with each micro-batch, or
    looked up from those precomputed once (`precompute`)."""

    def __init__(self, model: Any, precision: str) -> None:
        self.model, self.precision = model, precision
        self.table: dict[int, torch.Tensor] | None = None  # id(example) -> (2,) when precomputed

    def precompute(self, examples: Sequence[dict[str, Any]], collate: Callable, batch_size: int) -> None:
        """Compute every example's log-probs once, then let the model go (`model` may be the policy before its
        first step: its weights are the reference's only now)."""
        lp = reference_logprobs(self.model, examples, collate, batch_size, self.precision).cpu()  # (N, 2)
        self.table = {id(ex): row for ex, row in zip(examples, lp)}
        self.model = None

    @torch.no_grad()
    def __call__(self, examples: Sequence[dict[str, Any]], batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) float32 each on `engine.device()`: the reference's chosen and rejected log-probs of `examples`,
        `batch` their collated batch."""
        if self.table is not None:
            lp = torch.stack([self.table[id(ex)] for ex in examples]).to(engine.device())
            return lp[:, 0], lp[:, 1]
        return reference_logprobs(self.model, examples, lambda _: batch, len(examples), self.precision).unbind(-1)


def chosen_tokens(examples: Sequence[dict[str, Any]]) -> torch.Tensor:
    """(B,) long: each pair's chosen response tokens (RPO's NLL is per chosen token)."""
    return torch.tensor([len(ex["chosen_ids"]) for ex in examples], dtype=torch.long)


def token_counts(examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """`core.dpo_loss`'s `chosen_tokens` and `rejected_tokens` of a batch of pairs."""
    return {"chosen_tokens": chosen_tokens(examples),
            "rejected_tokens": torch.tensor([len(ex["rejected_ids"]) for ex in examples], dtype=torch.long)}


def loss_options(dc: Any) -> dict[str, Any]:
    """`core.dpo_loss`'s options from the `dpo` section."""
    return {"beta": dc.beta, "loss": dc.loss, "label_smoothing": dc.label_smoothing, "sft_weight": dc.sft_weight}


@torch.no_grad()
def heldout_stats(policy: Any, reference: Reference, examples: Sequence[dict[str, Any]], collate: Callable,
                  dc: Any, precision: str) -> dict[str, float]:
    """`eval/dpo/*`: `core.dpo_loss`'s statistics over the held-out pairs (the policy in eval mode against the
    reference), `dpo.eval_batch_size` pairs per forward; every rank runs every batch."""
    n_pairs, n_tokens = len(examples), float(chosen_tokens(examples).sum())
    total: dict[str, float] = {}
    for i in range(0, n_pairs, dc.eval_batch_size):
        exs = examples[i:i + dc.eval_batch_size]
        batch = collate(exs)
        chosen, rejected = pair_logprobs(policy, batch, precision)
        _, stats = dpo_loss(chosen, rejected, *reference(exs, batch), num_pairs=n_pairs, num_chosen_tokens=n_tokens,
                            **token_counts(exs), **loss_options(dc))
        for k, v in stats.items():
            total[k] = total.get(k, 0.0) + v
    return {f"eval/{k}": v for k, v in total.items()}


def run(cfg: Any, run_dir: Path) -> float | None:
    """`rlhf train-dpo` on the composed config `cfg` (conf/train_dpo.yaml), writing into `run_dir`: pairs → policy
    and reference → start table (the dry run stops there) → engine → (reference log-probs precomputed) → resume →
    optimizer steps → final held-out statistics → `final/` and `latest_dpo`. Returns the held-out accuracy
    (`eval/dpo/accuracy`), None without held-out pairs or on a dry run.

    Raises:
        ConfigError: a bad key or data (fewer training pairs than `dpo.batch_size`), in one line.
    """
    tr = SupervisedTrainer.start(cfg, run_dir, COMMAND, "pairs")
    tokenizer, _, data = tr.load_data(load_preference_data)
    if cfg.data.margin_key and engine.is_main():
        log.warning("data.margin_key=%s is not read by %s: the DPO losses have no per-pair margin", cfg.data.margin_key,
                    COMMAND.invocation)
    model, n_params, reference_model, what = policy_and_reference(cfg, tokenizer, cfg.dpo.precompute_reference)
    tr.plan(len(data.train))
    start_table(tr, model, n_params, data, what)
    if tr.dry_run_exit():
        return None
    eng = tr.build_engine(model)
    collate = pair_collator(eng.module, tokenizer.pad_token_id, cfg.data.packing)
    reference = build_reference(cfg, reference_model if reference_model is not None else eng.module, data, collate)
    tr.resume()  # after a precomputed reference: from the starting weights
    evaluate = partial(heldout_eval, eng, reference, data.eval, collate, cfg) if data.eval else None
    final_stats = tr.train(data.train, PROGRESS_KEYS, partial(train_step, eng, reference, collate, cfg), evaluate)
    tr.save_policy(tokenizer, final_stats)
    return final_stats.get("eval/dpo/accuracy")


def start_table(tr: SupervisedTrainer, model: Any, n_params: int, data: Any, what: str) -> None:
    """train-dpo's start table (`SupervisedTrainer.start_table`): the loss and its options, the reference (`what`, and
    whether its log-probs are precomputed), pairs and steps."""
    dc = tr.cfg.dpo
    tr.start_table(model, n_params, data, {
        "loss": f"{dc.loss} (beta={dc.beta:g}, label_smoothing={dc.label_smoothing:g}, sft_weight={dc.sft_weight:g})",
        "reference": what + (", log-probs precomputed" if dc.precompute_reference else ", with each micro-batch"),
        "train pairs": len(data.train), "eval pairs": len(data.eval), "optimizer steps": tr.total_steps,
    }, f"{tr.cfg.precision} (policy, reference and held-out passes alike; scoring_precision not read)")


def build_reference(cfg: Any, model: Any, data: Any, collate: Callable) -> Reference:
    """The run's `Reference` of `model`; with `dpo.precompute_reference` its log-probs of every training and
    held-out pair computed now, once, from the starting weights (before a resume loads trained ones)."""
    reference = Reference(model, cfg.precision)
    if cfg.dpo.precompute_reference:
        t0 = time.perf_counter()
        reference.precompute(list(data.train) + list(data.eval), collate, cfg.dpo.eval_batch_size)
        log.info("reference log-probs of %d pairs precomputed in %.1f s", len(data.train) + len(data.eval),
                 time.perf_counter() - t0)
    return reference


def train_step(eng: engine.TrainEngine, reference: Reference, collate: Callable, cfg: Any,
               mine: list[dict[str, Any]]) -> dict[str, float]:
    """One optimizer step on this rank's pairs `mine`, `dpo.micro_batch_size` at a time: the policy's summed
    response log-probs of chosen and rejected in one packed forward (`forwards.pair_logprobs`), the reference's,
    `core.dpo_loss` (each micro-batch's sum over the step's pairs, RPO's NLL over the step's chosen tokens on every
    rank), the engine's global backward and step. Returns the step's record: the loss statistics summed over
    ranks, the learning rate, gradient norm and throughput."""
    dc = cfg.dpo
    t0 = time.perf_counter()
    # the step's chosen tokens over every rank: RPO's NLL sum of each micro-batch is divided by it
    n_chosen = float(engine.all_reduce_sum(chosen_tokens(mine).sum().double().reshape(1))[0])
    stats_sum: dict[str, float] = {}
    tokens = torch.zeros(3)  # pair tokens (chosen + rejected sequences), real tokens computed, positions
    for m in range(0, len(mine), dc.micro_batch_size):
        exs = mine[m:m + dc.micro_batch_size]
        batch = collate(exs)
        tokens += torch.tensor([float(batch["pair_tokens"]), float(batch["attention_mask"].sum()),
                                float(batch["attention_mask"].numel())])
        # the reference first: under LoRA it is the policy's own (ZeRO-3-partitioned) module with its adapters off,
        # not run between the policy's forward and its backward
        ref_chosen, ref_rejected = reference(exs, batch)
        chosen, rejected = pair_logprobs(eng.module, batch, cfg.precision)  # (b,) float32, with the graph
        loss, stats = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, num_pairs=dc.batch_size,
                               num_chosen_tokens=n_chosen, **token_counts(exs), **loss_options(dc))
        eng.backward_global(loss)
        eng.step()
        for k, v in stats.items():
            stats_sum[k] = stats_sum.get(k, 0.0) + v
    dt = time.perf_counter() - t0
    keys = sorted(stats_sum)  # every stat is a sum over the step's pairs / its pair count: summed over ranks
    summed = engine.all_reduce_sum(torch.tensor([stats_sum[k] for k in keys] + tokens.tolist(),
                                                dtype=torch.float64)).tolist()
    record = dict(zip(keys, summed))
    pair_tok, real, positions = summed[len(keys):]
    record.update({**optimizer_stats(eng, COMMAND), "throughput/pairs_per_s": dc.batch_size / dt,
                   **throughput_stats(dt, pair_tok, real, positions)})
    return record


def heldout_eval(eng: engine.TrainEngine, reference: Reference, heldout: Sequence[dict[str, Any]],
                 collate: Callable, cfg: Any) -> dict[str, float]:
    """`heldout_stats` of the held-out pairs with the engine's model in eval mode (the loop puts it back in train
    mode)."""
    eng.eval()
    return heldout_stats(eng.module, reference, heldout, collate, cfg.dpo, cfg.precision)
