"""rlhf_cli.core.losses against plain-Python references, hand-computed cases and properties."""

import math

import pytest
import torch
from core_helpers import right_padded_mask, with_garbage
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_cli.core import (
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    logprobs_from_logits,
    pairwise_loss,
    policy_loss,
    value_loss,
)

PROPERTY = settings(max_examples=25, deadline=None)
GARBAGE = [1e6, -1e6, math.inf, -math.inf, math.nan]
SHAPES = [(1, 1), (2, 5), (4, 7), (3, 16)]
AGGREGATIONS = ["token-mean", "seq-mean-token-mean"]
POLICY_KEYS = {"policy/loss", "policy/clipfrac", "policy/clipfrac_high", "policy/clipfrac_low", "policy/dual_clipfrac",
               "policy/approx_kl", "policy/ratio_mean", "policy/kept_tokens"}
VALUE_KEYS = {"val/loss", "val/clipfrac", "val/explained_var"}
RM_KEYS = {"rm/loss", "rm/accuracy", "rm/margin", "rm/chosen_mean", "rm/rejected_mean"}


def rand_ppo_batch(seed, B, T, V=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return {
        "logprobs": -torch.rand(B, T, generator=gen, dtype=dtype) * 2,
        "old_logprobs": -torch.rand(B, T, generator=gen, dtype=dtype) * 2,
        "advantages": torch.randn(B, T, generator=gen, dtype=dtype),
        "values": torch.randn(B, T, generator=gen, dtype=dtype),
        "old_values": torch.randn(B, T, generator=gen, dtype=dtype),
        "returns": torch.randn(B, T, generator=gen, dtype=dtype),
        "logits": torch.randn(B, T, V, generator=gen, dtype=dtype) * 2,
        "labels": torch.randint(0, V, (B, T), generator=gen),
        "mask": right_padded_mask(gen, B, T),
    }


# ---------------------------------------------------------------- plain-Python references


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def var(xs):
    if len(xs) < 2:
        return 0.0
    mu = mean(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)


def aggregate(per_token_rows, num_tokens, aggregation, num_seqs):
    """per_token_rows: one list of real-token losses per row."""
    if aggregation == "token-mean":
        total = sum(sum(row) for row in per_token_rows)
        n = sum(len(row) for row in per_token_rows) if num_tokens is None else num_tokens
        return total / max(n, 1)
    seq_means = [sum(row) / len(row) for row in per_token_rows if row]
    n = len(seq_means) if num_seqs is None else num_seqs
    return sum(seq_means) / max(n, 1)


def real_rows(mask, *tensors):
    """For each row, the list of per-token tuples over real tokens."""
    lists = [t.tolist() for t in tensors]
    return [[tuple(lst[b][t] for lst in lists) for t, m in enumerate(row) if m] for b, row in enumerate(mask.tolist())]


def ref_policy_loss(lp, olp, adv, mask, clip, num_tokens=None, aggregation="token-mean", num_seqs=None,
                    clip_high=None, dual_clip=None):
    high = clip if clip_high is None else clip_high
    losses, flags, kls, ratios = [], {"high": [], "low": [], "dual": []}, [], []
    for row in real_rows(mask, lp, olp, adv):
        row_losses = []
        for a, b, A in row:
            r = math.exp(a - b)
            unclipped, clipped = -A * r, -A * min(max(r, 1 - clip), 1 + high)
            loss = max(unclipped, clipped)
            dual = dual_clip is not None and A < 0 and loss > -dual_clip * A
            row_losses.append(-dual_clip * A if dual else loss)
            flags["high"].append(1.0 if clipped > unclipped and A > 0 else 0.0)
            flags["low"].append(1.0 if clipped > unclipped and A < 0 else 0.0)
            flags["dual"].append(1.0 if dual else 0.0)
            kls.append((r - 1) - (a - b))
            ratios.append(r)
        losses.append(row_losses)
    loss = aggregate(losses, num_tokens, aggregation, num_seqs)
    return loss, {
        "policy/loss": loss,
        "policy/clipfrac": mean(flags["high"]) + mean(flags["low"]),
        "policy/clipfrac_high": mean(flags["high"]),
        "policy/clipfrac_low": mean(flags["low"]),
        "policy/dual_clipfrac": mean(flags["dual"]),
        "policy/approx_kl": mean(kls),
        "policy/ratio_mean": mean(ratios),
        "policy/kept_tokens": float(len(ratios)),
    }


def ref_value_loss(v, v_old, ret, mask, value_clip, num_tokens=None, aggregation="token-mean", num_seqs=None):
    losses, clipped_flags, residuals, targets = [], [], [], []
    for row in real_rows(mask, v, v_old, ret):
        row_losses = []
        for value, old, target in row:
            unclipped = (value - target) ** 2
            if value_clip is None:
                clipped = unclipped
            else:
                clipped = (old + min(max(value - old, -value_clip), value_clip) - target) ** 2
            row_losses.append(0.5 * max(unclipped, clipped))
            clipped_flags.append(1.0 if clipped > unclipped else 0.0)
            residuals.append(target - value)
            targets.append(target)
        losses.append(row_losses)
    loss = aggregate(losses, num_tokens, aggregation, num_seqs)
    explained = 1 - var(residuals) / var(targets) if var(targets) > 0 else 0.0
    return loss, {"val/loss": loss, "val/clipfrac": mean(clipped_flags), "val/explained_var": explained}


def ref_entropy_bonus(entropy, mask, num_tokens=None, aggregation="token-mean", num_seqs=None):
    rows = [[e for (e,) in row] for row in real_rows(mask, entropy)]
    bonus = aggregate(rows, num_tokens, aggregation, num_seqs)
    return bonus, {"policy/entropy": mean([e for row in rows for e in row])}


def ref_pairwise(chosen, rejected, margin):
    n = len(chosen)
    terms = [-math.log(1 / (1 + math.exp(-(c - r - m)))) for c, r, m in zip(chosen, rejected, margin)]
    return sum(terms) / n, {
        "rm/loss": sum(terms) / n,
        "rm/accuracy": sum(c > r for c, r in zip(chosen, rejected)) / n,
        "rm/margin": sum(c - r for c, r in zip(chosen, rejected)) / n,
        "rm/chosen_mean": sum(chosen) / n,
        "rm/rejected_mean": sum(rejected) / n,
    }


def assert_stats_close(got, expected, **tol):
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert isinstance(got[key], float), key
        assert got[key] == pytest.approx(value, **tol), key


# ---------------------------------------------------------------- policy_loss


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("num_tokens,num_seqs", [(None, None), (50, 7)])
def test_policy_loss_matches_reference(aggregation, B, T, num_tokens, num_seqs):
    d = rand_ppo_batch(B * 17 + T, B, T)
    args = (d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"], 0.2)
    loss, stats = policy_loss(*args, num_tokens, aggregation, num_seqs)
    expected_loss, expected_stats = ref_policy_loss(*args, num_tokens, aggregation, num_seqs)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert_stats_close(stats, expected_stats, abs=1e-12)
    assert set(stats) == POLICY_KEYS


def test_policy_loss_hand_computed():
    # ratios 1.5 (A=1: clipped to 1.2 -> -1.2) and 0.5 (A=1: min(0.5, 0.8) = 0.5 -> -0.5); token 3 is padding
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5), 7.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, math.nan]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = policy_loss(logprobs, old, adv, mask, clip=0.2)
    assert loss.item() == pytest.approx(-0.85)
    assert stats["policy/clipfrac"] == pytest.approx(0.5)
    assert stats["policy/ratio_mean"] == pytest.approx(1.0)
    assert stats["policy/approx_kl"] == pytest.approx(((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2)
    loss, _ = policy_loss(logprobs, old, adv, mask, clip=0.2, num_tokens=4)
    assert loss.item() == pytest.approx(-1.7 / 4)


def test_policy_loss_gradient_only_into_logprobs():
    d = rand_ppo_batch(0, 3, 4)
    lp = d["logprobs"].clone().requires_grad_(True)
    old = d["old_logprobs"].clone().requires_grad_(True)
    adv = d["advantages"].clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, d["mask"], 0.2)
    loss.backward()
    assert lp.grad is not None and old.grad is None and adv.grad is None


def test_policy_loss_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip"):
        policy_loss(x, x, x, x, -0.1)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(x, x, x, x, 0.2, aggregation="sum")
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(x, x, torch.zeros(2, 4), x, 0.2)


# ---------------------------------------------------------------- value_loss


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_value_loss_matches_reference(aggregation, B, T, value_clip):
    d = rand_ppo_batch(B * 19 + T, B, T)
    args = (d["values"], d["old_values"], d["returns"], d["mask"], value_clip)
    loss, stats = value_loss(*args, None, aggregation)
    expected_loss, expected_stats = ref_value_loss(*args, None, aggregation)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert_stats_close(stats, expected_stats, abs=1e-9)
    assert set(stats) == VALUE_KEYS


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, math.inf]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # unclipped: (1-2)^2 = 1, (0-1)^2 = 1 -> 0.5 * mean = 0.5
    loss, stats = value_loss(values, old, returns, mask, value_clip=None)
    assert loss.item() == pytest.approx(0.5)
    assert stats["val/clipfrac"] == 0.0
    # Var[R] = 0.5, Var[R - V] = Var[1, 1] = 0 -> explained variance 1
    assert stats["val/explained_var"] == pytest.approx(1.0)
    # clip 0.5: V_clip = [0.5, 0] -> (0.5-2)^2 = 2.25 > 1 (clipped), 1 -> 0.5 * (2.25 + 1) / 2
    loss, stats = value_loss(values, old, returns, mask, value_clip=0.5)
    assert loss.item() == pytest.approx(0.8125)
    assert stats["val/clipfrac"] == pytest.approx(0.5)


def test_value_loss_explained_var_zero_when_returns_constant():
    x = torch.tensor([[1.0, 1.0]])
    _, stats = value_loss(torch.tensor([[0.0, 3.0]]), x, x, torch.ones(1, 2), None)
    assert stats["val/explained_var"] == 0.0


def test_value_loss_rejects_bad_value_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(x, x, x, x, 0.0)


# ---------------------------------------------------------------- entropy_bonus


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("B,T", SHAPES)
def test_entropy_bonus_matches_reference(aggregation, B, T):
    d = rand_ppo_batch(B * 23 + T, B, T)
    entropy = entropy_from_logits(d["logits"])
    bonus, stats = entropy_bonus(d["logits"], d["mask"], aggregation=aggregation)
    expected, expected_stats = ref_entropy_bonus(entropy, d["mask"], aggregation=aggregation)
    assert bonus.item() == pytest.approx(expected, abs=1e-12)
    assert_stats_close(stats, expected_stats, abs=1e-12)
    same, _ = entropy_bonus(None, d["mask"], aggregation=aggregation, entropy=entropy)
    assert torch.equal(same, bonus)


def test_entropy_bonus_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [math.nan, 1.0]]])  # entropies log 2, log 2, padding
    bonus, stats = entropy_bonus(logits, torch.tensor([[1, 1, 0]]))
    assert bonus.item() == pytest.approx(math.log(2))
    assert stats == {"policy/entropy": pytest.approx(math.log(2))}


def test_entropy_bonus_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        entropy_bonus(None, torch.ones(1, 2))
    with pytest.raises(ValueError, match="exactly one"):
        entropy_bonus(torch.zeros(1, 2, 3), torch.ones(1, 2), entropy=torch.zeros(1, 2))


# ---------------------------------------------------------------- pairwise_loss


@pytest.mark.parametrize("B", [1, 4, 9])
@pytest.mark.parametrize("with_margin", [False, True])
def test_pairwise_loss_matches_reference(B, with_margin):
    gen = torch.Generator().manual_seed(B)
    chosen = torch.randn(B, generator=gen, dtype=torch.float64) * 3
    rejected = torch.randn(B, generator=gen, dtype=torch.float64) * 3
    margin = torch.rand(B, generator=gen, dtype=torch.float64) if with_margin else None
    loss, stats = pairwise_loss(chosen, rejected, margin)
    m = margin.tolist() if with_margin else [0.0] * B
    expected_loss, expected_stats = ref_pairwise(chosen.tolist(), rejected.tolist(), m)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert_stats_close(stats, expected_stats, abs=1e-12)
    assert set(stats) == RM_KEYS


def test_pairwise_loss_hand_computed():
    loss, stats = pairwise_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    # -log sigma(1) = log(1 + e^-1); -log sigma(0) = log 2
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log(2)) / 2)
    assert stats["rm/accuracy"] == 0.5  # the tie does not count as correct
    assert stats["rm/margin"] == 0.5 and stats["rm/chosen_mean"] == 0.5 and stats["rm/rejected_mean"] == 0.0
    loss, _ = pairwise_loss(torch.tensor([1.0]), torch.tensor([0.0]), margin=1.0)
    assert loss.item() == pytest.approx(math.log(2))


def test_pairwise_loss_large_gap_is_finite_and_empty_batch_is_zero():
    loss, _ = pairwise_loss(torch.tensor([-500.0]), torch.tensor([500.0]))
    assert loss.item() == pytest.approx(1000.0)
    empty = torch.zeros(0, requires_grad=True)
    loss, stats = pairwise_loss(empty, empty.detach())
    assert loss.item() == 0.0 and loss.requires_grad
    assert all(v == 0.0 for v in stats.values())


def test_pairwise_loss_bf16_within_tolerance_of_fp32():
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    low, _ = pairwise_loss(chosen.bfloat16(), rejected.bfloat16())
    high, _ = pairwise_loss(chosen.bfloat16().float(), rejected.bfloat16().float())
    assert low.dtype == torch.float32 and low.item() == pytest.approx(high.item(), abs=1e-6)
    assert low.item() == pytest.approx(pairwise_loss(chosen, rejected)[0].item(), abs=2e-2)


# ---------------------------------------------------------------- empty masks


def three_terms(logprobs, old_logprobs, advantages, values, old_values, returns, mask, clip, value_clip, c1, c2,
                num_tokens=None, aggregation="token-mean", num_seqs=None, *, logits):
    """policy_loss + c1 · value_loss − c2 · entropy_bonus, as the update of a shared critic adds them
    (`rollout.learner.Learner.losses`), with the union of their stats: the properties below hold of the three
    terms together."""
    agg = {"num_tokens": num_tokens, "aggregation": aggregation, "num_seqs": num_seqs}
    pg, stats = policy_loss(logprobs, old_logprobs, advantages, mask, clip, **agg)
    vf, vf_stats = value_loss(values, old_values, returns, mask, value_clip, **agg)
    bonus, ent_stats = entropy_bonus(logits, mask, **agg)
    return pg + c1 * vf - c2 * bonus, {**stats, **vf_stats, **ent_stats}


def test_all_zero_mask_gives_zero_loss_with_graph():
    d = rand_ppo_batch(1, 3, 4, dtype=torch.float32)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    lp = d["logprobs"].clone().requires_grad_(True)
    values = d["values"].clone().requires_grad_(True)
    logits = d["logits"].clone().requires_grad_(True)
    for aggregation in AGGREGATIONS:
        for num_tokens in (None, 0):
            loss, stats = three_terms(
                lp, d["old_logprobs"], d["advantages"], values, d["old_values"], d["returns"], mask,
                0.2, 0.2, 0.5, 0.01, num_tokens, aggregation, logits=logits,
            )  # fmt: skip
            assert loss.item() == 0.0 and loss.requires_grad
            assert all(math.isfinite(v) for v in stats.values())
            loss.backward()
            for leaf in (lp, values, logits):
                assert torch.equal(leaf.grad, torch.zeros_like(leaf))


# ---------------------------------------------------------------- properties


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 10), clip=st.floats(0.01, 0.5))
def test_ratio_one_gives_no_clipping_and_minus_mean_advantage(seed, B, T, clip):
    d = rand_ppo_batch(seed, B, T)
    mask = d["mask"]
    loss, stats = policy_loss(d["old_logprobs"], d["old_logprobs"], d["advantages"], mask, clip)
    real_adv = d["advantages"][mask]
    expected = -real_adv.mean().item() if real_adv.numel() else 0.0
    assert stats["policy/clipfrac"] == 0.0
    assert stats["policy/ratio_mean"] == pytest.approx(1.0 if real_adv.numel() else 0.0)
    assert stats["policy/approx_kl"] == 0.0
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@PROPERTY
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    T=st.integers(1, 8),
    value=st.sampled_from(GARBAGE),
    aggregation=st.sampled_from(AGGREGATIONS),
)
def test_padding_garbage_changes_no_output(seed, B, T, value, aggregation):
    d = rand_ppo_batch(seed, B, T, dtype=torch.float32)
    mask = d["mask"]
    keys = ("logprobs", "old_logprobs", "advantages", "values", "old_values", "returns", "logits")

    def run(batch):
        lp = batch["logprobs"].clone().requires_grad_(True)
        values = batch["values"].clone().requires_grad_(True)
        logits = batch["logits"].clone().requires_grad_(True)
        args = (lp, batch["old_logprobs"], batch["advantages"], values, batch["old_values"], batch["returns"], mask)
        loss, stats = three_terms(*args, 0.2, 0.2, 0.5, 0.01, aggregation=aggregation, logits=logits)
        loss.backward()
        return loss, stats, lp.grad, values.grad, logits.grad

    dirty = {**d, **{k: with_garbage(d[k], mask, value) for k in keys}}
    clean_out, dirty_out = run(d), run(dirty)
    assert torch.equal(clean_out[0], dirty_out[0])
    assert clean_out[1] == dirty_out[1]
    assert torch.equal(clean_out[2], dirty_out[2]) and torch.equal(clean_out[3], dirty_out[3])
    assert torch.equal(clean_out[4][mask], dirty_out[4][mask])  # gradients of real-token logits
    assert (dirty_out[2][~mask] == 0).all() and (dirty_out[3][~mask] == 0).all()


@PROPERTY
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(2, 6),
    T=st.integers(1, 8),
    n_micro=st.integers(1, 4),
    aggregation=st.sampled_from(AGGREGATIONS),
    value_clip=st.sampled_from([None, 0.2]),
)
def test_micro_batches_with_num_tokens_give_the_full_batch_gradient(seed, B, T, n_micro, aggregation, value_clip):
    d = rand_ppo_batch(seed, B, T)
    mask = d["mask"]
    num_tokens, num_seqs = mask.sum(), mask.any(1).sum()

    def grads(chunks, num_tokens, num_seqs):
        logits = d["logits"].clone().requires_grad_(True)
        values = d["values"].clone().requires_grad_(True)
        total = 0.0
        for rows in chunks:
            loss, _ = three_terms(
                logprobs_from_logits(logits[rows], d["labels"][rows]),
                d["old_logprobs"][rows], d["advantages"][rows],
                values[rows], d["old_values"][rows], d["returns"][rows], mask[rows],
                0.2, value_clip, 0.5, 0.01, num_tokens, aggregation, num_seqs, logits=logits[rows],
            )  # fmt: skip
            loss.backward()  # accumulate, as gradient accumulation does
            total += loss.item()
        return total, logits.grad, values.grad

    full = grads([torch.arange(B)], None, None)
    split = grads(torch.arange(B).tensor_split(n_micro), num_tokens, num_seqs)
    assert split[0] == pytest.approx(full[0], abs=1e-12)
    assert torch.allclose(split[1], full[1], atol=1e-12)
    assert torch.allclose(split[2], full[2], atol=1e-12)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 8))
def test_bf16_inputs_within_tolerance_of_fp32(seed, B, T):
    d = rand_ppo_batch(seed, B, T, dtype=torch.float32)
    keys = ("logprobs", "old_logprobs", "advantages", "values", "old_values", "returns")

    def run(dtype):
        args = [d[k].to(dtype) for k in keys] + [d["mask"]]
        return three_terms(*args, 0.2, 0.2, 0.5, 0.01, logits=d["logits"].to(dtype))

    low, low_stats = run(torch.bfloat16)
    upcast = {**d, **{k: d[k].bfloat16().float() for k in keys + ("logits",)}}
    args = [upcast[k] for k in keys] + [d["mask"]]
    exact, exact_stats = three_terms(*args, 0.2, 0.2, 0.5, 0.01, logits=upcast["logits"])
    high, high_stats = run(torch.float32)
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(exact.item(), abs=1e-6)  # bf16 in, float32 math
    assert low.item() == pytest.approx(high.item(), rel=5e-2, abs=5e-2)
    for key in low_stats:
        assert low_stats[key] == pytest.approx(exact_stats[key], abs=1e-5), key
        # clip fractions count threshold crossings that bf16 rounding may flip, and explained
        # variance is a ratio of variances, ill-conditioned on tiny batches
        if key not in ("policy/clipfrac", "policy/clipfrac_high", "policy/clipfrac_low", "policy/dual_clipfrac",
                       "val/clipfrac", "val/explained_var"):
            assert low_stats[key] == pytest.approx(high_stats[key], rel=5e-2, abs=5e-2), key


def test_kl_loss_is_the_aggregated_k3_with_gradient_through_logprobs_only():
    """GRPO's β·D_KL term: k3 = exp(ref − lp) − (ref − lp) − 1 per token, token-mean over the real tokens."""
    lp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 9.0, 9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    d = [-0.5, 1.0, 0.0]  # ref − lp on the three real tokens
    want = sum(math.exp(x) - x - 1 for x in d) / 3
    loss, stats = kl_loss(lp, ref, mask, "k3")
    assert loss.item() == pytest.approx(want, rel=1e-6) and stats["policy/kl_ref"] == pytest.approx(want, rel=1e-6)
    loss.backward()
    # d/d lp of exp(ref − lp) − (ref − lp) − 1 = 1 − exp(ref − lp); padding gets no gradient
    want_grad = torch.tensor([[1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0], [0.0, 0.0, 0.0]]) / 3
    torch.testing.assert_close(lp.grad, want_grad)
    half, _ = kl_loss(lp.detach(), ref, mask, "k3", num_tokens=6)  # a micro-batch's share of a larger minibatch
    assert half.item() == pytest.approx(want / 2, rel=1e-6)
