"""One training run's life, shared by every training stage: its directory, seeding, resumable checkpoints of
its engines, resume, interrupts, and the tail of the final save (config, pointer, status, pruning).

A stage reads top to bottom around it (torchtune's recipe shape):

    run_dir = prepare_run_dir(cfg, run_dir); seed_everything(cfg.seed)       # the run dir, config.yaml
    ... load data, build engines ...
    ckpts = Checkpoints(run_dir, {"actor": actor, ...}, cfg.paths.keep_checkpoints)
    start, state = ckpts.resume(cfg.resume, metrics)                        # resume=... continues here
    for step in range(start, total): ...; ckpts.save(step + 1, {...})       # every `save_every`, on Ctrl-C
    ckpts.save(total, {...}); <write final/ in HF format>; finish_run(...)    # pointer, status, pruning

Files (see runs.py for the whole layout): `ds/step-<N>/` one checkpoint, `ds/latest` the newest complete one.
States: `prepare_run_dir` marks a run `running`, `finish_run` `finished`, `mark_failed` `failed` (cli.py calls
it when an error stops the run). Which run `resume=true` continues is cli.py's choice (runs.find_resumable).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from rlhf_cli import engine
from rlhf_cli.commands import by_kind
from rlhf_cli.config import leaves
from rlhf_cli.errors import ConfigError
from rlhf_cli.lineage import FILE as LINEAGE_FILE
from rlhf_cli.lineage import MODEL_FILE as MODEL_LINEAGE_FILE
from rlhf_cli.lineage import MODEL_PATH_KEYS, resolve_model_path, resolve_model_paths
from rlhf_cli.runs import (
    TRACKER_FILE,
    MetricsLogger,
    atomic_write_text,
    check_writable,
    ckpt_dir,
    get_status,
    latest_tag,
    save_error,
    set_status,
    sweep_name,
    write_pointer,
)

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states, for resume."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _drop_file_handlers(folder: Path) -> None:
    """Detach and close every logging file handler writing under `folder` (a removed dir). Hydra's handler of a
    rank's own dir reopens its file on the next record once closed (a library may close it: vLLM's start does)."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", [])):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
                logger.removeHandler(handler)
                handler.close()


def prepare_run_dir(cfg: Any, run_dir: Path) -> Path:
    """Create the run dir (rank 0), check it is writable, write the resolved config, mark it running.

    `precision=auto` is resolved here (engine.resolve_precision), and so is every pointer or run dir a model path
    names (`lineage.resolve_model_paths`: the dir it names now, the value as typed kept in `paths.typed`), so every
    later step, the saved config and a resume see the concrete choice.

    When resuming (`cfg.resume` names this dir) the saved config is kept beside the new one as
    `config.prev.yaml`. Raises PermissionError when the dir cannot be written.
    """
    # under a launcher every rank's Hydra made its own time-stamped dir; rank 0's is the run's
    own = Path(run_dir)
    run_dir = Path(engine.broadcast_object(str(own)))
    if own != run_dir and own.is_dir() and not (own / "config.yaml").exists():
        shutil.rmtree(own, ignore_errors=True)  # only Hydra's files for this rank were in it
        _drop_file_handlers(own)  # its log file went with it: a later line of this rank would reopen it and fail
    cfg.precision = engine.resolve_precision(cfg.precision)
    # every pointer or run dir a model path names, resolved once (rank 0's reading, for every rank)
    resolved = None
    if engine.is_main():
        resolved = {k: OmegaConf.select(cfg, k) for k in resolve_model_paths(cfg, run_dir)}
        if OmegaConf.select(cfg, "paths.typed") is not None:
            resolved["paths.typed"] = OmegaConf.to_container(cfg.paths.typed)
    for key, value in engine.broadcast_object(resolved).items():
        OmegaConf.update(cfg, key, value, merge=False)
    if engine.is_main():
        check_writable(run_dir)
        cfg_path = run_dir / "config.yaml"
        if cfg_path.exists() and cfg.get("resume"):
            shutil.copyfile(cfg_path, run_dir / "config.prev.yaml")
        elif not cfg.get("resume"):  # a fresh run in a used dir: its trackers start new runs, not the old ones
            (run_dir / TRACKER_FILE).unlink(missing_ok=True)
        write_config(cfg, run_dir)
        if get_status(run_dir).get("state") != "finished":
            set_status(run_dir, "running")
    engine.barrier()
    return run_dir

def write_config(cfg: Any, run_dir: Path) -> None:
    """Rank 0: `run_dir/config.yaml`, the resolved config (again, when a stage resolved more of it since)."""
    atomic_write_text(Path(run_dir) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

# what a resumed run may change from its recorded config: its length, save cadence, checkpoint pruning, logging
RESUMABLE_KEYS = ("rm.max_steps", "rm.epochs", "ppo.iterations", "rm.save_every", "ppo.save_every",
                  "sft.max_steps", "sft.epochs", "sft.save_every", "sft.eval_every", "sft.log_every",
                  "dpo.max_steps", "dpo.epochs", "dpo.save_every", "dpo.eval_every", "dpo.log_every",
                  "kto.max_steps", "kto.epochs", "kto.save_every", "kto.eval_every", "kto.log_every",
                  "paths.keep_checkpoints", "paths.keep_optimizer", "rm.eval_every", "rm.log_every", "ppo.sample_every",
                  "logger", "tracker.project", "tracker.name", "tracker.group", "tracker.mlflow_tracking_uri", "resume",
                  "dry_run")

def resume_config(cfg: Any, run_dir: Path, given: list[str]) -> list[str]:
    """Make `cfg` the recorded config (`run_dir/config.yaml`) of the run `resume=` continues, in place.

    `given` holds the keys set on this command line (`data.path`, or a group such as `model`, which covers its
    keys). A key whose value differs from the record:
      - given, and in `RESUMABLE_KEYS` (more steps or iterations, save cadence, pruning, logging): takes the
        new value;
      - given, and not in that list: the resume is refused;
      - not given (today's default, or a pointer resolved anew): takes the recorded value, so a recorded
        path is never re-resolved.
    A given value that resolves to the recorded one is the same value: `precision=auto` against the precision
    it resolved to, a path against the absolute path (or the `final/` dir under it) the run recorded, a model path
    typed as the run was first given it (`paths.typed`: `model.name_or_path=runs/latest_sft` again). Keys
    only one side has (a field added or removed since) keep today's value. Returns the keys that took their
    recorded value.

    Raises:
        ConfigError: one line naming every given key that differs from the record, both values, and the
            keys that may change.
    """
    record = OmegaConf.load(run_dir / "config.yaml")
    recorded = leaves(OmegaConf.to_container(record, resolve=True))
    typed = dict(OmegaConf.select(record, "paths.typed") or {})  # each model path as the run was given it
    current = leaves(OmegaConf.to_container(cfg, resolve=True))
    is_given = lambda k: any(k == g or k.startswith(g + ".") for g in given)  # noqa: E731
    differ = [k for k in recorded if k in current and not _same(k, current[k], recorded[k], typed.get(k))]
    refused = [k for k in differ if is_given(k) and k not in RESUMABLE_KEYS]
    if refused:
        what = "; ".join(f"{k}={current[k]} (recorded: {recorded[k]})" for k in refused)
        raise ConfigError(f"resume={run_dir}: {what}: a resumed run keeps its recorded config; only "
                          f"{', '.join(k for k in RESUMABLE_KEYS if k not in ('resume', 'dry_run'))} may change "
                          f"(start a new run to change the rest)")
    kept = [k for k in differ if not is_given(k)]
    for k in kept:
        try:
            OmegaConf.update(cfg, k, recorded[k], merge=False)
        except Exception as e:  # noqa: BLE001 - a record today's schema rejects (an older version's)
            raise ConfigError(f"resume={run_dir}: its recorded {k}={recorded[k]!r} is not valid today "
                              f"({type(e).__name__}); start a new run") from None
    return kept

def _same(key: str, given: Any, recorded: Any, typed: str | None = None) -> bool:
    """Whether a command line's value is the recorded one, after the resolution the run applied to it: `precision=
    auto` resolved; a model path (`lineage.MODEL_PATH_KEYS`) typed as the run was first given it (`typed`, its
    `paths.typed` entry: the same pointer, even if it has moved since) or naming the recorded dir today."""
    if given == recorded:
        return True
    if key == "precision" and isinstance(given, str):
        return engine.resolve_precision(given) == recorded
    if key in MODEL_PATH_KEYS and isinstance(given, str) and (
            os.path.abspath(os.path.expanduser(given)) == typed or resolve_model_path(given) == recorded):
        return True
    if key.endswith("path") and isinstance(given, str) and isinstance(recorded, str):
        a, b = Path(given).expanduser().resolve(), Path(recorded).expanduser().resolve()
        return a == b or a / "final" == b
    return False

def _tag_step(path: Path) -> int:
    return int(path.name.split("-")[1])

def commit_checkpoint(run_dir: Path, tag: str, keep: int = 2) -> None:
    """After every rank has written `tag`, point `ds/latest` at it atomically and prune old tags, keeping
    the `keep` newest (`paths.keep_checkpoints`; at least 1, `tag` itself).

    A crash or a failed save before this leaves the previous `latest` (and its files) intact and
    loadable. Tags past `tag` are leftovers of an abandoned attempt (a save that failed half-way, or
    later checkpoints of a run since resumed from an earlier one) and are removed. Raises
    runs.SaveError when `ds/latest` cannot be written (it then still names the previous tag).
    """
    engine.barrier()
    if engine.is_main():
        latest = ckpt_dir(run_dir) / "latest"
        try:
            atomic_write_text(latest, tag + "\n")
        except OSError as e:
            raise save_error(f"the checkpoint pointer for {tag}", latest, e) from e
        step = int(tag.split("-")[1])
        tags = sorted((p for p in ckpt_dir(run_dir).iterdir() if p.is_dir() and p.name.startswith("step-")),
                      key=_tag_step)
        for old in [p for p in tags if _tag_step(p) > step] + [p for p in tags if _tag_step(p) <= step][:-max(1, keep)]:
            if old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    engine.barrier()

def drop_checkpoints(run_dir: Path, keep: int) -> None:
    """With `paths.keep_checkpoints=0`, delete the run's `ds/` (call after `final/` and the finished status
    are written: the HF model is then the run's only output and the run can no longer be resumed).

    Rank 0 only. Everything written so far is flushed to disk first, so a power loss cannot keep the
    deletion and lose `final/`; `ds/latest` goes first, so a deletion cut short leaves no pointer to a
    half-deleted checkpoint (a later `resume=<run dir>` then says there is nothing to continue from).
    """
    if keep != 0 or not engine.is_main():
        return
    os.sync()
    ds = ckpt_dir(run_dir)
    (ds / "latest").unlink(missing_ok=True)
    shutil.rmtree(ds, ignore_errors=True)
    if ds.exists():
        log.warning("paths.keep_checkpoints=0: could not delete all of %s", ds)

@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[int]]:
    """SIGINT/SIGTERM inside the block are recorded (in the yielded list), not raised, so the block runs to
    its end; a second signal raises KeyboardInterrupt at once. Outside the main thread: no change."""
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return

    def record(signum: int, frame: Any) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)
        log.warning("interrupt received: finishing this iteration's update, then saving a checkpoint "
                    "(interrupt again to stop now, without one)")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, record)
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

GB = 1e9
NO_OPTIMIZER = "NO_OPTIMIZER"
"""A file in `ds/step-<N>/` saved without the optimizer state (`paths.keep_optimizer=false`): what it holds."""


def checkpoint_bytes(models: Iterable[torch.nn.Module], zero_stage: int, optimizer: bool = True) -> tuple[int, int]:
    """Expected size on disk of one DeepSpeed checkpoint of `models` (each trained by one engine), summed over
    ranks (ZeRO partitions the same state, it does not add to it): (weights, optimizer state) in bytes.

    Only trained parameters are saved (a LoRA model's frozen base is rebuilt from its source). Weights: each
    trained parameter in its own dtype (fp32, or bf16 under precision=bf16); none under ZeRO-3, whose weights are
    the optimizer's fp32 partitions. Optimizer (AdamW): two fp32 moments per trained parameter (8 bytes), plus an
    fp32 master copy (4 bytes) under ZeRO 1-3 or with non-fp32 weights; 0 with `optimizer=False` (ZeRO 0-2).
    A few kB of schedule, RNG and counters are left out."""
    weights = opt = 0
    for model in models:
        trained = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in trained)
        master = zero_stage >= 1 or any(p.dtype != torch.float32 for p in trained)
        if zero_stage < 3:
            weights += sum(p.numel() * p.element_size() for p in trained)
        if optimizer or zero_stage == 3:
            opt += n * (8 + (4 if master else 0))
    return weights, opt


def hf_model_bytes(models: Iterable[torch.nn.Module]) -> int:
    """Size of `final/`'s weights: every parameter of `models` (tied ones once) in its dtype."""
    return sum(p.numel() * p.element_size() for model in models for p in model.parameters())


def planned_saves(total: int, save_every: int) -> int:
    """How many DeepSpeed checkpoints a run of `total` optimizer steps (or PPO iterations) writes: one every
    `save_every` (`rm.save_every`, `ppo.save_every`, ...; 0 = none) before the last step, then the final one. An
    interrupt's save takes the place of the later ones, so it adds none."""
    return (max(total - 1, 0) // save_every if save_every > 0 else 0) + 1


def disk_peak(checkpoint: int, final: int, hf: int, keep: int, saves: int) -> tuple[int, int]:
    """(most bytes the run's checkpoints and `final/` hold on disk at once, the most checkpoints at once).

    checkpoint: bytes of a checkpoint with the optimizer state (every save but the last); final: the last
    save's bytes (the same, or the weights only under `paths.keep_optimizer=false`); hf: `final/`'s bytes;
    keep: `paths.keep_checkpoints`; saves: `planned_saves`. As `commit_checkpoint` rotates them, a new
    checkpoint is complete before the oldest goes, so up to max(1, keep) + 1 of them coexist while one is
    written; `final/` is written after the last save, beside the max(1, keep) then kept (with keep=0, `ds/` goes
    after `final/` is complete). An interrupt's save is never the slim final one (it keeps the optimizer state
    wherever it comes), so the most checkpoints at once are all full-size ones."""
    kept = max(1, keep)
    at_once = min(saves, kept + 1)
    kept_at_end = [checkpoint] * (min(saves, kept) - 1) + [final]  # beside final/
    return max(checkpoint * at_once, sum(kept_at_end) + hf), at_once


def checkpoint_plan(models: list[torch.nn.Module], paths: Any, zero_stage: int, run_dir: Path, total: int,
                    save_every: int) -> str:
    """The start table's `checkpoint size` row, after checking that the run's saves fit on the run dir's file
    system: `disk_peak` of its checkpoints (`paths.keep_checkpoints` of them kept, one more while a new one is
    written; the final one without the optimizer state under `paths.keep_optimizer=false`) and `final/`.

    paths: the `paths` section; total, save_every: the run's optimizer steps (or PPO iterations) and its
    `*.save_every`, which give the checkpoints it writes (`planned_saves`; a resumed run writes fewer, and the
    ones it finds on disk are already counted as used).

    Raises:
        ConfigError: one line (exit status 2) with the sizes and the free space, before training.
    """
    weights, opt = checkpoint_bytes(models, zero_stage)
    slim = zero_stage < 3 and not paths.keep_optimizer
    final = weights + (0 if slim else opt)
    hf = hf_model_bytes(models)
    need, at_once = disk_peak(weights + opt, final, hf, paths.keep_checkpoints, planned_saves(total, save_every))
    free = shutil.disk_usage(run_dir).free
    if need > free:
        raise ConfigError(f"not enough disk space in {run_dir}: the run needs ~{need / GB:.2f} GB at its peak "
                          f"(up to {at_once} checkpoint(s) at once: paths.keep_checkpoints={paths.keep_checkpoints} "
                          f"kept while the next is written, each ~{(weights + opt) / GB:.2f} GB, weights "
                          f"{weights / GB:.2f} + optimizer state {opt / GB:.2f}; final/ ~{hf / GB:.2f} GB), but only "
                          f"{free / GB:.2f} GB "
                          "are free (free disk space or move paths.root; fewer paths.keep_checkpoints or saves; "
                          "paths.keep_optimizer=false makes the final checkpoint weights only)")
    text = f"~{(weights + opt) / GB:.3g} GB (weights {weights / GB:.3g} + optimizer {opt / GB:.3g})"
    if slim:
        text += f"; the final one ~{final / GB:.3g} GB (paths.keep_optimizer=false)"
    return (text + f"; final/ ~{hf / GB:.3g} GB; peak ~{need / GB:.3g} GB ({at_once} checkpoint(s) at once); "
            f"{free / GB:.0f} GB free")


class Checkpoints:
    """Resumable checkpoints of a run's engines: `ds/step-<N>/<name>/` per engine (a single engine named ""
    is written at `ds/step-<N>/` itself: train-rm's layout). The first engine's checkpoint also holds the
    stage's state (counters, controllers) with `step` and the RNG states.

    engines: {name: engine.TrainEngine}, in a fixed order (every rank saves and loads collectively);
    keep: `paths.keep_checkpoints`, the number of complete checkpoints kept; keep_optimizer:
    `paths.keep_optimizer` (false: the final checkpoint holds the weights and the LR schedule, not the optimizer
    state; ZeRO-3's cannot, which is said once here).
    """

    def __init__(self, run_dir: Path, engines: Mapping[str, engine.TrainEngine], keep: int,
                 keep_optimizer: bool = True) -> None:
        self.run_dir, self.engines, self.keep = Path(run_dir), dict(engines), keep
        self.keep_optimizer = keep_optimizer or any(e.zero_stage == 3 for e in self.engines.values())
        if self.keep_optimizer != keep_optimizer and engine.is_main():
            log.warning("paths.keep_optimizer=false has no effect under deepspeed.zero_stage=3 (its checkpoint's "
                        "weights are the optimizer's fp32 partitions): the final checkpoint keeps the optimizer state")

    def _where(self, tag: str, name: str) -> tuple[str, str]:
        return (str(ckpt_dir(self.run_dir) / tag), name) if name else (str(ckpt_dir(self.run_dir)), tag)

    def save(self, step: int, state: dict[str, Any] | None = None, final: bool = False) -> None:
        """Write `ds/step-<step>` (every engine, then `ds/latest` moves: see `commit_checkpoint`). A no-op
        when `ds/latest` already is that step (nothing changed since: never rewrite the good one). `final`: the
        run's last save, without the optimizer state when `paths.keep_optimizer=false` (marked by the file
        `NO_OPTIMIZER` in it)."""
        tag = f"step-{step}"
        if latest_tag(self.run_dir) == tag:
            return
        optimizer = self.keep_optimizer or not final
        state = {**(state or {}), "step": step, "rng": rng_state()}
        for i, (name, eng) in enumerate(self.engines.items()):
            eng.save(*self._where(tag, name), state if i == 0 else {}, optimizer=optimizer)
        if engine.is_main() and not optimizer:
            atomic_write_text(ckpt_dir(self.run_dir) / tag / NO_OPTIMIZER,
                              "paths.keep_optimizer=false: the weights and the LR schedule, no optimizer state\n")
        elif engine.is_main():  # a step dir saved again with its optimizer state: no stale mark
            (ckpt_dir(self.run_dir) / tag / NO_OPTIMIZER).unlink(missing_ok=True)
        commit_checkpoint(self.run_dir, tag, self.keep)

    def resume(self, resume: Any, metrics: MetricsLogger) -> tuple[int, dict[str, Any]]:
        """With `resume` set (the run dir being continued), load the newest complete checkpoint into every
        engine and restore the RNG states; returns (its step, the stage's saved state), or (0, {}) with none.
        Metrics records logged after that step (by the attempt that crashed) are dropped."""
        step, state = 0, {}
        tag = latest_tag(self.run_dir) if resume else None
        if tag is not None:
            optimizer = not (ckpt_dir(self.run_dir) / tag / NO_OPTIMIZER).is_file()
            for i, (name, eng) in enumerate(self.engines.items()):
                loaded = eng.load(*self._where(tag, name), optimizer=optimizer)
                state = loaded if i == 0 else state
            # "iteration": the key of PPO checkpoints written by earlier versions
            step = int(state["step"] if "step" in state else state["iteration"])
            set_rng_state(state["rng"])
            log.info("resumed from %s at step %d", tag, step)
            if not optimizer and engine.is_main():
                log.warning("%s is a final checkpoint saved with paths.keep_optimizer=false (weights and LR schedule "
                            "only): the optimizer restarts at step %d (AdamW's moments from zero)", tag, step)
        if resume:
            metrics.truncate_after(step)
        return step, state

def mark_failed(run_dir: Path, reason: str) -> None:
    """Rank 0: a run that stopped on an error (a data or size check, a crash in the code; not a lost node, see
    `engine.lost_rank`) is marked `failed`
    with the one-line `reason`, so `resume=true` never picks it (runs.find_resumable). Only a `running` run
    changes: a finished, aborted or dry run keeps its state, and a dir that was never prepared (no
    config.yaml: the config was rejected first) gets no status."""
    run_dir = Path(run_dir)
    if engine.is_main() and (run_dir / "config.yaml").is_file() and get_status(run_dir).get("state") == "running":
        set_status(run_dir, "failed", reason=reason)

def command_line_keys() -> list[str]:
    """The keys this process's Hydra command line set (`data.path`, or a group such as `data`); [] outside a
    Hydra app (a stage run in-process)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o.lstrip("+~").split("=", 1)[0] for o in HydraConfig.get().overrides.task]

def is_sweep_job(run_dir: Path) -> bool:
    """Whether `run_dir` is one job of a Hydra sweep (`-m`): running under one, or resumed in place from a
    `sweep-<time>/<job>` dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    running = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    return running or sweep_name(run_dir) is not None

def finish_run(cfg: Any, run_dir: Path, final: Path, kind: str, **status: Any) -> Path | None:
    """The tail of a training run, rank 0 only, after `final/` is written: the resolved config beside the
    model (`final/rlhf_config.yaml`) with its lineage (`final/rlhf_lineage.json`, see lineage.py); the pointer
    of `kind` (`commands.Command.pointer`: `latest_rm`, `latest_policy`) under `paths.root` (not for a sweep job: the
    pointer would name whichever job ran last); status `finished` (with `status`); `ds/` dropped when
    `paths.keep_checkpoints=0`. Returns the pointer's path, or None."""
    (final / "rlhf_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if (run_dir / LINEAGE_FILE).is_file():
        shutil.copyfile(run_dir / LINEAGE_FILE, final / MODEL_LINEAGE_FILE)
    moves = by_kind(kind).pointer is not None and not is_sweep_job(run_dir)  # a command may keep no pointer
    pointer = write_pointer(cfg.paths.root, kind, final) if moves else None
    set_status(run_dir, "finished", final=str(final.resolve()), **status)
    drop_checkpoints(run_dir, cfg.paths.keep_checkpoints)
    return pointer
