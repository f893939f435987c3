"""Packed rollouts (`data.packing`, issue 21): a group's shared prompt computed once and sequences packed into rows
give the padded forward's log-probs, entropies, values and gradients, and the same PPO and GRPO iterations.

Tolerances as in tests/models/test_models_packed_pairs.py (fp32: the same arithmetic in matrices of other shapes,
so reduction order only): 1e-5 absolute on log-probs, values and entropies; gradients to 1e-5 of each tensor's
largest entry. A whole iteration (rollout, advantages, one update) compounds that: 1e-4 relative on its statistics
and 1e-6 absolute on the updated weights.
"""

import logging

import pytest
import torch
from stage_helpers import assert_same_gradients, compose
from test_stage_critic_free import reward_file
from test_stage_ppo import TINY_PPO, build_trainer, force_eos, snapshot, spy_losses

from rlhf_cli.forwards import critic_values, pack_rollout, policy_forward
from rlhf_cli.models import PolicyWithValueHead
from rlhf_cli.rollout import kl_stats
from rlhf_cli.rollout.plan import packs_rollout_passes, update_order

PAD, EOS = 0, 2


def rollout_batch(vocab, seed=3):
    """(input_ids, attention_mask, P) as `sample_responses` lays them out: three groups (prompts of 5, 1 and 3 real
    tokens, left-padded to 5), responses right-padded to R = 6: one ends at the max length without EOS, one is the
    EOS alone, others end early."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rnd(5), rnd(1), rnd(3)]
    # (group, response length incl. EOS, ends with EOS)
    rows = [(0, 6, False), (0, 3, True), (0, 1, True), (1, 4, True), (1, 6, True), (2, 2, True), (2, 5, True)]
    P, R = 5, 6
    ids = torch.full((len(rows), P + R), PAD)
    am = torch.zeros_like(ids)
    for b, (k, n, eos) in enumerate(rows):
        p = prompts[k]
        ids[b, P - len(p):P], am[b, P - len(p):P] = torch.tensor(p), 1
        resp = rnd(n - 1) + ([EOS] if eos else rnd(1))
        ids[b, P:P + n], am[b, P:P + n] = torch.tensor(resp), 1
    return ids, am, P


def test_pack_rollout_shares_each_prompt_once(tokenizer):
    ids, am, P = rollout_batch(1000)
    pk = pack_rollout(ids, am, P)
    real = int(am.sum())
    assert int(pk.packed.attention_mask.sum()) == real - (3 - 1) * 5 - (2 - 1) * 1 - (2 - 1) * 3  # prompts once
    lengths = am[:, P:].sum(1)
    assert pk.computed.tolist() == [[t <= int(n) for t in range(6)] for n in lengths]
    # entry t reads the token before response token t: the prompt's last token for t = 0
    for b in range(ids.shape[0]):
        for t in range(int(lengths[b])):
            r, c = pk.source[b, t].tolist()
            assert pk.packed.input_ids[r, c] == ids[b, P - 1 + t]
            assert pk.packed.position_ids[r, c] == am[b, :P + t].sum() - 1
    with pytest.raises(ValueError, match="no prompt token"):
        pack_rollout(ids, torch.cat([torch.zeros_like(am[:, :P]), am[:, P:]], 1), P)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_policy_forward_equals_the_padded_one(tiny_model_cfg, tokenizer, impl):
    from rlhf_cli.models import load_causal_lm

    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer).eval()
    lm.config._attn_implementation = impl
    policy = PolicyWithValueHead(lm, seed=1)
    ids, am, P = rollout_batch(lm.config.vocab_size)
    mask = torch.zeros_like(am[:, P:], dtype=torch.bool)
    mask[:] = am[:, P:].bool()  # the loss mask: real response tokens
    out = {}
    for packing in (False, True):
        policy.zero_grad()
        lp, ent, v = policy_forward(policy, ids, am, P, 0.7, with_entropy=True, with_values=True, packing=packing)
        ((lp * mask).sum() + 0.1 * (ent * mask).sum() + (v * mask).sum()).backward()
        out[packing] = (lp.detach(), ent.detach(), v.detach(),
                        {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    (lp0, ent0, v0, g0), (lp1, ent1, v1, g1) = out[False], out[True]
    for a, b in ((lp0, lp1), (ent0, ent1), (v0, v1)):
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)
    computed = pack_rollout(ids, am, P).computed
    torch.testing.assert_close(lp1[computed], lp0[computed], rtol=0, atol=1e-5)  # the entry after EOS too
    assert (lp1[~computed] == 0).all() and (v1[~computed] == 0).all()
    assert_same_gradients(g1, g0)


def test_entropy_as_a_statistic_only_leaves_the_gradients_as_they_were(tiny_model_cfg, tokenizer):
    """`ppo.c2=0`: the training forward computes the entropy outside the graph (`entropy_grad=False`); the same
    entropies, and the gradients of a loss holding 0 x entropy bit for bit."""
    from rlhf_cli.models import load_causal_lm

    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    ids, am, P = rollout_batch(lm.config.vocab_size)
    mask = am[:, P:].float()
    out = {}
    for entropy_grad in (True, False):
        lm.zero_grad()
        lp, ent, _ = policy_forward(lm, ids, am, P, 0.7, with_entropy=True, entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad
        (-(lp * mask).sum() - 0.0 * (ent * mask).sum()).backward()
        out[entropy_grad] = ent.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1].keys() == out[False][1].keys()
    assert all(torch.equal(out[True][1][n], out[False][1][n]) for n in out[True][1])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_rollouts_sharing_a_system_prompt_and_first_tokens_give_the_padded_forward(tiny_model_cfg, tokenizer, impl):
    """Tries beyond a group's prompt: every prompt begins with the same 3 tokens (a chat template's system prompt),
    two responses of a group share their first tokens, and cheap attention lets groups share tries."""
    from rlhf_cli.models import load_causal_lm, load_scalar_model

    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer).eval()
    lm.config._attn_implementation = impl
    policy = PolicyWithValueHead(lm, seed=1)
    critic = load_scalar_model(tiny_model_cfg, "fp32", seed=2).eval()
    critic.config._attn_implementation = impl
    ids, am, P = rollout_batch(lm.config.vocab_size)
    system = torch.tensor([5, 6, 7])
    ids, am = torch.cat([torch.full((ids.shape[0], 3), PAD), ids], 1), torch.cat([torch.zeros_like(am[:, :3]), am], 1)
    P += 3
    for b in range(ids.shape[0]):  # the system prompt before each prompt's first real token
        first = int(am[b].nonzero()[0])
        ids[b, first - 3:first], am[b, first - 3:first] = system, 1
    ids[1, P:P + 2] = ids[0, P:P + 2]  # rows 0 and 1 (one group) share their first two response tokens
    pk = pack_rollout(ids, am, P, attention_tokens=1e9)
    # computed once: each group's prompt (2 * 8 + 4 + 6 positions saved), rows 0 and 1's first two response tokens
    # (2), and the system prompt for all three groups, in one trie (2 * 3)
    assert int(pk.packed.attention_mask.sum()) == int(am.sum()) - 26 - 2 - 6
    mask = am[:, P:].bool()
    with torch.no_grad():
        lp0, ent0, v0 = policy_forward(policy, ids, am, P, 0.7, with_entropy=True, with_values=True)
        lp1, ent1, v1 = policy_forward(policy, ids, am, P, 0.7, with_entropy=True, with_values=True, packing=pk)
        cv0, cv1 = critic_values(critic, ids, am, P), critic_values(critic, ids, am, P, packing=pk)
    for a, b in ((lp0, lp1), (ent0, ent1), (v0, v1), (cv0, cv1)):
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16"])
def test_packed_rollout_passes_add_no_error_beyond_bf16s_own(tiny_model_cfg, tokenizer, precision):
    """bf16 rounds at other places in the packed and padded layouts, so they differ by bf16 noise: packing is held
    to no more error against the fp32 numbers than the padded layout itself has (log-probs, entropies, shared
    values, a separate critic's values), as the packed reward-model pairs are (test_models_packed_pairs)."""
    from rlhf_cli import engine
    from rlhf_cli.models import load_causal_lm, load_scalar_model

    ids, am, P = rollout_batch(256)
    mask = am[:, P:].bool()

    def passes(prec, packing):
        lm = load_causal_lm(tiny_model_cfg, prec, seed=0, tokenizer=tokenizer).eval()
        policy, critic = PolicyWithValueHead(lm, seed=1), load_scalar_model(tiny_model_cfg, prec, seed=2).eval()
        with torch.no_grad(), engine.autocast(prec):
            lp, ent, v = policy_forward(policy, ids, am, P, 0.7, with_entropy=True, with_values=True,
                                        packing=packing)
            return torch.stack([lp, ent, v, critic_values(critic, ids, am, P, packing=packing)]).float()

    exact, padded, packed = passes("fp32", False), passes(precision, False), passes(precision, True)
    for k, name in enumerate(("logprobs", "entropy", "shared values", "critic values")):
        bf16_error = (padded[k] - exact[k])[mask].abs().max()
        assert 0 < bf16_error < 0.5, name
        assert (packed[k] - exact[k])[mask].abs().max() <= 2 * bf16_error, name


def test_packed_critic_values_equal_the_padded_ones_everywhere(tiny_model_cfg):
    from rlhf_cli.models import load_scalar_model

    critic = load_scalar_model(tiny_model_cfg, seed=0).eval()
    ids, am, P = rollout_batch(critic.config.vocab_size)
    with torch.no_grad():
        plain = critic_values(critic, ids, am, P)
        packed = critic_values(critic, ids, am, P, packing=True)
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-5)  # 0 at padding in both


def test_packed_reward_model_scores_equal_the_padded_ones(tiny_model_cfg):
    from rlhf_cli.forwards import batched_scores
    from rlhf_cli.models import load_scalar_model

    rm = load_scalar_model(tiny_model_cfg, seed=0).eval()
    ids, am, P = rollout_batch(rm.config.vocab_size)
    plain = batched_scores(rm, ids, am, 4, "fp32")
    packed = batched_scores(rm, ids, am, 4, "fp32", P, packing=True)
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-5)
    assert plain.std() > 1e-3  # distinct scores: a read at the wrong token would show
    # a sequence sampled twice (rows 2 and 7, in different rows and neighbours) gets one score: an exact tie
    twice = torch.tensor([0, 1, 2, 3, 4, 5, 6, 2])
    again = batched_scores(rm, ids[twice], am[twice], 3, "fp32", P, packing=True)
    assert again[7] == again[2] and torch.equal(again[:7], batched_scores(rm, ids, am, 3, "fp32", P, packing=True))


@pytest.mark.parametrize("packing,batch_size", [(True, 4), (False, 4), (True, 3), (True, 1)])
def test_eval_scores_both_sides_in_one_pass_as_each_alone(tiny_model_cfg, packing, batch_size, monkeypatch):
    """`rlhf eval` scores the policy's and the reference's samples of the same prompts together, a prompt's two
    samples in one forward (its prompt once for both, packed): the scores of each side alone, to float rounding,
    whichever side's responses are narrower; a sequence both sides sampled ties exactly."""
    from rlhf_cli.forwards import batched_scores
    from rlhf_cli.models import load_scalar_model
    from rlhf_cli.stages import evaluate
    from rlhf_cli.stages.evaluate import side_by_side_scores

    calls = []

    def spy(model, ids, am, *args):
        calls.append(ids)
        return batched_scores(model, ids, am, *args)

    monkeypatch.setattr(evaluate, "batched_scores", spy)

    rm = load_scalar_model(tiny_model_cfg, seed=0).eval()
    ids, am, P = rollout_batch(rm.config.vocab_size)
    other, other_am, _ = rollout_batch(rm.config.vocab_size, seed=4)  # other responses (and prompts) ...
    other[:, :P], other_am[:, :P] = ids[:, :P], am[:, :P]  # ... to the same prompts
    other, other_am = other[:, :-2], other_am[:, :-2].clone()  # a narrower response block: R 4
    other_am[:, -1] = 0
    other_am[:, P:] *= other_am[:, P:].cumprod(1)
    other[3], other_am[3] = ids[3, :-2], am[3, :-2]  # row 3 (4 response tokens) sampled by both
    want = {"wide": batched_scores(rm, ids, am, 4, "fp32", P, packing),
            "narrow": batched_scores(rm, other, other_am, 4, "fp32", P, packing)}
    for sides in (("wide", "narrow"), ("narrow", "wide")):  # the policy's responses wider, then narrower
        data = {"wide": (ids, am, P), "narrow": (other, other_am, P)}
        calls.clear()
        got = side_by_side_scores(rm, data[sides[0]], data[sides[1]], PAD, batch_size, "fp32", packing)
        for who, side in zip(("policy", "reference"), sides):
            torch.testing.assert_close(got[who], want[side], rtol=0, atol=1e-5)
        assert got["policy"][3] == got["reference"][3] and not torch.equal(got["policy"], got["reference"])
        # every forward holds whole prompts: rows 2i and 2i + 1 are one prompt's two samples
        assert all(len(c) % 2 == 0 and torch.equal(c[0::2, :P], c[1::2, :P]) for c in calls)
        assert sum(len(c) for c in calls) == 2 * len(ids) and len(calls) == -(-len(ids) // max(batch_size // 2, 1))
    with pytest.raises(ValueError, match="prompts differ"):
        side_by_side_scores(rm, (ids, am, P), (ids[:, 1:], am[:, 1:], P - 1), PAD, 4, "fp32", packing)


PPO = ["ppo.actor_lr=1e-4", "ppo.critic_lr=1e-4"]
GRPO = ["ppo.rollout_batch_size=2", "ppo.n_samples_per_prompt=4", "ppo.mini_batch_size=8",
        "ppo.advantage_estimator=grpo", "reward.type=function", "ppo.kl_in=loss", "ppo.kl_estimator=k3",
        "ppo.actor_lr=1e-4"]
GRPO_MINI = [*GRPO[:2], "ppo.mini_batch_size=4", "ppo.micro_batch_size=2", *GRPO[3:]]


RM_GRPO = [*GRPO_MINI[:5], "reward.type=model", *GRPO_MINI[6:]]  # a reward model scoring a group's packed rows


@pytest.mark.parametrize("overrides", [PPO, GRPO, GRPO_MINI, RM_GRPO, [*PPO, "ppo.epochs=2"],
                                       [*GRPO_MINI, "ppo.epochs=2"]],
                         ids=["ppo-gae", "grpo-on-policy", "grpo-minibatches", "grpo-reward-model", "ppo-2-epochs",
                              "grpo-minibatches-2-epochs"])
def test_a_packed_iteration_equals_the_padded_one(tmp_path, overrides):
    runs = {}
    if "reward.type=function" in overrides:  # the tiny model's checker score is 0 everywhere: no group signal
        overrides = [*overrides, f"reward.function={reward_file(tmp_path)}:length_bonus"]
    if "reward.type=model" in overrides:
        from rlhf_cli.models import load_scalar_model, load_tokenizer, save_hf

        cfg = compose("train_ppo", TINY_PPO)
        save_hf(load_scalar_model(cfg.model, "fp32", 1), load_tokenizer(cfg.model), tmp_path / "rm")
        overrides = [*overrides, f"reward_model.path={tmp_path / 'rm'}"]
    for packing in (True, False):
        tr = build_trainer(tmp_path / str(packing), [*overrides, f"data.packing={str(packing).lower()}"])
        before = snapshot(tr.actor.module)
        exp, roll_stats, _ = tr.maker.make_experience(0)
        train_stats = tr.train_on(exp, 0)
        roll_stats.update(kl_stats(exp, tr.kl_ctl.value))
        runs[packing] = (exp, roll_stats, train_stats, snapshot(tr.actor.module), before)
    (exp1, roll1, train1, w1, before), (exp0, roll0, train0, w0, _) = runs[True], runs[False]
    assert torch.equal(exp1.input_ids, exp0.input_ids)  # the same samples
    m = exp0.loss_mask.bool()
    for name in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns"):
        torch.testing.assert_close(getattr(exp1, name)[m], getattr(exp0, name)[m], rtol=1e-4, atol=1e-5,
                                   msg=lambda msg, n=name: f"{n}: {msg}")
    for stats1, stats0 in ((roll1, roll0), (train1, train0)):
        for k, v in stats0.items():
            if not k.startswith(("time/", "throughput/")):
                assert stats1[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=1e-6, msg=lambda msg, k=k: f"{k}: {msg}")
    assert any(not torch.equal(w1[k], before[k]) for k in w1), "the update moved no weight"


@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("precision,logprobs", [("fp32", "fp32"), ("bf16-autocast", "same"), ("bf16", "fp32")])
def test_packed_passes_keep_the_first_ratio_exactly_one(tmp_path, monkeypatch, precision, logprobs, epochs):
    """The old log-probs are computed over the update's own micro-batches, which keep their rows in every epoch
    (`update_order`), so a row's packed layout is the same in every pass: the ratio of the first minibatch is
    exactly 1 (as `test_stage_ppo`'s plain test), in every precision; the second minibatch, after a step, moves.
    The layouts are built once per micro-batch, by the maker, and the update reuses them."""
    import rlhf_cli.forwards.policy as policy_module

    tr = build_trainer(tmp_path, [*GRPO_MINI[:2], "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
                                  "ppo.advantage_estimator=gae", "reward.type=checker", "ppo.kl_in=reward",
                                  f"ppo.epochs={epochs}", f"precision={precision}", f"scoring_precision={logprobs}"])
    assert packs_rollout_passes(tr.cfg) and not tr.on_policy
    tr.carry = 0  # else the first micro-batch's old log-probs are its training forward's own
    force_eos(monkeypatch, tr, {0: 1, 5: 3})
    exp, _, _ = tr.maker.make_experience(0)
    assert len(exp.layouts) == 4  # one per micro-batch, for the reference, policy and critic passes
    built = []
    real = policy_module.pack_rollout
    monkeypatch.setattr(policy_module, "pack_rollout", lambda *a, **k: built.append(1) or real(*a, **k))
    calls = spy_losses(monkeypatch, tr)
    tr.train_on(exp, 0)
    assert not built  # the update's actor and critic forwards reuse them
    assert len(calls) == 4 * epochs  # 2 minibatches x 2 micro-batches per epoch
    for lp, old, mask, stats in calls[:2]:
        assert torch.equal(lp[mask.bool()], old[mask.bool()])
        assert stats["policy/clipfrac"] == 0.0
    assert any((lp - old)[mask.bool()].abs().max() > 0 for lp, old, mask, _ in calls[2:])


@pytest.mark.parametrize("overrides", [[], ["ppo.critic=shared"], ["model.gradient_checkpointing=true", "ppo.c2=0.01"],
                                       ["precision=bf16-autocast", "scoring_precision=same"], ["precision=bf16"],
                                       ["model.lora.r=4", "model.lora.alpha=8", "ppo.actor_lr=1e-2",
                                        "ppo.critic_lr=1e-2"],
                                       [o for o in GRPO_MINI if not o.startswith("ppo.actor_lr")]],
                         ids=["critic", "shared-critic", "checkpointing-entropy-bonus", "bf16-autocast", "bf16", "lora",
                              "grpo-groups-kl-in-loss"])
def test_the_first_micro_batches_forwards_are_run_once_for_the_rollout_and_the_update(tmp_path, monkeypatch,
                                                                                      overrides):
    """`UpdatePlan.carry`: the maker runs the training forwards of the update's first micro-batches
    (`ppo.carried_forwards`: one by default, two with the whole first minibatch) at the rollout's weights, takes
    their outputs as those rows' old log-probs and values, and the update's backward of each goes through its own.
    One policy and one critic forward fewer per carried micro-batch and iteration, and the same function of the
    same weights on the same layout: two iterations of two epochs (minibatches of 4 in micro-batches of 2) give
    the same rollouts, statistics and weights as the maker's own no-grad passes, bit for bit on the CPU (where the
    grad and no-grad forwards run the same kernels: `test_packed_passes_keep_the_first_ratio_exactly_one`). With
    LoRA the reference is the policy's own module with its adapters off, run while the carried graphs live."""
    import rlhf_cli.forwards.training as forward_module
    import rlhf_cli.rollout.maker as maker_module

    def counting(fn, forwards):
        def spy(model, *a, **k):
            if id(model) in forwards:
                forwards[id(model)] += 1
            return fn(model, *a, **k)
        return spy

    real = {(m, name): getattr(m, name) for m in (forward_module, maker_module)
            for name in ("policy_forward", "critic_values")}
    if "reward.type=function" in overrides:  # the tiny model's checker score is 0 everywhere: no group signal
        overrides = [*overrides, f"reward.function={reward_file(tmp_path)}:length_bonus"]
    lrs = [] if any(o.startswith("ppo.actor_lr") for o in overrides) else ["ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3"]
    runs = {}
    for carry in (0, 1, 2):
        tr = build_trainer(tmp_path / str(carry), [*overrides, "ppo.epochs=2", *lrs]
                           + ([] if carry == 1 else [f"ppo.carried_forwards={carry}"]))  # 1 by default
        assert tr.carry == carry
        trained = [m for m in (tr.actor.module, tr.critic and tr.critic.module) if m is not None]
        forwards = {id(m): 0 for m in trained}
        for (module, name), fn in real.items():
            monkeypatch.setattr(module, name, counting(fn, forwards))
        stats, carried = [], []
        for it in range(2):
            exp, roll, _ = tr.maker.make_experience(it)
            carried.append(list(exp.forwards.items()) or None)
            stats.append({**roll, **tr.train_on(exp, it)})
            stats[-1].update(kl_stats(exp, tr.kl_ctl.value))
            assert not exp.forwards  # each used once: no graph is held after the update
        runs[carry] = (exp, stats, [snapshot(m) for m in trained], carried, forwards)
        # per iteration, each trained model: 4 no-grad chunks and 2 epochs x 4 micro-batches, one forward fewer
        # per carried micro-batch
        assert list(forwards.values()) == [2 * (12 - carry)] * len(forwards)
        if carry == 0:
            assert carried == [None, None]
            continue
        first = update_order(tr.cfg, 1, exp.groups)[0][0]  # the first minibatch of the last iteration
        assert [key for key, _ in carried[1]] == [tuple(rows.tolist()) for rows in first[:carry]]
        assert all(fwd.logprobs.requires_grad and fwd.seconds > 0 for c in carried for _, fwd in c)
    exp0, stats0, w0, _, _ = runs[0]
    assert stats0[-1]["policy/clipfrac"] > 0  # the update moved the policy: a stale old log-prob would show
    for carry in (1, 2):
        exp1, stats1, w1, _, _ = runs[carry]
        assert torch.equal(exp1.input_ids, exp0.input_ids)
        for name in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns"):
            assert torch.equal(getattr(exp1, name), getattr(exp0, name)), (carry, name)
        for s1, s0 in zip(stats1, stats0):
            assert s1.keys() == s0.keys()
            for k, v in s0.items():
                if not k.startswith(("time/", "throughput/")):
                    assert s1[k] == v, (carry, k)
        for a, b in zip(w1, w0):
            assert all(torch.equal(a[k], b[k]) for k in b), carry


@pytest.mark.parametrize("overrides,zero_stage,offloaded,carries,said", [
    ([], 2, False, 1, None), (["ppo.carried_forwards=2"], 2, False, 2, None),
    (["ppo.carried_forwards=0"], 2, False, 0, None),
    (["ppo.carried_forwards=5"], 2, False, 2, "only 2 micro-batches come before"),
    (["ppo.carried_forwards=5", "ppo.mini_batch_size=8"], 2, False, 4, "only 4 micro-batches"),
    (["data.packing=false"], 2, False, 0, None),
    (["data.packing=false", "ppo.carried_forwards=2"], 2, False, 0, "does nothing here: the rollout's passes"),
    ([], 3, False, 0, None), (["ppo.carried_forwards=2"], 3, False, 0, "does nothing here: an engine runs ZeRO-3"),
    ([], 2, True, 0, None), (["ppo.carried_forwards=2"], 2, True, 0, "does nothing here: the reference is offloaded"),
    ([*GRPO, "ppo.epochs=1"], 0, False, 0, None),
    ([*GRPO, "ppo.epochs=1", "ppo.carried_forwards=3"], 0, False, 0, "does nothing here: the update is on-policy"),
    (GRPO_MINI, 0, False, 1, None)])
def test_the_first_micro_batches_forwards_are_carried_only_where_they_fold(tokenizer, caplog, overrides, zero_stage,
                                                                          offloaded, carries, said):
    """Up to `ppo.carried_forwards` of the first minibatch's micro-batches (the first optimizer step follows
    them; more is capped, said once). None over the plain layout's chunks (not the update's micro-batches), nor
    when an engine runs ZeRO-3 (weights gathered per forward and backward in order; read from the engine, which
    `deepspeed.extra` may set), nor when the reference is offloaded (the memory that saves), nor when the maker
    runs no policy pass at all (`UpdatePlan.on_policy`: one on-policy step without a critic). A count above the
    default that does nothing says why."""
    from types import SimpleNamespace

    from rlhf_cli.core import ESTIMATORS
    from rlhf_cli.rollout import PolicyLearner

    cfg = compose("train_ppo", [*TINY_PPO, *overrides])
    learner = PolicyLearner()
    learner.cfg, learner.p, learner.critic, learner.score_precision = cfg, cfg.ppo, None, "fp32"
    learner.actor, reference = SimpleNamespace(zero_stage=zero_stage), SimpleNamespace(offload=offloaded)
    learner.estimator = ESTIMATORS[cfg.ppo.advantage_estimator]
    with caplog.at_level(logging.INFO, logger="rlhf_cli.rollout.learner"):
        learner.settle_folds(reference)
    assert learner.carry == carries
    lines = [r.getMessage() for r in caplog.records if "carried_forwards" in r.getMessage()]
    assert len(lines) == (said is not None) and (said is None or said in lines[0]), lines


def test_training_forwards_of_rows_the_plan_does_not_visit_are_an_error(tmp_path):
    """A carried graph the update does not consume would be held until the rollout is dropped, and one reached after
    the first optimizer step would hold stale weights: both are errors. (The forwards are keyed by their rows and
    the order is the plan's, computed once: the stage's own plans reach neither.)"""
    tr = build_trainer(tmp_path, ["ppo.carried_forwards=2"])
    exp, _, _ = tr.maker.make_experience(0)
    exp.plan.order = [[exp.plan.order[0][0][:1]]]  # the update visits only its first micro-batch
    with pytest.raises(RuntimeError, match="does not visit"):
        tr.train_on(exp, 0)
    exp, _, _ = tr.maker.make_experience(1)  # a carried micro-batch after the first optimizer step: stale weights
    first, *rest = exp.plan.order[0]
    exp.plan.order = [[first[:1], first[1:], *rest]]
    with pytest.raises(RuntimeError, match="after the update's first optimizer step"):
        tr.train_on(exp, 1)


def first_epoch_before(cfg, iteration, groups):
    """The first epoch as `update_order` drew it before micro-batches were kept across epochs (commit 16dc0e9)."""
    from rlhf_cli.seeds import derive_seed

    p, n = cfg.ppo, groups.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(cfg.seed, iteration, 0)))
    epoch = []
    for s in range(0, n, p.mini_batch_size):
        rows = perm[s:s + p.mini_batch_size]
        if p.n_samples_per_prompt > 1:
            rows = rows[torch.argsort(groups[rows], stable=True)]
        epoch.append([rows[m:m + p.micro_batch_size] for m in range(0, len(rows), p.micro_batch_size)])
    return epoch


@pytest.mark.parametrize("n_samples,mini", [(1, 8), (4, 8), (1, 2)])
def test_the_update_keeps_each_micro_batch_across_epochs(n_samples, mini):
    """`update_order`: the first epoch is the seeded shuffle cut into minibatches and micro-batches (a minibatch's
    rows ordered by group), as before; every later epoch visits the same micro-batches, each row once, in new
    minibatches, or, when a minibatch is one micro-batch, the same minibatches in a new order."""
    from types import SimpleNamespace

    from rlhf_cli.rollout.learner import update_order

    B, micro = 32, 2
    cfg = SimpleNamespace(seed=5, ppo=SimpleNamespace(mini_batch_size=mini, micro_batch_size=micro, epochs=3,
                                                      n_samples_per_prompt=n_samples))
    groups = torch.arange(B) // n_samples
    order = update_order(cfg, 2, groups)
    assert len(order) == 3 and all(len(epoch) == B // mini for epoch in order)
    as_sets = [sorted(tuple(r.tolist()) for mb in epoch for r in mb) for epoch in order]
    assert as_sets[0] == as_sets[1] == as_sets[2]  # the same micro-batches, rows in the same order
    for epoch in order:
        rows = torch.cat([r for mb in epoch for r in mb])
        assert sorted(rows.tolist()) == list(range(B))  # each row once per epoch
        assert all(len(mb) == mini // micro and all(len(r) == micro for r in mb) for mb in epoch)
    if n_samples > 1:  # the first epoch's minibatches are ordered by group (so every micro-batch is)
        for mb in order[0]:
            g = groups[torch.cat(mb)]
            assert torch.equal(g, g.sort(stable=True).values)
    minibatches = [[sorted(torch.cat(mb).tolist()) for mb in epoch] for epoch in order]
    if mini > micro:  # reshuffled into new minibatches
        assert all(sorted(m) != sorted(minibatches[0]) for m in minibatches[1:])
    else:  # the same minibatches, visited in a new order
        assert all(sorted(m) == sorted(minibatches[0]) and m != minibatches[0] for m in minibatches[1:])
    listed = lambda epoch: [[r.tolist() for r in mb] for mb in epoch]  # noqa: E731
    assert listed(order[0]) == listed(first_epoch_before(cfg, 2, groups))  # the first epoch is unchanged
    assert listed(order[0]) == listed(update_order(cfg, 2, groups)[0])  # seeded
    cfg.ppo.epochs = 1
    assert listed(update_order(cfg, 2, groups)[0]) == listed(order[0])  # more epochs do not change the first
