"""The episode seam (`rollout/episodes.py`): the single-turn runner's action mask, and what a zero of the action
mask inside a response means for every piece of the update (the property a multi-turn runner relies on: tokens
the policy did not sample, such as a tool's output, get no gradient, no KL, no advantage and no weight in any
statistic, while the sampled tokens after them train as before)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_cli.core import ESTIMATORS, POLICY_LOSSES, entropy_bonus, kl_loss, value_loss
from rlhf_cli.rollout import (
    EpisodeRunner,
    Episodes,
    Experience,
    Generation,
    HFGenerator,
    Sampling,
    SingleTurnRunner,
    join_episodes,
    kl_stats,
    response_mask,
    whiten_across_ranks,
)
from rlhf_cli.rollout.shaping import shape

PAD, EOS = 0, 2


class Scripted:
    """A generator answering fixed responses (B, max_new_tokens) with fixed engine log-probs, cut at the first EOS
    as every engine cuts them."""

    own_weights, sync_seconds, probes, tensors_changed = False, 0.0, False, None

    def __init__(self, raw: list[list[int]], logprobs: bool = True) -> None:
        self.raw, self.logprobs = torch.tensor(raw), logprobs

    def generate(self, prompt_ids, seeds, sampling):
        responses, mask, has_eos = response_mask(self.raw, sampling.eos_ids, sampling.pad_id)
        lp = -(responses.float() + 1) / 10 * mask if self.logprobs else None
        return Generation(responses, mask, has_eos, lp)

    def update_weights(self, model, gather=None):
        pass

    def close(self):
        pass


def sampling(max_new_tokens: int = 4) -> Sampling:
    return Sampling(eos_ids=(EOS,), pad_id=PAD, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0)


def test_the_single_turn_runners_action_mask_is_the_sampled_response():
    """1 on every sampled token, the EOS included, 0 on the padding after it; equal to the response part of
    the attention mask (single turn: every response token was sampled); one turn per row, no score of its own."""
    prompts = [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [8]}, {"prompt_ids": [9, 10]}]
    runner = SingleTurnRunner()
    assert isinstance(runner, EpisodeRunner)
    ep = runner.run(prompts, [1, 2, 3], Scripted([[11, EOS, 12, 13], [14, 15, 16, 17], [EOS, 18, 19, 20]]),
                    sampling())
    assert ep.P == 3 and ep.input_ids.shape == (3, 3 + 4)
    assert ep.action_mask.dtype == torch.float32
    assert ep.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert torch.equal(ep.action_mask, ep.attention_mask[:, ep.P:].float())
    assert ep.has_eos.tolist() == [True, False, True] and ep.turns.tolist() == [1, 1, 1] and ep.score is None
    assert torch.equal(ep.engine_logprobs, -(ep.input_ids[:, ep.P:].float() + 1) / 10 * ep.action_mask)
    # a narrower round joined with it: every row keeps its own mask and log-probs, padded to the joined width
    narrow = runner.run(prompts[:1], [4], Scripted([[EOS, 21, 22, 23]]), sampling())
    joined = join_episodes([ep, narrow.rows(torch.tensor([0]))], PAD)
    assert joined.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert torch.equal(joined.engine_logprobs[:3], ep.engine_logprobs)
    assert joined.turns.tolist() == [1, 1, 1, 1]


def test_the_single_turn_runner_on_the_hf_engine_masks_exactly_the_sampled_tokens(tiny_causal, tokenizer):
    """On the real `hf` engine (tiny model): the action mask is 1 up to and including each row's first EOS."""
    generator = HFGenerator("fp32", chunk=2)
    generator.update_weights(tiny_causal)
    prompts = [{"prompt_ids": tokenizer("Hello there")["input_ids"]}, {"prompt_ids": tokenizer("Hi")["input_ids"]},
               {"prompt_ids": tokenizer("What is two plus two?")["input_ids"]}]
    ep = SingleTurnRunner().run(prompts, [7, 8, 9], generator, sampling(8))
    response = ep.input_ids[:, ep.P:]
    for row, ids in zip(ep.action_mask, response):
        n = int(row.sum())
        assert row.tolist() == [1.0] * n + [0.0] * (len(row) - n)  # one run of sampled tokens, then padding
        assert not bool((ids[:n - 1] == EOS).any())  # no EOS before the last sampled token
        assert bool((ids[n:] == PAD).all())
    assert ep.engine_logprobs is None  # hf gives none


# ----------------------------------------------------------------------------------------------
# zeros of the action mask inside a response: a tool's output in a multi-turn episode

B, R = 4, 8
HOLE = slice(2, 5)  # response columns 2..4 of every row: tokens the policy did not sample
AFTER = 6  # a sampled token after the hole


def hand_built(seed: int = 0, fill: float | None = None) -> SimpleNamespace:
    """Random rollout tensors (B, R) whose action mask has a hole inside each response; `fill`: the value written
    at the hole's positions into every per-token input (what a runner's non-sampled tokens may hold)."""
    g = torch.Generator().manual_seed(seed)
    action_mask = torch.ones(B, R)
    action_mask[:, HOLE] = 0
    action_mask[1, 7:] = 0  # one row also ends early (right padding)
    t = SimpleNamespace(action_mask=action_mask,
                        logprobs=-torch.rand(B, R, generator=g) - 0.1, old=-torch.rand(B, R, generator=g) - 0.1,
                        ref=-torch.rand(B, R, generator=g) - 0.1, values=torch.randn(B, R, generator=g),
                        entropy=torch.rand(B, R, generator=g), score=torch.randn(B, generator=g),
                        groups=torch.tensor([0, 0, 1, 1]), valid=torch.ones(B, dtype=torch.bool))
    if fill is not None:
        for name in ("logprobs", "old", "ref", "values", "entropy"):
            getattr(t, name)[:, HOLE] = fill
    return t


def shaped(t: SimpleNamespace, estimator: str, kl_in: str = "reward", whiten: bool = True):
    p = SimpleNamespace(kl_in=kl_in, kl_estimator="k1", gamma=1.0, lam=0.95)
    values = t.values if ESTIMATORS[estimator].needs_critic else None
    return shape(p, ESTIMATORS[estimator], whiten, 0.1, score=t.score, old_logprobs=t.old, ref_logprobs=t.ref,
                 values=values, action_mask=t.action_mask, loss_mask=t.action_mask, valid=t.valid, groups=t.groups)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_pp"])
def test_tokens_outside_the_action_mask_get_no_reward_no_advantage_and_no_weight_in_whitening(estimator):
    """Rewards (the KL penalty and the score), advantages and returns are 0 at the hole whatever its log-probs
    and values hold, and the advantages of the sampled tokens do not depend on them (whitening counts only the
    sampled tokens); the score lands on the last sampled token, and the sampled tokens after the hole carry an
    advantage."""
    clean, dirty = hand_built(), hand_built(fill=5.0)
    for whiten in (False, True):
        a = shaped(clean, estimator, whiten=whiten)
        b = shaped(dirty, estimator, whiten=whiten)
        for x, y in zip(a, b):  # rewards, advantages, returns
            assert torch.equal(x[:, HOLE], torch.zeros(B, 3))
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        rewards, advantages, _ = a
        assert bool((advantages[:, AFTER] != 0).all())
    # the score at the last sampled token (row 1 ends at column 6), the KL penalty on every other sampled one
    rewards, _, _ = shaped(clean, estimator, whiten=False)
    kl = -0.1 * (clean.old - clean.ref)
    torch.testing.assert_close(rewards[1, 6], kl[1, 6] + clean.score[1])
    torch.testing.assert_close(rewards[0, 7], kl[0, 7] + clean.score[0])
    torch.testing.assert_close(rewards[0, :2], kl[0, :2])
    assert rewards[1, 7] == 0
    # whitening alone: the hole's values change nothing, and it stays 0
    x = torch.randn(B, R)
    y = x.clone()
    y[:, HOLE] = 1e6
    torch.testing.assert_close(whiten_across_ranks(x, clean.action_mask), whiten_across_ranks(y, clean.action_mask))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_tokens_outside_the_action_mask_get_exactly_zero_gradient_and_count_in_no_loss(policy_loss, aggregation):
    """The policy loss, the KL loss, the entropy bonus and the value loss read the loss mask (the action mask of
    the rows that count): each one's gradient is exactly 0 at the hole, nonzero on the sampled tokens after it,
    and its value does not change when the hole holds anything else (its tokens count in no divisor)."""
    losses = {}
    for fill in (None, 7.0):
        t = hand_built(fill=fill)
        _, advantages, returns = shaped(hand_built(), "gae")
        mask = t.action_mask
        lp = t.logprobs.clone().requires_grad_(True)
        ent = t.entropy.clone().requires_grad_(True)
        v = t.values.clone().requires_grad_(True)
        agg = dict(num_tokens=float(mask.sum()), num_seqs=float((mask.sum(1) > 0).sum()), aggregation=aggregation)
        # at ratio 1 (the first minibatch's), so that no clip zeroes a sampled token's gradient
        pg, _ = POLICY_LOSSES[policy_loss](lp, t.logprobs, advantages, mask, 0.2, **agg, clip_high=None,
                                           dual_clip=None, weights=None)
        kl, _ = kl_loss(lp, t.ref, mask, "k3", **agg)
        bonus, _ = entropy_bonus(None, mask, entropy=ent, **agg)
        vf, _ = value_loss(v, t.values.detach(), returns, mask, 0.2, **agg)
        terms = {"policy": (pg, lp), "kl": (kl, lp), "entropy": (bonus, ent), "value": (vf, v)}
        for name, (loss, x) in terms.items():
            (grad,) = torch.autograd.grad(loss, x)
            assert torch.equal(grad[:, HOLE], torch.zeros(B, 3)), name
            assert bool((grad[:, AFTER] != 0).all()), name
            losses.setdefault(name, []).append(loss.item())
    for name, (clean, dirty) in losses.items():
        assert clean == dirty, name


def test_tokens_outside_the_action_mask_add_nothing_to_the_rollouts_kl_statistics():
    """`kl_stats` (`objective/kl`, `objective/kl_k3`, `objective/entropy_sampled`) sums over the action mask: the
    hole's log-probs change none of them, though the attention mask holds its tokens."""
    stats = []
    for fill in (None, -3.0):
        t = hand_built(fill=fill)
        P = 2
        exp = Experience(
            input_ids=torch.ones(B, P + R, dtype=torch.long), attention_mask=torch.ones(B, P + R, dtype=torch.long),
            action_mask=t.action_mask, loss_mask=t.action_mask, old_logprobs=t.old, ref_logprobs=t.ref,
            values=t.values, rewards=torch.zeros(B, R), advantages=torch.zeros(B, R), returns=torch.zeros(B, R),
            scores=t.score, groups=t.groups)
        assert exp.prompt_len == P
        stats.append(kl_stats(exp, 0.1))
    assert stats[0] == stats[1]
    want = ((hand_built().old - hand_built().ref) * hand_built().action_mask).sum(1).mean().item()
    assert stats[0]["objective/kl"] == pytest.approx(want)


def test_episodes_rows_keep_every_per_row_field():
    ep = Episodes(torch.arange(12).view(3, 4), torch.ones(3, 4, dtype=torch.long), 1, torch.ones(3, 3),
                  torch.tensor([True, False, True]), None, torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1, 2, 3]))
    sub = ep.rows(torch.tensor([2, 0]))
    assert sub.input_ids.tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]] and sub.P == 1
    assert sub.has_eos.tolist() == [True, True] and sub.engine_logprobs is None
    assert sub.score.tolist() == [2.0, 0.5] and sub.turns.tolist() == [3, 1]
