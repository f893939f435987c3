"""Small helpers the stages share: console tables and the tokenizer check.
(A run's directory, checkpoints and resume live in rlhf_cli/lifecycle.py.)"""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from rlhf_cli import engine
from rlhf_cli.errors import ConfigError
from rlhf_cli.models import parameter_counts, resolve_hf_dir

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


def check_same_tokenizer(tokenizer: Any, model_path: str, what: str) -> None:
    """Raise ConfigError when the model at `model_path` was trained with another tokenizer than `tokenizer`
    (its scores of our token ids would be meaningless): a different vocabulary, or the same tokens under
    different ids. The message names the first tokens that differ."""
    theirs, ours = AutoTokenizer.from_pretrained(resolve_hf_dir(model_path)).get_vocab(), tokenizer.get_vocab()
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


def supervised_engine(model: Any, cfg: Any, section: Any, total_steps: int) -> engine.TrainEngine:
    """The `engine.TrainEngine` of a supervised stage (train-rm, train-sft) from its section's keys (`rm.*`, `sft.*`):
    AdamW (lr, betas, weight decay), the warm-up fraction and schedule over `total_steps`, batch and micro-batch,
    gradient clipping; `deepspeed.*` and `precision` from the run."""
    return engine.TrainEngine(
        model, cfg.deepspeed, cfg.precision, lr=section.lr, train_batch_size=section.batch_size,
        micro_batch_size=section.micro_batch_size, total_steps=total_steps,
        warmup_steps=int(section.warmup_ratio * total_steps), scheduler=section.lr_scheduler,
        weight_decay=section.weight_decay, betas=tuple(section.betas), max_grad_norm=section.max_grad_norm)
