"""KTO's loss (`core.kto_loss`) against a hand computation and against a copy of TRL 1.12's formula
(`trl/trainer/kto_trainer.py`, `KTOTrainer._compute_loss`, written out below, not imported); its reference point
(`core.kl_reference_point`: the mismatched pairs cycled by one, clamped at 0); a step cut into micro-batches sums
to the whole step's loss, gradient and statistics."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_cli.core import kl_completion_index, kl_reference_point, kto_loss


def trl_kto_loss(policy_logps, ref_logps, labels, kl_logps, ref_kl_logps, beta, desirable_weight,
                 undesirable_weight):
    """TRL 1.12's KTO loss and metrics, as `KTOTrainer._compute_loss` computes them on one process with
    loss_type="kto" (its gather over processes is the identity there)."""
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    chosen_idx = torch.nonzero(labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~labels, as_tuple=False).view(-1)
    chosen_logps = policy_logps.index_select(0, chosen_idx)
    rejected_logps = policy_logps.index_select(0, rejected_idx)
    ref_chosen_logps = ref_logps.index_select(0, chosen_idx)
    ref_rejected_logps = ref_logps.index_select(0, rejected_idx)
    chosen_logratios = chosen_logps - ref_chosen_logps
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_logratios = rejected_logps - ref_rejected_logps
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    rejected_rewards = beta * rejected_logratios.detach()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    metrics = {"kl": kl.item(), "rewards/chosen": chosen_rewards.nansum().item() / len(chosen_idx),
               "logps/chosen": chosen_logps.nansum().item() / len(chosen_idx),
               "rewards/rejected": rejected_rewards.nansum().item() / len(rejected_idx),
               "logps/rejected": rejected_logps.nansum().item() / len(rejected_idx)}
    return losses.nanmean(), metrics


def random_batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 40
    ref = lp + torch.randn(n, generator=g, dtype=torch.float64) * 3
    labels = torch.tensor([True, False, True, True, False, False, True, False][:n])
    return lp, ref, labels


def test_hand_computed_case():
    """Two rows, β = 0.5, z0 = 1: a desirable row of log-ratio 3 loses λ_D (1 − σ(1)), an undesirable one of
    log-ratio −1 loses λ_U (1 − σ(1)); the mean over the 2 rows."""
    lp = torch.tensor([-10.0, -20.0], requires_grad=True)
    ref = torch.tensor([-13.0, -19.0])
    sig1 = 1 / (1 + math.exp(-1))
    loss, stats = kto_loss(lp, ref, torch.tensor([True, False]), 1.0, beta=0.5, desirable_weight=2.0,
                           undesirable_weight=0.5)
    want = (2.0 * (1 - sig1) + 0.5 * (1 - sig1)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert stats["kto/loss"] == pytest.approx(want, rel=1e-6)
    assert stats["kto/rewards_desirable"] == pytest.approx(1.5) and stats["kto/rewards_undesirable"] == -0.5
    assert stats["kto/logprobs_desirable"] == -10.0 and stats["kto/logprobs_undesirable"] == -20.0
    loss.backward()  # d/dr of λ_D (1 − σ(β (r − z0))) is −λ_D β σ'(1); of λ_U (1 − σ(β (z0 − r))) +λ_U β σ'(1)
    d = sig1 * (1 - sig1)
    torch.testing.assert_close(lp.grad, torch.tensor([-2.0 * 0.5 * d / 2, 0.5 * 0.5 * d / 2]))


def test_first_step_is_half_each_weight():
    """The policy is its reference: every log-ratio is 0, z0 is 0, and each row loses λ/2."""
    lp, _, labels = random_batch()
    loss, stats = kto_loss(lp, lp.clone(), labels, kl_reference_point(torch.zeros(()), 8), beta=0.1,
                           desirable_weight=1.0, undesirable_weight=3.0)
    n_good = int(labels.sum())
    assert loss.item() == pytest.approx((0.5 * n_good + 1.5 * (8 - n_good)) / 8)
    assert stats["kto/rewards_desirable"] == 0 and stats["kto/rewards_undesirable"] == 0


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
@pytest.mark.parametrize("kl_shift", [0.0, 5.0, -50.0])  # -50: the KL estimate is negative and clamped to 0
def test_equals_trls_formula(weights, kl_shift):
    lp, ref, labels = random_batch(seed=1)
    g = torch.Generator().manual_seed(2)
    kl_lp = -torch.rand(8, generator=g, dtype=torch.float64) * 30
    ref_kl_lp = kl_lp - torch.randn(8, generator=g, dtype=torch.float64) - kl_shift
    want, metrics = trl_kto_loss(lp, ref, labels, kl_lp, ref_kl_lp, 0.2, *weights)
    z0 = kl_reference_point((kl_lp - ref_kl_lp).sum(), 8)
    assert float(z0) == pytest.approx(metrics["kl"], abs=1e-12) and float(z0) >= 0
    loss, stats = kto_loss(lp, ref, labels, z0, beta=0.2, desirable_weight=weights[0], undesirable_weight=weights[1])
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    for ours, theirs in (("rewards_desirable", "rewards/chosen"), ("logprobs_desirable", "logps/chosen"),
                         ("rewards_undesirable", "rewards/rejected"), ("logprobs_undesirable", "logps/rejected")):
        assert stats[f"kto/{ours}"] == pytest.approx(metrics[theirs], abs=1e-9), ours
    if kl_shift < 0:
        assert float(z0) == 0.0


def test_kl_pairs_each_prompt_with_the_previous_rows_completion():
    """TRL's rotation (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}); a single row has no mismatched pair."""
    assert kl_completion_index(4).tolist() == [3, 0, 1, 2]
    assert kl_completion_index(2).tolist() == [1, 0]
    assert kl_completion_index(4, ["a", "b", "c", "d"]).tolist() == [3, 0, 1, 2]  # no shared prompt: TRL's rule
    # a preference pair split into two rows side by side (b, b): each pairs with an earlier row of another prompt
    assert kl_completion_index(4, ["a", "b", "b", "c"]).tolist() == [3, 0, 0, 2]
    assert kl_completion_index(3, ["a", "a", "a"]).tolist() == [2, 0, 1]  # one prompt only: the previous row
    with pytest.raises(ValueError, match="at least 2 rows"):
        kl_completion_index(1)
    with pytest.raises(ValueError, match="at least one"):
        kl_reference_point(torch.zeros(()), 0)
    assert float(kl_reference_point(torch.tensor([3.0, -1.0]), 4)) == 0.5  # the mean, 2 / 4
    assert float(kl_reference_point(torch.tensor(-3.0), 4)) == 0.0


def test_micro_batches_sum_to_the_step():
    """A step cut into micro-batches with the step's divisors: the summed losses, gradients and statistics are the
    whole batch's."""
    lp, ref, labels = random_batch(seed=3)
    lp = lp.float().requires_grad_()
    whole, stats = kto_loss(lp, ref.float(), labels, 0.7, beta=0.3)
    whole.backward()
    grad = lp.grad.clone()
    lp.grad = None
    parts, summed = [], {}
    for cut in ((0, 3), (3, 5), (5, 8)):
        sl = slice(*cut)
        loss, s = kto_loss(lp[sl], ref[sl].float(), labels[sl], 0.7, beta=0.3, num_rows=8,
                           num_desirable=int(labels.sum()), num_undesirable=int((~labels).sum()))
        parts.append(loss)
        for k, v in s.items():
            summed[k] = summed.get(k, 0.0) + v
    torch.stack(parts).sum().backward()
    assert torch.stack(parts).sum().item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(lp.grad, grad)
    for k in stats:
        assert summed[k] == pytest.approx(stats[k], rel=1e-6, abs=1e-9), k


def test_bad_arguments_are_refused():
    lp, ref, labels = random_batch()
    with pytest.raises(ValueError, match="shape mismatch"):
        kto_loss(lp, ref[:3], labels, 0.0, beta=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        kto_loss(lp, ref, labels, 0.0, beta=0.0)
    with pytest.raises(ValueError, match="weights must be > 0"):
        kto_loss(lp, ref, labels, 0.0, beta=0.1, undesirable_weight=0.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        kto_loss(lp, ref, labels, -1.0, beta=0.1)
