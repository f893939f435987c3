"""Critic-free estimators and reward functions in `rlhf train-ppo` (issue 18), tiny random model, CPU.

A critic-free run builds no critic and saves none; a user's reward function in a file is called with the
prompts' answers and its values (weighted, with the checker and the missing-EOS penalty) are the scores the
advantages are computed from; a function that returns ±inf or the wrong number of values stops the run with one
line naming it and the data row (None or NaN is an unscorable row: `test_unscorable.py`). Two ranks giving one
rank's group advantages: `tests/test_distributed.py`.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from stage_helpers import REPO, subprocess_env
from test_stage_ppo import build_trainer, snapshot

from rlhf_cli.data import checker
from rlhf_cli.models import has_value_head
from rlhf_cli.rewards import load_reward_function
from rlhf_cli.rollout import kl_stats

# 2 prompts × 4 samples = 8 completions, one minibatch
GROUPS = ["ppo.rollout_batch_size=2", "ppo.n_samples_per_prompt=4", "ppo.mini_batch_size=8"]

REWARD_FILE = '''
CALLS = []

def length_bonus(prompts, completions, answer, **kwargs):
    CALLS.append({"prompts": list(prompts), "completions": list(completions), "answer": list(answer)})
    return [len(c) / 10 + (0.5 if a is not None else 0.0) for c, a in zip(completions, answer)]
'''


def reward_file(tmp_path, body=REWARD_FILE):
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return path


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_critic_free_run_builds_no_critic_and_trains_the_policy(tmp_path, estimator):
    # the tiny model's checker score is 0 everywhere: a reward that varies within a group, so the update moves
    fn = f"reward.function={reward_file(tmp_path)}:length_bonus"
    tr = build_trainer(tmp_path, [*GROUPS, f"ppo.advantage_estimator={estimator}", "reward.type=function", fn])
    assert tr.critic is None and not has_value_head(tr.actor.module)
    before = snapshot(tr.actor.module)
    exp, roll_stats, _ = tr.maker.make_experience(0)
    assert torch.equal(exp.values, torch.zeros_like(exp.values))
    assert "val/explained_var" not in roll_stats and "groups/zero_var_frac" in roll_stats
    stats = tr.train_on(exp, 0)
    assert "val/loss" not in stats and not any(k.startswith("val/") for k in stats)
    moved = [k for k, v in tr.actor.module.state_dict().items() if not torch.equal(before[k], v)]
    assert moved, "one update moved no policy weight"


def test_critic_free_run_saves_the_policy_alone(run_stage):
    _, run_dir, _ = run_stage("train_ppo", [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=checker",
                                            "ppo.kl_in=loss", "ppo.kl_estimator=k3"])
    final = run_dir / "final"
    assert (final / "model.safetensors").is_file()
    assert not (final / "critic").exists() and not (final / "value_head.safetensors").exists()
    config = json.loads((final / "config.json").read_text())
    assert config["rlhf_advantage_estimator"] == "grpo"


def test_reward_function_gets_the_answers_and_its_values_are_the_scores(tmp_path):
    path = reward_file(tmp_path)
    spec = f"{path}:length_bonus"
    tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=function",
                                  f"reward.function={spec}", "reward.weights={function:2.0,checker:0.5}",
                                  "ppo.truncated=penalize", "ppo.missing_eos_penalty=1.0"])
    calls = load_reward_function(spec).__globals__["CALLS"]
    calls.clear()
    prompts, _, groups = tr.maker.prompt_batch(0)
    exp, stats, _ = tr.maker.make_experience(0)
    (call,) = calls
    assert call["answer"] == [x["answer"] for x in prompts] and None not in call["answer"]
    assert call["answer"][:4] == [call["answer"][0]] * 4  # a group: one prompt, four samples
    completions = call["completions"]
    P = exp.prompt_len
    assert completions == tr.tokenizer.batch_decode(exp.input_ids[:, P:], skip_special_tokens=True)
    fn = torch.tensor([len(c) / 10 + 0.5 for c in completions])
    chk = torch.tensor(checker(call["prompts"], completions, answer=call["answer"]), dtype=torch.float32)
    has_eos = torch.isin(exp.input_ids[:, P:], torch.tensor(tr.maker.eos_ids)).any(1).float()
    torch.testing.assert_close(exp.scores, 2.0 * fn + 0.5 * chk - 1.0 * (1 - has_eos))
    assert stats["reward/function"] == pytest.approx(fn.mean().item())
    # the scores reach the advantages: GRPO's (score − group mean) / group std, at every response token
    s = exp.scores.view(2, 4)
    want = ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)).flatten()
    first = exp.advantages[:, 0]
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("body", "needle"), [
    ("def f(prompts, completions, answer, **kw):\n    return [float('-inf')] + [1.0] * (len(completions) - 1)\n",
     "returned -inf for the completion of data row "),
    ("def f(prompts, completions, answer, **kw):\n    return [1.0] * (len(completions) - 1)\n",
     "values for 8 completions (data rows "),
])
def test_a_bad_reward_function_stops_the_run_with_one_line(tmp_path, body, needle):
    path = reward_file(tmp_path, body)
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "train-ppo", "experiment=smoke",
                          *GROUPS, "ppo.advantage_estimator=grpo", "reward.type=function", f"reward.function={path}:f",
                          f"paths.root={tmp_path / 'runs'}"],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: reward function {path}:f ") and needle in line, line
    assert not list((tmp_path / "runs").glob("ppo/*/final"))  # it never trained on the garbage


def test_the_readme_reward_function_example_loads_and_scores(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    (block,) = re.findall(r"```python\n(# my_rewards\.py.*?)```", readme, flags=re.S)
    path = tmp_path / "my_rewards.py"
    path.write_text(block)
    command = block.splitlines()[0].split(None, 2)[2]  # the run command the comment gives
    assert command.startswith("rlhf train-ppo reward.type=function reward.function=my_rewards.py:")
    fn = load_reward_function(f"{path}:{command.rsplit(':', 1)[1]}")
    prompts = ["What is 2 + 3?"] * 3
    assert fn(prompts, ["2 + 3 = 5.", "It is 6", "Five"], answer=[5, 5, None]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator, kl_estimator, precision", [
    ("grpo", "k3", "fp32"), ("rloo", "k2", "fp32"), ("grpo", "k3", "bf16-autocast"), ("grpo", "k3", "bf16")])
def test_an_on_policy_update_takes_the_old_logprobs_from_the_training_forward(tmp_path, estimator, kl_estimator,
                                                                               precision):
    """One epoch of one minibatch (the whole rollout), no critic, KL in the loss: the no-grad policy pass is
    skipped and the old log-probs are the training forward's own. The update, the log-probs written back and the
    rollout's KL statistics equal those of the run that computes the separate pass, in fp32, bf16-autocast and bf16."""
    fn = f"reward.function={reward_file(tmp_path)}:length_bonus"
    overrides = [*GROUPS, f"ppo.advantage_estimator={estimator}", "reward.type=function", fn, "ppo.kl_in=loss",
                 f"ppo.kl_estimator={kl_estimator}", "ppo.kl_beta=0.1", f"precision={precision}"]
    runs = {}
    for fused in (True, False):
        tr = build_trainer(tmp_path / str(fused), overrides)
        assert tr.on_policy
        tr.on_policy = fused
        before = snapshot(tr.actor.module)
        exp, roll_stats, _ = tr.maker.make_experience(0)
        if fused:
            assert (torch.equal(exp.old_logprobs, torch.zeros_like(exp.old_logprobs))
                    and "objective/kl" not in roll_stats)
        train_stats = tr.train_on(exp, 0)
        roll_stats.update(kl_stats(exp, tr.kl_ctl.value))
        runs[fused] = (exp.old_logprobs.clone(), roll_stats, train_stats, snapshot(tr.actor.module))
    (lp_f, roll_f, train_f, w_f), (lp_s, roll_s, train_s, w_s) = runs[True], runs[False]
    assert torch.allclose(lp_f, lp_s, atol=2e-5)
    for k in ("objective/kl", "objective/kl_k3", "objective/rlhf_reward", "objective/entropy_sampled",
              "objective/scores"):
        assert roll_f[k] == pytest.approx(roll_s[k], rel=1e-4, abs=1e-5), k
    assert train_f["policy/loss"] == pytest.approx(train_s["policy/loss"], rel=1e-4, abs=1e-6)
    assert train_f["policy/clipfrac"] == 0.0
    for k in w_f:
        assert torch.allclose(w_f[k], w_s[k], atol=1e-6), k
    assert any(not torch.equal(w_f[k], before[k]) for k in w_f), "the update moved no weight"


@pytest.mark.parametrize("extra,warned", [
    (["ppo.policy_loss=gspo", "ppo.dual_clip=3"], "ppo.policy_loss=gspo, ppo.dual_clip=3.0 change(s) nothing here"),
    (["ppo.clip_high=0.28"], "ppo.clip_high=0.28 change(s) nothing here"),
    ([], None), (["ppo.policy_loss=cispo", "ppo.epochs=2"], None)])
def test_a_policy_loss_or_clip_on_an_on_policy_update_says_once_that_it_changes_nothing(tmp_path, caplog, extra,
                                                                                       warned):
    with caplog.at_level("WARNING"):
        build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "ppo.kl_in=loss", "ppo.kl_estimator=k3",
                                 *extra])
    said = [r.getMessage() for r in caplog.records if "change(s) nothing here" in r.getMessage()]
    if warned is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(warned)


@pytest.mark.parametrize("overrides", [["ppo.epochs=2"], ["ppo.mini_batch_size=4"], ["ppo.kl_in=reward"],
                                       ["ppo.advantage_estimator=gae"]])
def test_an_update_that_is_not_on_policy_keeps_the_separate_pass(tmp_path, overrides):
    tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=checker", "ppo.kl_in=loss",
                                  "ppo.kl_estimator=k3", *overrides])
    assert not tr.on_policy
    exp, roll_stats, _ = tr.maker.make_experience(0)
    roll_stats.update(kl_stats(exp, tr.kl_ctl.value))
    assert "objective/kl" in roll_stats and not torch.equal(exp.old_logprobs, torch.zeros_like(exp.old_logprobs))


@pytest.mark.parametrize("on_policy", [True, False])
def test_max_kl_aborts_the_run_with_or_without_the_separate_pass(run_stage, tmp_path, on_policy):
    """Iteration 1 starts at the reference (KL 0); a later iteration's KL exceeds a tiny ppo.max_kl (iteration 2's
    k1 estimate may be below 0): the run stops with one line and status `aborted`, and that iteration's update is
    not saved (whether the KL came before the update or from its forward)."""
    from rlhf_cli.config import ConfigError

    fn = f"reward.function={reward_file(tmp_path)}:length_bonus"  # varies within a group: the policy moves
    overrides = [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=function", fn, "ppo.kl_in=loss",
                 "ppo.kl_estimator=k3", "ppo.iterations=3", "ppo.max_kl=1e-9", "ppo.actor_lr=1e-3"]
    if not on_policy:
        overrides.append("ppo.epochs=2")
    with pytest.raises(ConfigError, match=r"^aborting at iteration [23]: KL to the reference is .* nats/sequence > "
                                          r"ppo.max_kl=1e-09$"):
        run_stage("train_ppo", overrides)
    (run_dir,) = (tmp_path / "runs" / "ppo").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "aborted" and status["reason"].startswith("aborting at iteration ")
    assert not (run_dir / "final").exists() and not (run_dir / "ds").exists()  # no iteration was saved
