"""Checkpoints on disk: `paths.keep_optimizer=false` leaves the optimizer state out of the final checkpoint (and a
run resumed from it restarts the optimizer, saying so); the expected checkpoint size of the start table matches the
files; a run whose checkpoint and final/ would not fit in the free space is refused before training."""

import logging
import shutil
from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file

from rlhf_cli.errors import ConfigError
from rlhf_cli.lifecycle import NO_OPTIMIZER, checkpoint_bytes, checkpoint_plan
from rlhf_cli.runs import latest_tag, read_metrics

# 4 optimizer steps of 4 pairs, a DeepSpeed checkpoint at step 2 and the final one at step 4
TINY_RM = ["data.builtin.rm_train=16", "data.builtin.rm_eval=4", "rm.batch_size=4", "rm.micro_batch_size=4",
           "rm.max_steps=4", "rm.save_every=2", "rm.eval_every=0", "rm.lr=1e-3"]


def linear(dtype=torch.float32, frozen_bias=False):
    layer = torch.nn.Linear(4, 3).to(dtype)  # 12 weights + 3 biases
    layer.bias.requires_grad_(not frozen_bias)
    return layer


@pytest.mark.parametrize("dtype, zero, optimizer, expected", [
    (torch.float32, 0, True, (60, 120)),  # fp32 weights; AdamW's two fp32 moments
    (torch.float32, 0, False, (60, 0)),
    (torch.float32, 2, True, (60, 180)),  # ZeRO keeps an fp32 master copy in its optimizer files
    (torch.float32, 3, True, (0, 180)),  # ZeRO-3: the weights are the optimizer's fp32 partitions
    (torch.float32, 3, False, (0, 180)),  # ... so they cannot be left out
    (torch.bfloat16, 0, True, (30, 180)),  # bf16 weights; fp32 master copy and moments
])
def test_checkpoint_bytes_counts_trained_weights_and_adamw_state(dtype, zero, optimizer, expected):
    assert checkpoint_bytes([linear(dtype)], zero, optimizer) == expected


def test_frozen_parameters_are_not_in_a_checkpoint():
    assert checkpoint_bytes([linear(frozen_bias=True)], 0) == (48, 96)


def test_the_start_tables_checkpoint_size(tmp_path):
    text = checkpoint_plan([torch.nn.Linear(1000, 1000)], False, 0, tmp_path)  # 1,001,000 fp32 parameters
    assert text.startswith("~0.012 GB (weights 0.004 + optimizer 0.00801); the final one ~0.004 GB "
                           "(paths.keep_optimizer=false); final/ ~0.004 GB; ")
    assert text.endswith(" GB free")


def ds_files(tag_dir):
    return {p.name: p.stat().st_size for p in tag_dir.iterdir()}


@pytest.mark.parametrize("zero", [0, 2])
def test_keep_optimizer_false_final_checkpoint_holds_no_optimizer_state_and_resume_restarts_it(
        zero, run_stage, tmp_path, caplog):
    _, run, cfg = run_stage("train_rm", [*TINY_RM, "paths.keep_optimizer=false", f"deepspeed.zero_stage={zero}"])
    periodic, final = ds_files(run / "ds" / "step-2"), ds_files(run / "ds" / "step-4")
    # the periodic checkpoint keeps the optimizer state; the final one is the weights (and schedule) only
    assert NO_OPTIMIZER not in periodic and NO_OPTIMIZER in final
    assert not [n for n in final if "optim_states" in n]
    if zero == 0:  # the optimizer state sits in the model states file
        assert torch.load(run / "ds" / "step-2" / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]
        state = torch.load(run / "ds" / "step-4" / "mp_rank_00_model_states.pt", weights_only=False)
        assert state["optimizer"] is None and state["lr_scheduler"]["last_epoch"] == 4
    else:  # ZeRO-2: in its own file per rank
        assert [n for n in periodic if "optim_states" in n]
    # the sizes are the start table's, to a few kB of schedule, RNG and pickling
    from rlhf_cli.models import load_scalar_model

    model = load_scalar_model(cfg.model, cfg.precision, cfg.seed)
    weights, opt = checkpoint_bytes([model], zero)
    assert sum(final.values()) == pytest.approx(weights, abs=64e3)
    assert sum(periodic.values()) == pytest.approx(weights + opt, abs=64e3)

    # a longer run resumed from the final checkpoint: the weights load, the optimizer restarts
    step4 = load_file(run / "final" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.lifecycle"):
        run_stage("train_rm", [*TINY_RM, "paths.keep_optimizer=false", f"deepspeed.zero_stage={zero}",
                               "rm.max_steps=5", f"resume={run}"], run_dir=run)
    said = [r.getMessage() for r in caplog.records if r.name == "rlhf_cli.lifecycle" and r.levelno >= logging.WARNING]
    assert said == [
        "step-4 is a final checkpoint saved with paths.keep_optimizer=false (weights and LR schedule only): the "
        "optimizer restarts at step 4 (AdamW's moments from zero)"]
    assert [r["step"] for r in read_metrics(run) if "rm/loss" in r] == [1, 2, 3, 4, 5]
    assert latest_tag(run) == "step-5" and NO_OPTIMIZER in ds_files(run / "ds" / "step-5")
    # step 5 started from step 4's weights (ZeRO's fp32 master copy included): a fresh AdamW's first update
    # moves each weight by at most the learning rate (1e-3 at its peak); from any other weights it would not
    step5 = load_file(run / "final" / "model.safetensors")
    moved = max(float((step5[k] - step4[k]).abs().max()) for k in step4)
    assert 0 < moved <= 1.01e-3


def test_a_checkpoint_that_would_not_fit_is_refused_before_training(run_stage, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(ConfigError, match=r"^not enough disk space in .*: a checkpoint takes ~0\.04 GB \(weights "
                                          r"0\.01 \+ optimizer state 0\.03\) and final/ ~0\.01 GB, but only 0\.00 GB "
                                          r"are free \(free disk space or move paths\.root; paths\.keep_optimizer="
                                          r"false makes the final checkpoint weights only\)$") as err:
        run_stage("train_rm", TINY_RM)
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "runs" / "rm").glob("*/ds"))  # nothing was trained or saved


@pytest.mark.parametrize("command", ["train_sft", "train_dpo"])
def test_every_supervised_command_reads_keep_optimizer_and_shows_the_checkpoint_size(run_stage, tmp_path, command):
    """train-sft and train-dpo, like train-rm: `paths.keep_optimizer=false` leaves the optimizer state out of the
    final checkpoint (marked `NO_OPTIMIZER`), and the start table's checkpoint size is checked against the disk."""
    section = command.removeprefix("train_")
    _, run, _ = run_stage(command, ["experiment=smoke", f"{section}.max_steps=2", "paths.keep_optimizer=false"],
                          run_dir=tmp_path / "run")
    assert (run / "ds" / "step-2" / NO_OPTIMIZER).is_file()
    state = torch.load(run / "ds" / "step-2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["optimizer"] is None
