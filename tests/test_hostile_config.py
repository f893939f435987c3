"""Config and checkpoint mistakes fail before anything trains, with one line that says what to do.

Out-of-range values of every ppo.* / rm.* key (test_cli.py runs a few through the real CLI), model paths
that do not exist or hold the wrong kind of model (a policy where a reward model is expected and the
reverse), and a reward model whose tokenizer is not the policy's.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
from stage_helpers import REPO, compose, subprocess_env

from rlhf_cli.config import ConfigError
from rlhf_cli.preflight import VALIDATORS

TINY = ["model=tiny", "precision=fp32"]
# the smallest train-ppo run that gets to build its models (reward model from reward_model.path); run_stage adds TINY
TINY_PPO = ["ppo.rollout_batch_size=4", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4",
            "ppo.max_new_tokens=4", "ppo.iterations=1", "ppo.epochs=1", "data.builtin.ppo_train=8",
            "data.builtin.ppo_eval=4"]


def validate(command, overrides, tmp_path):
    cfg = compose(command, [*TINY, f"paths.root={tmp_path / 'runs'}", *overrides])
    VALIDATORS[command](cfg)
    return cfg


def config_error(command, overrides, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(command, overrides, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------------------------
# out-of-range values: every numeric or enumerated ppo.* and rm.* key

RANGE_ERRORS = [
    ("train_ppo", "ppo.iterations=0", "ppo.iterations must be >= 1 (got 0)"),
    ("train_ppo", "ppo.epochs=0", "ppo.epochs must be >= 1 (got 0)"),
    ("train_ppo", "ppo.rollout_batch_size=0", "ppo.rollout_batch_size (0) and ppo.mini_batch_size (8) must be > 0"),
    ("train_ppo", "ppo.micro_batch_size=3",
     "ppo.mini_batch_size=8 is not divisible by ppo.micro_batch_size × world size = 3 × 1 = 3"),
    ("train_ppo", "ppo.micro_batch_size=0", "ppo.mini_batch_size (8) and ppo.micro_batch_size (0) must be > 0"),
    ("train_ppo", "ppo.lam=-0.1", "ppo.lam (λ) must be in [0, 1] (got -0.1)"),
    ("train_ppo", "ppo.value_clip=0", "ppo.value_clip must be > 0 or null (got 0.0)"),
    ("train_ppo", "ppo.c1=-1", "ppo.c1 must be >= 0 (got -1.0)"),
    ("train_ppo", "ppo.c2=-0.01", "ppo.c2 must be >= 0 (got -0.01)"),
    ("train_ppo", "ppo.kl_beta=-0.1", "ppo.kl_beta (β) must be >= 0 (got -0.1)"),
    ("train_ppo", "ppo.kl_target=0", "ppo.kl_target must be > 0 or null (got 0.0)"),
    ("train_ppo", "ppo.kl_horizon=0", "ppo.kl_horizon must be > 0 (got 0)"),
    ("train_ppo", "ppo.kl_estimator=k4", "ppo.kl_estimator='k4' is not one of k1, k2, k3"),
    ("train_ppo", "ppo.advantage_estimator=ppo", "ppo.advantage_estimator='ppo' is not one of gae, grpo"),
    ("train_ppo", "ppo.max_new_tokens=0", "ppo.max_new_tokens must be >= 1 (got 0)"),
    ("train_ppo", "ppo.temperature=0", "ppo.temperature must be > 0 (got 0.0)"),
    ("train_ppo", "ppo.top_p=1.5", "ppo.top_p must be in (0, 1] (got 1.5)"),
    ("train_ppo", "ppo.truncated=drop", "ppo.truncated='drop' is not one of penalize, mask, keep"),
    ("train_ppo", "ppo.missing_eos_penalty=-1", "ppo.missing_eos_penalty must be >= 0 (got -1.0)"),
    ("train_ppo", "ppo.critic=none", "ppo.critic='none' is not one of separate, shared"),
    ("train_ppo", "ppo.critic_init=random", "ppo.critic_init='random' is not one of reward_model, policy"),
    ("train_ppo", "ppo.aggregation=sum", "ppo.aggregation='sum' is not one of token-mean, seq-mean-token-mean"),
    ("train_ppo", "ppo.clip_high=0", "ppo.clip_high (ε_high) must be > 0 or null (got 0.0)"),
    ("train_ppo", "ppo.dual_clip=1", "ppo.dual_clip (c) must be > 1 or null (got 1.0)"),
    ("train_ppo", "ppo.policy_loss=grpo", "ppo.policy_loss='grpo' is not one of ppo, gspo, cispo"),
    ("train_ppo", "ppo.policy_loss=gspo", "ppo.policy_loss=gspo with ppo.advantage_estimator=gae: GSPO's sequence"),
    ("train_ppo", "ppo.policy_loss=cispo ppo.dual_clip=3",
     "ppo.dual_clip=3.0 with ppo.policy_loss=cispo: CISPO has no clipped objective to bound"),
    ("train_ppo", "ppo.overlong_buffer=-1",
     "ppo.overlong_buffer must be in [0, ppo.max_new_tokens=32] (0 = off; got -1)"),
    ("train_ppo", "ppo.overlong_buffer=33", "ppo.overlong_buffer must be in [0, ppo.max_new_tokens=32]"),
    ("train_ppo", "ppo.overlong_penalty=-1", "ppo.overlong_penalty must be >= 0 (got -1.0)"),
    ("train_ppo", "ppo.actor_lr=0", "ppo.actor_lr (0.0) and ppo.critic_lr (1e-05) must be > 0"),
    ("train_ppo", "ppo.max_bad_steps=-1", "ppo.max_bad_steps must be >= 0 (got -1)"),
    ("train_ppo", "ppo.max_kl=0", "ppo.max_kl must be > 0 or null (got 0.0)"),
    # checks added with these tests
    ("train_ppo", "ppo.weight_decay=-0.1", "ppo.weight_decay must be >= 0 (got -0.1)"),
    ("train_ppo", "ppo.warmup_steps=-1", "ppo.warmup_steps must be >= 0 (got -1)"),
    ("train_ppo", "ppo.max_grad_norm=-1", "ppo.max_grad_norm must be >= 0 (0 disables clipping; got -1.0)"),
    ("train_ppo", "ppo.sample_every=-1", "ppo.sample_every must be >= 0 (0 = never; got -1)"),
    ("train_ppo", "ppo.save_every=-1", "ppo.save_every must be >= 0 (0 = only at the end; got -1)"),
    ("train_ppo", "ppo.kl_beta=inf", "ppo.kl_beta must be a finite number (got inf)"),
    ("train_ppo", "ppo.clip=nan", "ppo.clip must be a finite number (got nan)"),
    ("train_ppo", "ppo.actor_lr=inf", "ppo.actor_lr must be a finite number (got inf)"),
    ("train_ppo", "ppo.max_kl=inf", "ppo.max_kl must be a finite number (got inf)"),
    ("train_rm", "rm.lr=0", "rm.lr must be > 0 (got 0.0)"),
    ("train_rm", "rm.warmup_ratio=1", "rm.warmup_ratio must be in [0, 1) (got 1.0)"),
    ("train_rm", "rm.lr_scheduler=step", "rm.lr_scheduler='step' is not one of cosine, linear, constant"),
    ("train_rm", "rm.epochs=0", "rm.epochs must be >= 1 (got 0)"),
    ("train_rm", "rm.max_steps=0", "rm.max_steps must be >= 1 or null (got 0)"),
    ("train_rm", "rm.max_grad_norm=-1", "rm.max_grad_norm must be >= 0 (got -1.0)"),
    ("train_rm", "rm.batch_size=12",
     "rm.batch_size=12 is not divisible by rm.micro_batch_size × world size = 8 × 1 = 8"),
    ("train_rm", "rm.eval_batch_size=0", "rm.eval_batch_size must be > 0 (got 0)"),
    ("train_rm", "rm.margin=true", "rm.margin=true needs data.margin_key"),
    ("train_rm", "rm.center_rewards_coef=-0.01", "rm.center_rewards_coef must be >= 0 or null (got -0.01)"),
    # checks added with these tests
    ("train_rm", "rm.log_every=0", "rm.log_every must be >= 1 (got 0)"),  # was a ZeroDivisionError after step 1
    ("train_rm", "rm.eval_every=-1", "rm.eval_every must be >= 0 (0 = only at the end; got -1)"),
    ("train_rm", "rm.save_every=-2", "rm.save_every must be >= 0 (0 = only at the end; got -2)"),
    ("train_rm", "rm.weight_decay=-0.1", "rm.weight_decay must be >= 0 (got -0.1)"),
    ("train_rm", "rm.betas=[0.9,1.0]", "rm.betas must be two AdamW decay rates in [0, 1) (got [0.9, 1.0])"),
    ("train_rm", "rm.betas=[0.9]", "rm.betas must be two AdamW decay rates in [0, 1) (got [0.9])"),
    ("train_rm", "rm.lr=inf", "rm.lr must be a finite number (got inf)"),
    ("train_rm", "rm.center_rewards_coef=nan", "rm.center_rewards_coef must be a finite number (got nan)"),
    ("train_rm", "rm.betas=[0.9,nan]", "rm.betas must be a finite number (got [0.9, nan])"),
    ("eval", "eval.generation_batch_size=0", "eval.generation_batch_size must be > 0 (got 0)"),
]


@pytest.mark.parametrize("command,override,needle", RANGE_ERRORS, ids=[r[1] for r in RANGE_ERRORS])
def test_out_of_range_value_is_one_line_naming_the_key(command, override, needle, tmp_path):
    assert needle in config_error(command, override.split(), tmp_path)  # a space separates combined overrides


def test_defaults_and_edge_values_pass(tmp_path):
    for command in ("train_rm", "train_ppo", "eval"):
        validate(command, [], tmp_path)
    validate("train_rm", ["rm.eval_every=0", "rm.save_every=0", "rm.betas=[0.0,0.999]", "rm.weight_decay=0"], tmp_path)
    validate("train_ppo", ["ppo.sample_every=0", "ppo.max_grad_norm=0", "ppo.kl_target=null", "ppo.max_kl=null"],
             tmp_path)
    # the policy losses where they are defined: gspo with a critic-free estimator, cispo without a dual clip
    validate("train_ppo", ["ppo.clip_high=0.28", "ppo.dual_clip=3", "ppo.aggregation=seq-mean-token-mean"], tmp_path)
    validate("train_ppo", ["ppo.policy_loss=gspo", "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=2",
                           "ppo.dual_clip=3"], tmp_path)
    validate("train_ppo", ["ppo.policy_loss=cispo", "ppo.clip_high=4"], tmp_path)
    validate("train_ppo", ["ppo.overlong_buffer=32", "ppo.overlong_penalty=0"], tmp_path)


# ----------------------------------------------------------------------------------------------
# model paths: missing, empty, stale, or holding the wrong kind of model


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, tiny_model_cfg, tokenizer):
    """A tiny policy saved as a train-ppo run dir (`<run>/final/`) and a tiny reward model as a plain HF dir."""
    from rlhf_cli.models import load_causal_lm, load_scalar_model, save_hf

    root = tmp_path_factory.mktemp("saved")
    save_hf(load_causal_lm(tiny_model_cfg, "fp32", 1, tokenizer=tokenizer), tokenizer, root / "ppo_run" / "final")
    save_hf(load_scalar_model(tiny_model_cfg, "fp32", 2), tokenizer, root / "rm")
    return {"policy_run": root / "ppo_run", "rm": root / "rm"}


@pytest.mark.parametrize("command,key,hint", [
    ("train_ppo", "reward_model.path", "set it to a `rlhf train-rm` run dir, its final/ dir or an HF reward-model dir, "
                                       "or leave it unset for "),
    ("train_ppo", "reference.path", "set it to a causal LM (a run dir, its final/ dir or an HF dir), or leave it unset "
                                    "for the policy's initial weights"),
    ("eval", "policy.path", "set it to a `rlhf train-ppo` run dir, its final/ dir or an HF causal-LM dir"),
    ("eval", "reward_model.path", "or leave it unset for the one the policy recorded"),
    ("eval", "reference.path", "or leave it unset for the one the policy recorded"),
])
def test_missing_checkpoint_path_names_the_key_and_the_fix(command, key, hint, tmp_path):
    msg = config_error(command, [f"{key}=/nonexistent/ckpt"], tmp_path)
    assert msg.startswith(f"{key}=/nonexistent/ckpt does not exist; ") and hint in msg
    # a relative path that cannot be a hub id (`org/name`) is a missing path too, not a hub lookup
    assert "does not exist" in config_error(command, [f"{key}=runs/rm/no-such-run"], tmp_path)


def test_model_name_or_path_missing(tmp_path):
    msg = config_error("train_rm", ["model=hf", "model.name_or_path=./no/such/model"], tmp_path)
    assert msg.startswith("model.name_or_path=./no/such/model does not exist; set it to a hub id")


def test_unfinished_run_dir_and_stale_pointer(tmp_path):
    run = tmp_path / "runs" / "rm" / "unfinished"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    msg = config_error("train_ppo", [f"reward_model.path={run}"], tmp_path)
    assert "holds no model" in msg and "a run that has not finished has no final/ yet" in msg
    pointer = tmp_path / "runs" / "latest_rm"
    pointer.write_text(str(tmp_path / "deleted" / "final") + "\n")
    msg = config_error("train_ppo", [f"reward_model.path={pointer}"], tmp_path)
    assert "names '" in msg and "which does not exist" in msg


def test_hub_ids_and_unused_paths_are_left_alone(tmp_path):
    validate("train_ppo", ["reward_model.path=some-org/some-rm"], tmp_path)  # the loader looks it up
    validate("train_ppo", ["reward.type=checker", "reward_model.path=/nonexistent"], tmp_path)  # not read


def test_reward_model_path_pointing_at_a_policy(saved_models, tmp_path):
    run = saved_models["policy_run"]
    for command in ("train_ppo", "eval"):
        msg = config_error(command, [f"reward_model.path={run}"], tmp_path)
        assert msg.startswith(f"reward_model.path={run} holds a causal LM (LlamaForCausalLM), not a reward model "
                              f"with a scalar head: set it to a `rlhf train-rm` run dir")


def test_policy_or_reference_pointing_at_a_reward_model(saved_models, tmp_path):
    rm = saved_models["rm"]
    for command, key in (("eval", "policy.path"), ("eval", "reference.path"), ("train_ppo", "reference.path")):
        msg = config_error(command, [f"{key}={rm}"], tmp_path)
        assert msg.startswith(f"{key}={rm} holds a reward model (LlamaForSequenceClassification), not a causal LM: ")
    validate("eval", [f"policy.path={saved_models['policy_run']}", f"reward_model.path={rm}"], tmp_path)


def test_cli_missing_reward_model_is_one_line_and_writes_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "train-ppo", "model=tiny", "reward_model.path=/nonexistent",
                          f"paths.root={tmp_path}"], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        "error: reward_model.path=/nonexistent does not exist; set it to a `rlhf train-rm` run dir, its final/ dir "
        f"or an HF reward-model dir, or leave it unset for {tmp_path / 'latest_rm'}"]
    assert not list((tmp_path / "ppo").glob("*/config.yaml"))  # no run was started


# ----------------------------------------------------------------------------------------------
# a reward model whose tokenizer is not the policy's


def _retokenized(tokenizer, how):
    """A copy of `tokenizer` with one more token (`extra_token`) or two token ids swapped (`swapped_ids`:
    same size, same texts, different ids for them)."""
    import tempfile

    from transformers import AutoTokenizer

    if how == "extra_token":
        tok = copy.deepcopy(tokenizer)
        tok.add_tokens(["<my_extra_token>"])
        return tok
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        spec = json.loads(open(os.path.join(d, "tokenizer.json")).read())
        vocab = spec["model"]["vocab"]
        vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
        open(os.path.join(d, "tokenizer.json"), "w").write(json.dumps(spec))
        tok = AutoTokenizer.from_pretrained(d)
    assert tok("hello world")["input_ids"] != tokenizer("hello world")["input_ids"]
    return tok


@pytest.mark.parametrize("how", ["extra_token", "swapped_ids"])
def test_reward_model_with_another_tokenizer_fails_before_training(how, run_stage, tiny_model_cfg, tokenizer, tmp_path):
    from rlhf_cli.models import load_scalar_model, save_hf

    rm_dir = tmp_path / "other_rm"
    save_hf(load_scalar_model(tiny_model_cfg, "fp32", 3), _retokenized(tokenizer, how), rm_dir)
    run_dir = tmp_path / "runs" / "ppo" / "run"
    with pytest.raises(ConfigError, match=r"uses a different tokenizer than the policy .*train the reward model from "
                                          r"the same base model"):
        run_stage("train_ppo", [*TINY_PPO, f"reward_model.path={rm_dir}"], run_dir=run_dir)
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "ds").exists()  # no step ran


def test_eval_with_a_reward_model_of_another_tokenizer_fails_before_sampling(saved_models, run_stage, tiny_model_cfg,
                                                                               tokenizer, tmp_path):
    from rlhf_cli.models import load_scalar_model, save_hf

    rm_dir = tmp_path / "other_rm"
    save_hf(load_scalar_model(tiny_model_cfg, "fp32", 3), _retokenized(tokenizer, "swapped_ids"), rm_dir)
    with pytest.raises(ConfigError, match=r"same tokens under different ids: \[\('hello'.*train the reward model"):
        run_stage("eval", [f"policy.path={saved_models['policy_run']}", f"reference.path={saved_models['policy_run']}",
                          f"reward_model.path={rm_dir}"])
