"""The policy losses `ppo.policy_loss` selects (`core.POLICY_LOSSES`): PPO with clip-higher and dual-clip, GSPO
and CISPO, each against a plain-Python loop (value, stats and gradient), a hand-computed case, and a transcription
of a peer's formula (veRL's or TRL's, cited where it is written down) on random inputs."""

import math

import pytest
import torch
from core_helpers import with_garbage
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_losses import POLICY_KEYS, aggregate, assert_stats_close, mean, rand_ppo_batch, real_rows

from rlhf_cli import config, registry
from rlhf_cli.core import POLICY_LOSSES, cispo_loss, gspo_loss, policy_loss

PROPERTY = settings(max_examples=25, deadline=None)
AGGREGATIONS = ["token-mean", "seq-mean-token-mean"]
SHAPES = [(1, 1), (2, 5), (4, 7), (3, 16)]
CLIPS = [(0.2, None, None), (0.2, 0.28, None), (0.2, None, 3.0), (0.1, 0.3, 2.0)]  # (clip, clip_high, dual_clip)


def test_the_policy_losses_are_the_declared_ones_in_order():
    assert list(POLICY_LOSSES) == list(registry.POLICY_LOSSES.names)
    assert config.PPOConfig().policy_loss == "ppo" and POLICY_LOSSES["ppo"] is policy_loss


# ---------------------------------------------------------------- plain-Python references


def agg_weights(mask, num_tokens, aggregation, num_seqs):
    """For each row, the weight d loss / d per_token_t of its real tokens under `aggregation`."""
    lengths = [sum(row) for row in mask.tolist()]
    if aggregation == "token-mean":
        n = sum(lengths) if num_tokens is None else num_tokens
        return [1 / max(n, 1)] * len(lengths)
    n = sum(1 for k in lengths if k) if num_seqs is None else num_seqs
    return [1 / (k * max(n, 1)) if k else 0.0 for k in lengths]


def ref_surrogate(r, A, clip, high, dual_clip):
    """One token's clipped surrogate (negated) and d loss / d r, with the flags (high, low, dual)."""
    unclipped, clipped = -A * r, -A * min(max(r, 1 - clip), 1 + high)
    loss, grad = (unclipped, -A) if unclipped >= clipped else (clipped, 0.0)
    dual = dual_clip is not None and A < 0 and loss > -dual_clip * A
    if dual:
        loss, grad = -dual_clip * A, 0.0
    return loss, grad, (clipped > unclipped and A > 0, clipped > unclipped and A < 0, dual)


def ref_loss(kind, lp, olp, adv, mask, clip, num_tokens=None, aggregation="token-mean", num_seqs=None,
             clip_high=None, dual_clip=None):
    """(loss, stats, d loss / d logprobs as nested lists) of `kind` in `ppo`, `gspo`, `cispo`, token by token."""
    high = clip if clip_high is None else clip_high
    weights = agg_weights(mask, num_tokens, aggregation, num_seqs)
    losses, grads, flags, kls, ratios = [], [], {"high": [], "low": [], "dual": []}, [], []
    for i, row in enumerate(real_rows(mask, lp, olp, adv)):
        seq_ratio = math.exp(sum(a - b for a, b, _ in row) / len(row)) if row else 1.0
        row_losses, row_grads = [], []
        for a, b, A in row:
            r = math.exp(a - b)
            if kind == "cispo":
                w = min(r, 1 + high)
                loss, grad = -w * A * a, -w * A
                f = (r > 1 + high, False, False)
                ratios.append(r)
            else:
                s = seq_ratio if kind == "gspo" else r
                loss, d_ratio, f = ref_surrogate(s, A, clip, high, dual_clip)
                grad = d_ratio * s  # d s / d log pi_t = s (the token form's gradient, GSPO eq. 14)
                ratios.append(s)
            row_losses.append(loss)
            row_grads.append(grad * weights[i])
            for key, flag in zip(("high", "low", "dual"), f):
                flags[key].append(1.0 if flag else 0.0)
            kls.append((r - 1) - (a - b))
        losses.append(row_losses)
        grads.append(row_grads)
    loss = aggregate(losses, num_tokens, aggregation, num_seqs)
    stats = {
        "policy/loss": loss,
        "policy/clipfrac": mean(flags["high"]) + mean(flags["low"]),
        "policy/clipfrac_high": mean(flags["high"]),
        "policy/clipfrac_low": mean(flags["low"]),
        "policy/dual_clipfrac": mean(flags["dual"]),
        "policy/approx_kl": mean(kls),
        "policy/ratio_mean": mean(ratios),
        "policy/kept_tokens": float(len(ratios)),
    }
    return loss, stats, grads


def run(fn, d, *args, **kwargs):
    lp = d["logprobs"].clone().requires_grad_(True)
    loss, stats = fn(lp, d["old_logprobs"], d["advantages"], d["mask"], *args, **kwargs)
    loss.backward()
    return loss, stats, lp.grad


def assert_grads(got, want_rows, mask):
    assert (got[~mask] == 0).all()
    got_rows = [[g for g, m in zip(row, mrow) if m] for row, mrow in zip(got.tolist(), mask.tolist())]
    for g_row, w_row in zip(got_rows, want_rows):
        assert g_row == pytest.approx(w_row, abs=1e-12)


def row_constant_advantages(d):
    """`d` with one advantage per row (a sequence-level estimator's: GRPO's outcome advantage)."""
    return {**d, "advantages": d["advantages"][:, :1].expand_as(d["advantages"]).contiguous()}


# ---------------------------------------------------------------- loops on random inputs


@pytest.mark.parametrize("kind,clip,clip_high,dual_clip",  # cispo refuses a dual clip (test below)
                         [(k, *c) for k in sorted(POLICY_LOSSES) for c in CLIPS if k != "cispo" or c[2] is None])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("num_tokens,num_seqs", [(None, None), (50, 7)])
def test_policy_losses_match_the_loop_reference(kind, aggregation, B, T, clip, clip_high, dual_clip, num_tokens,
                                                num_seqs):
    d = rand_ppo_batch(B * 31 + T, B, T)
    if kind == "gspo":
        d = row_constant_advantages(d)
    args = (clip, num_tokens, aggregation, num_seqs)
    loss, stats, grad = run(POLICY_LOSSES[kind], d, *args, clip_high=clip_high, dual_clip=dual_clip)
    want_loss, want_stats, want_grads = ref_loss(kind, d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"],
                                                 *args, clip_high=clip_high, dual_clip=dual_clip)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert_stats_close(stats, want_stats, abs=1e-12)
    assert set(stats) == POLICY_KEYS
    assert_grads(grad, want_grads, d["mask"])


def test_the_random_inputs_reach_every_branch():
    """The loop test above is only as good as its inputs: on them every clip, the dual clip and the CISPO cap act."""
    seen = {k: 0.0 for k in ("policy/clipfrac_high", "policy/clipfrac_low", "policy/dual_clipfrac")}
    capped = 0.0
    for B, T in SHAPES:
        d = rand_ppo_batch(B * 31 + T, B, T)
        _, stats = policy_loss(d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"], 0.1, clip_high=0.3,
                               dual_clip=2.0)
        for k in seen:
            seen[k] += stats[k]
        capped += cispo_loss(d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"], 0.2)[1]["policy/clipfrac"]
    assert all(v > 0 for v in seen.values()), seen
    assert capped > 0


# ---------------------------------------------------------------- hand-computed cases


def test_clip_high_hand_computed():
    # ratios 1.5 (A=1: capped at 1 + 0.28 -> -1.28, not 1.2), 0.5 (A=-1: raised to 1 - 0.2 -> 0.8) and 1.1 (A=1)
    lp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(lp, torch.zeros(1, 3), adv, mask, clip=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1) / 3)
    assert stats["policy/clipfrac_high"] == pytest.approx(1 / 3)
    assert stats["policy/clipfrac_low"] == pytest.approx(1 / 3)
    assert stats["policy/clipfrac"] == pytest.approx(2 / 3) and stats["policy/dual_clipfrac"] == 0
    loss.backward()  # only the unclipped token learns: d(-A r)/d log pi = -A r
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -1.1 / 3]]))
    symmetric, _ = policy_loss(lp.detach(), torch.zeros(1, 3), adv, mask, clip=0.2)
    assert symmetric.item() == pytest.approx((-1.2 + 0.8 - 1.1) / 3)


def test_dual_clip_hand_computed():
    # A = -1 everywhere; ratios 4 (PPO keeps the unclipped 4; dual clip c = 3 bounds it at 3), 2 (below c: 2) and
    # 0.5 (clipped low: 0.8); A = +2 with ratio 4 is not touched by the dual clip (capped at 1.2 -> -2.4)
    lp = torch.tensor([[math.log(4.0), math.log(2.0), math.log(0.5), math.log(4.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(lp, torch.zeros(1, 4), adv, mask, clip=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 + 0.8 - 2.4) / 4)
    assert stats["policy/dual_clipfrac"] == pytest.approx(1 / 4)
    assert stats["policy/clipfrac_low"] == pytest.approx(1 / 4)
    assert stats["policy/clipfrac_high"] == pytest.approx(1 / 4)
    loss.backward()  # the dual-clipped token has no gradient; the ratio-2 token's is -A r / 4 = 0.5
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.5, 0.0, 0.0]]))
    plain, _ = policy_loss(lp.detach(), torch.zeros(1, 4), adv, mask, clip=0.2)
    assert plain.item() == pytest.approx((4.0 + 2.0 + 0.8 - 2.4) / 4)


def test_gspo_hand_computed():
    # row 0: log ratios (ln 2, 0) -> s = sqrt(2) ~ 1.414, A = 1: clipped to 1.2 on both tokens (no gradient);
    # row 1: one token, log ratio ln 0.9 -> s = 0.9, A = -2: unclipped (0.9 > 0.8), loss 1.8, gradient -A s = 1.8;
    # row 2: (ln 1.1, ln 0.9, 0) -> s = (0.99)^(1/3), A = 1, unclipped: each token's gradient -A s
    lp = torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(0.9), 5.0, 5.0], [math.log(1.1), math.log(0.9), 0.0]],
                      requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    s2 = 0.99 ** (1 / 3)
    loss, stats = gspo_loss(lp, torch.zeros(3, 3), adv, mask, clip=0.2)
    assert loss.item() == pytest.approx((-1.2 * 2 + 1.8 - 3 * s2) / 6)
    assert stats["policy/clipfrac_high"] == pytest.approx(2 / 6) and stats["policy/clipfrac_low"] == 0
    assert stats["policy/ratio_mean"] == pytest.approx((2 * math.sqrt(2) + 0.9 + 3 * s2) / 6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [1.8, 0.0, 0.0], [-s2, -s2, -s2]]) / 6)
    seq, _ = gspo_loss(lp.detach(), torch.zeros(3, 3), adv, mask, clip=0.2, aggregation="seq-mean-token-mean")
    assert seq.item() == pytest.approx((-1.2 + 1.8 - s2) / 3)


def test_cispo_hand_computed():
    # ratios 1.5 (A=1: weight capped at 1 + 0.28), 0.5 (A=-1: no lower bound, weight 0.5); loss -w A log pi
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, math.nan]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = cispo_loss(lp, torch.zeros(1, 3), adv, mask, clip=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 * math.log(1.5) + 0.5 * math.log(0.5)) / 2)
    assert stats["policy/clipfrac"] == stats["policy/clipfrac_high"] == pytest.approx(0.5)
    assert stats["policy/clipfrac_low"] == 0 and stats["policy/dual_clipfrac"] == 0
    loss.backward()  # every real token learns, the capped one with weight 1.28
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28 / 2, 0.5 / 2, 0.0]]))


# ---------------------------------------------------------------- properties


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 8))
def test_gspo_gradient_is_the_sequence_objectives(seed, B, T):
    """With one advantage per row and seq-mean-token-mean, the token form's gradient is that of the paper's
    sequence objective -1/G Σ_i min(s_i A_i, clip(s_i) A_i) (Zheng et al. 2025), taken by autograd."""
    d = row_constant_advantages(rand_ppo_batch(seed, B, T))
    mask = d["mask"]
    loss, _, grad = run(gspo_loss, d, 0.2, aggregation="seq-mean-token-mean", clip_high=0.3)
    lp = d["logprobs"].clone().requires_grad_(True)
    m = mask.double()
    s = torch.exp(((lp - d["old_logprobs"]) * m).sum(1) / m.sum(1).clamp(min=1))
    A = d["advantages"][:, 0]
    seq = -torch.minimum(s * A, s.clamp(0.8, 1.3) * A)
    rows = mask.any(1)
    want = seq[rows].sum() / max(int(rows.sum()), 1)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, lp.grad, 0.0), atol=1e-12, rtol=0)


@PROPERTY
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(2, 6),
    T=st.integers(1, 8),
    n_micro=st.integers(1, 4),
    aggregation=st.sampled_from(AGGREGATIONS),
    kind=st.sampled_from(sorted(POLICY_LOSSES)),
)
def test_micro_batches_give_the_full_batch_gradient(seed, B, T, n_micro, aggregation, kind):
    d = rand_ppo_batch(seed, B, T)
    mask = d["mask"]
    extra = {"clip_high": 0.3} if kind == "cispo" else {"clip_high": 0.3, "dual_clip": 2.0}

    def grads(chunks, num_tokens, num_seqs):
        lp = d["logprobs"].clone().requires_grad_(True)
        for rows in chunks:
            loss, _ = POLICY_LOSSES[kind](lp[rows], d["old_logprobs"][rows], d["advantages"][rows], mask[rows], 0.2,
                                          num_tokens, aggregation, num_seqs, **extra)
            loss.backward()
        return lp.grad

    full = grads([torch.arange(B)], None, None)
    split = grads(torch.arange(B).tensor_split(n_micro), mask.sum(), mask.any(1).sum())
    torch.testing.assert_close(split, full, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("value", [1e6, -math.inf, math.nan])
def test_padding_garbage_changes_no_output(kind, value):
    d = rand_ppo_batch(3, 4, 6)
    mask = d["mask"]
    dirty = {**d, **{k: with_garbage(d[k], mask, value) for k in ("logprobs", "old_logprobs", "advantages")}}
    clean_loss, clean_stats, clean_grad = run(POLICY_LOSSES[kind], d, 0.2, clip_high=0.3)
    dirty_loss, dirty_stats, dirty_grad = run(POLICY_LOSSES[kind], dirty, 0.2, clip_high=0.3)
    assert torch.equal(clean_loss, dirty_loss) and clean_stats == dirty_stats and torch.equal(clean_grad, dirty_grad)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_all_zero_mask_gives_zero_loss_with_graph(kind):
    lp = torch.randn(2, 3, requires_grad=True)
    loss, stats = POLICY_LOSSES[kind](lp, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3), 0.2)
    loss.backward()
    assert loss.item() == 0 and (lp.grad == 0).all() and all(math.isfinite(v) for v in stats.values())


def test_policy_losses_reject_bad_arguments():
    x = torch.zeros(2, 3)
    for fn in POLICY_LOSSES.values():
        with pytest.raises(ValueError, match="clip_high"):
            fn(x, x, x, x, 0.2, clip_high=-0.1)
        with pytest.raises(ValueError, match="clip must"):
            fn(x, x, x, x, -0.2)
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            fn(x, x, x, x, 0.2, dual_clip=1.0)
        with pytest.raises(ValueError, match="shape mismatch"):
            fn(x, x, torch.zeros(2, 4), x, 0.2)
    with pytest.raises(ValueError, match="dual_clip is not defined for CISPO"):
        cispo_loss(x, x, x, x, 0.2, dual_clip=3.0)


# ---------------------------------------------------------------- peers' formulas, transcribed
# Each function below transcribes a peer's formula (not its code paths: no config objects, no overflow guards that
# random inputs never reach), so that our reading of the paper is checked against theirs on random inputs.


def peer_agg(loss_mat, mask, mode):
    """veRL `core_algos.agg_loss`: token-mean = masked sum / mask sum; seq-mean-token-mean = mean over rows of the
    row's token mean (rows here all have tokens)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()


def verl_vanilla(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c,
                 mode):
    """veRL `verl/trainer/ppo/core_algos.py::compute_policy_loss_vanilla` (clip-higher and dual-clip)."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return peer_agg(pg_losses, response_mask, mode)


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, mode):
    """veRL `verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo`."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    return peer_agg(torch.maximum(pg_losses1, pg_losses2), response_mask, mode)


def trl_cispo(per_token_logps, old_per_token_logps, advantages, completion_mask, epsilon_high, mode):
    """TRL `trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss`, `loss_type="cispo"` (token-level sampling):
    an absolute cap `epsilon_high` on the ratio."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped_ratios * advantages * per_token_logps
    return peer_agg(per_token_loss, completion_mask, mode)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 8),
       mode=st.sampled_from(AGGREGATIONS), kind=st.sampled_from(sorted(POLICY_LOSSES)))
def test_policy_losses_match_a_peers_formula(seed, B, T, mode, kind):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)  # no empty row: the peers' seq-mean divides by B
    mask = torch.arange(T) < lengths[:, None]
    d = {**rand_ppo_batch(seed, B, T), "mask": mask}
    old, adv, m = d["old_logprobs"], d["advantages"], mask.double()
    if kind == "gspo":
        adv = row_constant_advantages(d)["advantages"]
    clean = {k: torch.where(mask, v, 0.0) for k, v in (("lp", d["logprobs"]), ("old", old), ("adv", adv))}
    ours_lp, peer_lp = (clean["lp"].clone().requires_grad_(True) for _ in range(2))
    if kind == "ppo":
        ours, _ = policy_loss(ours_lp, old, adv, mask, 0.1, aggregation=mode, clip_high=0.3, dual_clip=2.5)
        peer = verl_vanilla(clean["old"], peer_lp, clean["adv"], m, 0.1, 0.3, 2.5, mode)
    elif kind == "gspo":
        ours, _ = gspo_loss(ours_lp, old, adv, mask, 0.1, aggregation=mode, clip_high=0.3)
        peer = verl_gspo(clean["old"], peer_lp, clean["adv"], m, 0.1, 0.3, mode)
    else:
        ours, _ = cispo_loss(ours_lp, old, adv, mask, 0.2, aggregation=mode, clip_high=0.3)
        peer = trl_cispo(peer_lp, clean["old"], clean["adv"], m, 1.3, mode)  # TRL's epsilon_high = 1 + clip_high
    ours.backward()
    peer.backward()
    assert ours.item() == pytest.approx(peer.item(), abs=1e-12)
    torch.testing.assert_close(ours_lp.grad, peer_lp.grad * m, atol=1e-12, rtol=0)

