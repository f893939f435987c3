"""Small helpers the stages share: console tables, the tokenizer check, and the supervised stages' (train-rm,
train-sft, train-dpo, train-kto) shared steps, `SupervisedTrainer`: start, data, length, start table, dry-run exit,
engine and metrics, the optimizer-step loop, the final held-out figures and the final save; the step's common figures.
(A run's directory, checkpoints and resume live in rlhf_cli/lifecycle.py.)"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from rlhf_cli import engine, lineage
from rlhf_cli.commands import Command
from rlhf_cli.data import epoch_order, example_length
from rlhf_cli.eos import eos_ids
from rlhf_cli.errors import ConfigError
from rlhf_cli.forwards import FrozenWithoutAdapters
from rlhf_cli.lifecycle import (
    Checkpoints,
    checkpoint_plan,
    deferred_interrupts,
    finish_run,
    prepare_run_dir,
    seed_everything,
)
from rlhf_cli.models import (
    add_lora,
    auto_tokenizer,
    count_parameters,
    disable_dropout,
    load_causal_lm,
    load_generation_config,
    load_tokenizer,
    lora_enabled,
    parameter_counts,
    save_model,
)
from rlhf_cli.runs import MetricsLogger, Progress, atomic_write_json, set_status

log = logging.getLogger(__name__)
console = Console(stderr=False)


def print_table(title: str, rows: dict[str, Any]) -> None:
    """A two-column rich table (rank 0 only)."""
    if not engine.is_main():
        return
    table = Table(title=title, show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in rows.items():
        table.add_row(str(k), f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(table)


def start_run(cfg: Any, run_dir: Path) -> Path:
    """A stage's first steps: the process group (`engine.init_distributed`), the run dir made and its config written
    (`lifecycle.prepare_run_dir`; every rank gets rank 0's dir), and the seeded RNGs (`seed`). Returns the run dir."""
    engine.init_distributed()
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    return run_dir


def dry_run_exit(cfg: Any, run_dir: Path) -> bool:
    """True (and status `dry_run` written, rank 0) when `dry_run=true`: the stage stops after its start table."""
    if cfg.dry_run and engine.is_main():
        set_status(run_dir, "dry_run")
    return bool(cfg.dry_run)


def check_same_tokenizer(tokenizer: Any, model_path: str, what: str) -> None:
    """Raise ConfigError when the model at `model_path` was trained with another tokenizer than `tokenizer`
    (its scores of our token ids would be meaningless): a different vocabulary, or the same tokens under
    different ids. The message names the first tokens that differ."""
    theirs, ours = auto_tokenizer(model_path).get_vocab(), tokenizer.get_vocab()
    if theirs == ours:
        return
    only = sorted(set(theirs) ^ set(ours))[:3]
    moved = sorted(t for t in set(theirs) & set(ours) if theirs[t] != ours[t])[:3]
    detail = (f"tokens in one but not the other: {only}" if only else
              f"same tokens under different ids: {[(t, ours[t], theirs[t]) for t in moved]}")
    raise ConfigError(f"the {what} at {model_path} uses a different tokenizer than the policy ({len(theirs)} vs "
                      f"{len(ours)} tokens; {detail}): train the {what} from the same base model as the policy")


def model_source(model_cfg: Any) -> str | None:
    """Where a `model` section's weights come from, for the lineage: its path or hub id, its GGUF file, or
    None for a randomly initialised model (`model.init=random`)."""
    if model_cfg.init == "random":
        return None
    return model_cfg.name_or_path or model_cfg.gguf_file


def trained_parameters(model: Any, lora_cfg: Any) -> str:
    """What a stage's start table says of the parameters it trains: all of them, or LoRA's share."""
    trained, total = parameter_counts(model)
    if trained == total:
        return f"all ({total / 1e6:.1f}M)"
    return f"{trained / 1e6:.2f}M of {total / 1e6:.1f}M (LoRA r={lora_cfg.r}, alpha={lora_cfg.alpha:g})"


class RankShare(list):
    """This rank's examples of an optimizer step (a list), with the step's whole batch: `batch`, every rank's
    share in order, and `start`, the index in it of this share's first example (for a loss that pairs examples
    across the step, as train-kto's reference point does)."""

    def __init__(self, mine: Sequence[dict[str, Any]], batch: Sequence[dict[str, Any]], start: int) -> None:
        super().__init__(mine)
        self.batch, self.start = list(batch), start


def rank_share(train: Sequence[dict[str, Any]], order: Sequence[int], pos: int, batch_size: int) -> RankShare:
    """This rank's contiguous share (`batch_size` / world size examples) of the `pos`-th batch of `batch_size`
    examples of `train` in the epoch's `order` (indices into `train`)."""
    batch = [train[j] for j in order[pos * batch_size:(pos + 1) * batch_size]]
    per_rank = batch_size // engine.world_size()
    start = engine.rank() * per_rank
    return RankShare(batch[start:start + per_rank], batch, start)


def save_on_interrupt(ckpts: Checkpoints, step: int, stepping: bool) -> None:
    """On Ctrl-C/SIGTERM between steps: a checkpoint of the `step` steps done. In the middle of a step (`stepping`,
    a second interrupt) none: its weights are half-updated; said, so that the user resumes from the last one."""
    if stepping:
        log.warning("stopped in the middle of step %d: no checkpoint of it (resume=true continues from the last "
                    "one)", step + 1)
        return
    log.warning("interrupted at step %d: saving a checkpoint before exit", step)
    ckpts.save(step)


def optimizer_stats(eng: engine.TrainEngine, command: Command) -> dict[str, float]:
    """The optimizer step's learning rate and gradient norm (before clipping) of a supervised stage's record, in
    its command's namespace (`rm/lr`, `rm/grad_norm`; runs written before were bare: `Command.renamed_metrics`)."""
    return {f"{command.section}/lr": eng.lr(), f"{command.section}/grad_norm": eng.grad_norm()}


def throughput_stats(dt: float, tokens: float, real: float, positions: float) -> dict[str, float]:
    """A step's throughput figures: `tokens` (sequence tokens of the step's examples) per second over `dt`
    seconds, the padding fraction of the `positions` computed (`real` of them real tokens), and positions
    computed per sequence token (below 1 where packing computes shared prompts once)."""
    return {"throughput/tokens_per_s": tokens / dt, "throughput/padding_fraction": 1 - real / positions,
            "throughput/positions_per_token": positions / tokens}


def reference_spec(cfg: Any) -> dict[str, Any]:
    """How `rlhf eval` rebuilds the starting model a trained policy is compared against: the `model` section as
    run, with its `seed` (a random init is rebuilt from it)."""
    return {**OmegaConf.to_container(cfg.model, resolve=True), "seed": cfg.seed}


@dataclass
class SupervisedTrainer:
    """One run of a supervised stage (train-rm, train-sft, train-dpo, train-kto), as `PPOTrainer` is train-ppo's: the
    pieces its shared steps read, gathered once: the composed config, the run dir, the stage's `command` (whose
    `section`, `cfg.rm`, holds the keys of `config.SupervisedConfig`) and what its training `examples` are called in
    messages ("pairs"). The steps, in the order a stage calls them: `start` → `load_data` → `plan` →
    `start_table` → `dry_run_exit` → `build_engine` (`eng`, `metrics`, `ckpts`) → `resume` (`step`) → `train`
    (or `loop`) → `save`."""

    cfg: Any
    run_dir: Path
    command: Command
    examples: str
    total_steps: int = 0
    """Optimizer steps of the run (`plan`)."""
    step: int = 0
    """Optimizer steps done: 0, the step a resume loaded, the last step after `train`."""
    eng: engine.TrainEngine | None = None
    metrics: MetricsLogger | None = None
    ckpts: Checkpoints | None = None

    @classmethod
    def start(cls, cfg: Any, run_dir: Path, command: Command, examples: str) -> SupervisedTrainer:
        """The run's first steps (`start_run`: process group, run dir, seeded RNGs)."""
        return cls(cfg, start_run(cfg, run_dir), command, examples)

    @property
    def section(self) -> Any:
        """The command's own config section (`cfg.rm`, `cfg.sft`, `cfg.dpo`, `cfg.kto`)."""
        return self.cfg[self.command.section]

    def load_data(self, loader: Callable[..., Any]) -> tuple[Any, tuple[int, ...], Any]:
        """The data step: the tokenizer of `cfg.model`, the run's EOS set (`eos.eos_ids`),
        `loader(cfg.data, tokenizer, eos_ids=...)`'s split (`data.load_sft_data` or `load_preference_data`) and its
        lineage record (the command's run-dir kind). Returns (tokenizer, the EOS ids, data).

        Raises:
            ConfigError: fewer training examples than one batch (`<section>.batch_size`), in one line.
        """
        cfg, batch_size = self.cfg, self.section.batch_size
        tokenizer = load_tokenizer(cfg.model)
        eos = eos_ids(tokenizer, load_generation_config(cfg.model))  # where a response ends
        data = loader(cfg.data, tokenizer, eos_ids=eos)
        lineage.record(self.run_dir, cfg, self.command.kind, data.summary, {"model": model_source(cfg.model)},
                       write=engine.is_main())
        if len(data.train) < batch_size:
            raise ConfigError(f"only {len(data.train)} training {self.examples}, fewer than "
                              f"{self.command.section}.batch_size={batch_size}: {data.summary.drops()}")
        return tokenizer, eos, data

    def plan(self, n_train: int) -> int:
        """The run's length (`total_steps`) from `n_train` training examples; returns the examples left out of each
        epoch. An epoch is `n_train // batch_size` steps, its last partial batch dropped (each epoch reshuffles, so
        other examples sit out; said once, naming `<section>.batch_size`); `max_steps` overrides `epochs` epochs."""
        sec, key = self.section, f"{self.command.section}.batch_size"
        steps_per_epoch = n_train // sec.batch_size
        dropped = n_train - steps_per_epoch * sec.batch_size
        if dropped and engine.is_main():
            log.warning("each epoch trains on %d of %d %s: the last partial batch of %d is dropped (%s=%d; each "
                        "epoch reshuffles, so different %s sit out)", n_train - dropped, n_train, self.examples,
                        dropped, key, sec.batch_size, self.examples)
        self.total_steps = sec.max_steps or steps_per_epoch * sec.epochs
        return dropped

    def start_table(self, model: Any, n_params: int, data: Any, rows: dict[str, Any], precision: str) -> None:
        """The start table (also the dry run's): the model, its size `n_params` (non-embedding parameters, counted
        before any LoRA adapter) and the parameters trained, the stage's own `rows`, batch / micro-batch / world
        size, `precision` (the stage's text), the ZeRO stage, the data summary and the checkpoint size plan of
        `total_steps` steps saving every `save_every` (`lifecycle.checkpoint_plan`)."""
        cfg, sec = self.cfg, self.section
        print_table(f"{self.command.name}: {self.run_dir}", {
            "model": cfg.model.name, "params (non-embedding)": n_params,
            "trained params": trained_parameters(model, cfg.model.lora), **rows,
            "batch / micro / world": f"{sec.batch_size} / {sec.micro_batch_size} / {engine.world_size()}",
            "precision": precision, "zero stage": cfg.deepspeed.zero_stage, "data": data.summary,
            "checkpoint size": checkpoint_plan([model], cfg.paths, cfg.deepspeed.zero_stage, self.run_dir,
                                               self.total_steps, sec.save_every),
        })

    def dry_run_exit(self) -> bool:
        """`dry_run_exit` of this run: True when the stage stops after its start table."""
        return dry_run_exit(self.cfg, self.run_dir)

    def build_engine(self, model: Any) -> engine.TrainEngine:
        """The `engine.TrainEngine` of `model` from the section's keys (AdamW's lr, betas and weight decay, the
        warm-up fraction and schedule over `total_steps`, batch and micro-batch, gradient clipping; `deepspeed.*`
        and `precision` from the run), the metrics logger (`metrics.jsonl` and the trackers of `logger`/`tracker`,
        rank 0) and the checkpoints (`paths.keep_checkpoints`, `paths.keep_optimizer`). Returns the engine; the
        stage resumes (`resume`) when it is ready to."""
        cfg, sec, total = self.cfg, self.section, self.total_steps
        self.eng = engine.TrainEngine(
            model, cfg.deepspeed, cfg.precision, lr=sec.lr, train_batch_size=sec.batch_size,
            micro_batch_size=sec.micro_batch_size, total_steps=total, warmup_steps=int(sec.warmup_ratio * total),
            scheduler=sec.lr_scheduler, weight_decay=sec.weight_decay, betas=tuple(sec.betas),
            max_grad_norm=sec.max_grad_norm)
        self.metrics = MetricsLogger(self.run_dir, enabled=engine.is_main(), loggers=cfg.logger, tracker=cfg.tracker,
                                     config=OmegaConf.to_container(cfg, resolve=True))
        self.ckpts = Checkpoints(self.run_dir, {"": self.eng}, cfg.paths.keep_checkpoints, cfg.paths.keep_optimizer)
        return self.eng

    def resume(self) -> None:
        """`resume=`: the checkpoint's weights, optimizer and step (`step`), and its metrics kept up to it."""
        self.step, _ = self.ckpts.resume(self.cfg.resume, self.metrics)

    def epoch_order(self, train: Sequence[dict[str, Any]], epoch: int) -> list[int]:
        """The seeded order of `train` (indices) in epoch `epoch`: `data.epoch_order` with `(data.seed, seed)`, by
        length groups of `micro_batch_size` when `data.group_by_length`; the same on every rank and on resume."""
        cfg, sec = self.cfg, self.section
        lengths = [example_length(ex) for ex in train] if cfg.data.group_by_length else None
        return epoch_order(len(train), (cfg.data.seed, cfg.seed), epoch, lengths, sec.micro_batch_size)

    def step_batches(self, train: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Every optimizer step's whole batch (all ranks' shares, in order) of the run's `total_steps`, as `loop`
        will take them: for work a stage does once before the first step (train-kto's precomputed reference)."""
        per_epoch = len(train) // self.section.batch_size
        orders: dict[int, list[int]] = {}
        out = []
        for step in range(self.total_steps):
            epoch, pos = divmod(step, per_epoch)
            if epoch not in orders:
                orders = {epoch: self.epoch_order(train, epoch)}
            out.append(rank_share(train, orders[epoch], pos, self.section.batch_size).batch)
        return out

    def loop(self, train: Sequence[dict[str, Any]], progress_keys: Sequence[str],
             train_step: Callable[[list[dict[str, Any]]], dict[str, float]],
             evaluate: Callable[[], dict[str, float]] | None) -> int:
        """The optimizer-step loop, from `step` (0, or the step a resume loaded) to `total_steps`; returns the last
        step (also in `step`).

        Each step takes the next `batch_size` examples of `train` in the epoch's seeded order
        (`data.epoch_order` with `(data.seed, seed)`, by length groups of `micro_batch_size` when
        `data.group_by_length`; an epoch is `len(train) // batch_size` steps, its last partial batch dropped), gives
        this rank its contiguous share to `train_step(examples)`, which runs the micro-batches, the backwards and
        the engine steps and returns the step's record, to which the loop adds `<section>/epoch` (epochs done:
        `rm/epoch`); the share is a `RankShare`, which also holds the step's whole batch. Every `eval_every` steps
        (not at the last one: `train` evaluates after the loop) `evaluate()`'s figures join the record; the record
        is logged every `log_every` steps, at the last, and with held-out figures; a checkpoint is written every
        `save_every` steps, and on Ctrl-C (or SIGTERM) before the interrupt goes on: one that arrives during a step
        lets the step and its record finish first (`lifecycle.deferred_interrupts`), on every rank. The engine is in
        train mode for every `train_step`."""
        sec, eng, total_steps, step = self.section, self.eng, self.total_steps, self.step
        steps_per_epoch = len(train) // sec.batch_size
        progress = Progress(total_steps, self.command.name, list(progress_keys), enabled=engine.is_main(),
                            start=step)
        order_epoch, order = -1, []
        eng.train()
        stepping = False
        try:
            while step < total_steps:
                epoch, pos = divmod(step, steps_per_epoch)
                if epoch != order_epoch:
                    order = self.epoch_order(train, epoch)
                    order_epoch = epoch
                mine = rank_share(train, order, pos, sec.batch_size)
                # a checkpoint mid-step would hold the step's weights under the previous step (or none of its row):
                # a Ctrl-C/SIGTERM here lets the step and its record finish, then saves it (a second one stops at
                # once, without a checkpoint)
                with deferred_interrupts() as pending:
                    stepping = True
                    record = train_step(mine)
                    step += 1
                    record[f"{self.command.section}/epoch"] = step / steps_per_epoch
                    evaluated = (evaluate is not None and sec.eval_every and step % sec.eval_every == 0
                                 and step < total_steps)
                    if evaluated:
                        record.update(evaluate())
                        eng.train()
                    if step % sec.log_every == 0 or step == total_steps or evaluated:  # held-out figures always
                        self.metrics.log(step, record)
                    progress.update(1, record)
                    stepping = False
                if sec.save_every and step % sec.save_every == 0 and step < total_steps:
                    self.ckpts.save(step)
                if engine.all_reduce_sum(torch.tensor(float(bool(pending)))).item() > 0:  # every rank stops together
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            progress.close()
            save_on_interrupt(self.ckpts, step, stepping)
            raise
        progress.close()
        self.step = step
        return step

    def train(self, train: Sequence[dict[str, Any]], progress_keys: Sequence[str],
              train_step: Callable[[list[dict[str, Any]]], dict[str, float]],
              evaluate: Callable[[], dict[str, float]] | None) -> dict[str, float]:
        """`loop`, then `evaluate()` once more after the last step, its figures logged at that step. Returns the
        final held-out figures ({} when `evaluate` is None: no held-out examples)."""
        step = self.loop(train, progress_keys, train_step, evaluate)
        final_stats = evaluate() if evaluate is not None else {}
        if final_stats:
            self.metrics.log(step, final_stats)
        return final_stats

    def save(self, tokenizer: Any, extra_config: dict[str, Any], eval_record: dict[str, Any],
             rows: dict[str, Any]) -> None:
        """The run's end: the last checkpoint (`final=True`; without the optimizer state when
        `paths.keep_optimizer=false`), `final/` in HF format with `extra_config` in its config.json
        (`models.save_model`; LoRA merged), `final/rlhf_eval.json` (`eval_record`), the pointer of the command's kind
        (`lifecycle.finish_run`), the finish table (`rows`, then the checkpoint and the pointer); then every rank
        waits and the metrics close."""
        cfg, step = self.cfg, self.step
        self.ckpts.save(step, final=True)
        final = self.run_dir / "final"
        state_dict = self.eng.consolidated_state_dict()
        if engine.is_main():
            save_model(self.eng.module, state_dict, tokenizer, final, model_source(cfg.model),
                       extra_config=extra_config)
            atomic_write_json(final / "rlhf_eval.json", eval_record)
            pointer = finish_run(cfg, self.run_dir, final, self.command.kind, steps=step)
            print_table(f"{self.command.name} finished", {**rows, "checkpoint": str(final),
                                                          "pointer": str(pointer or "not moved (a sweep job)")})
        engine.barrier()
        self.metrics.close()

    def save_policy(self, tokenizer: Any, final_stats: dict[str, float]) -> None:
        """`save` of a stage that trains a policy (train-sft, train-dpo, train-kto): its `final/` records the starting
        model (`reference_spec`) that `rlhf eval` compares against; the held-out figures go to `rlhf_eval.json` only
        (a config key would be carried into the next stage's model)."""
        self.save(tokenizer, {"rlhf_stage": self.command.kind, "rlhf_reference_model": reference_spec(self.cfg)},
                  {"eval": final_stats, "steps": self.step}, final_stats)


def policy_and_reference(cfg: Any, tokenizer: Any, precompute_reference: bool) -> tuple[Any, int, Any, str]:
    """A preference stage's policy and frozen reference (train-dpo, train-kto): the policy (dropout off: the first
    step's policy is the reference; LoRA adapters when `model.lora.r` > 0) and its reference: under LoRA the policy
    with its adapters off; with `precompute_reference` (`dpo.`/`kto.precompute_reference`) None (the policy itself,
    before its first step); else a frozen copy. Returns (policy, its non-embedding parameters before any adapter,
    the reference model or None, what the reference is, for the start table)."""
    model = disable_dropout(load_causal_lm(cfg.model, cfg.precision, cfg.seed, tokenizer=tokenizer))
    n_params = count_parameters(model)
    if lora_enabled(cfg.model.lora):
        add_lora(model, cfg.model.lora, what="policy")
        return (model, n_params, FrozenWithoutAdapters(model, cfg.precision).module,
                "the policy with its LoRA adapters off")
    if not precompute_reference:  # a second copy only when neither LoRA nor precomputing spares it
        return (model, n_params, engine.FrozenModel(copy.deepcopy(model), cfg.precision).module,
                "a frozen copy of the starting weights")
    return model, n_params, None, "the starting weights"  # the policy itself, before its first step
