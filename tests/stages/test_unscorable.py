"""Rows no reward source can score (issue 58, step 1), tiny random model, CPU.

A reward function may return None or NaN for a completion. That row gets advantage 0 and no weight in the loss,
is left out of group baselines, whitening and every reward statistic, and is counted in `reward/unscorable_frac`;
a group with fewer than two scored rows is flat (advantages 0 from the score); no NaN reaches an advantage, a
loss, a gradient or a logged number; a round with more than `reward.max_unscorable_frac` unscored stops the run.
The rule is TRL's (trl #5749, #5773): reward 0 instead would push the policy away from answers a verifier could
not read.
"""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from stage_helpers import compose
from test_stage_critic_free import GROUPS, reward_file
from test_stage_ppo import build_trainer

from rlhf_cli.core import ESTIMATORS, policy_eval_stats
from rlhf_cli.errors import RewardError
from rlhf_cli.rewards import call_reward_function
from rlhf_cli.rollout.scores import unscored_rows
from rlhf_cli.rollout.shaping import shape
from rlhf_cli.rollout.stats import scored_means

# rows 0, 4, 5 and 6 of the 2 × 4 completions are unscorable: group 0 keeps 3 scored rows, group 1 only one
UNSCORED = [0, 4, 5, 6]
PARTLY = '''
def f(prompts, completions, answer, **kwargs):
    out = [len(c) / 10 + 0.1 * i for i, c in enumerate(completions)]
    out[0], out[4], out[5], out[6] = None, float("nan"), None, float("nan")
    return out
'''


def test_a_reward_function_may_return_none_or_nan_but_not_inf():
    fn = lambda prompts, completions, answer: [1.0, None, float("nan"), 2]  # noqa: E731
    got = call_reward_function(fn, "m:f", ["p"] * 4, ["a", "b", "c", "d"], [None] * 4, [1, 2, 3, 4])
    assert got.dtype == torch.float32 and got[[0, 3]].tolist() == [1.0, 2.0] and got[1:3].isnan().all()
    with pytest.raises(RewardError, match=r"returned inf for the completion of data row 2 .*or None for one"):
        call_reward_function(lambda *a, **k: [1.0, math.inf], "m:f", ["p"] * 2, ["a", "b"], [None] * 2, [1, 2])
    with pytest.raises(RewardError, match="not a list of 2 floats"):
        call_reward_function(lambda *a, **k: [1.0, "x"], "m:f", ["p"] * 2, ["a", "b"], [None] * 2, [1, 2])


def test_unscored_rows_zeroes_them_and_the_stop_rule_counts_the_round():
    cfg = SimpleNamespace(reward=SimpleNamespace(max_unscorable_frac=0.5, type="function",
                                                 weights={"function": None}))
    raw = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    score = torch.tensor([0.5, float("nan"), 1.5, float("nan")])  # a normalised source may lose a row too
    r, s, scored = unscored_rows(cfg, 0, raw, score)
    assert scored.tolist() == [True, False, True, False]
    assert r.tolist() == [1.0, 0.0, 3.0, 0.0] and s.tolist() == [0.5, 0.0, 1.5, 0.0]  # exactly half: allowed
    cfg.reward.max_unscorable_frac = 0.25
    with pytest.raises(RewardError, match=r"^iteration 3: 2 of 4 completions \(50%\) could not be scored \(reward "
                                          r"function returned None or NaN\), more than reward.max_unscorable_frac="
                                          r"0.25"):
        unscored_rows(cfg, 2, raw, score)


def test_scored_means_leave_unscored_rows_out_and_give_nothing_for_none():
    x = torch.tensor([1.0, 100.0, 3.0])
    assert scored_means({"a": x}, torch.tensor([True, False, True])) == {"a": 2.0}
    assert scored_means({"a": x}, torch.zeros(3, dtype=torch.bool)) == {}
    y = torch.randn(5)  # every row scored: the plain float32 mean, bit for bit
    assert scored_means({"a": y}, torch.ones(5, dtype=torch.bool))["a"] == y.mean().item()


@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_an_unscored_row_learns_nothing_and_changes_no_other_row(name, whiten):
    """shape() with two unscored rows equals shape() on the batch without them, and gives them advantage 0."""
    g = torch.Generator().manual_seed(0)
    B, R = 8, 5
    est = ESTIMATORS[name]
    p = SimpleNamespace(kl_in="reward", kl_estimator="k1", gamma=1.0, lam=0.95)
    action_mask = torch.ones(B, R)
    action_mask[1, 3:] = 0  # a shorter response
    old, ref = torch.randn(B, R, generator=g) * action_mask, torch.randn(B, R, generator=g) * action_mask
    values = torch.randn(B, R, generator=g) if est.needs_critic else None
    groups = torch.arange(B) // 4
    valid = torch.ones(B, dtype=torch.bool)
    valid[[2, 5]] = False  # unscored: their score is 0 (`unscored_rows`)
    score = torch.randn(B, generator=g) * valid
    kept = valid.nonzero().flatten()

    def run(rows):
        return shape(p, est, whiten, 0.1, score=score[rows], old_logprobs=old[rows], ref_logprobs=ref[rows],
                     values=None if values is None else values[rows], action_mask=action_mask[rows],
                     loss_mask=action_mask[rows] * valid[rows].float()[:, None], valid=valid[rows],
                     groups=groups[rows])

    _, adv, ret = run(torch.arange(B))
    _, adv_kept, _ = run(kept)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.equal(adv[~valid], torch.zeros_like(adv[~valid]))
    torch.testing.assert_close(adv[kept], adv_kept, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_unscorable_rows_in_a_run_get_no_advantage_no_weight_and_no_nan(tmp_path, estimator):
    # the score alone in the advantage: a flat group's is 0
    kl = ["ppo.kl_in=loss", "ppo.kl_estimator=k3"] if estimator != "gae" else []
    tr = build_trainer(tmp_path, [*GROUPS, f"ppo.advantage_estimator={estimator}", *kl, "reward.type=function",
                                  f"reward.function={reward_file(tmp_path, PARTLY)}:f"])
    exp, stats, samples = tr.maker.make_experience(0)
    unscored = torch.zeros(8, dtype=torch.bool)
    unscored[UNSCORED] = True
    assert torch.equal(exp.scored, ~unscored)
    assert exp.loss_mask[unscored].sum() == 0 and exp.loss_mask[~unscored].sum() > 0
    assert torch.equal(exp.advantages[unscored], torch.zeros_like(exp.advantages[unscored]))
    for name in ("advantages", "returns", "rewards", "scores", "values", "old_logprobs", "ref_logprobs"):
        assert torch.isfinite(getattr(exp, name)).all(), name
    completions = tr.tokenizer.batch_decode(exp.input_ids[:, exp.prompt_len:], skip_special_tokens=True)
    fn = torch.tensor([len(c) / 10 + 0.1 * i for i, c in enumerate(completions)])
    assert stats["reward/unscorable_frac"] == 0.5
    assert stats["reward/function"] == pytest.approx(fn[~unscored].mean().item())
    assert stats["objective/scores"] == pytest.approx(fn[~unscored].mean().item())
    assert samples["scores"][0] is None
    if estimator != "gae":
        assert stats["groups/zero_var_frac"] == 0.5  # group 1 has one scored row: no baseline
        assert torch.equal(exp.advantages[7], torch.zeros_like(exp.advantages[7])) or estimator == "reinforce_pp"
    train = tr.train_on(exp, 0)
    assert all(math.isfinite(v) for v in {**stats, **train}.values() if isinstance(v, float)), {**stats, **train}
    for name, param in tr.actor.module.named_parameters():
        assert param.grad is None or torch.isfinite(param.grad).all(), name
        assert torch.isfinite(param).all(), name


def test_too_many_unscorable_rows_stop_the_run_and_a_limit_of_one_trains_nothing(tmp_path):
    body = "def f(prompts, completions, answer, **kwargs):\n    return [None] * len(completions)\n"
    spec = f"reward.function={reward_file(tmp_path, body)}:f"
    tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=function", spec])
    with pytest.raises(RewardError, match=r"iteration 1: 8 of 8 completions \(100%\) could not be scored"):
        tr.maker.make_experience(0)
    tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=function", spec,
                                  "reward.max_unscorable_frac=1"])
    exp, stats, _ = tr.maker.make_experience(0)
    assert exp.loss_mask.sum() == 0 and stats["reward/unscorable_frac"] == 1.0
    assert "objective/scores" not in stats and "reward/function" not in stats  # no number rather than NaN
    assert all(math.isfinite(v) for v in stats.values())


def test_filter_groups_takes_unscored_rows_as_invalid(tmp_path):
    tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=function",
                                  f"reward.function={reward_file(tmp_path, PARTLY)}:f", "ppo.filter_groups=true",
                                  "ppo.filter_groups_max_rounds=1", "ppo.mini_batch_size=4"])
    exp, stats, _ = tr.maker.make_experience(0)
    # group 1 of each round has one scored row: flat, dropped; group 0 of each round is kept (its scores vary)
    assert stats["groups/dropped_frac"] == 0.5
    assert exp is not None and exp.scored.tolist() == [False, True, True, True] * (exp.scores.shape[0] // 4)


@pytest.mark.parametrize("key", ["function", "score"])
def test_eval_figures_leave_unscored_completions_out(key):
    side = {"length": torch.ones(4), "eos": torch.ones(4), "kl_k1": torch.zeros(4), "kl_k3": torch.zeros(4)}
    nan = float("nan")
    policy = {**side, key: torch.tensor([1.0, nan, 3.0, 5.0])}
    reference = {**side, key: torch.tensor([0.0, 1.0, nan, 6.0])}
    r = policy_eval_stats(policy, reference)
    assert r[f"policy/{key}_mean"] == 3.0 and r[f"policy/{key}_unscorable"] == 1
    assert r[f"reference/{key}_mean"] == pytest.approx(7 / 3) and r[f"reference/{key}_unscorable"] == 1
    gain = "function_gain" if key == "function" else "score_gain"
    assert r[gain] == 0.0  # prompts 0 (+1) and 3 (−1), the two both sides were scored on
    if key == "score":
        assert r["win_rate"] == 0.5 and r["win_rate_ci95_low"] > 0.0  # one win, one loss, of 2
    assert all(not (isinstance(v, float) and math.isnan(v)) for k, v in r.items() if "ci95" not in k)
    clean = policy_eval_stats({**side, key: torch.ones(4)}, {**side, key: torch.zeros(4)})
    assert f"policy/{key}_unscorable" not in clean  # counted only when there are any


def test_group_figures_leave_a_group_without_scored_rows_out():
    from rlhf_cli.rollout.maker import group_metrics

    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0])  # group 1: every row unscorable (score 0)
    groups = torch.arange(8) // 4
    valid = torch.tensor([True] * 4 + [False] * 4)
    got = group_metrics(scores, groups, valid)
    assert got["groups/score_mean"] == 2.5 and got["groups/zero_var_frac"] == 0.5
    assert got["groups/score_std"] == pytest.approx(torch.tensor([1.0, 2, 3, 4]).std().item())
    assert group_metrics(scores, groups, torch.zeros(8, dtype=torch.bool)) == {"groups/zero_var_frac": 1.0}


def test_a_reward_model_nan_is_a_fault_and_a_weight_zero_source_changes_no_score(tmp_path, monkeypatch):
    import rlhf_cli.rollout.scores as scores_module

    half = "def f(prompts, completions, answer, **kw):\n    return [None, *([1.0] * (len(completions) - 1))]\n"
    fn = f"reward.function={reward_file(tmp_path, half)}:f"
    tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", fn,
                                  "reward.weights={checker:1.0,function:0.0}", "ppo.missing_eos_penalty=0"])
    exp, stats, _ = tr.maker.make_experience(0)
    assert exp.scored.all() and stats["reward/unscorable_frac"] == 0.0  # the weight-0 function's None: scored
    assert stats["reward/function"] == 1.0  # its own mean leaves its None out
    class FakeRewardModel:  # `engine.FrozenModel`'s interface; its scores come from the patched forward
        @contextlib.contextmanager
        def on_device(self):
            yield None

    monkeypatch.setattr(scores_module, "batched_scores", lambda *a, **k: torch.tensor([float("nan")] + [0.0] * 7))
    mixer = scores_module.ScoreMixer(compose("train_ppo", ["model=tiny", "reward.type=model"]), tr.tokenizer,
                                     FakeRewardModel(), None, 2, "fp32", normalize=False)
    with pytest.raises(RewardError, match=r"the reward model scored NaN for 1 completions"):
        mixer(exp.input_ids, exp.attention_mask, exp.prompt_len, [{}] * 8)


def test_columns_reach_a_function_that_takes_them_and_never_clash_with_its_positional_names():
    cols = [{"prompt": "p1", "level": 1}, {"prompt": "p2", "level": None}]

    def positional(prompt, completion, answer=None):  # a column `prompt`: not passed again
        return [1.0] * len(completion)

    def wants_level(prompts, completions, answer, level):
        return [float(v or 0) for v in level]

    def takes_all(prompts, completions, answer, **kwargs):
        return [float(len(kwargs))] * len(completions)

    args = (["p1", "p2"], ["a", "b"], [None, None], [1, 2], cols)
    assert call_reward_function(positional, "m:f", *args).tolist() == [1.0, 1.0]
    assert call_reward_function(wants_level, "m:f", *args).tolist() == [1.0, 0.0]
    assert call_reward_function(takes_all, "m:f", *args).tolist() == [2.0, 2.0]  # prompt and level
