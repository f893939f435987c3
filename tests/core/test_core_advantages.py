"""rlhf_cli.core.advantages against plain-Python references, hand-computed cases and properties."""

import math

import pytest
import torch
from core_helpers import right_padded_mask, with_garbage
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_cli.core import (
    compute_gae,
    compute_gae_vectorized,
    discounted_returns,
    kl_estimate,
    kl_penalized_rewards,
    overlong_penalty,
)

PROPERTY = settings(max_examples=30, deadline=None)
GARBAGE = [1e6, -1e6, math.inf, -math.inf, math.nan]
SHAPES = [(1, 1), (2, 5), (4, 7), (3, 16)]
GAE_FNS = [compute_gae, compute_gae_vectorized]


# ---------------------------------------------------------------- plain-Python references


def ref_gae(rewards, values, mask, gamma, lam):
    """CleanRL-style reverse loop on Python floats, one row at a time (right-padded rows)."""
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask):
        n, T = sum(m), len(m)
        adv = [0.0] * T
        last = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_value - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        advantages.append(adv)
        returns.append([adv[t] + v[t] if t < n else 0.0 for t in range(T)])
    return advantages, returns


def ref_kl_rewards(scores, lp, ref_lp, mask, beta, estimator):
    out = []
    for s, a_row, b_row, m in zip(scores, lp, ref_lp, mask):
        n = sum(m)
        row = []
        for t, (a, b) in enumerate(zip(a_row, b_row)):
            if t >= n:
                row.append(0.0)
                continue
            log_r = b - a
            kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r}[estimator]
            row.append(-beta * kl + (s if t == n - 1 else 0.0))
        out.append(row)
    return out


def rand_batch(seed, B, T, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen, dtype=dtype)
    values = torch.randn(B, T, generator=gen, dtype=dtype)
    return rewards, values, right_padded_mask(gen, B, T)


# ---------------------------------------------------------------- compute_gae


@pytest.mark.parametrize("fn", GAE_FNS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.0, 0.5)])
def test_gae_matches_reference(fn, B, T, gamma, lam):
    rewards, values, mask = rand_batch(B * 31 + T, B, T)
    adv, ret = fn(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.int().tolist(), gamma, lam)
    assert adv.dtype == torch.float64 and adv.shape == (B, T)
    assert torch.allclose(adv, torch.tensor(ref_adv, dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor(ref_ret, dtype=torch.float64))


@pytest.mark.parametrize("fn", GAE_FNS)
def test_gae_hand_computed(fn):
    # delta = [0 + .5 - .5, 0 + .5 - .5, 1 + 0 - .5] = [0, 0, .5]; A_2 = .5, A_1 = .25, A_0 = .125
    rewards = torch.tensor([[0.0, 0.0, 1.0, 123.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, math.nan]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = fn(rewards, values, mask, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.125, 0.25, 0.5, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.625, 0.75, 1.0, 0.0]]))


def test_gae_vectorized_equals_loop_at_T1024():
    gen = torch.Generator().manual_seed(0)
    B, T = 8, 1024
    mask = right_padded_mask(gen, B, T)
    values = torch.randn(B, T, generator=gen)
    rewards = torch.randn(B, T, generator=gen) * 0.05  # -beta * KL per token
    for gamma, lam in [(1.0, 0.95), (1.0, 1.0), (0.99, 0.95)]:
        loop = compute_gae(rewards, values, mask, gamma, lam)
        vec = compute_gae_vectorized(rewards, values, mask, gamma, lam)
        for a, b in zip(loop, vec):
            assert (a - b).abs().max().item() < 1e-5


def test_gae_vectorized_equals_loop_with_left_padding():
    rewards, values, mask = rand_batch(5, 4, 9)
    left = mask.flip(1)
    for a, b in zip(
        compute_gae(rewards, values, left, 0.9, 0.9), compute_gae_vectorized(rewards, values, left, 0.9, 0.9)
    ):
        assert torch.allclose(a, b)


@pytest.mark.parametrize("fn", GAE_FNS + [lambda r, v, m, gamma, lam: discounted_returns(r, m, gamma)])
def test_gae_rejects_bad_gamma_lambda_and_shapes(fn):
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        fn(r, r, r, 1.5, 0.9)
    with pytest.raises(ValueError, match="shape mismatch"):
        fn(r, r, torch.ones(2, 4), 1.0, 0.9)


# ---------------------------------------------------------------- discounted_returns


@pytest.mark.parametrize("B,T", SHAPES)
def test_discounted_returns_matches_reference(B, T):
    rewards, _, mask = rand_batch(B + T, B, T)
    got = discounted_returns(rewards, mask, 0.9)
    for b in range(B):
        n = int(mask[b].sum())
        for t in range(T):
            expected = sum(0.9 ** (s - t) * rewards[b, s].item() for s in range(t, n)) if t < n else 0.0
            assert got[b, t].item() == pytest.approx(expected, abs=1e-12)


def test_discounted_returns_hand_computed():
    rewards = torch.tensor([[1.0, 1.0, 1.0, math.inf]])
    mask = torch.tensor([[True, True, True, False]])
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), torch.tensor([[1.75, 1.5, 1.0, 0.0]]))


# ---------------------------------------------------------------- kl_penalized_rewards


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("B,T", SHAPES)
def test_kl_penalized_rewards_matches_reference(estimator, B, T):
    gen = torch.Generator().manual_seed(B * 13 + T)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    mask = right_padded_mask(gen, B, T)
    got = kl_penalized_rewards(scores, lp, ref, mask, 0.1, estimator)
    expected = ref_kl_rewards(scores.tolist(), lp.tolist(), ref.tolist(), mask.int().tolist(), 0.1, estimator)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64))


def test_kl_penalized_rewards_hand_computed():
    scores = torch.tensor([2.0, 5.0, 7.0])
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 9.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -1.0, -9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    got = kl_penalized_rewards(scores, lp, ref, mask, kl_beta=0.5)
    # k1 = lp - ref: row 0 [0.5, -1, 0] -> [-0.25, 0.5, 0 + 2]; row 1 [0, 0] -> score on t=1; row 2 empty
    assert torch.allclose(got, torch.tensor([[-0.25, 0.5, 2.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0]]))


def test_kl_penalized_rewards_scores_shape_checked():
    with pytest.raises(ValueError, match="scores"):
        kl_penalized_rewards(torch.zeros(3), torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), 0.1)


# ---------------------------------------------------------------- properties


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 12), gamma=st.floats(0.0, 1.0))
def test_lambda_zero_gives_td_residual(seed, B, T, gamma):
    rewards, values, mask = rand_batch(seed, B, T)
    next_values = torch.where(mask, values, 0.0).roll(-1, dims=1)
    next_values[:, -1] = 0.0
    delta = torch.where(mask, rewards + gamma * next_values - values, 0.0)
    for fn in GAE_FNS:
        adv, _ = fn(rewards, values, mask, gamma, 0.0)
        assert torch.allclose(adv, delta)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 12))
def test_lambda_one_gamma_one_zero_values_gives_rewards_to_go(seed, B, T):
    rewards, _, mask = rand_batch(seed, B, T)
    to_go = torch.where(mask, rewards, 0.0).flip(1).cumsum(1).flip(1)
    to_go = torch.where(mask, to_go, 0.0)
    for fn in GAE_FNS:
        adv, ret = fn(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
        assert torch.allclose(adv, to_go) and torch.allclose(ret, to_go)
    assert torch.allclose(discounted_returns(rewards, mask, 1.0), to_go)


@PROPERTY
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    value=st.sampled_from(GARBAGE),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_padding_garbage_changes_no_output(seed, B, T, value, gamma, lam):
    rewards, values, mask = rand_batch(seed, B, T, dtype=torch.float32)
    dirty_r, dirty_v = with_garbage(rewards, mask, value), with_garbage(values, mask, value)
    for fn in GAE_FNS:
        for clean, dirty in zip(fn(rewards, values, mask, gamma, lam), fn(dirty_r, dirty_v, mask, gamma, lam)):
            assert torch.equal(clean, dirty)
    assert torch.equal(discounted_returns(rewards, mask, gamma), discounted_returns(dirty_r, mask, gamma))
    scores = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    for estimator in ("k1", "k2", "k3"):
        clean = kl_penalized_rewards(scores, rewards, values, mask, 0.05, estimator)
        dirty = kl_penalized_rewards(scores, dirty_r, dirty_v, mask, 0.05, estimator)
        assert torch.equal(clean, dirty) and (clean[~mask] == 0).all()
    # and no NaN reaches the gradient of the real values
    leaf = dirty_v.clone().requires_grad_(True)
    compute_gae_vectorized(rewards, leaf, mask, gamma, lam)[0].sum().backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[~mask] == 0).all()


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 10))
def test_bf16_inputs_within_tolerance_of_fp32(seed, B, T):
    rewards, values, mask = rand_batch(seed, B, T, dtype=torch.float32)
    for fn in GAE_FNS:
        for low, high in zip(
            fn(rewards.bfloat16(), values.bfloat16(), mask, 1.0, 0.95), fn(rewards, values, mask, 1.0, 0.95)
        ):
            assert low.dtype == torch.float32
            assert torch.allclose(low, high, rtol=2e-2, atol=5e-2)
    scores = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    low = kl_penalized_rewards(scores.bfloat16(), rewards.bfloat16(), values.bfloat16(), mask, 0.1, "k3")
    high = kl_penalized_rewards(scores, rewards, values, mask, 0.1, "k3")
    assert low.dtype == torch.float32 and torch.allclose(low, high, rtol=5e-2, atol=5e-2)


def test_kl_penalized_rewards_uses_kl_estimate():
    """The per-token penalty is exactly -beta * kl_estimate on real tokens (no second KL formula)."""
    rewards, values, mask = rand_batch(3, 3, 6)
    got = kl_penalized_rewards(torch.zeros(3, dtype=torch.float64), rewards, values, mask, 0.2, "k2")
    assert torch.allclose(got, -0.2 * kl_estimate(rewards, values, "k2", mask=mask))


# ---------------------------------------------------------------- overlong_penalty


def test_overlong_penalty_hand_computed():
    # L_max = 16, L_cache = 4: no penalty up to 12 tokens, then -1/4 per token, -1 at 16
    lengths = torch.tensor([1, 10, 12, 13, 15, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, 0.0, -0.25, -0.75, -1.0]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, 0.0, -0.125, -0.375, -0.5]
    assert overlong_penalty(lengths, 16, 0, 1.0).tolist() == [0.0] * 6  # no buffer: off
    assert overlong_penalty(lengths, 16, 16, 2.0).tolist() == [-0.125, -1.25, -1.5, -1.625, -1.875, -2.0]
    assert overlong_penalty(torch.tensor([20.0]), 16, 4, 1.0).tolist() == [-1.0]  # past L_max: -1 (eq. 13)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), max_new=st.integers(1, 40), data=st.data())
def test_overlong_penalty_matches_reference(seed, max_new, data):
    buffer = data.draw(st.integers(0, max_new))
    penalty = data.draw(st.floats(0, 3))
    lengths = torch.randint(0, max_new + 1, (8,), generator=torch.Generator().manual_seed(seed))
    got = overlong_penalty(lengths, max_new, buffer, penalty)
    for n, g in zip(lengths.tolist(), got.tolist()):
        if buffer == 0 or n <= max_new - buffer:
            want = 0.0
        else:
            want = penalty * max(-1.0, ((max_new - buffer) - n) / buffer)
        assert g == pytest.approx(want, abs=1e-6)
    assert got.dtype == torch.float32


def test_overlong_penalty_rejects_bad_arguments():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 4, 5, 1.0)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(torch.tensor([1]), 4, 2, -1.0)


# ---------------------------------------------------------------- masks with gaps (multi-turn episodes)


def gapped_mask(gen, B, T):
    """Rows `1…1 0…0 1…1 … 0…0`: sampled runs separated by tool/environment gaps, then right padding."""
    mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        t = 0
        while t < T:
            run = int(torch.randint(1, 4, (1,), generator=gen))
            mask[b, t:t + run] = 1
            t += run + int(torch.randint(0, 4, (1,), generator=gen))
        mask[b, int(torch.randint(1, T + 1, (1,), generator=gen)):] = 0
    return mask


def compacted_reference(fn_ref, rewards, values, mask, *args):
    """The plain-Python loop over each row's sampled tokens only (the gaps taken out), spread back."""
    adv_out, ret_out = [], []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.int().tolist()):
        keep = [t for t, x in enumerate(m) if x]
        a, ret = fn_ref([[r[t] for t in keep]], [[v[t] for t in keep]], [[1] * len(keep)], *args)
        row_a, row_r = [0.0] * len(m), [0.0] * len(m)
        for i, t in enumerate(keep):
            row_a[t], row_r[t] = a[0][i], ret[0][i]
        adv_out.append(row_a)
        ret_out.append(row_r)
    return torch.tensor(adv_out, dtype=torch.float64), torch.tensor(ret_out, dtype=torch.float64)


@pytest.mark.parametrize("fn", GAE_FNS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_with_gaps_runs_over_the_sampled_tokens_only(fn, gamma, lam):
    gen = torch.Generator().manual_seed(7)
    B, T = 6, 23
    mask = gapped_mask(gen, B, T)
    assert any((row[1:] > row[:-1]).any() for row in mask)  # some row has a gap followed by sampled tokens
    rewards = with_garbage(torch.randn(B, T, generator=gen, dtype=torch.float64), mask.bool(), math.nan)
    values = with_garbage(torch.randn(B, T, generator=gen, dtype=torch.float64), mask.bool(), math.inf)
    adv, ret = fn(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = compacted_reference(ref_gae, torch.where(mask.bool(), rewards, 0.0),
                                           torch.where(mask.bool(), values, 0.0), mask, gamma, lam)
    assert torch.allclose(adv, ref_adv) and torch.allclose(ret, ref_ret)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_discounted_returns_and_last_token_with_gaps():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0, 0]])
    rewards = torch.tensor([[1.0, 2.0, 99.0, 99.0, 3.0, 99.0, 4.0, 99.0, 99.0]])
    got = discounted_returns(rewards, mask, 0.5)
    # sampled tokens [1, 2, 3, 4]: G = [1 + .5*2 + .25*3 + .125*4, 2 + .5*3 + .25*4, 3 + .5*4, 4]
    expected = torch.tensor([[3.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    expected[0, [1, 4, 6]] = torch.tensor([4.5, 5.0, 4.0])
    assert torch.allclose(got, expected)
    shaped = kl_penalized_rewards(torch.tensor([10.0]), torch.zeros(1, 9), torch.zeros(1, 9), mask, 0.1)
    assert shaped[0, 6].item() == 10.0 and shaped.sum().item() == 10.0  # the score at the last sampled token


@pytest.mark.parametrize("fn", GAE_FNS)
def test_gae_without_gaps_is_bitwise_unchanged(fn):
    """A right-padded mask: the compaction is the identity, so the values are those of the plain recursion."""
    rewards, values, mask = rand_batch(3, 5, 12, dtype=torch.float32)
    adv, ret = fn(rewards, values, mask, 0.99, 0.95)
    deltas_loop = []
    m = mask.bool()
    r, v = torch.where(m, rewards, 0.0), torch.where(m, values, 0.0)
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))
    d = torch.where(m, r + 0.99 * next_v - v, 0.0)
    last = torch.zeros(5)
    for t in reversed(range(12)):
        last = torch.where(m[:, t], d[:, t] + 0.99 * 0.95 * last, 0.0)
        deltas_loop.append(last)
    loop = torch.stack(deltas_loop[::-1], 1)
    if fn is compute_gae:
        assert torch.equal(adv, loop)
    else:
        assert (adv - loop).abs().max() < 1e-5
