"""Checkpoints on disk: `paths.keep_optimizer=false` leaves the optimizer state out of the final checkpoint (and a
run resumed from it restarts the optimizer, saying so); the expected checkpoint size of the start table matches the
files; a run whose checkpoints (as many at once as `Checkpoints` keeps, plus the one being written) and final/ would not
fit in the free space is refused before training; `rlhf train-ppo`'s dry run shows the size of what it will train."""

import logging
import shutil
from collections import namedtuple

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from stage_helpers import compose

from rlhf_cli import lifecycle
from rlhf_cli.errors import ConfigError
from rlhf_cli.lifecycle import NO_OPTIMIZER, checkpoint_bytes, checkpoint_plan, disk_peak, planned_saves
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


def paths(keep_optimizer=True, keep=2):
    return OmegaConf.create({"keep_optimizer": keep_optimizer, "keep_checkpoints": keep})


def test_the_start_tables_checkpoint_size(tmp_path):
    # 1,001,000 fp32 parameters, one save (the final one, weights only; an interrupt's would be full-size: the peak)
    text = checkpoint_plan([torch.nn.Linear(1000, 1000)], paths(keep_optimizer=False), 0, tmp_path, 4, 0)
    assert text.startswith("~0.012 GB (weights 0.004 + optimizer 0.00801); the final one ~0.004 GB "
                           "(paths.keep_optimizer=false); final/ ~0.004 GB; peak ~0.012 GB (1 checkpoint(s) at "
                           "once); ")
    assert text.endswith(" GB free")


@pytest.mark.parametrize("total, save_every, saves", [(4, 2, 2), (6, 2, 3), (5, 2, 3), (16, 25, 1), (5, 0, 1),
                                                      (1, 1, 1), (3, 1, 3)])
def test_planned_saves_counts_the_periodic_ones_before_the_last_step_and_the_final_one(total, save_every, saves):
    assert planned_saves(total, save_every) == saves


@pytest.mark.parametrize("keep, saves, expected", [
    (2, 5, (30, 3)),  # 3 full ones while the 3rd and 4th are written; the final one beside 2 full ones: 24
    (0, 5, (20, 2)),  # keep=0 keeps one while training: two at once
    (1, 5, (20, 2)),
    (2, 1, (10, 1)),  # the final save alone, then final/ beside it (4 + 3); an interrupt's save is full: 10
    (2, 2, (20, 2)),  # final/ beside a full and the final one (10 + 4 + 3); interrupted at the end: two full
    (5, 3, (30, 3)),  # all three kept (24) with final/ (27); interrupted at the end: three full
])
def test_disk_peak_counts_the_kept_checkpoints_the_one_being_written_and_final(keep, saves, expected):
    assert disk_peak(10, 4, 3, keep, saves) == expected  # full checkpoint 10, final one 4, final/ 3


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_disk_peak_is_what_the_rotation_keeps_on_disk(keep, run_stage, tmp_path, monkeypatch):
    """The most `ds/step-*` dirs on disk at once in a real run (counted as each new one is complete, before the
    oldest goes) is `disk_peak`'s count; with keep=0 `ds/` is gone at the end."""
    most = []
    commit = lifecycle.commit_checkpoint

    def counting_commit(run_dir, tag, keep_):
        most.append(len(list((run_dir / "ds").glob("step-*"))))
        commit(run_dir, tag, keep_)

    monkeypatch.setattr(lifecycle, "commit_checkpoint", counting_commit)
    _, run, _ = run_stage("train_rm", [*TINY_RM, "rm.save_every=1", f"paths.keep_checkpoints={keep}"])
    assert max(most) == disk_peak(1, 1, 0, keep, planned_saves(4, 1))[1] == max(1, keep) + 1
    assert len(list((run / "ds").glob("step-*"))) == keep


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
    with pytest.raises(ConfigError, match=r"^not enough disk space in .*: the run needs ~0\.09 GB at its peak "
                                          r"\(up to 2 checkpoint\(s\) at once: paths\.keep_checkpoints=2 kept while "
                                          r"the next is written, each ~0\.04 GB, weights 0\.01 \+ optimizer state "
                                          r"0\.03; final/ ~0\.01 GB\), but only 0\.00 GB are free \(free disk space "
                                          r"or move paths\.root; fewer paths\.keep_checkpoints or saves; paths\."
                                          r"keep_optimizer=false makes the final checkpoint weights only\)$") as err:
        run_stage("train_rm", TINY_RM)
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "runs" / "rm").glob("*/ds"))  # nothing was trained or saved


def test_the_refusal_counts_every_checkpoint_that_coexists(run_stage, tmp_path, monkeypatch):
    """Room for one checkpoint and final/, not for the three that `paths.keep_checkpoints=2` and a save every step
    hold at once: refused (one checkpoint alone would have passed before)."""
    from rlhf_cli.models import load_scalar_model

    cfg = compose("train_rm", ["model=tiny", "precision=fp32", *TINY_RM])
    model = load_scalar_model(cfg.model, cfg.precision, cfg.seed)
    weights, opt = checkpoint_bytes([model], 0)
    one = weights + opt + lifecycle.hf_model_bytes([model])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 2 * one, 2 * one))
    run_stage("train_rm", [*TINY_RM, "rm.max_steps=1"])  # one save: fits
    with pytest.raises(ConfigError, match=r"up to 3 checkpoint\(s\) at once"):
        run_stage("train_rm", [*TINY_RM, "rm.save_every=1"])


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


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    """A tiny reward model's run dir (one step), for a critic grown from it."""
    from rlhf_cli.stages import rm

    root = tmp_path_factory.mktemp("rm")
    rm.run(compose("train_rm", ["experiment=smoke", "rm.max_steps=1", f"paths.root={root}"]), root / "rm" / "run")
    return root / "rm" / "run"


@pytest.mark.parametrize("overrides, from_rm", [
    ([], False),  # a separate critic from the policy's trunk
    (["model.lora.r=8", "paths.keep_optimizer=false"], False),
    (["ppo.critic=shared"], False),
    (["ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=2"], False),  # critic-free
    (["ppo.critic_init=reward_model"], True),
    (["ppo.critic_init=reward_model", "model.lora.r=8"], True),  # adapters on the reward model's own weights
])
def test_ppo_dry_run_shows_the_checkpoint_size_of_what_the_run_trains(overrides, from_rm, run_stage, request, tmp_path,
                                                                      monkeypatch):
    """`rlhf train-ppo dry_run=true` puts a `checkpoint size` row in its table (and refuses a run that would not fit)
    from models that checkpoint as the engines the run builds: policy, value head or critic, LoRA or not, each
    trained parameter in its dtype, at every ZeRO stage, with and without the optimizer state."""
    from rlhf_cli import engine
    from rlhf_cli.lifecycle import hf_model_bytes, seed_everything
    from rlhf_cli.preflight import VALIDATORS
    from rlhf_cli.stages import ppo

    if from_rm:
        overrides = [*overrides, "reward.type=model", f"reward_model.path={request.getfixturevalue('tiny_rm')}"]
    else:
        overrides = ["reward.type=checker", *overrides]
    planned, rows = [], []
    plan = ppo.checkpoint_plan

    def spy(models, *args):
        planned.append(models)
        rows.append(plan(models, *args))
        return rows[-1]

    monkeypatch.setattr(ppo, "checkpoint_plan", spy)
    run_stage("train_ppo", ["dry_run=true", *overrides])
    assert len(planned) == 1 and rows[0].endswith(" GB free")
    assert ("the final one" in rows[0]) == ("paths.keep_optimizer=false" in overrides)

    cfg = compose("train_ppo", ["model=tiny", "precision=fp32", f"paths.root={tmp_path / 'runs'}", *overrides])
    VALIDATORS["train_ppo"](cfg)
    engine.init_distributed()
    seed_everything(cfg.seed)
    tr = ppo.PPOTrainer(cfg, tmp_path / "built")
    tr.load_data()
    tr.build_models()
    built = [e.module for e in (tr.actor, tr.critic) if e is not None]
    assert len(planned[0]) == len(built)
    for zero in (0, 2, 3):
        for optimizer in (True, False):
            assert checkpoint_bytes(planned[0], zero, optimizer) == checkpoint_bytes(built, zero, optimizer)
    assert hf_model_bytes(planned[0]) == hf_model_bytes(built)
