"""The learning half of an RL iteration: the update on one rollout's `Experience`.

    PolicyLearner.train_on(exp, iteration)   `ppo.epochs` passes of shuffled minibatches; returns the mean stats
        micro_batches                          the order: minibatches of `ppo.mini_batch_size` completions (over all
                                               ranks), cut into micro-batches of `ppo.micro_batch_size`
        losses                                 one micro-batch's forward and losses (`Losses`): the seam tests spy on
        micro_step                             `losses`, the backward passes, the optimizer steps, NaN skipping

`PolicyLearner` is a mixin: the stage's trainer (stages/ppo.py `PPOTrainer`) provides `cfg`, `p` (= cfg.ppo),
`actor` and `critic` (`engine.TrainEngine`, critic None when shared or critic-free), `kl_ctl`, `estimator`
(`core.ESTIMATORS` entry) and `bad_steps`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.core import entropy_bonus, kl_loss, policy_loss, value_loss
from rlhf_cli.forwards import critic_values, policy_forward
from rlhf_cli.models import has_value_head
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.seeds import derive_seed

log = logging.getLogger(__name__)


def micro_batches_per_minibatch(p: Any) -> int:
    """Micro-batches of `ppo.micro_batch_size` rows in one minibatch on this rank (`ppo.mini_batch_size` over all
    ranks); the optimizer steps once per minibatch (`update_order`)."""
    return -(-(p.mini_batch_size // engine.world_size()) // p.micro_batch_size)


def update_order(cfg: Any, iteration: int, groups: torch.Tensor) -> list[list[list[torch.Tensor]]]:
    """The rows of this rank's rollout (B = len(groups)) in the order the update visits them: `ppo.epochs` passes,
    each a list of minibatches of `ppo.mini_batch_size` rows (over all ranks), each a list of micro-batches of
    `ppo.micro_batch_size` row indices (long tensors). Shuffles are seeded by (seed, iteration, rank).

    The micro-batches are drawn once per iteration: a shuffle of the rows cut into minibatches, and with
    `ppo.n_samples_per_prompt` > 1 a minibatch's rows ordered by group before the cut into micro-batches, so that
    a group's samples share micro-batches and `data.packing` computes their prompt once (the minibatch, and so the
    update, is the same: its loss is summed over micro-batches). The first epoch visits them in that order; each
    later epoch shuffles the same micro-batches into new minibatches (veRL keeps its micro-batches across epochs,
    and OpenRLHF's packed samples are shuffled whole); when a minibatch is one micro-batch (`ppo.mini_batch_size`
    = `ppo.micro_batch_size` × world size), later epochs visit the same minibatches in a new order. So a row is in
    one micro-batch, with the same rows, in every pass of an iteration: its packed layout, and the float rounding
    that depends on it, is the one the no-grad passes saw (`packs_rollout_passes`). The plain layout
    (`data.packing=false`) takes the same order, so the switch changes no update beyond float rounding."""
    p = cfg.ppo
    n, mini = groups.shape[0], p.mini_batch_size // engine.world_size()
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, iteration, engine.rank()))
    perm = torch.randperm(n, generator=g)
    micro: list[torch.Tensor] = []
    for s in range(0, n, mini):
        rows = perm[s:s + mini]
        if p.n_samples_per_prompt > 1:
            rows = rows[torch.argsort(groups.cpu()[rows], stable=True)]
        micro += [rows[m:m + p.micro_batch_size] for m in range(0, len(rows), p.micro_batch_size)]
    per_mini = micro_batches_per_minibatch(p)
    order = [list(range(len(micro)))] + [torch.randperm(len(micro), generator=g).tolist()
                                         for _ in range(p.epochs - 1)]
    return [[[micro[j] for j in epoch[s:s + per_mini]] for s in range(0, len(micro), per_mini)] for epoch in order]


def packs_rollout_passes(cfg: Any) -> bool:
    """Whether the policy, reference and critic passes of a rollout run packed (`data.packing`, `forwards.packing`).

    A packed layout depends on a row's micro-batch, and float rounding on the layout. The update keeps each row in
    one micro-batch for the whole iteration (`update_order`), and the experience maker runs its no-grad passes
    over those micro-batches, so old log-probs, reference log-probs, values and every epoch's training forward of
    a row see one packed layout, and the first ratio is exactly 1 as in the plain layout."""
    return bool(cfg.data.packing)


class Forward(NamedTuple):
    """One micro-batch's training forward (`training_forward`), with its autograd graph: response logprobs (B, R)
    float32, entropies (B, R) float32 nats (in the graph only when `ppo.c2` != 0), values (B, R) float32 of the
    shared value head or the separate critic (None when critic-free), and `seconds` of wall time when the maker
    ran it (`ExperienceMaker.carries_forward`; 0 otherwise)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None
    seconds: float = 0.0


def training_forward(actor: engine.TrainEngine, critic: engine.TrainEngine | None, p: Any, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, prompt_len: int, packing: Any) -> Forward:
    """The forward every loss of a micro-batch reads: the policy's response logprobs at `ppo.temperature` with
    their entropies (and the shared head's values) under the actor's autocast, and a separate critic's values under
    its own. input_ids, attention_mask: (B, P+R); `packing`: as `policy_forward` takes it. The one code path of
    the update, and of the maker's forwards of the update's first micro-batches (`ExperienceMaker.carries_forward`)."""
    with actor.autocast():
        # with ppo.c2=0 the entropy is a statistic: no gradient through its (B, R, V) softmax (0 x it is 0)
        lp, ent, v = policy_forward(actor.module, input_ids, attention_mask, prompt_len, p.temperature,
                                    with_entropy=True, with_values=has_value_head(actor.module), packing=packing,
                                    entropy_grad=p.c2 != 0)
    if critic is not None:
        with critic.autocast():
            v = critic_values(critic.module, input_ids, attention_mask, prompt_len, packing=packing)
    return Forward(lp, ent, v)


class Losses(NamedTuple):
    """One micro-batch's losses (`PPOTrainer.losses`): what each engine backpropagates, the two losses logged
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
    bad_steps: int
    old_from_training: bool = False  # the maker skipped the old log-probs: they are the training forward's own

    def micro_batches(self, exp: Experience, iteration: int) -> Iterator[tuple[Experience, float, torch.Tensor]]:
        """The update's order (`update_order`), micro-batch by micro-batch. Yields (micro-batch, real response
        tokens of its minibatch over all ranks: the divisor of every micro-batch loss, its rows' indices in `exp`)."""
        for epoch in update_order(self.cfg, iteration, exp.groups):
            for minibatch in epoch:
                num_tokens = engine.all_reduce_sum(exp.mask[torch.cat(minibatch)].sum()).item()
                for rows in minibatch:
                    b = exp.rows(rows)
                    if exp.carried:  # the next of the first micro-batches' forwards, run by the maker: used once
                        key, b.carried = exp.carried.pop(0)
                        if key != tuple(rows.tolist()):
                            raise RuntimeError("a carried training forward is not of the update's next micro-batch "
                                               "(ExperienceMaker.carries_forward)")
                        exp.carried = exp.carried or None
                    yield b, num_tokens, rows
        if exp.carried:  # else its graph would be held until the rollout is dropped
            raise RuntimeError(f"{len(exp.carried)} carried training forward(s) never reached by the update "
                               "(ExperienceMaker.carries_forward)")

    def losses(self, b: Experience, num_tokens: float) -> Losses:
        """The forward (`training_forward`, or the one the maker ran for one of the update's first micro-batches:
        `b.carried`) and the losses of one micro-batch (Schulman et al. 2017, eq. 9): clipped surrogate
        (`ppo.clip`) minus `ppo.c2` × entropy bonus, plus β × KL to the reference when `ppo.kl_in=loss`, plus
        `ppo.c1` × clipped value loss (`ppo.value_clip`): in the actor's objective with a shared critic, as the
        separate critic's objective otherwise, absent for a critic-free estimator. Each is aggregated over the
        whole minibatch (`ppo.aggregation`, `num_tokens` real tokens over all ranks), so micro-batch losses sum
        to the minibatch's."""
        p, P = self.p, b.prompt_len
        shared, separate = has_value_head(self.actor.module), self.critic is not None
        if b.carried is not None:  # run by the maker at these weights (ExperienceMaker.carries_forward)
            lp, ent, v, _ = b.carried
        else:
            packing: Any = packs_rollout_passes(self.cfg)
            if packing and b.layout is not None:  # the layout the maker built for these rows
                packing = b.layout
            lp, ent, v, _ = training_forward(self.actor, self.critic, p, b.input_ids, b.attention_mask, P, packing)
        agg = dict(num_tokens=num_tokens, num_seqs=float(p.mini_batch_size), aggregation=p.aggregation)
        old = lp.detach() if self.old_from_training else b.logprobs
        pg_loss, pg_stats = policy_loss(lp, old, b.advantages, b.mask, p.clip, **agg)
        ent_bonus, ent_stats = entropy_bonus(None, b.mask, entropy=ent, **agg)
        actor_loss = pg_loss - p.c2 * ent_bonus
        stats = {**pg_stats, **ent_stats}
        if p.kl_in == "loss":  # GRPO's β·D_KL term (Shao et al. 2024, eq. 3)
            kl, kl_stats = kl_loss(lp, b.ref_logprobs, b.mask, p.kl_estimator, **agg)
            actor_loss = actor_loss + self.kl_ctl.value * kl
            stats.update(kl_stats)
        vf_loss = torch.zeros(())
        if shared or separate:
            vf_loss, vf_stats = value_loss(v, b.values, b.returns, b.mask, p.value_clip, **agg)
            if shared:
                actor_loss = actor_loss + p.c1 * vf_loss
            stats.update(vf_stats)
            stats.pop("val/explained_var", None)  # per rollout, in ExperienceMaker.make_experience
        return Losses(actor_loss, p.c1 * vf_loss if separate else None, pg_loss.detach(), vf_loss.detach(),
                      lp.detach(), stats)

    def micro_step(self, b: Experience, num_tokens: float, iteration: int) -> Losses:
        """`losses`, then the backward passes; the optimizers step at accumulation boundaries. A non-finite
        loss on any rank is skipped on all of them (`ppo.max_bad_steps`)."""
        out = self.losses(b, num_tokens)
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
        """The update on one rollout (`micro_batches` in order, `micro_step` each); returns its mean stats. With
        `old_from_training`, the training forward's log-probs (detached, float32) are written into `exp.logprobs`.
        `time/training` includes the seconds of the first micro-batches' forwards the maker ran (`exp.carried`)."""
        ws = engine.world_size()
        sums: dict[str, float] = {}
        count, tokens = 0, 0.0
        t0 = time.perf_counter()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        carried_seconds = sum(fwd.seconds for _, fwd in exp.carried or [])
        for b, num_tokens, rows in self.micro_batches(exp, iteration):
            tokens += float(b.attention_mask.sum())
            out = self.micro_step(b, num_tokens, iteration)
            if self.old_from_training:
                exp.logprobs[rows] = out.logprobs.float()
            # per-micro-batch stats: losses summed over micro-batches give the minibatch loss
            for k, val in out.stats.items():
                sums[k] = sums.get(k, 0.0) + val
            sums["policy/loss_sum"] = sums.get("policy/loss_sum", 0.0) + out.policy.item()
            sums["val/loss_sum"] = sums.get("val/loss_sum", 0.0) + out.value.item()
            count += 1
        dt = time.perf_counter() - t0 + carried_seconds  # the carried forwards are the update's, run earlier
        stats = {k: v / max(count, 1) for k, v in sums.items()}
        n_minibatches = self.p.epochs * math.ceil(exp.input_ids.shape[0] / (self.p.mini_batch_size // ws))
        stats["policy/loss"] = sums.get("policy/loss_sum", 0.0) / n_minibatches * ws
        if self.estimator.needs_critic:
            stats["val/loss"] = sums.get("val/loss_sum", 0.0) / n_minibatches * ws
        stats.pop("policy/loss_sum", None), stats.pop("val/loss_sum", None)
        stats["time/training"] = dt
        stats["throughput/train_tokens_per_s"] = tokens * ws / max(dt, 1e-9)
        stats["policy/grad_norm"] = self.actor.grad_norm()
        stats["lr/actor"] = self.actor.lr()
        return engine.reduce_stats(stats)
