"""The learning half of an RL iteration: the update on one rollout's `Experience`.

    PolicyLearner.settle_folds(reference)    once per run: what the rollout folds into the update (`fold_settings`)
    PolicyLearner.plan(iteration, groups)    the iteration's `UpdatePlan`: the maker asks, the experience carries it
    PolicyLearner.train_on(exp, iteration)   `ppo.epochs` passes of shuffled minibatches; returns the mean stats
        micro_batches                          the plan's order: minibatches of `ppo.mini_batch_size` completions (over
                                               all ranks), cut into micro-batches of `ppo.micro_batch_size`
        losses                                 one micro-batch's forward and losses (`Losses`): the seam tests spy on
        micro_step                             `losses`, the backward passes, the optimizer steps, NaN skipping

`PolicyLearner` is a mixin: the stage's trainer (stages/ppo.py `PPOTrainer`) provides `cfg`, `p` (= cfg.ppo),
`actor` and `critic` (`engine.TrainEngine`, critic None when shared or critic-free), `kl_ctl`, `estimator`
(`core.ESTIMATORS` entry), `score_precision` (`engine.scoring_precision`'s) and `bad_steps`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.core import (
    KEPT_TOKEN_MEANS,
    KEPT_TOKENS,
    POLICY_LOSSES,
    engine_is_weights,
    entropy_bonus,
    kl_loss,
    value_loss,
)
from rlhf_cli.forwards import training_forward
from rlhf_cli.models import has_value_head
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.plan import (
    UpdatePlan,
    fold_settings,
    micro_batches_per_minibatch,
    packs_rollout_passes,
    update_order,
)

log = logging.getLogger(__name__)


class Losses(NamedTuple):
    """One micro-batch's losses (`PolicyLearner.losses`): what each engine backpropagates, the two losses logged
    (detached), the training forward's response logprobs (B, R) (detached) and the loss modules' stats."""

    actor: torch.Tensor
    critic: torch.Tensor | None  # a separate critic's objective; None when shared or critic-free
    policy: torch.Tensor
    value: torch.Tensor
    logprobs: torch.Tensor
    stats: dict[str, float]


class PolicyLearner:
    """The update of `ppo.advantage_estimator`'s policy (and critic, when it has one) on one rollout."""

    cfg: Any
    p: Any
    actor: engine.TrainEngine | None
    critic: engine.TrainEngine | None
    kl_ctl: Any
    estimator: Any
    score_precision: str
    bad_steps: int
    on_policy: bool = False  # `plan.fold_settings`: the old log-probs are the update's own forward's
    carry: int = 0  # `plan.fold_settings`: the update's first micro-batches whose forwards the rollout runs

    def settle_folds(self, reference: Any) -> None:
        """Decide once per run what the rollout folds into the update (`plan.fold_settings`): `on_policy` and
        `carry`, from the config and the engines as built (their ZeRO stage, an offloaded `reference`). A
        `ppo.carried_forwards` above the default that does nothing here says why, once; one above the first
        minibatch's micro-batches says it is capped. On an on-policy update (the ratio is exactly 1), a policy loss
        other than `ppo`, `ppo.clip_high` and `ppo.dual_clip` change nothing, which is said once."""
        p = self.p
        zero_stage = max((e.zero_stage for e in (self.actor, self.critic) if e is not None), default=0)  # as built
        self.on_policy, self.carry, why_not = fold_settings(self.cfg, self.estimator.needs_critic,
                                                            self.score_precision, zero_stage,
                                                            getattr(reference, "offload", False))
        inert = ([f"ppo.policy_loss={p.policy_loss}"] if p.policy_loss != "ppo" else []) + [
            f"ppo.{key}={getattr(p, key)}" for key in ("clip_high", "dual_clip") if getattr(p, key) is not None]
        if self.on_policy and inert and engine.is_main():
            log.warning("%s change(s) nothing here: the update is on-policy (one epoch of one minibatch: the ratio is "
                        "exactly 1, no clip acts and every policy loss has the gradient −A·∇log π)", ", ".join(inert))
        before_first_step = micro_batches_per_minibatch(p)  # the first optimizer step follows them
        if why_not and p.carried_forwards > 1 and engine.is_main():  # the default's cases: docs/internals.md "Packing"
            log.warning("ppo.carried_forwards=%d does nothing here: %s", p.carried_forwards, why_not)
        elif not why_not and p.carried_forwards > before_first_step and engine.is_main():
            log.info("ppo.carried_forwards=%d: only %d micro-batches come before the update's first optimizer step "
                     "(ppo.mini_batch_size=%d over %d rank(s) in micro-batches of %d); carrying %d",
                     p.carried_forwards, before_first_step, p.mini_batch_size, engine.world_size(), p.micro_batch_size,
                     before_first_step)

    def plan(self, iteration: int, groups: torch.Tensor) -> UpdatePlan:
        """The update of iteration `iteration` on this rank's rollout rows (their group ids `groups`, (B,) long):
        its order (`update_order`), computed once, with the run's folds (`settle_folds`)."""
        return UpdatePlan(update_order(self.cfg, iteration, groups), packs_rollout_passes(self.cfg), self.on_policy,
                          self.carry)

    def micro_batches(self, exp: Experience) -> Iterator[tuple[Experience, float, float, torch.Tensor]]:
        """The plan's order (`exp.plan.order`), micro-batch by micro-batch. Yields (micro-batch, the divisors of
        every micro-batch loss of its minibatch, over all ranks: its tokens in the loss (`ppo.aggregation=
        token-mean`) and its rows with at least one token in the loss (`seq-mean-token-mean`), its rows' indices in
        `exp`). A row the loss masks out (`ppo.truncated=mask` without EOS: no token in `exp.loss_mask`) counts in
        neither divisor, as `core.masked_aggregate` counts a whole batch, so the micro-batches' losses sum to the
        loss of the minibatch in one call. A training forward the rollout ran for a micro-batch (`exp.forwards`)
        moves onto it (used once)."""
        if exp.plan is None:
            raise ValueError("an Experience without its UpdatePlan (PolicyLearner.plan): the update has no order")
        for e, epoch in enumerate(exp.plan.order):
            for m, minibatch in enumerate(epoch):
                in_loss = exp.loss_mask[torch.cat(minibatch)]
                num_tokens, num_seqs = engine.all_reduce_sum(
                    torch.stack([in_loss.sum(), (in_loss.sum(1) > 0).sum().to(in_loss.dtype)])).tolist()
                for rows in minibatch:
                    b = exp.rows(rows)
                    fwd = exp.forwards.pop(tuple(rows.tolist()), None)
                    if fwd is not None:
                        if (e, m) != (0, 0):  # its weights are the rollout's: only before the first optimizer step
                            raise RuntimeError("a training forward of the rollout reached after the update's first "
                                               "optimizer step (Experience.forwards, UpdatePlan.carry)")
                        b.forwards[tuple(range(len(rows)))] = fwd
                    yield b, num_tokens, num_seqs, rows
        if exp.forwards:  # else its graph would be held until the rollout is dropped
            raise RuntimeError(f"{len(exp.forwards)} training forward(s) of rows the update's plan does not visit "
                               "(Experience.forwards)")

    def losses(self, b: Experience, num_tokens: float, num_seqs: float | None = None) -> Losses:
        """The forward (`training_forward`, or the one the rollout ran for one of the update's first micro-batches:
        `b.forward`) and the losses of one micro-batch (Schulman et al. 2017, eq. 9): the policy loss
        (`ppo.policy_loss`: PPO's clipped surrogate, GSPO's or CISPO's, with `ppo.clip`, `ppo.clip_high` and
        `ppo.dual_clip`; each token's term weighted by the engine correction, `rollout.is_correction`, when the
        engine gave its log-probs) minus `ppo.c2` × entropy bonus, plus β × KL to the reference when
        `ppo.kl_in=loss`, plus `ppo.c1` × clipped value loss (`ppo.value_clip`): in the actor's objective with a
        shared critic, as the separate critic's objective otherwise, absent for a critic-free estimator. Each is
        aggregated over the whole minibatch (`ppo.aggregation`: `num_tokens` tokens in the loss and `num_seqs`
        rows with one, over all ranks, `micro_batches`; num_seqs None: `b`'s own such rows), so micro-batch losses
        sum to the minibatch's."""
        p, P = self.p, b.prompt_len
        shared, separate = has_value_head(self.actor.module), self.critic is not None
        if b.forward is not None:  # run by the rollout at these weights (UpdatePlan.carry)
            lp, ent, v, _ = b.forward
        else:
            packing: Any = b.plan.packed
            if packing and b.layout is not None:  # the layout the maker built for these rows
                packing = b.layout
            lp, ent, v, _ = training_forward(self.actor, self.critic, b.input_ids, b.attention_mask, P,
                                             p.temperature, p.c2 != 0, packing, top_p=p.top_p)
        if num_seqs is None:
            num_seqs = float((b.loss_mask.sum(1) > 0).sum())
        agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, aggregation=p.aggregation)
        old = lp.detach() if b.plan.on_policy else b.old_logprobs
        r, weights = self.cfg.rollout, None
        if r.is_correction != "none" and b.engine_logprobs is not None:  # the engine correction's constant weights
            weights, _, _ = engine_is_weights(old, b.engine_logprobs, b.loss_mask, r.is_correction, r.is_low,
                                              r.is_high)
        pg_loss, pg_stats = POLICY_LOSSES[p.policy_loss](lp, old, b.advantages, b.loss_mask, p.clip, **agg,
                                                         clip_high=p.clip_high, dual_clip=p.dual_clip,
                                                         weights=weights)
        ent_bonus, ent_stats = entropy_bonus(None, b.loss_mask, entropy=ent, **agg)
        actor_loss = pg_loss - p.c2 * ent_bonus
        stats = {**pg_stats, **ent_stats}
        if p.kl_in == "loss":  # GRPO's β·D_KL term (Shao et al. 2024, eq. 3)
            kl, kl_stats = kl_loss(lp, b.ref_logprobs, b.loss_mask, p.kl_estimator, **agg)
            actor_loss = actor_loss + self.kl_ctl.value * kl
            stats.update(kl_stats)
        vf_loss = torch.zeros(())
        if shared or separate:
            vf_loss, vf_stats = value_loss(v, b.values, b.returns, b.loss_mask, p.value_clip, **agg)
            if shared:
                actor_loss = actor_loss + p.c1 * vf_loss
            stats.update(vf_stats)
            stats.pop("val/explained_var", None)  # per rollout, in ExperienceMaker.make_experience
        return Losses(actor_loss, p.c1 * vf_loss if separate else None, pg_loss.detach(), vf_loss.detach(),
                      lp.detach(), stats)

    def micro_step(self, b: Experience, num_tokens: float, num_seqs: float, iteration: int) -> Losses:
        """`losses`, then the backward passes; the optimizers step at accumulation boundaries. A non-finite
        loss on any rank is skipped on all of them (`ppo.max_bad_steps`)."""
        out = self.losses(b, num_tokens, num_seqs)
        actor_loss, critic_loss = out.actor, out.critic
        finite = torch.isfinite(actor_loss.detach())
        if critic_loss is not None:
            finite = finite & torch.isfinite(critic_loss.detach())
        if engine.all_reduce_sum((~finite).float().cpu()).item() > 0:  # every rank skips together
            self.bad_steps += 1
            log.warning("non-finite loss at iteration %d (bad steps: %d)", iteration + 1, self.bad_steps)
            if self.bad_steps > self.p.max_bad_steps:
                raise FloatingPointError(f"aborting: {self.bad_steps} micro-steps with NaN/inf losses "
                                         f"(ppo.max_bad_steps={self.p.max_bad_steps})")
            actor_loss = engine.zero_loss(self.actor.module)
            critic_loss = engine.zero_loss(self.critic.module) if critic_loss is not None else None
        self.actor.backward_global(actor_loss)
        self.actor.step()
        if critic_loss is not None:
            self.critic.backward_global(critic_loss)
            self.critic.step()
        return out

    def train_on(self, exp: Experience, iteration: int) -> dict[str, float]:
        """The update on one rollout (`micro_batches` in its plan's order, `micro_step` each); returns its mean
        stats. With `exp.plan.on_policy`, the training forward's log-probs (detached, float32) are written into
        `exp.old_logprobs`. `time/training` includes the seconds of the first micro-batches' forwards the rollout ran
        (`exp.forwards`)."""
        ws = engine.world_size()
        sums: dict[str, float] = {}
        count, tokens = 0, 0.0
        t0 = time.perf_counter()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        carried_seconds = sum(fwd.seconds for fwd in exp.forwards.values())
        for b, num_tokens, num_seqs, rows in self.micro_batches(exp):
            tokens += float(b.attention_mask.sum())
            out = self.micro_step(b, num_tokens, num_seqs, iteration)
            if exp.plan.on_policy:
                exp.old_logprobs[rows] = out.logprobs.float()
            # per-micro-batch stats: losses summed over micro-batches give the minibatch loss; the policy loss's
            # means over its kept tokens are weighed by their count (a micro-batch that keeps none adds nothing)
            kept = out.stats.get(KEPT_TOKENS, 0.0)
            for k, val in out.stats.items():
                sums[k] = sums.get(k, 0.0) + (val * kept if k in KEPT_TOKEN_MEANS else val)
            sums["policy/loss_sum"] = sums.get("policy/loss_sum", 0.0) + out.policy.item()
            sums["val/loss_sum"] = sums.get("val/loss_sum", 0.0) + out.value.item()
            count += 1
        dt = time.perf_counter() - t0 + carried_seconds  # the carried forwards are the update's, run earlier
        stats = {k: v if k in KEPT_TOKEN_MEANS or k == KEPT_TOKENS else v / max(count, 1) for k, v in sums.items()}
        n_minibatches = self.p.epochs * math.ceil(exp.input_ids.shape[0] / (self.p.mini_batch_size // ws))
        stats["policy/loss"] = sums.get("policy/loss_sum", 0.0) / n_minibatches * ws
        if self.estimator.needs_critic:
            stats["val/loss"] = sums.get("val/loss_sum", 0.0) / n_minibatches * ws
        stats.pop("policy/loss_sum", None), stats.pop("val/loss_sum", None)
        stats["time/training"] = dt
        stats["throughput/train_tokens_per_s"] = tokens * ws / max(dt, 1e-9)
        stats["policy/grad_norm"] = self.actor.grad_norm()
        stats["lr/actor"] = self.actor.lr()
        stats = engine.reduce_stats(stats)  # the kept-token sums and their count alike: ratios of totals
        kept = stats.pop(KEPT_TOKENS, 0.0)
        for k in KEPT_TOKEN_MEANS:
            if k in stats:
                stats[k] = stats[k] / kept if kept > 0 else 0.0
        return stats
