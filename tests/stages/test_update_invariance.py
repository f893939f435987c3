"""The update does not depend on how a minibatch is cut (issue 42; the bug class of trl PR #6024 and verl#5625).

One fixed rollout of 8 completions with very unequal response lengths is trained on as one minibatch cut into
micro-batches of 8, 4, 2 and 1 (gradient accumulation 1, 2, 4 and 8). For every `ppo.aggregation` and every
`ppo.policy_loss` the accumulated gradient at the optimizer step is the same (≤ 1e-5 relative, fp32): each
micro-batch's loss is divided by the whole minibatch's token (or response) count, not its own
(`PolicyLearner.micro_batches`). The update is off-policy (old log-probs perturbed away from the policy's, ε_high
and the dual clip set) so that every clip acts, and the KL term is in the loss; a `gae` run checks the separate
critic's gradient the same way. The logged policy stats over kept tokens (ratio, KL, clip fractions) are the
whole minibatch's for every cut too: each micro-batch's mean is weighed by its kept tokens.
"""

import pytest
import torch
from stage_helpers import assert_same_gradients, compose, grads
from test_stage_ppo import force_eos

from rlhf_cli import engine
from rlhf_cli.core import KEPT_TOKEN_MEANS
from rlhf_cli.lifecycle import seed_everything
from rlhf_cli.preflight import VALIDATORS
from rlhf_cli.registry import POLICY_LOSSES
from rlhf_cli.rollout.plan import UpdatePlan, update_order
from rlhf_cli.stages.ppo import PPOTrainer

CUTS = (8, 4, 2, 1)  # micro-batch size; accumulation 8 // micro
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
# response position of the EOS per row (rows 3 and 6 run to ppo.max_new_tokens unless the policy samples an EOS)
EOS_AT = {0: 0, 1: 11, 2: 1, 4: 0, 5: 6, 7: 2}


def overrides(estimator, micro):
    return ["model=tiny", "precision=fp32", "reward.type=checker", "ppo.rollout_batch_size=4",
            "ppo.n_samples_per_prompt=2", "ppo.mini_batch_size=8", f"ppo.micro_batch_size={micro}",
            "ppo.max_new_tokens=12", "ppo.temperature=0.7", "ppo.iterations=1", "ppo.epochs=1",
            f"ppo.advantage_estimator={estimator}", "data.packing=false", "ppo.carried_forwards=0",
            "ppo.clip=0.1", "ppo.clip_high=0.3", "ppo.dual_clip=2.0", "ppo.c2=0.01",
            *(["ppo.kl_in=loss", "ppo.kl_estimator=k3", "ppo.kl_beta=0.1"] if estimator != "gae" else [])]


def build(tmp_path, estimator, micro):
    cfg = compose("train_ppo", [*overrides(estimator, micro), f"paths.root={tmp_path / 'runs'}"])
    VALIDATORS["train_ppo"](cfg)
    engine.init_distributed()
    seed_everything(cfg.seed)
    tr = PPOTrainer(cfg, tmp_path / f"run{micro}")
    tr.load_data()
    tr.build_models()
    tr.bad_steps = 0
    return tr


def fixed_rollout(tr, monkeypatch):
    """One rollout with unequal lengths, old log-probs off the policy's and one random advantage per response."""
    force_eos(monkeypatch, tr, EOS_AT)
    exp, _, _ = tr.maker.make_experience(0)
    mask = exp.loss_mask.bool()
    lengths = mask.sum(1)
    assert lengths.max() >= 8 * lengths.min(), lengths  # very unequal: micro-batch token counts differ a lot
    gen = torch.Generator().manual_seed(0)
    B, R = mask.shape
    base = exp.ref_logprobs if exp.plan.on_policy else exp.old_logprobs  # on-policy rollouts leave them to the update
    exp.old_logprobs = torch.where(mask, base + 0.5 * torch.randn(B, R, generator=gen), 0.0)
    exp.advantages = torch.where(mask, torch.randn(B, 1, generator=gen).expand(B, R), 0.0)
    return exp


def accumulated_gradients(tr, exp, weights, monkeypatch):
    """The actor's (and a separate critic's) gradients at the update's one optimizer step, from `weights`."""
    tr.actor.module.load_state_dict(weights["actor"])
    if tr.critic is not None:
        tr.critic.module.load_state_dict(weights["critic"])
    exp.plan = UpdatePlan(update_order(tr.cfg, 0, exp.groups), packed=False, on_policy=False, carry=0)
    seen = {}
    with monkeypatch.context() as mp:
        for name in ("actor", "critic"):
            eng = getattr(tr, name)
            if eng is None:
                continue

            def step(eng=eng, name=name, real=eng.step):
                if eng.is_boundary():
                    seen[name] = grads(eng.module)
                real()

            mp.setattr(eng, "step", step)
        stats = tr.train_on(exp, 0)
    assert set(seen) == ({"actor", "critic"} if tr.critic is not None else {"actor"})
    return seen, stats


@pytest.mark.parametrize("estimator,losses", [("grpo", POLICY_LOSSES.names), ("gae", ("ppo", "cispo"))])
def test_the_accumulated_gradient_does_not_depend_on_the_micro_batch_cut(tmp_path, monkeypatch, estimator, losses):
    trainers = {micro: build(tmp_path, estimator, micro) for micro in CUTS}
    first = trainers[CUTS[0]]
    exp = fixed_rollout(first, monkeypatch)
    weights = {"actor": {k: v.clone() for k, v in first.actor.module.state_dict().items()}}
    if first.critic is not None:
        weights["critic"] = {k: v.clone() for k, v in first.critic.module.state_dict().items()}
    acted = {"policy/clipfrac_high": 0.0, "policy/clipfrac_low": 0.0, "policy/dual_clipfrac": 0.0}
    for policy_loss in losses:
        for aggregation in AGGREGATIONS:
            results, stats = {}, {}
            for micro, tr in trainers.items():
                tr.p.policy_loss, tr.p.aggregation = policy_loss, aggregation
                if policy_loss == "cispo":
                    tr.p.dual_clip = None
                results[micro], stats[micro] = accumulated_gradients(tr, exp, weights, monkeypatch)
                tr.p.dual_clip = 2.0
            acted = {k: acted[k] + stats[1][k] for k in acted}
            for micro in CUTS[1:]:
                for name in results[micro]:
                    assert_same_gradients(results[micro][name], results[CUTS[0]][name], rel=1e-5)
                # the logged means over kept tokens are the whole minibatch's, whatever the cut
                for k in KEPT_TOKEN_MEANS:
                    assert stats[micro][k] == pytest.approx(stats[CUTS[0]][k], rel=1e-5, abs=1e-7), (micro, k)
    assert all(v > 0 for v in acted.values()), acted  # every clip acted somewhere: the cut is tested through it


def test_a_micro_batchs_own_token_count_would_break_the_invariance(tmp_path, monkeypatch):
    """The check above can fail: dividing each micro-batch's loss by its own token count (the bug of trl PR #6024)
    changes the accumulated gradient between cuts."""
    trainers = {micro: build(tmp_path, "grpo", micro) for micro in (8, 2)}
    exp = fixed_rollout(trainers[8], monkeypatch)
    weights = {"actor": {k: v.clone() for k, v in trainers[8].actor.module.state_dict().items()}}
    results = {}
    for micro, tr in trainers.items():
        real = tr.losses
        with monkeypatch.context() as mp:
            mp.setattr(tr, "losses", lambda b, num_tokens, num_seqs, real=real: real(b, float(b.loss_mask.sum())))
            results[micro], _ = accumulated_gradients(tr, exp, weights, monkeypatch)
    with pytest.raises(AssertionError):
        assert_same_gradients(results[2]["actor"], results[8]["actor"], rel=1e-5)


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq_mask"])
def test_the_engine_correction_keeps_the_invariance(tmp_path, monkeypatch, mode):
    """`rollout.is_correction` weights each token by its row's own numbers only: with synthetic engine log-probs
    (vLLM's, which the tiny CPU run has not) the accumulated gradient is the same for every cut, and differs from
    the uncorrected one (the weights act)."""
    cuts = (8, 2, 1)
    trainers = {micro: build(tmp_path, "grpo", micro) for micro in cuts}
    exp = fixed_rollout(trainers[8], monkeypatch)
    mask = exp.loss_mask.bool()
    gen = torch.Generator().manual_seed(1)
    exp.engine_logprobs = torch.where(mask, exp.old_logprobs + 0.8 * torch.randn(mask.shape, generator=gen), 0.0)
    weights = {"actor": {k: v.clone() for k, v in trainers[8].actor.module.state_dict().items()}}
    for aggregation in AGGREGATIONS:
        results, stats = {}, {}
        for micro, tr in trainers.items():
            tr.cfg.rollout.is_correction, tr.cfg.rollout.is_high, tr.p.aggregation = mode, 1.5, aggregation
            results[micro], stats[micro] = accumulated_gradients(tr, exp, weights, monkeypatch)
        for micro in cuts[1:]:
            assert_same_gradients(results[micro]["actor"], results[8]["actor"], rel=1e-5)
            for k in KEPT_TOKEN_MEANS:  # a one-row micro-batch the correction masks whole adds nothing to them
                assert stats[micro][k] == pytest.approx(stats[8][k], rel=1e-5, abs=1e-7), (micro, k)
        trainers[8].cfg.rollout.is_correction = "none"
        plain, _ = accumulated_gradients(trainers[8], exp, weights, monkeypatch)
        with pytest.raises(AssertionError):
            assert_same_gradients(plain["actor"], results[8]["actor"], rel=1e-5)
