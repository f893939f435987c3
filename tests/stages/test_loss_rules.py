"""The written rules of the update's loss (issue 42; README "Advantage estimators", `ppo.aggregation`):

* a zero-variance group (all valid scores equal) stays in the update unless `ppo.filter_groups` drops it: its
  rows' advantages are 0, so they add no policy gradient, but their tokens count in the loss's divisors and take
  the KL term (`ppo.kl_in=loss`) and the entropy bonus like every sampled token;
* a row with no token in the loss (`ppo.truncated=mask` without EOS: a response always holds at least its
  first token, so this is the "empty" response) is left out of its group's baseline, gets advantage 0, and
  counts in neither divisor: `seq-mean-token-mean` divides by the minibatch's rows that have a token in the loss,
  as `core.masked_aggregate` does for a whole batch in one call. No NaN arises from either.
"""

import pytest
import torch
from test_update_invariance import AGGREGATIONS, build, fixed_rollout

from rlhf_cli.core import group_adjusted_scores


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_a_row_the_loss_masks_out_counts_in_no_divisor(tmp_path, monkeypatch, aggregation):
    tr = build(tmp_path, "grpo", 2)
    tr.p.aggregation = aggregation
    exp = fixed_rollout(tr, monkeypatch)
    masked = torch.tensor([3, 6])
    exp.loss_mask[masked] = 0.0  # as ppo.truncated=mask leaves an unterminated response
    exp.advantages[masked] = 0.0
    (minibatch,) = exp.plan.order[0]
    total, seen = 0.0, set()
    for b, num_tokens, num_seqs, _ in tr.micro_batches(exp):
        seen.add((num_tokens, num_seqs))
        total = total + tr.losses(b, num_tokens, num_seqs).actor
    assert seen == {(float(exp.loss_mask.sum()), 6.0)}
    whole = exp.rows(torch.cat(minibatch))  # the minibatch in one call: core's own counts
    one_call = tr.losses(whole, float(whole.loss_mask.sum())).actor
    assert torch.isfinite(total) and total.item() == pytest.approx(one_call.item(), rel=1e-5)


def test_an_empty_row_is_left_out_of_its_groups_baseline():
    scores, groups = torch.tensor([1.0, 0.0, 5.0, 0.0]), torch.tensor([0, 0, 0, 0])
    valid = torch.tensor([True, True, False, True])  # row 2 has no token in the loss
    adjusted = group_adjusted_scores(scores, groups, valid, "dr_grpo")
    assert adjusted.tolist() == pytest.approx([2 / 3, -1 / 3, 0.0, -1 / 3])  # mean of 1, 0, 0 = 1/3


def test_a_flat_groups_rows_count_in_the_divisor_and_take_the_kl_term(tmp_path, monkeypatch):
    tr = build(tmp_path, "grpo", 2)
    exp = fixed_rollout(tr, monkeypatch)
    flat = (exp.groups == exp.groups[0]).nonzero().flatten()  # a group whose scores were all equal
    exp.advantages[flat] = 0.0
    gen = torch.Generator().manual_seed(2)
    exp.ref_logprobs = torch.where(exp.loss_mask.bool(), exp.ref_logprobs + 0.3 * torch.randn(exp.loss_mask.shape,
                                                                                          generator=gen), 0.0)
    _, num_tokens, num_seqs, _ = next(tr.micro_batches(exp))
    assert num_tokens == float(exp.loss_mask.sum()) and num_seqs == float(exp.loss_mask.shape[0])
    out = tr.losses(exp.rows(flat), num_tokens, num_seqs)
    assert out.policy.item() == 0.0 and out.actor.item() != 0.0  # no policy gradient; the KL term acts
    out.actor.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.actor.module.parameters())
