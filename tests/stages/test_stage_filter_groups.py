"""`ppo.filter_groups` (DAPO dynamic sampling, issue 42) in `rlhf train-ppo`, tiny random model, CPU.

Groups whose scores are all equal are dropped and further rounds of prompts are sampled until the batch holds
`ppo.rollout_batch_size` groups, for at most `ppo.filter_groups_max_rounds` extra rounds; at the bound the update
trains on what was kept, and with nothing kept the iteration trains nothing, says so and the run goes on. The
scores are scripted (`tr.maker.score_mixer` replaced) so that which groups are flat is known."""

import pytest
import torch
from stage_helpers import compose
from test_stage_ppo import build_trainer

from rlhf_cli.config import ConfigError
from rlhf_cli.core import group_stats
from rlhf_cli.preflight import VALIDATORS
from rlhf_cli.rollout.generation import join_rollout_batches

# 4 prompts × 4 samples = 16 completions, minibatches of 8
R, G = 4, 4
FILTER = [f"ppo.rollout_batch_size={R}", f"ppo.n_samples_per_prompt={G}", "ppo.mini_batch_size=8",
          "ppo.micro_batch_size=4", "ppo.advantage_estimator=grpo", "reward.type=checker", "ppo.filter_groups=true",
          "ppo.truncated=keep"]


def script_scores(tr, flat_groups_per_round):
    """Replace the run's rewards: in the r-th call (generation round) the groups whose position in the round is in
    `flat_groups_per_round[r]` score 0 on every row, the others 0, 1, 2, ... (they vary). Returns the calls' group
    ids."""
    calls = []

    def rewards(input_ids, attention_mask, P, prompts):
        r = len(calls)
        B = input_ids.shape[0]
        score = torch.arange(B, dtype=torch.float32) % G
        for g in flat_groups_per_round[r]:
            score[g * G:(g + 1) * G] = 0.0
        calls.append(B)
        return score.clone(), score, {}

    tr.maker.score_mixer = rewards
    return calls


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_flat_groups_are_dropped_and_refilled_from_a_new_round(tmp_path, monkeypatch, estimator):
    tr = build_trainer(tmp_path, [o for o in FILTER if "advantage_estimator" not in o]
                       + [f"ppo.advantage_estimator={estimator}"])
    calls = script_scores(tr, [[0, 1, 2], [1, 2, 3], []])  # round 0 keeps 1 group, round 1 one, round 2 all
    exp, stats, _ = tr.maker.make_experience(0)
    assert calls == [R * G] * 3
    assert stats["groups/extra_rounds"] == 2 and stats["groups/kept_frac"] == 1.0
    assert stats["groups/dropped_frac"] == pytest.approx(6 / 12)
    assert stats["groups/zero_var_frac"] == pytest.approx(3 / 4)  # the first round's, as without the filter
    # kept in round order: round 0's group 3, round 1's group 0 (id R + 0), round 2's first two (ids 2R, 2R + 1)
    assert exp.groups.tolist() == [g for g in (3, R, 2 * R, 2 * R + 1) for _ in range(G)]
    assert exp.input_ids.shape[0] == R * G
    assert group_stats(exp.scores, exp.groups, exp.loss_mask.sum(1) > 0)["flat"].sum() == 0
    assert (exp.advantages.abs().sum(1) > 0).all()  # every kept row learns
    steps = optimizer_steps(monkeypatch, tr)
    stats = tr.train_on(exp, 0)
    assert torch.isfinite(torch.tensor(stats["policy/loss"])) and steps == [False, True] * 2


def optimizer_steps(monkeypatch, tr):
    """Record, per micro-step of the actor, whether the optimizer stepped (an accumulation boundary)."""
    seen, real = [], tr.actor.step

    def step():
        seen.append(tr.actor.is_boundary())
        real()

    monkeypatch.setattr(tr.actor, "step", step)
    return seen


def test_at_the_bound_the_update_trains_on_whole_minibatches_of_what_was_kept(tmp_path, monkeypatch):
    # 3 groups kept; a minibatch is 8 completions = 2 groups: the update trains on the first 2 (one optimizer step)
    tr = build_trainer(tmp_path, [*FILTER, "ppo.filter_groups_max_rounds=1"])
    script_scores(tr, [[0], [0, 1, 2, 3]])
    exp, stats, _ = tr.maker.make_experience(0)
    assert stats["groups/extra_rounds"] == 1 and stats["groups/kept_frac"] == pytest.approx(2 / 4)
    assert stats["groups/dropped_frac"] == pytest.approx(5 / 8)
    assert exp.groups.tolist() == [g for g in (1, 2) for _ in range(G)]
    steps = optimizer_steps(monkeypatch, tr)
    tr.train_on(exp, 0)
    assert steps == [False, True]  # 2 micro-batches of 4, the optimizer steps after the second


def test_fewer_groups_than_a_minibatch_train_nothing(tmp_path, caplog):
    tr = build_trainer(tmp_path, [*FILTER, "ppo.filter_groups_max_rounds=1"])
    script_scores(tr, [[0, 2, 3], [0, 1, 2, 3]])  # 1 group kept, a minibatch needs 2
    with caplog.at_level("WARNING"):
        exp, stats, _ = tr.maker.make_experience(0)
    assert exp is None and stats["groups/kept_frac"] == 0.0
    said = [r.getMessage() for r in caplog.records if "trains nothing" in r.getMessage()]
    assert len(said) == 1 and "1 group(s) with varied scores kept, fewer than the 2 × ppo.n_samples_per_prompt=4" \
        in said[0]


def test_nothing_kept_skips_the_iteration_with_one_warning(tmp_path, caplog):
    tr = build_trainer(tmp_path, [*FILTER, "ppo.filter_groups_max_rounds=2"])
    script_scores(tr, [[0, 1, 2, 3]] * 3)
    with caplog.at_level("WARNING"):
        exp, stats, _ = tr.maker.make_experience(0)
    assert exp is None and stats["groups/dropped_frac"] == 1.0 and stats["groups/kept_frac"] == 0.0
    said = [r.getMessage() for r in caplog.records if "trains nothing" in r.getMessage()]
    assert said == ["iteration 1 trains nothing: every group sampled has equal scores in 3 round(s) "
                    "(ppo.filter_groups=true, ppo.filter_groups_max_rounds=2)"]


def test_a_run_whose_groups_are_all_flat_goes_on_and_finishes(run_stage):
    # the tiny random model's checker score is 0 everywhere: every group is flat, every iteration is skipped
    _, run_dir, _ = run_stage("train_ppo", [*FILTER, "ppo.iterations=2", "ppo.filter_groups_max_rounds=1"])
    assert (run_dir / "final" / "model.safetensors").is_file()
    text = (run_dir / "metrics.jsonl").read_text()
    assert '"groups/kept_frac": 0.0' in text and '"policy/loss"' not in text


def test_without_the_filter_nothing_changes(tmp_path):
    tr = build_trainer(tmp_path, [o for o in FILTER if "filter_groups" not in o])
    calls = script_scores(tr, [[0, 1, 2]])
    exp, stats, _ = tr.maker.make_experience(0)
    assert len(calls) == 1 and exp.input_ids.shape[0] == R * G and not any("dropped" in k for k in stats)
    assert exp.groups.tolist() == [g for g in range(R) for _ in range(G)]


def test_an_extra_round_takes_other_prompts_its_own_seeds_and_group_ids(tmp_path):
    tr = build_trainer(tmp_path, FILTER)
    p0, s0, g0 = tr.maker.prompt_batch(3)
    p1, s1, g1 = tr.maker.prompt_batch(3, 1)
    assert not {x["prompt_text"] for x in p0} & {x["prompt_text"] for x in p1}
    assert not set(s0) & set(s1) and g1.tolist() == [R + k for k in range(R) for _ in range(G)]
    assert tr.maker.prompt_batch(3, 1)[1] == s1  # seeded


@pytest.mark.parametrize("extra,needle", [
    (["ppo.advantage_estimator=gae"], "needs a critic-free estimator"),
    (["ppo.n_samples_per_prompt=1", "ppo.mini_batch_size=4"], "ppo.n_samples_per_prompt >= 2"),
    (["ppo.filter_groups_max_rounds=-1"], "ppo.filter_groups_max_rounds must be >= 0")])
def test_the_filter_is_refused_where_it_is_not_defined(extra, needle):
    cfg = compose("train_ppo", [*FILTER, *extra])
    with pytest.raises(ConfigError, match=needle):
        VALIDATORS["train_ppo"](cfg)


def test_join_rollout_batches_pads_and_trims():
    a = (torch.tensor([[0, 5, 6, 7, 0]]), torch.tensor([[0, 1, 1, 1, 0]]), 3)  # prompt [5, 6], response [7]
    b = (torch.tensor([[8, 9, 9, 0]]), torch.tensor([[1, 1, 1, 0]]), 1)  # prompt [8], response [9, 9]
    ids, am, P = join_rollout_batches([a, b], pad_id=0)
    assert P == 2
    assert ids.tolist() == [[5, 6, 7, 0], [0, 8, 9, 9]] and am.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]


def test_the_rounds_engine_logprobs_follow_their_rows_into_the_joined_batch(tmp_path, monkeypatch):
    """An engine's log-probs (vLLM's; synthetic here: a function of each response token) stay with their rows when
    the rounds are joined (prompt and response widths differ between rounds)."""
    tr = build_trainer(tmp_path, FILTER)
    script_scores(tr, [[0, 1, 2], [1, 2, 3], []])
    real = tr.maker.generate

    def with_engine_logprobs(prompts, seeds, push=True):
        episodes = real(prompts, seeds, push=push)
        P, mask = episodes.P, episodes.action_mask
        return episodes._replace(engine_logprobs=-(episodes.input_ids[:, P:] % 7 + 1).float() * mask)

    monkeypatch.setattr(tr.maker, "generate", with_engine_logprobs)
    exp, _, _ = tr.maker.make_experience(0)
    P, mask = exp.prompt_len, exp.attention_mask[:, exp.prompt_len:].float()
    assert exp.engine_logprobs.shape == mask.shape
    torch.testing.assert_close(exp.engine_logprobs, -(exp.input_ids[:, P:] % 7 + 1).float() * mask, rtol=0, atol=0)


def test_the_kl_controller_and_the_lr_schedule_count_what_was_trained(run_stage, monkeypatch):
    """Iteration 1 keeps all 4 groups (16 completions, 2 minibatches), 2 and 4 none (skipped), 3 two groups (8
    completions, 1 minibatch). The adaptive controller moves β by the episodes trained on (16, then 8: Ziegler et
    al.'s n_steps), not the rollout's 16; the warm-up counts the optimizer steps taken (2, then 1)."""
    import json

    import rlhf_cli.stages.ppo as ppo_stage

    flat = [[], [0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]

    class Scripted:
        def __init__(self, *args, **kwargs):
            self.calls = 0

        def __call__(self, input_ids, attention_mask, P, prompts):
            score = torch.arange(input_ids.shape[0], dtype=torch.float32) % G
            for g in flat[self.calls]:
                score[g * G:(g + 1) * G] = 0.0
            self.calls += 1
            return score.clone(), score, {}

    monkeypatch.setattr(ppo_stage, "ScoreMixer", Scripted)
    horizon, warmup, lr = 16, 10, 1e-4
    _, run_dir, cfg = run_stage("train_ppo", [*FILTER, "ppo.iterations=4", "ppo.filter_groups_max_rounds=0",
                                              "ppo.kl_target=1e-6", f"ppo.kl_horizon={horizon}",
                                              f"ppo.warmup_steps={warmup}", f"ppo.actor_lr={lr}", "ppo.epochs=1"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "objective/kl_beta" in r]
    assert [r["groups/kept_frac"] for r in rows] == [1.0, 0.0, 0.5, 0.0]
    beta = [r["objective/kl_beta"] for r in rows]  # β each rollout was shaped with

    def moved(b, kl, n):
        return b * (1 + max(-0.2, min(0.2, kl / 1e-6 - 1)) * n / horizon)

    assert beta[1] == pytest.approx(moved(beta[0], rows[0]["objective/kl"], 16), rel=1e-9)
    assert beta[2] == beta[1]  # the skipped iteration moves nothing
    assert beta[3] == pytest.approx(moved(beta[2], rows[2]["objective/kl"], 8), rel=1e-9)
    assert beta[3] != pytest.approx(moved(beta[2], rows[2]["objective/kl"], 16), rel=1e-9)
    # the LR after k optimizer steps is lr·(k + 1)/warmup: 2 steps, then 3
    assert rows[0]["lr/actor"] == pytest.approx(lr * 3 / warmup)
    assert "lr/actor" not in rows[1] and "lr/actor" not in rows[3]
    assert rows[2]["lr/actor"] == pytest.approx(lr * 4 / warmup)
