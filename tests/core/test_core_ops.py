"""rlhf_cli.core.ops against plain-Python references, hand-computed cases and properties."""

import math

import pytest
import torch
from core_helpers import right_padded_mask, with_garbage
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_cli.core import entropy_from_logits, kl_estimate, logprobs_from_logits, masked_mean, masked_var, masked_whiten

PROPERTY = settings(max_examples=30, deadline=None)
GARBAGE = [1e6, -1e6, math.inf, -math.inf, math.nan]
SHAPES = [(1, 1), (2, 5), (4, 7), (3, 16)]


# ---------------------------------------------------------------- plain-Python references


def ref_log_softmax(row):
    top = max(row)
    lse = top + math.log(sum(math.exp(z - top) for z in row))
    return [z - lse for z in row]


def ref_logprobs(logits, labels):
    return [[ref_log_softmax(pos)[lab] for pos, lab in zip(seq, labs)] for seq, labs in zip(logits, labels)]


def ref_entropy(logits):
    out = []
    for seq in logits:
        row_out = []
        for pos in seq:
            logp = ref_log_softmax(pos)
            row_out.append(-sum(math.exp(lp) * lp for lp in logp if lp > -math.inf))
        out.append(row_out)
    return out


def real_values(x, mask):
    return [v for xs, ms in zip(x.tolist(), mask.tolist()) for v, m in zip(xs, ms) if m]


def ref_mean(vals):
    return sum(vals) / len(vals) if vals else 0.0


def ref_var(vals, unbiased=True):
    if len(vals) < 2:
        return 0.0
    mu = ref_mean(vals)
    return sum((v - mu) ** 2 for v in vals) / (len(vals) - (1 if unbiased else 0))


def ref_kl(lp, ref_lp, estimator):
    out = []
    for a_row, b_row in zip(lp, ref_lp):
        row = []
        for a, b in zip(a_row, b_row):
            log_r = b - a  # log(pi_ref / pi)
            row.append({"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r}[estimator])
        out.append(row)
    return out


# ---------------------------------------------------------------- logprobs_from_logits


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("V", [3, 11])
def test_logprobs_matches_reference(B, T, V):
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + V)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (B, T), generator=gen)
    got = logprobs_from_logits(logits, labels)
    assert got.shape == (B, T) and got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(ref_logprobs(logits.tolist(), labels.tolist()), dtype=torch.float64))


def test_logprobs_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    labels = torch.tensor([[1, 0]])
    got = logprobs_from_logits(logits, labels)
    assert torch.allclose(got, torch.tensor([[math.log(0.75), math.log(0.5)]]))


def test_logprobs_bf16_is_float32_of_upcast_and_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (3, 5), generator=gen)
    got = logprobs_from_logits(logits.bfloat16(), labels)
    assert got.dtype == torch.float32
    assert torch.allclose(got, logprobs_from_logits(logits.bfloat16().float(), labels), atol=1e-6)
    assert torch.allclose(got, logprobs_from_logits(logits, labels), atol=0.1)


def test_logprobs_gradient_matches_log_softmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (2, 4), generator=gen)
    (g1,) = torch.autograd.grad(logprobs_from_logits(logits, labels).sum(), logits)
    naive = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).sum()
    (g2,) = torch.autograd.grad(naive, logits)
    assert torch.allclose(g1, g2)


def test_logprobs_shape_mismatch_raises():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------- entropy_from_logits


@pytest.mark.parametrize("B,T", SHAPES)
def test_entropy_matches_reference(B, T):
    gen = torch.Generator().manual_seed(B * 10 + T)
    logits = torch.randn(B, T, 9, generator=gen, dtype=torch.float64) * 2
    logits[..., 0] = -math.inf  # a masked vocabulary entry everywhere
    got = entropy_from_logits(logits)
    assert got.shape == (B, T)
    assert torch.allclose(got, torch.tensor(ref_entropy(logits.tolist()), dtype=torch.float64))


def test_entropy_hand_computed():
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [5.0, 5.0, -math.inf, -math.inf], [0.0, -math.inf, -math.inf, -math.inf]]]
    )
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([[math.log(4), math.log(2), 0.0]]))


def test_entropy_finite_with_neg_inf_in_bf16_and_gradient_finite():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 16, generator=gen) * 3
    logits[..., 8:] = -math.inf
    ent32 = entropy_from_logits(logits)
    ent16 = entropy_from_logits(logits.bfloat16())
    assert ent16.dtype == torch.float32 and torch.isfinite(ent16).all()
    assert torch.allclose(ent16, ent32, atol=0.05)
    leaf = logits.clone().requires_grad_(True)
    entropy_from_logits(leaf).sum().backward()
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad[..., 8:] == 0).all()


# ---------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("B,T", SHAPES)
def test_masked_stats_match_reference(B, T):
    gen = torch.Generator().manual_seed(B + 7 * T)
    x = torch.randn(B, T, generator=gen, dtype=torch.float64) * 2 + 1
    mask = right_padded_mask(gen, B, T)
    vals = real_values(x, mask)
    assert masked_mean(x, mask).item() == pytest.approx(ref_mean(vals))
    assert masked_var(x, mask).item() == pytest.approx(ref_var(vals))
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(ref_var(vals, unbiased=False))
    rows = masked_mean(x, mask, dim=1)
    for b in range(B):
        assert rows[b].item() == pytest.approx(ref_mean(real_values(x[b : b + 1], mask[b : b + 1])))
    whitened = masked_whiten(x, mask)
    mu, sd = ref_mean(vals), math.sqrt(ref_var(vals) + 1e-8)
    for b in range(B):
        for t in range(T):
            expected = (x[b, t].item() - mu) / sd if mask[b, t] else 0.0
            assert whitened[b, t].item() == pytest.approx(expected, abs=1e-9)
    unshifted = masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(unshifted, torch.where(mask, whitened + mu, 0.0))


def test_masked_stats_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0], [5.0, -7.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(11 / 4)  # (1+2+3+5)/4
    assert torch.allclose(masked_mean(x, mask, dim=1), torch.tensor([2.0, 5.0]))
    # deviations -1.75, -0.75, 0.25, 2.25 -> squares sum 8.75
    assert masked_var(x, mask).item() == pytest.approx(8.75 / 3)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(8.75 / 4)


def test_masked_stats_degenerate_masks_are_finite():
    x = torch.tensor([[3.0, math.nan, math.inf]])
    one = torch.tensor([[1, 0, 0]])
    none = torch.zeros(1, 3)
    assert masked_mean(x, one).item() == 3.0
    assert masked_var(x, one).item() == 0.0
    assert torch.equal(masked_whiten(x, one), torch.zeros(1, 3))
    assert torch.equal(masked_whiten(x, one, shift_mean=False), torch.tensor([[3.0, 0.0, 0.0]]))
    assert masked_mean(x, none).item() == 0.0
    assert masked_var(x, none).item() == 0.0
    assert torch.equal(masked_whiten(x, none), torch.zeros(1, 3))
    assert torch.equal(masked_mean(x, none, dim=1), torch.zeros(1))


def test_masked_mean_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape mismatch"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))


# ---------------------------------------------------------------- kl_estimate


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("B,T", SHAPES)
def test_kl_estimate_matches_reference(estimator, B, T):
    gen = torch.Generator().manual_seed(B * 3 + T)
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    got = kl_estimate(lp, ref, estimator)
    assert torch.allclose(got, torch.tensor(ref_kl(lp.tolist(), ref.tolist(), estimator), dtype=torch.float64))
    if estimator != "k1":
        assert (got >= 0).all()


def test_kl_estimate_hand_computed():
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])  # log r = -log 2
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))


def test_kl_estimate_unknown_estimator_raises():
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_kl_estimate_k3_unbiased_on_categorical():
    """Schulman's note: E_{x~pi}[k1] = E[k3] = KL(pi || pi_ref) exactly (k2 only approximately)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = (p * (p / q).log()).sum()
    for estimator in ("k1", "k3"):
        per_outcome = kl_estimate(p.log()[None], q.log()[None], estimator)[0]
        assert (p * per_outcome).sum().item() == pytest.approx(exact.item())


# ---------------------------------------------------------------- properties


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 12), value=st.sampled_from(GARBAGE))
def test_padding_garbage_changes_no_output(seed, B, T, value):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=gen)
    ref = torch.randn(B, T, generator=gen)
    mask = right_padded_mask(gen, B, T)
    dirty, dirty_ref = with_garbage(x, mask, value), with_garbage(ref, mask, value)
    assert torch.equal(masked_mean(x, mask), masked_mean(dirty, mask))
    assert torch.equal(masked_mean(x, mask, dim=1), masked_mean(dirty, mask, dim=1))
    assert torch.equal(masked_var(x, mask), masked_var(dirty, mask))
    assert torch.equal(masked_whiten(x, mask), masked_whiten(dirty, mask))
    for estimator in ("k1", "k2", "k3"):
        clean = kl_estimate(x, ref, estimator, mask=mask)
        assert torch.equal(clean, kl_estimate(dirty, dirty_ref, estimator, mask=mask))
        assert (clean[~mask] == 0).all()
    leaf = dirty.clone().requires_grad_(True)
    masked_whiten(leaf, mask).pow(2).sum().backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[~mask] == 0).all()


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(2, 20), scale=st.floats(0.1, 100.0))
def test_whitened_has_zero_mean_unit_std(seed, B, T, scale):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=gen, dtype=torch.float64) * scale + 3
    mask = right_padded_mask(gen, B, T)
    mask[0, :2] = True  # at least two real tokens
    whitened = masked_whiten(x, mask)
    assert abs(masked_mean(whitened, mask).item()) < 1e-9
    var = masked_var(x, mask).item()
    std = masked_var(whitened, mask).sqrt().item()
    assert std == pytest.approx(math.sqrt(var / (var + 1e-8)), rel=1e-9)  # eps = 1e-8
    assert std == pytest.approx(1.0, abs=1e-3)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 8))
def test_bf16_inputs_within_tolerance_of_fp32(seed, B, T):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=gen)
    ref = torch.randn(B, T, generator=gen)
    mask = right_padded_mask(gen, B, T)
    for fn in (masked_mean, masked_var):
        low = fn(x.bfloat16(), mask)
        assert low.dtype == torch.float32
        assert torch.allclose(low, fn(x, mask), rtol=2e-2, atol=2e-2)
    assert torch.allclose(masked_whiten(x.bfloat16(), mask), masked_whiten(x, mask), atol=5e-2)
    got = kl_estimate(x.bfloat16(), ref.bfloat16(), "k3", mask=mask)
    assert got.dtype == torch.float32
    assert torch.allclose(got, kl_estimate(x, ref, "k3", mask=mask), rtol=5e-2, atol=5e-2)
