"""The engine correction (`core/correction.py`, `rollout.is_correction`): each mode against a hand-computed case,
a plain-Python loop and a transcription of a peer's formula on random inputs; the weights in the policy losses."""

import math

import pytest
import torch
from core_helpers import right_padded_mask, with_garbage
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_losses import rand_ppo_batch

from rlhf_cli import config
from rlhf_cli.core import IS_CORRECTIONS, POLICY_LOSSES, engine_is_weights, is_bounds

PROPERTY = settings(max_examples=25, deadline=None)


def test_the_config_offers_exactly_the_corrections():
    assert list(config.IS_CORRECTIONS) == list(IS_CORRECTIONS)
    assert config.RolloutConfig().is_correction == "none"


def test_hand_computed_every_mode():
    # row 0: ratios 0.25, 1, 3, 10 (geometric mean (0.25·1·3·10)^(1/4) = 7.5^(1/4) = 1.655); row 1: 0.6, 1 and
    # padding (geometric mean 0.6^(1/2) = 0.775)
    rho = torch.tensor([[0.25, 1.0, 3.0, 10.0], [0.6, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    eng = torch.full_like(rho, -2.0)
    old = with_garbage(eng + rho.log(), mask, float("nan"))
    eng = with_garbage(eng, mask, 7.0)
    w, _, hit = engine_is_weights(old, eng, mask, "tis", None, 2.0)  # Yao et al.: min(ρ, 2)
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 2.0, 2.0], [0.6, 1.0, 0, 0]], dtype=torch.float64))
    assert hit.tolist() == [[False, False, True, True], [False, False, False, False]]
    w, _, hit = engine_is_weights(old, eng, mask, "tis", 0.5, 5.0)  # OpenRLHF's [0.5, 5]
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 3.0, 5.0], [0.6, 1.0, 0, 0]], dtype=torch.float64))
    w, _, hit = engine_is_weights(old, eng, mask, "icepop", None, 2.0)  # band [0.5, 2]
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.6, 1.0, 0, 0]], dtype=torch.float64))
    assert hit.tolist() == [[True, False, True, True], [False, False, False, False]]
    w, ratio, hit = engine_is_weights(old, eng, mask, "seq_mask", None, 1.5)  # band [2/3, 1.5]
    assert ratio[0, 0].item() == pytest.approx(7.5 ** 0.25) and ratio[1, 1].item() == pytest.approx(0.6 ** 0.5)
    assert w.tolist() == [[0.0] * 4, [1.0, 1.0, 0.0, 0.0]]
    w, ratio, hit = engine_is_weights(old, eng, mask, "seq_mask", None, 1.7)  # band [0.588, 1.7]: both rows inside
    assert w.tolist() == [[1.0] * 4, [1.0, 1.0, 0.0, 0.0]] and not hit.any()
    w, ratio, hit = engine_is_weights(old, eng, mask, "none", None, 2.0)
    assert w.tolist() == [[1.0] * 4, [1.0, 1.0, 0.0, 0.0]] and not hit.any()
    assert torch.isfinite(ratio).all() and ratio[1, 2:].tolist() == [1.0, 1.0]


def loop_reference(old, eng, mask, mode, low, high):
    """The module docstring's equations, one token at a time."""
    lo, hi = is_bounds(mode, low, high)
    B, T = old.shape
    w = [[0.0] * T for _ in range(B)]
    for i in range(B):
        real = [t for t in range(T) if mask[i, t]]
        seq = math.exp(sum(float(old[i, t] - eng[i, t]) for t in real) / max(len(real), 1))
        for t in real:
            rho = math.exp(float(old[i, t] - eng[i, t]))
            if mode == "none":
                w[i][t] = 1.0
            elif mode == "tis":
                w[i][t] = min(max(rho, lo), hi)
            elif mode == "icepop":
                w[i][t] = rho if lo <= rho <= hi else 0.0
            else:
                w[i][t] = 1.0 if lo <= seq <= hi else 0.0
    return torch.tensor(w, dtype=torch.float64)


def rand_pair(seed, B, T, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    eng = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = eng + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    return old, eng, right_padded_mask(gen, B, T)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 8),
       mode=st.sampled_from(IS_CORRECTIONS), low=st.sampled_from([None, 0.2, 0.8]),
       high=st.sampled_from([1.2, 2.0, 5.0]))
def test_every_mode_matches_the_loop_reference(seed, B, T, mode, low, high):
    old, eng, mask = rand_pair(seed, B, T)
    w, _, hit = engine_is_weights(with_garbage(old, mask, float("inf")), with_garbage(eng, mask, float("nan")),
                                  mask, mode, low, high)
    torch.testing.assert_close(w, loop_reference(old, eng, mask, mode, low, high), atol=1e-12, rtol=0)
    assert not (hit & ~mask).any() and not w.requires_grad


# ---------------------------------------------------------------- peers' formulas, transcribed

def trl_token_truncate(old_per_token_logps, sampling_per_token_logps, mask, cap):
    """TRL GRPOTrainer's vLLM importance sampling, `token_truncate`: exp(old − sampling) clamped at the cap."""
    ratio = torch.exp(old_per_token_logps - sampling_per_token_logps)
    return torch.clamp(ratio, max=cap) * mask


def verl_geometric_mask(old_log_prob, rollout_log_prob, response_mask, lower, upper):
    """veRL's rollout rejection sampling at the geometric level: the sequence's mean log-ratio, exponentiated,
    must lie in [lower, upper], else the sequence's tokens are masked."""
    log_ratio = (old_log_prob - rollout_log_prob) * response_mask
    geo = torch.exp(log_ratio.sum(-1) / response_mask.sum(-1).clamp(min=1))
    keep = (geo >= lower) & (geo <= upper)
    return keep[:, None].to(old_log_prob.dtype) * response_mask


def icepop_mask(log_probs_train, log_probs_infer, mask, alpha, beta):
    """IcePop's M(k; α, β) = k if α <= k <= β else 0, k = π_train / π_infer per token."""
    k = torch.exp(log_probs_train - log_probs_infer)
    return torch.where((k >= alpha) & (k <= beta), k, torch.zeros_like(k)) * mask


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 8))
def test_every_mode_matches_a_peers_formula(seed, B, T):
    old, eng, mask = rand_pair(seed, B, T, spread=0.5)
    m = mask.double()
    w, _, _ = engine_is_weights(old, eng, mask, "tis", None, 3.0)
    torch.testing.assert_close(w, trl_token_truncate(old, eng, m, 3.0), atol=1e-12, rtol=0)
    w, _, _ = engine_is_weights(old, eng, mask, "seq_mask", 0.8, 1.25)
    torch.testing.assert_close(w, verl_geometric_mask(old, eng, m, 0.8, 1.25), atol=1e-12, rtol=0)
    w, _, _ = engine_is_weights(old, eng, mask, "icepop", 0.5, 5.0)
    torch.testing.assert_close(w, icepop_mask(old, eng, m, 0.5, 5.0), atol=1e-12, rtol=0)


def test_bounds_defaults_and_errors():
    assert is_bounds("tis", None, 2.0) == (0.0, 2.0) and is_bounds("icepop", None, 4.0) == (0.25, 4.0)
    assert is_bounds("seq_mask", 0.9, 1.1) == (0.9, 1.1)
    with pytest.raises(ValueError, match="unknown engine correction"):
        is_bounds("ice", None, 2.0)
    with pytest.raises(ValueError, match="0 <= low <= high"):
        is_bounds("tis", 3.0, 2.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine_is_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), "tis", None, 2.0)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_weights_multiply_each_tokens_loss_and_keep_the_divisor(kind, aggregation):
    """loss(weights=w) = Σ_t w_t · loss_t with the unweighted divisor: each loss_t (and its gradient) is taken
    from a call whose advantages are zero except at t (every loss here is linear in the advantages). A weight of
    0 is among them except for GSPO, whose sequence ratio also leaves such a token out (the next tests)."""
    d = rand_ppo_batch(3, 3, 5)
    gen = torch.Generator().manual_seed(1)
    mask = right_padded_mask(gen, 3, 5)
    mask[1, :2] = True  # no empty row
    w = torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2
    w[0, 1] = 0.0 if kind != "gspo" else 0.5
    fn = POLICY_LOSSES[kind]
    kw = dict(aggregation=aggregation, clip_high=0.3, num_tokens=float(mask.sum()), num_seqs=3.0)
    lp = d["logprobs"].clone().requires_grad_(True)
    got, _ = fn(lp, d["old_logprobs"], d["advantages"], mask, 0.2, **kw, weights=w)
    got.backward()
    want, want_grad = 0.0, torch.zeros_like(lp)
    for i, t in mask.nonzero().tolist():
        one = torch.zeros_like(d["advantages"])
        one[i, t] = d["advantages"][i, t]
        lp_t = d["logprobs"].clone().requires_grad_(True)
        part, _ = fn(lp_t, d["old_logprobs"], one, mask, 0.2, **kw)
        part.backward()
        want, want_grad = want + w[i, t].item() * part.item(), want_grad + w[i, t] * lp_t.grad
    assert got.item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(lp.grad, want_grad, atol=1e-12, rtol=0)
    ones, _ = fn(d["logprobs"], d["old_logprobs"], d["advantages"], mask, 0.2, **kw, weights=torch.ones_like(w))
    plain, _ = fn(d["logprobs"], d["old_logprobs"], d["advantages"], mask, 0.2, **kw)
    assert ones.item() == plain.item()


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq_mask"])
def test_a_token_both_sides_give_no_probability_is_masked_never_nan(mode):
    # row 0: ρ = 1.5, then a token both log-probs put at -inf (0/0), then ρ = 1; row 1: an ordinary row; row 2: only
    # the trainer at -inf (ρ = 0) and only the engine at -inf (ρ = +inf): both defined, so the bounds act on them
    inf = float("inf")
    old = torch.tensor([[math.log(1.5) - 1, -inf, -1.0], [-1.0, -1.0, -1.0], [-inf, -1.0, -1.0]])
    eng = torch.tensor([[-1.0, -inf, -1.0], [-1.0, -1.0, -1.0], [-1.0, -inf, -1.0]])
    mask = torch.ones_like(old, dtype=torch.bool)
    w, ratio, hit = engine_is_weights(old, eng, mask, mode, None, 2.0)
    assert torch.isfinite(w).all() and not torch.isnan(ratio).any()
    if mode == "seq_mask":  # row 0 masked whole; its ratio is the geometric mean of its other tokens, √1.5
        assert w[0].tolist() == [0.0] * 3 and hit[0].all()
        assert ratio[0].tolist() == pytest.approx([1.5 ** 0.5] * 3)
        assert w[1].tolist() == [1.0] * 3 and not hit[1].any()
        assert w[2].tolist() == [0.0] * 3 and hit[2].all()  # a row with +inf and -inf tokens: undefined too
        assert ratio[2].tolist() == [1.0] * 3
    else:
        assert w[0, 1].item() == 0.0 and hit[0, 1] and ratio[0, 1].item() == 1.0
        assert w[0, 0].item() == pytest.approx(1.5) and w[0, 2].item() == 1.0 and not hit[0, [0, 2]].any()
        assert w[1].tolist() == [1.0] * 3
        assert ratio[2, :2].tolist() == [0.0, inf]
        if mode == "tis":  # clamped to [0, 2]: 0 is inside
            assert w[2, :2].tolist() == [0.0, 2.0] and hit[2, :2].tolist() == [False, True]
        else:
            assert w[2, :2].tolist() == [0.0, 0.0] and hit[2, :2].all()
    # under none the log-probs are not read: the weights stay 1 on real tokens
    w, _, hit = engine_is_weights(old, eng, mask, "none", None, 2.0)
    assert w.tolist() == [[1.0] * 3] * 3 and not hit.any()


def test_a_nan_log_prob_is_masked_and_padding_still_holds_anything():
    old = torch.tensor([[float("nan"), -1.0, float("nan")]])
    eng = torch.tensor([[-1.0, -1.0, float("-inf")]])
    mask = torch.tensor([[1, 1, 0]])
    w, ratio, hit = engine_is_weights(old, eng, mask, "tis", None, 2.0)
    assert w.tolist() == [[0.0, 1.0, 0.0]] and ratio.tolist() == [[1.0, 1.0, 1.0]]
    assert hit.tolist() == [[True, False, False]]


@pytest.mark.parametrize("case", ["old -inf", "old nan", "both -inf (on-policy)"])
@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_a_token_of_weight_zero_leaves_no_nan_in_the_loss_or_its_gradient(kind, case):
    """The engine correction gives weight 0 to a token the trainer gave no probability (log pi_old = -inf, so
    r = inf; on-policy log pi = log pi_old = -inf, so r = NaN) or whose old log-prob is NaN: the loss and every
    gradient stay finite, and equal those of the same batch with that token's advantage zeroed and ordinary
    log-probs (its term is 0 either way; the divisor still counts it)."""
    d = rand_ppo_batch(3, 2, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    w = torch.ones(2, 4, dtype=torch.float64)
    w[0, 2] = 0.0
    old, lp_in = d["old_logprobs"].clone(), d["logprobs"].clone()
    old[0, 2] = float("nan") if case == "old nan" else float("-inf")
    if case.startswith("both"):
        lp_in[0, 2] = float("-inf")
    adv = d["advantages"].clone()
    adv[0, 2] = -1.0  # A < 0: -A * r = +inf without the guard
    fn = POLICY_LOSSES[kind]
    lp = lp_in.requires_grad_(True)
    got, stats = fn(lp, old, adv, mask, 0.2, weights=w, num_tokens=8.0)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0
    assert all(math.isfinite(v) for v in stats.values()), stats
    adv0, old0 = adv.clone(), d["old_logprobs"]
    adv0[0, 2] = 0.0
    lp0 = d["logprobs"].clone().requires_grad_(True)
    want, want_stats = fn(lp0, old0, adv0, mask, 0.2, weights=w, num_tokens=8.0)
    want.backward()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(lp.grad, lp0.grad, atol=1e-12, rtol=0)
    assert stats == pytest.approx(want_stats, abs=1e-12)  # the stats leave the token out too


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_a_token_of_weight_zero_is_as_if_cut_from_its_row(kind):
    """With token-mean and a fixed divisor, a weight-0 token is the same as that token cut out of its response
    (the row shifted left, padded at the end): the loss, the other tokens' gradients and the stats agree. For
    GSPO this is the rule that the sequence ratio s_i is the geometric mean over the kept tokens only."""
    d = rand_ppo_batch(5, 2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    w = torch.ones(2, 5, dtype=torch.float64)
    w[0, 1] = 0.0
    fn = POLICY_LOSSES[kind]
    lp = d["logprobs"].clone().requires_grad_(True)
    got, stats = fn(lp, d["old_logprobs"], d["advantages"], mask, 0.2, weights=w, num_tokens=10.0)
    got.backward()
    keep = [0, 2, 3, 4]  # row 0 without its token 1, then one padding column
    cut = {k: d[k].clone() for k in ("logprobs", "old_logprobs", "advantages")}
    for v in cut.values():
        v[0, :4] = v[0, keep]
        v[0, 4] = 0.0
    cut_mask = mask.clone()
    cut_mask[0, 4] = False
    lp_cut = cut["logprobs"].requires_grad_(True)
    want, want_stats = fn(lp_cut, cut["old_logprobs"], cut["advantages"], cut_mask, 0.2, num_tokens=10.0)
    want.backward()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(lp.grad[0, keep], lp_cut.grad[0, :4], atol=1e-12, rtol=0)
    torch.testing.assert_close(lp.grad[1], lp_cut.grad[1], atol=1e-12, rtol=0)
    assert lp.grad[0, 1] == 0
    assert stats == pytest.approx(want_stats, abs=1e-12)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_a_loss_that_keeps_no_token_reports_zeros_under_the_same_keys(kind):
    """Every token of weight 0 (or padding): the loss is 0 and so is its gradient; the stats keep their keys (ranks
    reduce them by position) with 0 for the ratio, KL and clip fractions, never NaN."""
    d = rand_ppo_batch(7, 2, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    lp = d["logprobs"].clone().requires_grad_(True)
    loss, stats = POLICY_LOSSES[kind](lp, d["old_logprobs"], d["advantages"], mask, 0.2,
                                      weights=torch.zeros(2, 4, dtype=torch.float64))
    loss.backward()
    _, kept = POLICY_LOSSES[kind](d["logprobs"], d["old_logprobs"], d["advantages"], mask, 0.2)
    assert stats.keys() == kept.keys() and set(stats.values()) == {0.0}
    assert loss.item() == 0.0 and not lp.grad.any()
    _, stats = POLICY_LOSSES[kind](d["logprobs"], d["old_logprobs"], d["advantages"], torch.zeros_like(mask), 0.2)
    assert stats.keys() == kept.keys() and set(stats.values()) == {0.0}
