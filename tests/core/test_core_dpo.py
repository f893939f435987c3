"""rlhf_cli.core.dpo: hand-computed cases, a copy of TRL's formulas on random inputs, the micro-batch cut and
the errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_cli.core import DPO_LOSSES, dpo_loss

KEYS = {"dpo/loss", "dpo/pair_loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy",
        "dpo/logprobs_chosen", "dpo/logprobs_rejected"}


def trl_losses(pi_c, pi_r, ref_c, ref_r, beta, loss_type, label_smoothing, n_c, n_r):
    """TRL's DPO losses as written in trl 1.12.0's DPOTrainer (a copy of the equations, per pair), with the cDPO
    smoothing of earlier releases' sigmoid: logits = (pi_c - ref_c) - (pi_r - ref_r); sigmoid: -logsigmoid(beta
    logits)(1 - ls) - logsigmoid(-beta logits) ls; hinge: relu(1 - beta logits); ipo: the gap of per-token
    log-ratios (each divided by its response's tokens n_c, n_r), (gap - 1 / (2 beta))^2; rewards beta (pi - ref)."""
    logits = (pi_c - ref_c) - (pi_r - ref_r)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        gap = (pi_c - ref_c) / n_c.clamp(min=1.0) - (pi_r - ref_r) / n_r.clamp(min=1.0)
        losses = (gap - 1 / (2 * beta)) ** 2
    return losses, beta * (pi_c - ref_c), beta * (pi_r - ref_r)


def rand_logprobs(seed, B, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [-torch.rand(B, generator=gen, dtype=dtype) * 30 for _ in range(4)]


def test_hand_computed_sigmoid():
    # pi_c - ref_c = -1 - (-2) = 1, pi_r - ref_r = -3 - (-2) = -1: h = 2; beta 0.5 -> z = 1
    args = [torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0])]
    loss, stats = dpo_loss(*args, beta=0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), rel=1e-6)
    assert stats["dpo/rewards_chosen"] == pytest.approx(0.5) and stats["dpo/rewards_rejected"] == pytest.approx(-0.5)
    assert stats["dpo/margin"] == pytest.approx(1.0) and stats["dpo/accuracy"] == 1.0
    assert stats["dpo/logprobs_chosen"] == -1.0 and stats["dpo/logprobs_rejected"] == -3.0
    assert set(stats) == KEYS
    # cDPO, eps = 0.25: 0.75 log(1 + e^-1) + 0.25 log(1 + e^1)
    loss, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.25)
    assert loss.item() == pytest.approx(0.75 * math.log(1 + math.exp(-1)) + 0.25 * math.log(1 + math.exp(1)),
                                        rel=1e-6)


def test_hand_computed_ipo_and_hinge():
    args = [torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -4.0]), torch.tensor([-2.0, -4.0]),
            torch.tensor([-2.0, -4.0])]  # h = 2 and 0; log-ratios (1, -1) and (0, 0)
    tokens = {"chosen_tokens": torch.tensor([1, 3]), "rejected_tokens": torch.tensor([1, 5])}
    ipo, _ = dpo_loss(*args, beta=0.25, loss="ipo", **tokens)  # 1/(2 beta) = 2: (1/1 + 1/1 - 2)^2 = 0, (0 - 2)^2 = 4
    assert ipo.item() == pytest.approx(2.0)
    per_token = {"chosen_tokens": torch.tensor([2, 1]), "rejected_tokens": torch.tensor([4, 1])}
    ipo, _ = dpo_loss(*args, beta=0.25, loss="ipo", **per_token)  # gap 1/2 + 1/4 = 0.75: (0.75 - 2)^2 = 1.5625
    assert ipo.item() == pytest.approx((1.5625 + 4) / 2)
    hinge, stats = dpo_loss(*args, beta=0.25, loss="hinge")  # relu(1 - 0.5) = 0.5 and relu(1 - 0) = 1 -> 0.75
    assert hinge.item() == pytest.approx(0.75)
    assert stats["dpo/accuracy"] == 0.5  # the tie (h = 0) is not correct
    hinge_far, _ = dpo_loss(*args, beta=1.0, loss="hinge")  # relu(1 - 2) = 0 and 1 -> 0.5
    assert hinge_far.item() == pytest.approx(0.5)


def test_equal_policy_and_reference_give_log_2_and_zero_margins():
    pi_c, pi_r, _, _ = rand_logprobs(0, 16, torch.float32)
    loss, stats = dpo_loss(pi_c, pi_r, pi_c.clone(), pi_r.clone(), beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert stats["dpo/margin"] == 0 and stats["dpo/accuracy"] == 0 and stats["dpo/rewards_chosen"] == 0


def test_sft_term_is_the_chosen_nll_per_chosen_token():
    pi_c, pi_r, ref_c, ref_r = rand_logprobs(1, 4)
    tokens = torch.tensor([3, 5, 2, 6])
    base, _ = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1)
    loss, stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1, sft_weight=0.5, chosen_tokens=tokens)
    nll = -pi_c.sum().item() / 16
    assert stats["dpo/sft_loss"] == pytest.approx(nll, rel=1e-12)
    assert loss.item() == pytest.approx(base.item() + 0.5 * nll, rel=1e-12)
    assert stats["dpo/loss"] == pytest.approx(loss.item()) and stats["dpo/pair_loss"] == pytest.approx(base.item())


@pytest.mark.parametrize("loss_type", list(DPO_LOSSES))
@pytest.mark.parametrize("seed", range(5))
def test_equals_a_copy_of_trl_formulas_on_random_inputs(loss_type, seed):
    """Loss, gradient and rewards against TRL's equations (loss = the mean over pairs + α × the chosen NLL per
    chosen token: TRL 1.12's loss_type=["sigmoid", "sft"], loss_weights=[1, α]), at several β and, for sigmoid,
    label smoothing."""
    pi_c, pi_r, ref_c, ref_r = rand_logprobs(seed, 8)
    beta = [0.05, 0.1, 0.5, 1.0, 2.0][seed]
    ls = 0.1 * (seed % 3) if loss_type == "sigmoid" else 0.0
    tokens, rejected_tokens = torch.arange(1, 9), torch.arange(8, 0, -1)
    ours_c, ours_r = pi_c.clone().requires_grad_(), pi_r.clone().requires_grad_()
    loss, stats = dpo_loss(ours_c, ours_r, ref_c, ref_r, beta, loss_type, ls, sft_weight=0.3, chosen_tokens=tokens,
                           rejected_tokens=rejected_tokens)
    loss.backward()
    theirs_c, theirs_r = pi_c.clone().requires_grad_(), pi_r.clone().requires_grad_()
    losses, rc, rr = trl_losses(theirs_c, theirs_r, ref_c, ref_r, beta, loss_type, ls, tokens.double(),
                                rejected_tokens.double())
    want = losses.mean() + 0.3 * (-theirs_c.sum() / tokens.sum())
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(ours_c.grad, theirs_c.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours_r.grad, theirs_r.grad, rtol=1e-12, atol=0)
    assert stats["dpo/rewards_chosen"] == pytest.approx(rc.mean().item(), rel=1e-12)
    assert stats["dpo/rewards_rejected"] == pytest.approx(rr.mean().item(), rel=1e-12)
    assert stats["dpo/accuracy"] == pytest.approx((rc > rr).double().mean().item())


@pytest.mark.parametrize("loss_type", list(DPO_LOSSES))
def test_micro_batches_with_the_step_divisors_sum_to_the_whole_batch(loss_type):
    pi_c, pi_r, ref_c, ref_r = rand_logprobs(7, 8)
    tokens, rejected = torch.arange(2, 10), torch.arange(1, 9)
    kw = dict(beta=0.2, loss=loss_type, sft_weight=1.0)
    whole, whole_stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, chosen_tokens=tokens, rejected_tokens=rejected, **kw)
    parts = [dpo_loss(pi_c[i:i + 2], pi_r[i:i + 2], ref_c[i:i + 2], ref_r[i:i + 2], num_pairs=8,
                      chosen_tokens=tokens[i:i + 2], rejected_tokens=rejected[i:i + 2],
                      num_chosen_tokens=float(tokens.sum()), **kw) for i in (0, 2, 4, 6)]
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)
    for key, value in whole_stats.items():
        assert sum(p[1][key] for p in parts) == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_bf16_inputs_compute_in_float32_and_no_gradient_reaches_the_reference():
    pi_c, pi_r, ref_c, ref_r = (t.to(torch.bfloat16) for t in rand_logprobs(3, 4, torch.float32))
    ref_c.requires_grad_()
    loss, _ = dpo_loss(pi_c.requires_grad_(), pi_r, ref_c, ref_r, beta=0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert ref_c.grad is None and pi_c.grad is not None


def test_empty_batch_is_zero_and_attached():
    e = torch.zeros(0, requires_grad=True)
    loss, stats = dpo_loss(e, e, e, e, beta=0.1)
    loss.backward()
    assert loss.item() == 0 and stats["dpo/accuracy"] == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"loss": "kto"}, "loss must be one of sigmoid, ipo, hinge"),
    ({"beta": 0.0}, "beta must be > 0"),
    ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
    ({"loss": "ipo", "label_smoothing": 0.1}, "sigmoid loss only"),
    ({"loss": "hinge", "label_smoothing": 0.1}, "sigmoid loss only"),
    ({"sft_weight": 1.0}, "needs chosen_tokens"),
    ({"loss": "ipo", "chosen_tokens": torch.ones(2)}, "needs chosen_tokens and rejected_tokens"),
])
def test_errors(kwargs, match):
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        dpo_loss(x, x, x, x, **{"beta": 0.1, **kwargs})
    with pytest.raises(ValueError, match="shape mismatch"):
        dpo_loss(x, torch.zeros(3), x, x, beta=0.1)
