"""`rlhf train-kto`: Kahneman-Tversky optimisation of a causal LM on unpaired labelled completions, on DeepSpeed.

The policy is trained on rows of a prompt, a completion and a label, desirable or not (`data.format=unpaired`, or
preference pairs split into a desirable and an undesirable row each; with no `data.*` keys the built-in task's
problems, one reply each labelled by its checker) against a frozen reference, its own starting weights: KTO's
loss (`core.kto_loss`, Ethayarajh et al. 2024, eq. 7) of each row's log-ratio to the reference against the step's
reference point z0, averaged over the optimizer step's rows (each micro-batch's sum is divided by the step's row
count and `engine.TrainEngine.backward_global` undoes DeepSpeed's average over ranks, so the update does not depend
on how the step is cut).

The reference point (`core.kl_reference_point`, logged as `kto/kl`) is TRL's KL estimate, computed once per
optimizer step before its first micro-batch: each row of the step's whole batch (every rank's share, in the
epoch's order) has its prompt paired with the previous row's completion (cycled by one, `core.kl_completion_index`;
the completion cut to fit `data.max_length` beside the prompt, as TRL's collator cuts it), the policy's and the
reference's log-probs of those pairs are taken with no gradient (each rank its own share's, `kto.micro_batch_size`
rows per forward), their log-ratios summed over every rank, and the mean clamped at 0. So z0 depends on the
step's rows and their order only, not on the micro-batch cut or the world size. The held-out rows get one z0 of
their own, their prompts paired the same way over the whole held-out set.

The reference runs in eval mode with no gradient: a frozen copy of the starting model, or under LoRA the policy
with its adapters off (`forwards.FrozenWithoutAdapters`). A row's completion and its mismatched completion share
its prompt, so the reference's log-probs of both come from one packed forward (`forwards.pair_logprobs`). With
`kto.precompute_reference` they are computed once before the first step (and before a resume loads its
checkpoint), for every step's rows (the steps' orders are seeded) and the held-out rows, from the starting policy
itself: no reference is held while training. Dropout is off in the policy (LoRA's `model.lora.dropout` aside),
and every pass runs in `precision` (`scoring_precision` is not read), so at the first step policy and reference are
one function: every log-ratio and z0 are 0 and the loss is λ_D/2 per desirable row and λ_U/2 per undesirable one.

Steps: load tokenizer and rows → build the policy (LoRA adapters when `model.lora.r` > 0) and its reference →
DeepSpeed engine → (precompute the reference) → (resume) → loop over optimizer steps with held-out statistics
every `kto.eval_every` steps and checkpoints → final held-out statistics → `final/` a plain causal LM in HF format
(LoRA merged, its adapter in `final/adapter/`; `rlhf_reference_model` records the starting model, for
`rlhf eval`) → `latest_kto` pointer.
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
from rlhf_cli.core import kl_completion_index, kl_reference_point, kto_loss
from rlhf_cli.data import load_unpaired_data
from rlhf_cli.errors import ConfigError
from rlhf_cli.forwards import (
    completion_logprobs,
    pair_collator,
    pair_logprobs,
    unpaired_collator,
)
from rlhf_cli.stages.common import RankShare, SupervisedTrainer, optimizer_stats, policy_and_reference, throughput_stats

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry (its name, run-dir kind, pointer)

PROGRESS_KEYS = ["kto/loss", "kto/kl", "kto/rewards_desirable", "kto/rewards_undesirable", "throughput/rows_per_s"]
CLASS_KEYS = {True: ("kto/rewards_desirable", "kto/logprobs_desirable"),
              False: ("kto/rewards_undesirable", "kto/logprobs_undesirable")}
"""Each class's statistics: left out of a record whose rows hold none of that class."""


def with_kl_completions(rows: Sequence[dict[str, Any]], max_length: int) -> list[dict[str, Any]]:
    """`rows` (a step's whole batch, or the held-out rows) each with `kl_ids`, the completion its prompt is paired
    with for the reference point: the previous row's with another prompt (cycled, `core.kl_completion_index`), its first
    `max_length` − prompt tokens (TRL's collator cuts a sequence at `max_length`), and `key`, the identities of the
    two rows it came from (the precomputed reference's table key)."""
    prev = kl_completion_index(len(rows), [tuple(ex["prompt_ids"]) for ex in rows]).tolist()
    return [{**ex, "kl_ids": list(rows[j]["completion_ids"][:max_length - len(ex["prompt_ids"])]),
             "key": (id(ex), id(rows[j]))} for ex, j in zip(rows, prev)]


def as_pair(ex: dict[str, Any]) -> dict[str, Any]:
    """A row with `kl_ids` as a pair sharing its prompt: its completion "chosen", the mismatched one "rejected"."""
    return {"prompt_ids": ex["prompt_ids"], "chosen_ids": ex["completion_ids"], "rejected_ids": ex["kl_ids"]}


class Reference:
    """The frozen reference of a run: its summed log-probs of rows' completions and of their mismatched completions
    (`with_kl_completions`), from `model` one forward per chunk, or looked up from those precomputed once
    (`precompute`). Every rank runs every forward of the rows it is given."""

    def __init__(self, model: Any, precision: str, collate: Callable) -> None:
        self.model, self.precision, self.collate = model, precision, collate  # collate: pairs (`as_pair`)
        self.table: dict[tuple[int, int], torch.Tensor] | None = None  # `key` -> (2,) when precomputed

    @torch.no_grad()
    def _forward(self, rows: Sequence[dict[str, Any]], chunk: int) -> torch.Tensor:
        module = self.model if isinstance(self.model, torch.nn.Module) else None  # the LoRA view has no mode
        was_training = module is not None and module.training
        if module is not None:
            module.eval()
        try:
            out = [torch.stack(pair_logprobs(self.model, self.collate([as_pair(ex) for ex in rows[i:i + chunk]]),
                                             self.precision), -1) for i in range(0, len(rows), chunk)]
        finally:
            if module is not None:
                module.train(was_training)
        return torch.cat(out) if out else torch.zeros(0, 2, device=engine.device())

    def precompute(self, rows: Sequence[dict[str, Any]], chunk: int) -> None:
        """Compute the log-probs of every row of `rows` once, then let the model go (`model` may be the policy
        before its first step: its weights are the reference's only now)."""
        lp = self._forward(rows, chunk).cpu()  # (N, 2)
        self.table = {ex["key"]: row for ex, row in zip(rows, lp)}
        self.model = None

    def __call__(self, rows: Sequence[dict[str, Any]], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) float32 each on `engine.device()`: the reference's log-probs of the rows' completions and of their
        mismatched completions, `chunk` rows per forward."""
        if self.table is not None:
            lp = torch.stack([self.table[ex["key"]] for ex in rows]).to(engine.device()) if rows else \
                torch.zeros(0, 2, device=engine.device())
        else:
            lp = self._forward(rows, chunk)
        return lp[:, 0], lp[:, 1]


@torch.no_grad()
def kl_logratio_sum(policy: Any, reference: Reference, rows: Sequence[dict[str, Any]], kl_collate: Callable,
                    chunk: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Over `rows` (with `kl_ids`), `chunk` at a time, no gradient: (the sum of log π − log π_ref of the mismatched
    pairs, float64 0-dim, the reference point's numerator; the reference's log-probs of the rows' own completions,
    (B,) float32). The reference runs first: under LoRA it is the policy's own module with its adapters off."""
    ref_lp, ref_kl = reference(rows, chunk)
    pol_kl = [completion_logprobs(policy, kl_collate(rows[i:i + chunk]), precision) for i in range(0, len(rows), chunk)]
    pol = torch.cat(pol_kl) if pol_kl else torch.zeros(0, device=engine.device())
    return (pol.double() - ref_kl.double()).sum(), ref_lp


def labels(rows: Sequence[dict[str, Any]]) -> torch.Tensor:
    """(B,) bool: True where a row's completion is desirable."""
    return torch.tensor([bool(ex["label"]) for ex in rows], dtype=torch.bool)


def loss_options(kc: Any) -> dict[str, Any]:
    """`core.kto_loss`'s options from the `kto` section."""
    return {"beta": kc.beta, "desirable_weight": kc.desirable_weight, "undesirable_weight": kc.undesirable_weight}


def drop_empty_classes(record: dict[str, float], counts: dict[bool, float], prefix: str = "") -> dict[str, float]:
    """`record` without the statistics of a class its rows hold none of (a mean over no row)."""
    for cls, n in counts.items():
        if not n:
            for key in CLASS_KEYS[cls]:
                record.pop(prefix + key, None)
    return record


@torch.no_grad()
def heldout_stats(policy: Any, reference: Reference, rows: Sequence[dict[str, Any]], collate: Callable,
                  kl_collate: Callable, kc: Any, precision: str) -> dict[str, float]:
    """`eval/kto/*`: the held-out rows' reference point (their prompts paired with the previous held-out row's
    completion, cycled over the whole set) and `core.kto_loss`'s statistics against it, `kto.eval_batch_size` rows
    per forward; every rank runs every batch."""
    logratio, ref_lp = kl_logratio_sum(policy, reference, rows, kl_collate, kc.eval_batch_size, precision)
    z0 = kl_reference_point(logratio, len(rows))
    good = labels(rows)
    counts = {True: float(good.sum()), False: float((~good).sum())}
    total: dict[str, float] = {}
    for i in range(0, len(rows), kc.eval_batch_size):
        exs = rows[i:i + kc.eval_batch_size]
        lp = completion_logprobs(policy, collate(exs), precision)
        _, stats = kto_loss(lp, ref_lp[i:i + len(exs)], labels(exs), z0, num_rows=len(rows),
                            num_desirable=counts[True], num_undesirable=counts[False], **loss_options(kc))
        for k, v in stats.items():
            total[k] = total.get(k, 0.0) + v
    total["kto/kl"] = float(z0)
    return drop_empty_classes({f"eval/{k}": v for k, v in total.items()}, counts, "eval/")


def weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float
                  ) -> str | None:
    """TRL's check of unbalanced classes (the paper's eq. 8: λ_D n_D / (λ_U n_U) in [1, 4/3]): None when the classes
    are balanced or either weight is in its advised range, else one line advising either range."""
    n_d, n_u = max(n_desirable, 1), max(n_undesirable, 1)
    if n_d == n_u:
        return None
    d_lo, d_hi = round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo, u_hi = round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (f"{n_desirable} desirable and {n_undesirable} undesirable training rows: the paper (eq. 8) advises either "
            f"kto.desirable_weight in [{d_lo}, {d_hi}] or kto.undesirable_weight in [{u_lo}, {u_hi}] (not both)")


def run(cfg: Any, run_dir: Path) -> float | None:
    """`rlhf train-kto` on the composed config `cfg` (conf/train_kto.yaml), writing into `run_dir`: rows → policy and
    reference → start table (the dry run stops there) → engine → (reference log-probs precomputed) → resume →
    optimizer steps → final held-out statistics → `final/` and `latest_kto`. Returns the held-out loss
    (`eval/kto/loss`), None without held-out rows or on a dry run.

    Raises:
        ConfigError: a bad key or data (fewer training rows than `kto.batch_size`, one held-out row), in one line.
    """
    tr = SupervisedTrainer.start(cfg, run_dir, COMMAND, "rows")
    tokenizer, _, data = tr.load_data(load_unpaired_data)
    if len(data.eval) == 1:
        raise ConfigError("1 held-out row: its reference point pairs each prompt with another row's completion; "
                          "hold out at least 2 (data.test_size, data.eval_path)")
    good = labels(data.train)
    advice = weight_advice(int(good.sum()), int((~good).sum()), cfg.kto.desirable_weight, cfg.kto.undesirable_weight)
    if advice and engine.is_main():
        log.warning(advice)
    model, n_params, reference_model, what = policy_and_reference(cfg, tokenizer, cfg.kto.precompute_reference)
    tr.plan(len(data.train))
    start_table(tr, model, n_params, data, what, int(good.sum()))
    if tr.dry_run_exit():
        return None
    eng = tr.build_engine(model)
    pad, packing = tokenizer.pad_token_id, cfg.data.packing
    collate = unpaired_collator(eng.module, pad, packing)
    kl_collate = unpaired_collator(eng.module, pad, packing, completion_key="kl_ids")
    heldout = with_kl_completions(data.eval, cfg.data.max_length) if data.eval else []
    reference = build_reference(tr, reference_model if reference_model is not None else eng.module,
                                pair_collator(eng.module, pad, packing), data.train, heldout)
    tr.resume()  # after a precomputed reference: from the starting weights
    evaluate = partial(heldout_eval, eng, reference, heldout, collate, kl_collate, cfg) if heldout else None
    final_stats = tr.train(data.train, PROGRESS_KEYS, partial(train_step, eng, reference, collate, kl_collate, cfg),
                           evaluate)
    tr.save_policy(tokenizer, final_stats)
    return final_stats.get("eval/kto/loss")


def start_table(tr: SupervisedTrainer, model: Any, n_params: int, data: Any, what: str, n_desirable: int) -> None:
    """train-kto's start table (`SupervisedTrainer.start_table`): the loss and its options, the reference (`what`,
    and whether its log-probs are precomputed), rows per class and steps."""
    kc = tr.cfg.kto
    tr.start_table(model, n_params, data, {
        "loss": f"kto (beta={kc.beta:g}, desirable_weight={kc.desirable_weight:g}, "
                f"undesirable_weight={kc.undesirable_weight:g})",
        "reference": what + (", log-probs precomputed" if kc.precompute_reference else ", with each step"),
        "reference point": "KL estimate of each step's prompts paired with the previous row's completion, clamped at 0",
        "train rows": f"{len(data.train)} ({n_desirable} desirable, {len(data.train) - n_desirable} undesirable)",
        "eval rows": len(data.eval), "optimizer steps": tr.total_steps,
    }, f"{tr.cfg.precision} (policy, reference and held-out passes alike; scoring_precision not read)")


def build_reference(tr: SupervisedTrainer, model: Any, collate: Callable, train: Sequence[dict[str, Any]],
                    heldout: Sequence[dict[str, Any]]) -> Reference:
    """The run's `Reference` of `model`; with `kto.precompute_reference` its log-probs of every step's rows and
    mismatched completions (`SupervisedTrainer.step_batches`: the orders the loop will take) and of the held-out
    rows computed now, once, from the starting weights (before a resume loads trained ones)."""
    cfg = tr.cfg
    reference = Reference(model, cfg.precision, collate)
    if cfg.kto.precompute_reference:
        t0 = time.perf_counter()
        rows = {ex["key"]: ex for batch in tr.step_batches(train)
                for ex in with_kl_completions(batch, cfg.data.max_length)}
        rows.update((ex["key"], ex) for ex in heldout)
        reference.precompute(list(rows.values()), cfg.kto.eval_batch_size)
        log.info("reference log-probs of %d rows and their mismatched completions precomputed in %.1f s", len(rows),
                 time.perf_counter() - t0)
    return reference


def train_step(eng: engine.TrainEngine, reference: Reference, collate: Callable, kl_collate: Callable, cfg: Any,
               mine: RankShare) -> dict[str, float]:
    """One optimizer step on this rank's rows `mine`: the step's reference point first (this rank's mismatched
    pairs of the step's whole batch, `kl_logratio_sum`, summed over ranks, `core.kl_reference_point`), then
    `kto.micro_batch_size` rows at a time the policy's summed completion log-probs (`forwards.completion_logprobs`,
    packed), `core.kto_loss` (each micro-batch's sum over the step's rows), the engine's global backward and step.
    Returns the step's record: the loss statistics summed over ranks, z0, the learning rate, gradient norm and
    throughput."""
    kc = cfg.kto
    t0 = time.perf_counter()
    rows = with_kl_completions(mine.batch, cfg.data.max_length)[mine.start:mine.start + len(mine)]
    logratio, ref_lp = kl_logratio_sum(eng.module, reference, rows, kl_collate, kc.micro_batch_size, cfg.precision)
    good = labels(rows)
    # (Σ log-ratio, pairs, desirable rows, undesirable rows) over every rank: z0 and the class divisors of the step
    step = engine.all_reduce_sum(torch.stack([logratio.cpu(), torch.tensor(float(len(rows)), dtype=torch.float64),
                                              good.sum().double(), (~good).sum().double()])).tolist()
    z0 = kl_reference_point(torch.tensor(step[0]), step[1])
    counts = {True: step[2], False: step[3]}
    stats_sum: dict[str, float] = {}
    tokens = torch.zeros(3)  # row tokens, real tokens computed, positions
    for m in range(0, len(rows), kc.micro_batch_size):
        exs = rows[m:m + kc.micro_batch_size]
        batch = collate(exs)
        tokens += torch.tensor([float(batch["tokens"]), float(batch["attention_mask"].sum()),
                                float(batch["attention_mask"].numel())])
        logprobs = completion_logprobs(eng.module, batch, cfg.precision)  # (b,) float32, with the graph
        loss, stats = kto_loss(logprobs, ref_lp[m:m + len(exs)], labels(exs), z0, num_rows=kc.batch_size,
                               num_desirable=counts[True], num_undesirable=counts[False], **loss_options(kc))
        eng.backward_global(loss)
        eng.step()
        for k, v in stats.items():
            stats_sum[k] = stats_sum.get(k, 0.0) + v
    dt = time.perf_counter() - t0
    keys = sorted(stats_sum)  # every stat is a sum over the step's rows / its count: summed over ranks
    summed = engine.all_reduce_sum(torch.tensor([stats_sum[k] for k in keys] + tokens.tolist(),
                                                dtype=torch.float64)).tolist()
    record = drop_empty_classes(dict(zip(keys, summed)), counts)
    record["kto/kl"] = float(z0)
    row_tok, real, positions = summed[len(keys):]
    record.update({**optimizer_stats(eng, COMMAND), "throughput/rows_per_s": kc.batch_size / dt,
                   **throughput_stats(dt, row_tok, real, positions)})
    return record


def heldout_eval(eng: engine.TrainEngine, reference: Reference, heldout: Sequence[dict[str, Any]],
                 collate: Callable, kl_collate: Callable, cfg: Any) -> dict[str, float]:
    """`heldout_stats` of the held-out rows with the engine's model in eval mode (the loop puts it back in train
    mode)."""
    eng.eval()
    return heldout_stats(eng.module, reference, heldout, collate, kl_collate, cfg.kto, cfg.precision)
