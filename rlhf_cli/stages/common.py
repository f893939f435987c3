"""Steps every stage shares: run-dir setup, seeding, resume bookkeeping, checkpoint tags."""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from rlhf_cli import engine
from rlhf_cli.runs import atomic_write_text, check_writable, get_status, save_error, set_status

log = logging.getLogger(__name__)
console = Console(stderr=False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> Dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states, for resume."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def epoch_order(n: int, seed: int, epoch: int, lengths: Optional[Sequence[int]] = None,
                group_size: int = 0) -> List[int]:
    """A seeded permutation of range(n) for one epoch (the same on every rank and on resume).

    With `lengths` and `group_size`, rows are sorted by length inside shuffled windows of
    `group_size * 8` rows and the resulting groups shuffled again (less padding, every row once).
    """
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    if lengths is None or group_size <= 0:
        return order
    window = group_size * 8
    chunks = []
    for i in range(0, n, window):
        w = sorted(order[i:i + window], key=lambda j: lengths[j])
        chunks += [w[k:k + group_size] for k in range(0, len(w), group_size)]
    perm = torch.randperm(len(chunks), generator=g).tolist()
    return [j for c in perm for j in chunks[c]]


def prepare_run_dir(cfg: Any, run_dir: Path) -> Path:
    """Create the run dir (rank 0), check it is writable, write the resolved config, mark it running.

    `precision=auto` is resolved here (engine.resolve_precision), so every later step and the saved
    config see the concrete choice.

    When resuming (`cfg.resume` names this dir) the saved config is kept beside the new one as
    `config.prev.yaml`. Raises PermissionError when the dir cannot be written.
    """
    # under a launcher every rank's Hydra made its own time-stamped dir; rank 0's is the run's
    own = Path(run_dir)
    run_dir = Path(engine.broadcast_object(str(own)))
    if own != run_dir and own.is_dir() and not (own / "config.yaml").exists():
        shutil.rmtree(own, ignore_errors=True)  # only Hydra's files for this rank were in it
    cfg.precision = engine.resolve_precision(cfg.precision)
    if engine.is_main():
        check_writable(run_dir)
        cfg_path = run_dir / "config.yaml"
        if cfg_path.exists() and cfg.get("resume"):
            shutil.copyfile(cfg_path, run_dir / "config.prev.yaml")
        atomic_write_text(cfg_path, OmegaConf.to_yaml(cfg, resolve=True))
        if get_status(run_dir).get("state") != "finished":
            set_status(run_dir, "running")
    engine.barrier()
    return run_dir


def ckpt_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ds"


def latest_tag(run_dir: Path) -> Optional[str]:
    """Tag of the newest complete DeepSpeed checkpoint of a run (written only after a save completes)."""
    p = ckpt_dir(run_dir) / "latest"
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    return tag if (ckpt_dir(run_dir) / tag).is_dir() else None


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


def print_table(title: str, rows: Dict[str, Any]) -> None:
    """A two-column rich table (rank 0 only)."""
    if not engine.is_main():
        return
    table = Table(title=title, show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in rows.items():
        table.add_row(str(k), f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(table)


def check_same_tokenizer(tokenizer: Any, model_path: str, what: str) -> None:
    """Raise ConfigError when the model at `model_path` was trained with another tokenizer than `tokenizer`
    (its scores of our token ids would be meaningless): a different vocabulary, or the same tokens under
    different ids. The message names the first tokens that differ."""
    from transformers import AutoTokenizer

    from rlhf_cli.config import ConfigError
    from rlhf_cli.models import resolve_hf_dir

    theirs, ours = AutoTokenizer.from_pretrained(resolve_hf_dir(model_path)).get_vocab(), tokenizer.get_vocab()
    if theirs == ours:
        return
    only = sorted(set(theirs) ^ set(ours))[:3]
    moved = sorted(t for t in set(theirs) & set(ours) if theirs[t] != ours[t])[:3]
    detail = (f"tokens in one but not the other: {only}" if only else
              f"same tokens under different ids: {[(t, ours[t], theirs[t]) for t in moved]}")
    raise ConfigError(f"the {what} at {model_path} uses a different tokenizer than the policy ({len(theirs)} vs "
                      f"{len(ours)} tokens; {detail}): train the {what} from the same base model as the policy")
