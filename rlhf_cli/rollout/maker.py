"""The rollout half of a PPO iteration (OpenRLHF's experience maker): prompts → sampled responses (a group of
`ppo.n_samples_per_prompt` per prompt) → scores → no-grad passes (old logprobs, ref_logprobs, values when there
is a critic) → per-token rewards → advantages and returns (`ppo.advantage_estimator`), as one `Experience` per
rank, with the rollout's statistics.

Precision: sampling and a separate critic run in `precision`; the policy's and the reference's log-prob
passes and the reward model in the one `scoring_precision` gives (see config.py, `scoring_precision`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import ESTIMATORS, add_at_last_token, group_stats, kl_estimate, kl_penalized_rewards
from rlhf_cli.data import epoch_order
from rlhf_cli.models import attention_tokens
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.generation import Sampling, make_generator, rollout_batch
from rlhf_cli.rollout.learner import (
    Forward,
    micro_batches_per_minibatch,
    packs_rollout_passes,
    training_forward,
    update_order,
)
from rlhf_cli.rollout.packing import PackedRollout, pack_rollout, use_packing
from rlhf_cli.rollout.policy import critic_values, has_value_head, lm_of, policy_forward, sequence_kl
from rlhf_cli.rollout.rewards import Rewards
from rlhf_cli.rollout.stats import explained_variance_across_ranks, whiten_across_ranks
from rlhf_cli.seeds import derive_seed

log = logging.getLogger(__name__)


class ExperienceMaker:
    """Makes one iteration's `Experience` on this rank from the run's models.

    cfg: the run config (`ppo.*`, `seed`, `data.seed`, `precision`, `scoring_precision`); prompts: the
    tokenized prompt rows; actor: the policy's `engine.TrainEngine` (carrying the value head when
    `ppo.critic=shared`); critic: a separate critic's engine or None (shared, or a critic-free estimator);
    reference: an `engine.FrozenModel`; rewards: the run's `Rewards`; kl_ctl: the KL controller whose `value`
    is β; score_precision: the precision of the scoring passes, as `engine.scoring_precision` resolved it.
    """

    def __init__(self, cfg: Any, tokenizer: Any, prompts: Sequence[dict[str, Any]], actor: Any, reference: Any,
                 critic: Any, rewards: Rewards, kl_ctl: Any, score_precision: str) -> None:
        self.cfg, self.p = cfg, cfg.ppo
        self.tokenizer, self.prompts = tokenizer, prompts
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.actor, self.reference, self.critic = actor, reference, critic
        self.rewards, self.kl_ctl = rewards, kl_ctl
        self.estimator = ESTIMATORS[cfg.ppo.advantage_estimator]
        self.whiten = self.p.whiten_advantages if self.p.whiten_advantages is not None else self.estimator.whiten
        self.precision = cfg.precision  # sampling, separate critic
        self.generator = make_generator(cfg.rollout.engine, precision=cfg.precision, chunk=self.p.micro_batch_size * 4)
        """The sampling engine (`rollout.engine`), pointed at the policy's weights before each rollout."""
        self.sampling = Sampling(eos_ids=(self.eos_id,), pad_id=self.pad_id, max_new_tokens=self.p.max_new_tokens,
                                 temperature=self.p.temperature, top_p=self.p.top_p)
        self.score_precision = score_precision  # resolved once per run (it warns under precision=bf16)
        self._order: list[int] = []  # prompt order of data epoch `_order_epoch` (prompt_batch)
        self._order_epoch: int | None = None
        self.pass_seconds = {"reward": 0.0, "reference": 0.0, "policy": 0.0, "critic": 0.0, "packing": 0.0}
        """Seconds of the last rollout's scoring, by pass: `reward` (reward model and functions), `reference`,
        `policy` (the old log-probs; 0 when `old_from_training` skips it), `critic` (a separate critic) and
        `packing` (building the packed layouts of the other three, once per micro-batch). The forwards of the
        update's first micro-batches (`carries_forward`) are in none of them: they are training's
        (`time/training`)."""
        p = self.p
        checks_kl = score_precision == "bf16-autocast" and p.kl_check_rows > 0  # kl_fp32_check needs the old pass
        self.old_from_training = (p.epochs == 1 and p.mini_batch_size == p.rollout_batch_size * p.n_samples_per_prompt
                                  and not self.estimator.needs_critic and p.kl_in == "loss" and not checks_kl)
        """The update is on-policy: one epoch of one minibatch (the whole rollout, one optimizer step), no critic,
        and the KL in the loss, so nothing before the update reads the old log-probs (nor does the bf16 KL check,
        `kl_fp32_check`, which runs only with `scoring_precision=same` under bf16-autocast and then keeps the pass).
        The no-grad policy pass is
        then skipped: the old log-probs are the training forward's own, detached (ratio 1, as TRL's GRPO with one
        step per generation), and the rollout's KL statistics come after the update (`kl_stats`)."""
        zero_stage = max((e.zero_stage for e in (actor, critic) if e is not None), default=0)  # as built
        before_first_step = micro_batches_per_minibatch(p)  # the first optimizer step follows them
        why_not = ("the rollout's passes do not run over the update's micro-batches (data.packing=false)"
                   if not packs_rollout_passes(cfg) else
                   "the update is on-policy and the maker runs no old-log-prob pass" if self.old_from_training else
                   "an engine runs ZeRO-3" if zero_stage >= 3 else
                   "the reference is offloaded (ppo.offload_reference)" if getattr(reference, "offload", False)
                   else None)
        self.carries_forward = 0 if why_not else min(p.carried_forwards, before_first_step)
        """How many of the update's first micro-batches the maker runs the training forwards of
        (`ppo.carried_forwards`; 0 = none). They are this rollout's first chunks, and the update's first optimizer
        step comes after them: at the rollout's weights their training forwards give the old log-probs and values
        the no-grad passes would. So the maker runs those forwards (`learner.training_forward`, graphs kept) in
        place of the chunks' no-grad policy and critic passes, takes their outputs (detached) as those rows' old
        log-probs and values, and hands them to the update in `Experience.carried`: one forward of each trained
        model per carried micro-batch and iteration saved, the same numbers (the same function of the same weights
        on the same layout; their ratios are exactly 1). They run after the other chunks' passes, so their graphs
        (the ones the update's forwards of those micro-batches would hold) live only through the advantages and
        the rollout's statistics, and each until its own backward.

        Capped at the micro-batches of the update's first minibatch (its first optimizer step follows them). 0
        when the rollout's passes do not run over the update's micro-batches (`data.packing=false`), when nothing
        is left to fold (`old_from_training`), when an engine runs ZeRO-3 (its partitioned weights are gathered
        per forward and backward, in order) and when the reference is offloaded (`ppo.offload_reference` on a GPU:
        a graph held beside the reference on the device is the memory that setting saves)."""
        if why_not and p.carried_forwards > 1 and engine.is_main():  # the default's cases: README "Packing"
            log.warning("ppo.carried_forwards=%d does nothing here: %s", p.carried_forwards, why_not)
        elif not why_not and p.carried_forwards > before_first_step and engine.is_main():
            log.info("ppo.carried_forwards=%d: only %d micro-batches come before the update's first optimizer step "
                     "(ppo.mini_batch_size=%d over %d rank(s) in micro-batches of %d); carrying %d",
                     p.carried_forwards, before_first_step, p.mini_batch_size, engine.world_size(), p.micro_batch_size,
                     before_first_step)

    def prompt_batch(self, iteration: int) -> tuple[list[dict[str, Any]], list[int], torch.Tensor]:
        """This rank's rows of an iteration: their prompts, sampling seeds and group ids.

        Prompts: a seeded walk through epochs of shuffled prompts (the same on every rank), `ppo.rollout_batch_size`
        per iteration, each repeated `ppo.n_samples_per_prompt` (n) times in a row; a rank takes whole groups.
        Seeds: one per (run seed, iteration, k·n + j) for sample j of the iteration's k-th prompt, so every
        sample has its own stream and a response is the same whatever the world size. Group id: k.
        """
        n, R, G = len(self.prompts), self.p.rollout_batch_size, self.p.n_samples_per_prompt
        idx = []
        for k in range(iteration * R, (iteration + 1) * R):
            epoch, pos = divmod(k, n)
            if epoch != self._order_epoch:
                self._order, self._order_epoch = epoch_order(n, (self.cfg.data.seed, self.cfg.seed), epoch), epoch
            idx.append(self._order[pos])
        per_rank = R // engine.world_size()
        ks = range(engine.rank() * per_rank, (engine.rank() + 1) * per_rank)
        prompts = [self.prompts[idx[k]] for k in ks for _ in range(G)]
        seeds = [derive_seed(self.cfg.seed, iteration, k * G + j) for k in ks for j in range(G)]
        groups = torch.tensor([k for k in ks for _ in range(G)], dtype=torch.long)
        return prompts, seeds, groups

    def generate(self, prompts: list[dict[str, Any]],
                 seeds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Sample one response per prompt with the current policy, one seed per prompt (`self.generator`).
        Returns the rollout batch: input_ids (B, P+R), attention_mask (B, P+R), P, has_eos (B,)
        (`generation.rollout_batch`)."""
        prompt_ids = [x["prompt_ids"] for x in prompts]
        with self.actor.gathered_params():  # ZeRO-3: the full weights, for the engine to sample from
            self.generator.update_weights(lm_of(self.actor.module))
            generation = self.generator.generate(prompt_ids, seeds, self.sampling)
        return rollout_batch(prompt_ids, generation, self.pad_id)

    @torch.no_grad()
    def forward_no_grad(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                        chunks: list[torch.Tensor] | None = None,
                        layouts: dict[tuple[int, ...], PackedRollout] | None = None,
                        carry: int = 0) -> tuple[Any, ...]:
        """Old logprobs, ref logprobs and old values (None without a critic) of every row, as training computes
        them: over `chunks` (row-index tensors, the update's micro-batches: packed, `packs_rollout_passes`), or
        over consecutive micro-batches of `ppo.micro_batch_size` rows (plain). Packed, each chunk's layout is
        built once for the three passes and kept in `layouts` (keyed by the chunk's rows) for the update.
        `carry` (with `chunks`, whose first are the update's first micro-batches): the first `carry` chunks'
        policy and critic passes are their training forwards (`carries_forward`), run after the other chunks' and
        returned fourth as a list of (rows, `learner.Forward`), in update order, for `Experience.carried`; else
        the fourth result is None."""
        with self.reference.on_device() as reference:
            return self._forward_no_grad(input_ids, attention_mask, P, reference, chunks,
                                         {} if layouts is None else layouts, carry if chunks is not None else 0)

    def _forward_no_grad(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                         reference: torch.nn.Module, chunks: list[torch.Tensor] | None,
                         layouts: dict[tuple[int, ...], PackedRollout], carry: int) -> tuple[Any, ...]:
        mb, temperature = self.p.micro_batch_size, self.p.temperature
        packed = chunks is not None
        if chunks is None:
            chunks = [torch.arange(i, min(i + mb, input_ids.shape[0])) for i in range(0, input_ids.shape[0], mb)]
        B, R = input_ids.shape[0], input_ids.shape[1] - P
        dev = input_ids.device
        logprobs, ref_logprobs = torch.zeros(B, R, device=dev), torch.zeros(B, R, device=dev)
        values = torch.zeros(B, R, device=dev)
        has_values = False
        carried: list[tuple[tuple[int, ...], Forward]] = []
        shared = has_value_head(self.actor.module)
        policy_lm = lm_of(self.actor.module)
        clock = self.pass_seconds
        for i, rows in enumerate(chunks[carry:] + chunks[:carry]):  # the carried graphs live the least time
            carry_this = i >= len(chunks) - carry
            rows = rows.to(dev)
            ids, am = input_ids[rows], attention_mask[rows]
            t0 = _clock(dev)
            packing: bool | PackedRollout = packed
            if packed and use_packing(policy_lm, True):  # else each model decides for itself
                # kept on the CPU (the 4D masks of every micro-batch live until the update ends), moved per pass
                packing = layouts[tuple(rows.tolist())] = pack_rollout(
                    ids.cpu(), am.cpu(), P, attention_tokens=attention_tokens(policy_lm))
            clock["packing"] += _clock(dev) - t0
            t0 = _clock(dev)
            with self.reference.autocast():
                ref_logprobs[rows], _, _ = policy_forward(reference, ids, am, P, temperature, packing=packing)
            t1 = _clock(dev)
            clock["reference"] += t1 - t0
            v = None
            if carry_this:  # one of the update's first micro-batches: its training forward, at these passes' weights
                self.actor.train()
                if self.critic is not None:
                    self.critic.train()
                with torch.enable_grad():
                    fwd = training_forward(self.actor, self.critic, self.p, ids, am, P, packing)
                fwd = fwd._replace(seconds=_clock(dev) - t1)
                carried.append((tuple(rows.tolist()), fwd))
                logprobs[rows] = fwd.logprobs.detach()
                v = None if fwd.values is None else fwd.values.detach()
            else:
                if not self.old_from_training:  # else the update fills the old log-probs in
                    with self.actor.autocast():
                        logprobs[rows], _, v = policy_forward(self.actor.module, ids, am, P, temperature,
                                                              with_values=shared, packing=packing)
                t2 = _clock(dev)
                clock["policy"] += t2 - t1
                if self.critic is not None:
                    with self.critic.autocast():
                        v = critic_values(self.critic.module, ids, am, P, packing=packing)
                clock["critic"] += _clock(dev) - t2
            if v is not None:
                values[rows], has_values = v.float(), True
        return logprobs, ref_logprobs, (values if has_values else None), (carried or None)

    def kl_stats(self, exp: Experience, beta: float) -> dict[str, float]:
        """The rollout's KL statistics (mean over ranks): `objective/kl` (k1, nats/seq), `objective/kl_k3`,
        `objective/rlhf_reward` (score − β·KL), `objective/entropy_sampled`, and the fp32 check (`kl_fp32_check`).
        From `exp.logprobs`: after the update when the old log-probs come from it (`old_from_training`)."""
        return engine.reduce_stats(self._kl_stats(exp, beta))

    def _kl_stats(self, exp: Experience, beta: float) -> dict[str, float]:
        mask = exp.attention_mask[:, exp.prompt_len:].float()
        kl_seq = (kl_estimate(exp.logprobs, exp.ref_logprobs, "k1") * mask).sum(1)  # nats per sequence
        return {
            "objective/kl": kl_seq.mean().item(),
            "objective/kl_k3": (kl_estimate(exp.logprobs, exp.ref_logprobs, "k3") * mask).sum(1).mean().item(),
            "objective/rlhf_reward": (exp.scores - beta * kl_seq).mean().item(),
            "objective/entropy_sampled": (-(exp.logprobs * mask).sum(1)).mean().item(),
            **self.kl_fp32_check(exp.input_ids, exp.attention_mask, exp.prompt_len, kl_seq),
        }

    @torch.no_grad()
    def kl_fp32_check(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                      kl_seq: torch.Tensor) -> dict[str, float]:
        """The noise floor of bf16 log-probs: `objective/kl_fp32`, the KL (k1, nats/seq) of this rank's first
        `ppo.kl_check_rows` rollout rows computed in fp32, and `objective/kl_check`, the reported KL of the same
        rows. Only when the scoring passes run under bf16 autocast (`scoring_precision=same`); else {}."""
        k = min(self.p.kl_check_rows, input_ids.shape[0])
        if k == 0 or self.score_precision != "bf16-autocast":
            return {}
        # the first k rows packed together, a layout other than the rollout's micro-batches: in fp32 that moves
        # the KL by float rounding (~1e-6 nats), far below the bf16 noise this check measures
        with self.reference.on_device() as reference:  # the weights are fp32 under bf16-autocast
            kl_fp32 = sequence_kl(self.actor.module, reference, input_ids[:k], attention_mask[:k], P,
                                  self.p.temperature, k, "fp32", packing=packs_rollout_passes(self.cfg))["k1"]
        return {"objective/kl_fp32": kl_fp32.mean().item(), "objective/kl_check": kl_seq[:k].mean().item()}

    def make_experience(self, iteration: int) -> tuple[Experience, dict[str, float], dict[str, Any]]:
        p = self.p
        prompts, seeds, groups = self.prompt_batch(iteration)
        t0 = time.perf_counter()
        input_ids, attention_mask, P, has_eos = self.generate(prompts, seeds)
        t1 = time.perf_counter()
        raw, score, source_means = self.rewards(input_ids, attention_mask, P, prompts)
        self.pass_seconds = {"reward": _clock(input_ids.device) - t1, "reference": 0.0, "policy": 0.0, "critic": 0.0,
                             "packing": 0.0}
        mask = attention_mask[:, P:].float()
        if p.truncated == "penalize":
            score = score - p.missing_eos_penalty * (~has_eos).float()
        chunks, layouts = None, {}
        if packs_rollout_passes(self.cfg):  # the update's own micro-batches: one packed layout per row
            chunks = [rows for minibatch in update_order(self.cfg, iteration, groups)[0] for rows in minibatch]
        logprobs, ref_logprobs, values, carried = self.forward_no_grad(input_ids, attention_mask, P, chunks, layouts,
                                                                       carry=self.carries_forward)
        t2 = time.perf_counter()
        carried_seconds = sum(fwd.seconds for _, fwd in carried or [])
        valid = has_eos if p.truncated == "mask" else torch.ones_like(has_eos)
        loss_mask = mask * valid.float()[:, None]
        beta = self.kl_ctl.value
        if p.kl_in == "reward":
            rewards = kl_penalized_rewards(score, logprobs, ref_logprobs, mask, beta, p.kl_estimator)
        else:  # β·KL is a loss term (PPOTrainer.losses): the reward is the score alone
            rewards = add_at_last_token(torch.zeros_like(logprobs), mask, score)
        groups = groups.to(score.device)
        advantages, returns = self.estimator(rewards, mask, scores=score, groups=groups, valid=valid, values=values,
                                             gamma=p.gamma, lam=p.lam)
        if self.whiten:
            advantages = whiten_across_ranks(advantages, loss_mask)
        exp = Experience(input_ids, attention_mask, loss_mask, logprobs, ref_logprobs,
                         values if values is not None else torch.zeros_like(logprobs), rewards, advantages, returns,
                         score, groups, layouts, carried)
        # token means over all ranks of the advantages the update uses (after whitening)
        adv_sums = engine.all_reduce_sum(torch.stack([(advantages * loss_mask).sum(),
                                                      (advantages.abs() * loss_mask).sum(), loss_mask.sum()]))
        if adv_sums[2] == 0 and engine.is_main():
            log.warning("iteration %d trains nothing: every response is masked (ppo.truncated=mask and none ended "
                        "with EOS within ppo.max_new_tokens=%d)", iteration + 1, p.max_new_tokens)
        lengths = mask.sum(1)
        gen_tokens = float(lengths.sum())
        stats = {
            "objective/scores": raw.mean().item(),
            "objective/scores_norm": score.mean().item(),
            "objective/kl_beta": beta,
            "advantages/mean": (adv_sums[0] / adv_sums[2].clamp(min=1)).item(),
            "advantages/abs_mean": (adv_sums[1] / adv_sums[2].clamp(min=1)).item(),
            "response/length_mean": lengths.mean().item(),
            "response/eos_frac": has_eos.float().mean().item(),
            "time/generation": t1 - t0,
            "time/scoring": t2 - t1 - carried_seconds,  # the carried forwards count in time/training
            **{f"time/scoring_{k}": v for k, v in self.pass_seconds.items()},
            "throughput/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            **source_means,
            **({} if self.old_from_training else self._kl_stats(exp, beta)),
        }
        if values is not None:
            stats["val/values_mean"] = ((values * mask).sum() / mask.sum().clamp(min=1)).item()
            stats["val/explained_var"] = explained_variance_across_ranks(values, returns, loss_mask)
        if p.n_samples_per_prompt > 1:
            stats.update(group_metrics(score, groups, valid))
        stats = engine.reduce_stats(stats)
        samples = {"prompts": [x.get("prompt_text", "") for x in prompts[:3]],
                   "responses": self.tokenizer.batch_decode(input_ids[:3, P:], skip_special_tokens=True),
                   "scores": raw[:3].tolist()}
        return exp, stats, samples


def _clock(device: torch.device) -> float:
    """`time.perf_counter()` after the device's queued work (a CUDA pass is charged to itself, not the next)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def group_metrics(scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Per-iteration statistics of the groups on this rank (each group counted once): `groups/score_mean` (mean
    of the group means), `groups/score_std` (mean within-group std) and `groups/zero_var_frac` (the fraction of
    groups without a learning signal for a group baseline: all valid scores equal, or fewer than 2 valid rows)."""
    st = group_stats(scores, groups, valid)
    first = torch.ones_like(groups, dtype=torch.bool)
    first[1:] = groups[1:] != groups[:-1]  # a group's rows are adjacent (prompt_batch)
    return {"groups/score_mean": st["mean"][first].mean().item(),
            "groups/score_std": st["std"][first].mean().item(),
            "groups/zero_var_frac": st["flat"][first].mean().item()}
