"""Advantage estimators (`core/estimators.py`, `core/groups.py`): one signature, each bound to its declaration in
`registry.ADVANTAGE_ESTIMATORS`, and each critic-free estimator against a hand-computed case and a loop reference,
including flat groups, groups of one and masked rows."""

import math

import pytest
import torch

from rlhf_cli import config, registry
from rlhf_cli.core import (
    ESTIMATORS,
    compute_gae,
    group_adjusted_scores,
    group_stats,
    informative_groups,
    kl_penalized_rewards,
    teacher_token_rewards,
)
from rlhf_cli.core.estimators import AdvantageEstimator

CRITIC_FREE = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def rollout(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 3, 1, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return rewards, values, mask


def call(name, rewards, mask, scores, groups, valid=None, values=None, gamma=1.0, lam=1.0):
    valid = torch.ones(len(scores), dtype=torch.bool) if valid is None else valid
    return ESTIMATORS[name](rewards, mask, scores=scores, groups=groups, valid=valid, values=values, gamma=gamma,
                            lam=lam)


def outcome_only(scores, lengths, T=5):
    """Rewards holding just the score at each row's last real token (`ppo.kl_in=loss`)."""
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    zeros = torch.zeros(len(lengths), T)
    return kl_penalized_rewards(scores, zeros, zeros, mask, 0.0), mask


def loop_reference(name, rewards, mask, scores, groups, valid, gamma, eps=1e-6):
    """The estimators' definition, one row and one token at a time."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        if not valid[i]:
            continue
        s = [float(scores[j]) for j in range(B) if groups[j] == groups[i] and valid[j]]
        n, si = len(s), float(scores[i])
        if name == "reinforce_pp":
            a = si
        elif n < 2 or max(s) == min(s):
            a = 0.0
        else:
            mean = sum(s) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in s) / (n - 1))
            a = {"grpo": (si - mean) / (std + eps), "dr_grpo": si - mean,
                 "rloo": si - (sum(s) - si) / (n - 1)}[name]
        L = int(mask[i].sum())
        r = [float(rewards[i, t]) for t in range(L)]
        if L:
            r[L - 1] += a - si
        g = 0.0
        for t in reversed(range(L)):
            g = r[t] + gamma * g
            adv[i, t] = g
    return adv


def test_each_estimator_carries_its_declaration():
    assert list(ESTIMATORS) == list(registry.ADVANTAGE_ESTIMATORS.names)
    assert all({**vars(e), "fn": None} == {**vars(registry.ADVANTAGE_ESTIMATORS[n]), "fn": None}
               for n, e in ESTIMATORS.items())
    assert config.PPOConfig().advantage_estimator == "gae"
    assert [n for n, e in ESTIMATORS.items() if not e.needs_critic] == [*CRITIC_FREE, "distill"]
    assert {n: e.min_group_size for n, e in ESTIMATORS.items()} == {"gae": 1, "grpo": 2, "dr_grpo": 2, "rloo": 2,
                                                                    "reinforce_pp": 1, "distill": 1}
    assert {n for n, e in ESTIMATORS.items() if e.whiten} == {"gae", "reinforce_pp"}


def test_gae_entry_is_compute_gae_and_needs_the_critic():
    rewards, values, mask = rollout()
    groups, scores = torch.arange(4), torch.zeros(4)
    adv, ret = call("gae", rewards, mask, scores, groups, values=values, gamma=0.9, lam=0.8)
    want_adv, want_ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)
    assert ESTIMATORS["gae"].needs_critic
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        call("gae", rewards, mask, scores, groups)


def test_hand_computed_group_of_three():
    """Scores [1, 0, 0] in one group, one [0.5] alone (a group of one gets 0 from every group baseline)."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5])
    rewards, mask = outcome_only(scores, [3, 2, 5, 4])
    groups = torch.tensor([7, 7, 7, 9])
    std = math.sqrt(1 / 3)  # unbiased: ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3
    want = {"grpo": [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 0.0],
            "dr_grpo": [2 / 3, -1 / 3, -1 / 3, 0.0],
            "rloo": [1.0, -0.5, -0.5, 0.0],
            "reinforce_pp": [1.0, 0.0, 0.0, 0.5]}
    for name, per_row in want.items():
        adv, ret = call(name, rewards, mask, scores, groups)
        assert torch.equal(adv, ret), name
        expected = torch.tensor(per_row)[:, None] * mask  # γ = 1, no KL: every real token gets the row's value
        torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("name", CRITIC_FREE)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_matches_the_loop_reference_with_kl_rewards_and_masked_rows(name, gamma):
    g = torch.Generator().manual_seed(3)
    B, T = 12, 6
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    scores = torch.randint(0, 3, (B,), generator=g).float()  # ties and flat groups happen
    scores[8:12] = 2.0  # one flat group
    lp, ref = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    rewards = kl_penalized_rewards(scores, lp, ref, mask, 0.1)
    groups = torch.arange(B) // 4 * 10 + 3
    valid = torch.ones(B, dtype=torch.bool)
    valid[[1, 6, 7]] = False  # masked (truncated) rows: group 1 keeps only 2 valid rows
    adv, _ = call(name, rewards, mask, scores, groups, valid, gamma=gamma)
    want = loop_reference(name, rewards, mask, scores, groups, valid, gamma)
    torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-6)
    assert adv[~valid].abs().sum() == 0 and adv[mask == 0].abs().sum() == 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_flat_group_gives_exactly_zero_even_when_the_mean_rounds(name):
    """0.1 three times: the float32 mean is not exactly 0.1, yet the advantages are exactly 0 (no eps blow-up)."""
    scores = torch.tensor([0.1, 0.1, 0.1])
    rewards, mask = outcome_only(scores, [2, 3, 1])
    adv, _ = call(name, rewards, mask, scores, torch.zeros(3, dtype=torch.long))
    assert torch.equal(adv, torch.zeros_like(adv))


def test_a_group_reduced_to_one_valid_row_gives_it_zero():
    scores = torch.tensor([1.0, 0.0])
    rewards, mask = outcome_only(scores, [2, 2])
    for name in ("grpo", "dr_grpo", "rloo"):
        adv, _ = call(name, rewards, mask, scores, torch.zeros(2, dtype=torch.long), torch.tensor([True, False]))
        assert torch.equal(adv, torch.zeros_like(adv)), name


def test_group_rows_need_not_be_adjacent_and_ids_are_arbitrary():
    scores = torch.tensor([1.0, 5.0, 0.0, 3.0])
    rewards, mask = outcome_only(scores, [1, 1, 1, 1], T=1)
    a, _ = call("rloo", rewards, mask, scores, torch.tensor([-4, 100, -4, 100]))
    assert a[:, 0].tolist() == [1.0, 2.0, -1.0, -2.0]


def test_group_stats_are_unbiased_and_flag_flat_and_single_groups():
    st = group_stats(torch.tensor([1.0, 3.0, 2.0, 2.0, 7.0]), torch.tensor([0, 0, 1, 1, 2]),
                     torch.ones(5, dtype=torch.bool))
    assert st["mean"].tolist() == [2.0, 2.0, 2.0, 2.0, 7.0]
    torch.testing.assert_close(st["std"], torch.tensor([math.sqrt(2), math.sqrt(2), 0.0, 0.0, 0.0]))
    assert st["flat"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0] and st["count"].tolist() == [2, 2, 2, 2, 1]
    with pytest.raises(ValueError, match="unknown group baseline"):
        group_adjusted_scores(torch.zeros(2), torch.zeros(2), torch.ones(2), "mean")
    with pytest.raises(ValueError, match=r"\(B,\) tensors of one shape"):
        group_stats(torch.zeros(2), torch.zeros(3), torch.ones(2))


def test_informative_groups_hand_computed():
    # DAPO eq. 11: group 0 mixed (kept); group 1 all correct, group 2 all wrong (dropped); group 3 mixed but one
    # of its rows invalid leaves one valid row (dropped); group 4 mixed with an invalid row among three (kept,
    # invalid row too); ids need not be adjacent
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 5.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 0])
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    kept = informative_groups(scores, groups, valid)
    assert kept.tolist() == [True, True, False, False, False, False, False, False, True, True, True, True]
    # kept exactly where a group baseline gives some row a non-zero adjusted score (the loop's rule)
    adjusted = group_adjusted_scores(scores, groups, valid, "dr_grpo")
    for g in groups.unique():
        rows = groups == g
        assert bool(kept[rows].all()) == bool((adjusted[rows] != 0).any())
        assert bool(kept[rows].any()) == bool(kept[rows].all())


def test_a_bound_estimator_is_called_through_the_one_signature():
    seen = {}

    def sum_to_go(rewards, mask, *, values, gamma, lam, **rest):
        seen.update(values=values, gamma=gamma, lam=lam, keys=sorted(rest))
        adv = (rewards * mask).flip(1).cumsum(1).flip(1) * mask
        return adv, adv

    estimator = AdvantageEstimator("sum_to_go", fn=sum_to_go)
    rewards, _, mask = rollout(1)
    adv, _ = estimator(rewards, mask, scores=torch.zeros(4), groups=torch.arange(4),
                       valid=torch.ones(4, dtype=torch.bool), values=None, gamma=1.0, lam=0.5)
    assert seen == {"values": None, "gamma": 1.0, "lam": 0.5, "keys": ["groups", "scores", "valid"]}
    assert torch.allclose(adv[1, 0], rewards[1, :3].sum()) and adv[1, 3:].abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# distill: on-policy distillation's per-token reverse KL (`reward.type=teacher`)


def test_teacher_token_rewards_are_the_masked_log_ratio_in_fp32():
    g = torch.Generator().manual_seed(5)
    teacher, student = torch.randn(3, 4, generator=g).bfloat16(), torch.randn(3, 4, generator=g).bfloat16()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).float()
    student[0, 3] = float("nan")  # padding holds garbage: it never reaches the output
    r = teacher_token_rewards(teacher, student, mask)
    assert r.dtype == torch.float32
    want = torch.zeros(3, 4)
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                want[b, t] = float(teacher[b, t]) - float(student[b, t])
    assert torch.equal(r, want)
    assert torch.equal(teacher_token_rewards(teacher, teacher, mask), torch.zeros(3, 4))


def test_distill_hand_computed():
    """Rewards log π_t − log π_s = [0.5, −1, 2] on a 3-token row, its score 0.25 at the last token, in a group with
    a row scored −0.25: every token keeps its own log-ratio (no discount) and gets the score's group-normalised
    advantage, (0.25 − 0) / (std 0.3536 + ε) = 0.7071; an invalid row and padding get 0; a group of one gets no
    score advantage."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]).float()
    scores = torch.tensor([0.25, -0.25, 3.0, 5.0])
    per_token = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.0, 0, 0, 0], [1.0, 1.0, 0.0, 0.0], [2.0, 0, 0, 0]])
    rewards = per_token + torch.tensor([[0, 0, 0.25, 0], [-0.25, 0, 0, 0], [0, 3.0, 0, 0], [5.0, 0, 0, 0]])
    valid = torch.tensor([True, True, False, True])
    adv, ret = call("distill", rewards, mask, scores, torch.tensor([0, 0, 1, 2]), valid, gamma=0.5, lam=0.5)
    assert torch.equal(adv, ret)
    a = 0.25 / (0.125 ** 0.5 + 1e-6)  # the unbiased std of (0.25, −0.25)
    want = torch.tensor([[0.5 + a, -1 + a, 2 + a, 0.0], [1 - a, 0, 0, 0], [0.0, 0, 0, 0], [2.0, 0, 0, 0]])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=1e-6)
    assert not ESTIMATORS["distill"].whiten and not ESTIMATORS["distill"].needs_critic


def test_distill_matches_the_loop_reference():
    """Teacher log-ratios plus −β·kl and the score at the last token, random lengths, groups of 3 and invalid rows:
    the loop gives each sampled token its own reward, the score taken off the last token and its GRPO advantage
    (over the group's valid rows) put on every token."""
    g = torch.Generator().manual_seed(11)
    B, T = 9, 7
    lengths = torch.randint(0, T + 1, (B,), generator=g)  # an empty row may occur
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    scores = torch.randn(B, generator=g)
    lp, ref, teacher = (torch.randn(B, T, generator=g) for _ in range(3))
    rewards = kl_penalized_rewards(scores, lp, ref, mask, 0.1) + teacher_token_rewards(teacher, lp, mask)
    valid = torch.rand(B, generator=g) > 0.3
    groups = torch.arange(B) // 3
    adv, _ = call("distill", rewards, mask, scores, groups, valid, gamma=0.9)
    want = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        mates = [float(scores[j]) for j in range(B) if groups[j] == groups[b] and valid[j]]
        m = sum(mates) / len(mates) if mates else 0.0
        sd = (sum((x - m) ** 2 for x in mates) / (len(mates) - 1)) ** 0.5 if len(mates) > 1 else 0.0
        adjusted = (float(scores[b]) - m) / (sd + 1e-6) if len(mates) > 1 and sd > 0 else 0.0
        for t in range(n if valid[b] else 0):
            kl = float(lp[b, t]) - float(ref[b, t])
            want[b, t] = float(teacher[b, t]) - float(lp[b, t]) - 0.1 * kl + adjusted
    torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-6)
