"""The rollout half of a PPO iteration (OpenRLHF's experience maker): prompts → sampled responses (a group of
`ppo.n_samples_per_prompt` per prompt) → scores → no-grad passes (old logprobs, ref_logprobs, values when there
is a critic) → per-token rewards → advantages and returns (`ppo.advantage_estimator`), as one `Experience` per
rank, with the rollout's statistics.

Precision: sampling and a separate critic run in `precision`; the policy's and the reference's log-prob
passes and the reward model in the one `scoring_precision` gives (see config.py, `scoring_precision`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.core import (
    ESTIMATORS,
    add_at_last_token,
    group_stats,
    informative_groups,
    kl_penalized_rewards,
    overlong_penalty,
)
from rlhf_cli.data import epoch_order
from rlhf_cli.eos import eos_ids
from rlhf_cli.forwards import (
    Forward,
    PackedRollout,
    critic_values,
    pack_rollout,
    policy_forward,
    sequence_kl,
    training_forward,
    use_packing,
)
from rlhf_cli.models import attention_tokens, has_value_head, lm_of
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.generation import (
    EngineSettings,
    Sampling,
    join_rollout_batches,
    make_generator,
    resolve_engine,
    rollout_batch,
)
from rlhf_cli.rollout.plan import UpdatePlan
from rlhf_cli.rollout.scores import ScoreMixer
from rlhf_cli.rollout.stats import explained_variance_across_ranks, response_kl, whiten_across_ranks
from rlhf_cli.seeds import derive_seed

log = logging.getLogger(__name__)


class ExperienceMaker:
    """Makes one iteration's `Experience` on this rank from the run's models.

    cfg: the run config (`ppo.*`, `seed`, `data.seed`, `precision`, `scoring_precision`); prompts: the
    tokenized prompt rows; actor: the policy's `engine.TrainEngine` (carrying the value head when
    `ppo.critic=shared`); critic: a separate critic's engine or None (shared, or a critic-free estimator);
    reference: an `engine.FrozenModel`; score_mixer: the run's `ScoreMixer`; kl_ctl: the KL controller whose `value`
    is β; score_precision: the precision of the scoring passes, as `engine.scoring_precision` resolved it;
    plan: the learner's `plan(iteration, groups) -> UpdatePlan` (`PolicyLearner.plan`), asked once per iteration:
    the rollout runs its passes over the update's micro-batches, folds what the plan says into them, and hands the
    plan to the update in the `Experience`; workdir: the run dir (an engine with its own model dir writes it there).
    """

    def __init__(self, cfg: Any, tokenizer: Any, prompts: Sequence[dict[str, Any]], actor: Any, reference: Any,
                 critic: Any, score_mixer: ScoreMixer, kl_ctl: Any, score_precision: str,
                 plan: Callable[[int, torch.Tensor], UpdatePlan], workdir: Any = None) -> None:
        self.cfg, self.p = cfg, cfg.ppo
        self.tokenizer, self.prompts = tokenizer, prompts
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids(tokenizer, lm_of(actor.module).generation_config)
        """Every id that ends a response (`eos.eos_ids`): sampling stops at the first, the masks and `has_eos` read
        them all."""
        self.actor, self.reference, self.critic = actor, reference, critic
        self.score_mixer, self.kl_ctl = score_mixer, kl_ctl
        self.estimator = ESTIMATORS[cfg.ppo.advantage_estimator]
        self.whiten = self.p.whiten_advantages if self.p.whiten_advantages is not None else self.estimator.whiten
        self.engine_name, why = resolve_engine(cfg.rollout.engine, lm_of(actor.module).config)
        """The sampling engine this run uses (`rollout.engine`, `auto` resolved: `generation.resolve_engine`)."""
        if why != "as set" and engine.is_main():
            log.info("rollout.engine=%s samples with %s (%s)", cfg.rollout.engine, self.engine_name, why)
        if cfg.rollout.is_correction != "none" and self.engine_name == "hf" and engine.is_main():
            log.warning("rollout.is_correction=%s does nothing with rollout.engine=hf: the trainer samples itself, so "
                        "there are no engine log-probs and the ratio is 1 (rollout.engine=vllm gives them)",
                        cfg.rollout.is_correction)
        self.generator = make_generator(self.engine_name, EngineSettings(
            precision=cfg.precision, chunk=self.p.micro_batch_size * 4, workdir=workdir,
            kv_cache_gb=cfg.rollout.kv_cache_gb, max_model_len=cfg.data.max_prompt_length + self.p.max_new_tokens,
            engine_dtype=cfg.rollout.engine_dtype, score_precision=score_precision,
            verbose=cfg.rollout.engine_verbose, selftest=cfg.rollout.engine_selftest,
            sync_timeout_s=cfg.rollout.sync_timeout_s))
        """The sampling engine (`rollout.engine`), pointed at the policy's weights before each rollout; the stage
        closes it (`generator.close()`) when the run ends."""
        self.sampling = Sampling(eos_ids=self.eos_ids, pad_id=self.pad_id, max_new_tokens=self.p.max_new_tokens,
                                 temperature=self.p.temperature, top_p=self.p.top_p)
        self.score_precision = score_precision  # resolved once per run (it warns under precision=bf16)
        self._order: list[int] = []  # prompt order of data epoch `_order_epoch` (prompt_batch)
        self._order_epoch: int | None = None
        self.pass_seconds = {"reward": 0.0, "reference": 0.0, "policy": 0.0, "critic": 0.0, "packing": 0.0}
        """Seconds of the last rollout's scoring, by pass: `reward` (reward model and functions), `reference`,
        `policy` (the old log-probs; 0 when the plan is on-policy), `critic` (a separate critic) and `packing`
        (building the packed layouts of the other three, once per micro-batch). The forwards of the update's first
        micro-batches (`UpdatePlan.carry`) are in none of them: they are training's (`time/training`)."""
        self.plan = plan

    def prompt_batch(self, iteration: int,
                     round_: int = 0) -> tuple[list[dict[str, Any]], list[int], torch.Tensor]:
        """This rank's rows of an iteration's generation round: their prompts, sampling seeds and group ids.

        Prompts: round 0 (every iteration's, and the only one without `ppo.filter_groups`) takes a seeded walk
        through epochs of shuffled prompts (the same on every rank), `ppo.rollout_batch_size` (M) per iteration; an
        extra round r >= 1 of `ppo.filter_groups` takes M prompts of its own seeded permutation of all prompts,
        (data.seed, seed, iteration, r), those of round 0 last (so they repeat only when fewer than 2M prompts
        exist); the walk is not advanced. Each prompt is repeated `ppo.n_samples_per_prompt` (G) times in a row; a
        rank takes whole groups. The round's k-th prompt is the iteration's (r·M + k)-th: its group id, and the
        seed of its sample j is one per (run seed, iteration, (r·M + k)·G + j), so every sample has its own stream
        and a response is the same whatever the world size.
        """
        M, G = self.p.rollout_batch_size, self.p.n_samples_per_prompt
        idx = self._walk(iteration)
        if round_ > 0:
            first = set(idx)
            perm = epoch_order(len(self.prompts), (self.cfg.data.seed, self.cfg.seed, iteration), round_)
            idx = ([i for i in perm if i not in first] + [i for i in perm if i in first])[:M]
        per_rank, offset = M // engine.world_size(), round_ * M
        ks = range(engine.rank() * per_rank, (engine.rank() + 1) * per_rank)
        prompts = [self.prompts[idx[k]] for k in ks for _ in range(G)]
        seeds = [derive_seed(self.cfg.seed, iteration, (offset + k) * G + j) for k in ks for j in range(G)]
        groups = torch.tensor([offset + k for k in ks for _ in range(G)], dtype=torch.long)
        return prompts, seeds, groups

    def _walk(self, iteration: int) -> list[int]:
        """The prompt indices of an iteration's round 0: positions iteration·M ... (iteration + 1)·M − 1 of the
        walk through epochs of shuffled prompts (`data.epoch_order` seeded by (data.seed, seed, epoch)), M =
        `ppo.rollout_batch_size`."""
        n, M = len(self.prompts), self.p.rollout_batch_size
        idx = []
        for k in range(iteration * M, (iteration + 1) * M):
            epoch, pos = divmod(k, n)
            if epoch != self._order_epoch:
                self._order, self._order_epoch = epoch_order(n, (self.cfg.data.seed, self.cfg.seed), epoch), epoch
            idx.append(self._order[pos])
        return idx

    def generate(self, prompts: list[dict[str, Any]], seeds: Sequence[int], push: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor | None]:
        """Sample one response per prompt with the current policy, one seed per prompt (`self.generator`).
        Returns the rollout batch: input_ids (B, P+R), attention_mask (B, P+R), P, has_eos (B,)
        (`generation.rollout_batch`), and the engine's log-probs of the response tokens (B, R) float32 on the
        batch's device, or None when the engine gives none (`hf`). `push=False`: the engine already holds these
        weights (a later generation round of one iteration), none are pushed."""
        prompt_ids = [x["prompt_ids"] for x in prompts]
        lm = lm_of(self.actor.module)
        if self.generator.own_weights:  # ZeRO-3: one layer gathered at a time for the push, none while sampling
            if push:
                self.generator.update_weights(lm, gather=self.actor.gathered)
            generation = self.generator.generate(prompt_ids, seeds, self.sampling)
        else:
            with self.actor.gathered_params():  # ZeRO-3: the full weights, for the engine to sample from
                if push:
                    self.generator.update_weights(lm)
                generation = self.generator.generate(prompt_ids, seeds, self.sampling)
        input_ids, attention_mask, P, has_eos = rollout_batch(prompt_ids, generation, self.pad_id)
        engine_logprobs = None
        if generation.logprobs is not None:
            engine_logprobs = generation.logprobs[:, :input_ids.shape[1] - P].float().to(input_ids.device)
        return input_ids, attention_mask, P, has_eos, engine_logprobs

    def rollout_passes(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                       plan: UpdatePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                  dict[tuple[int, ...], PackedRollout], dict[tuple[int, ...], Forward]]:
        """The rollout's passes over every row, as training computes them: (old_logprobs (B, R), ref_logprobs
        (B, R), old values (B, R) or None without a critic, packed layouts, training forwards), float32.

        Packed (`plan.packed`) they run over the update's own first-epoch micro-batches, each chunk's layout built
        once for its passes and kept (keyed by the chunk's rows) for the update; plain, over consecutive chunks of
        `ppo.micro_batch_size` rows. The no-grad policy pass is skipped when the plan is on-policy (the update fills
        the old log-probs in). The first `plan.carry` chunks run their training forwards (with their graphs) in
        place of their no-grad policy and critic passes, after the other chunks, so their graphs live the least;
        they are returned by rows for `Experience.forwards`."""
        mb, B, R = self.p.micro_batch_size, input_ids.shape[0], input_ids.shape[1] - P
        chunks = (plan.first_epoch if plan.packed
                  else [torch.arange(i, min(i + mb, B)) for i in range(0, B, mb)])
        carry = plan.carry  # 0 unless packed (`plan.fold_settings`)
        dev = input_ids.device
        out = {"old_logprobs": torch.zeros(B, R, device=dev), "ref_logprobs": torch.zeros(B, R, device=dev),
               "values": torch.zeros(B, R, device=dev)}
        layouts: dict[tuple[int, ...], PackedRollout] = {}
        forwards: dict[tuple[int, ...], Forward] = {}
        has_values = False
        with self.reference.on_device() as reference:
            for i, rows in enumerate(chunks[carry:] + chunks[:carry]):  # the carried graphs live the least time
                rows = rows.to(dev)
                key = tuple(rows.tolist())
                packing = self._layout(input_ids[rows], attention_mask[rows], P, plan.packed, key, layouts)
                fwd = self._chunk_passes(input_ids[rows], attention_mask[rows], P, reference, packing,
                                         on_policy=plan.on_policy, train=i >= len(chunks) - carry)
                out["ref_logprobs"][rows] = fwd.ref_logprobs
                if fwd.old_logprobs is not None:
                    out["old_logprobs"][rows] = fwd.old_logprobs
                if fwd.values is not None:
                    out["values"][rows], has_values = fwd.values.float(), True
                if fwd.training is not None:
                    forwards[key] = fwd.training
        return out["old_logprobs"], out["ref_logprobs"], out["values"] if has_values else None, layouts, forwards

    def _layout(self, ids: torch.Tensor, am: torch.Tensor, P: int, packed: bool, key: tuple[int, ...],
                layouts: dict[tuple[int, ...], PackedRollout]) -> bool | PackedRollout:
        """One chunk's packed layout for all its passes (kept in `layouts` under `key`), or `packed` when the
        policy cannot take one (each model then decides for itself)."""
        t0 = _clock(ids.device)
        packing: bool | PackedRollout = packed
        policy_lm = lm_of(self.actor.module)
        if packed and use_packing(policy_lm, True):
            # kept on the CPU (the 4D masks of every micro-batch live until the update ends), moved per pass
            packing = layouts[key] = pack_rollout(ids.cpu(), am.cpu(), P, attention_tokens=attention_tokens(policy_lm))
        self.pass_seconds["packing"] += _clock(ids.device) - t0
        return packing

    def _chunk_passes(self, ids: torch.Tensor, am: torch.Tensor, P: int, reference: torch.nn.Module,
                      packing: bool | PackedRollout, on_policy: bool, train: bool) -> _ChunkPasses:
        """One chunk's passes: the reference's log-probs; then either the training forward (`train`: one of the
        update's first micro-batches, at these passes' weights) or the no-grad policy pass (none when
        `on_policy`) and a separate critic's."""
        clock, dev, temperature = self.pass_seconds, ids.device, self.p.temperature
        t0 = _clock(dev)
        with torch.no_grad(), self.reference.autocast():  # its whole softmax at any ppo.top_p (it samples nothing)
            ref_lp, _, _ = policy_forward(reference, ids, am, P, temperature, packing=packing)
        t1 = _clock(dev)
        clock["reference"] += t1 - t0
        if train:
            self.actor.train()
            if self.critic is not None:
                self.critic.train()
            with torch.enable_grad():
                fwd = training_forward(self.actor, self.critic, ids, am, P, temperature, self.p.c2 != 0, packing,
                                       top_p=self.p.top_p)
            fwd = fwd._replace(seconds=_clock(dev) - t1)
            values = None if fwd.values is None else fwd.values.detach()
            return _ChunkPasses(ref_lp, fwd.logprobs.detach(), values, fwd)
        lp = v = None
        with torch.no_grad():
            if not on_policy:  # else the update fills the old log-probs in
                with self.actor.autocast():
                    lp, _, v = policy_forward(self.actor.module, ids, am, P, temperature,
                                              with_values=has_value_head(self.actor.module), packing=packing,
                                              top_p=self.p.top_p)
            t2 = _clock(dev)
            clock["policy"] += t2 - t1
            if self.critic is not None:
                with self.critic.autocast():
                    v = critic_values(self.critic.module, ids, am, P, packing=packing)
            clock["critic"] += _clock(dev) - t2
        return _ChunkPasses(ref_lp, lp, v, None)

    @torch.no_grad()
    def kl_fp32_check(self, exp: Experience) -> dict[str, float]:
        """The noise floor of bf16 log-probs: `objective/kl_fp32`, the KL (k1, nats/seq) of this rank's first
        `ppo.kl_check_rows` rollout rows computed in fp32 at the rollout's weights, and `objective/kl_check`, the
        reported KL of the same rows (`stats.response_kl`). Only when the scoring passes run under bf16 autocast
        (`scoring_precision=same`), which keeps the plan off-policy (`plan.fold_settings`); else {}."""
        input_ids, attention_mask, P = exp.input_ids, exp.attention_mask, exp.prompt_len
        k = min(self.p.kl_check_rows, input_ids.shape[0])
        if k == 0 or self.score_precision != "bf16-autocast":
            return {}
        kl_seq = response_kl(exp)
        # the first k rows packed together, a layout other than the rollout's micro-batches: in fp32 that moves
        # the KL by float rounding (~1e-6 nats), far below the bf16 noise this check measures
        with self.reference.on_device() as reference:  # the weights are fp32 under bf16-autocast
            kl_fp32 = sequence_kl(self.actor.module, reference, input_ids[:k], attention_mask[:k], P,
                                  self.p.temperature, k, "fp32", packing=exp.plan.packed, top_p=self.p.top_p)["k1"]
        return {"objective/kl_fp32": kl_fp32.mean().item(), "objective/kl_check": kl_seq[:k].mean().item()}

    def sample(self, prompts: list[dict[str, Any]], seeds: Sequence[int], groups: torch.Tensor,
               push: bool = True) -> _Round:
        """One generation round: sample (`generate`; `push=False` in an iteration's later rounds), score
        (`score_mixer`), then the score rules that act per row: `ppo.truncated=penalize`'s missing-EOS penalty and the
        overlong shaping (`core.overlong_penalty`). Which rows count in a group baseline (`valid`): those that
        ended with EOS under `ppo.truncated=mask`, else all."""
        p = self.p
        t0 = time.perf_counter()
        input_ids, attention_mask, P, has_eos, engine_logprobs = self.generate(prompts, seeds, push=push)
        t1 = time.perf_counter()
        raw, score, source_means = self.score_mixer(input_ids, attention_mask, P, prompts)
        t2 = _clock(input_ids.device)
        response_mask = attention_mask[:, P:].float()
        if p.truncated == "penalize":
            score = score - p.missing_eos_penalty * (~has_eos).float()
        overlong = overlong_penalty(response_mask.sum(1), p.max_new_tokens, p.overlong_buffer, p.overlong_penalty)
        score = score + overlong.to(score.dtype)  # DAPO's soft overlong punishment; 0 with ppo.overlong_buffer=0
        valid = has_eos if p.truncated == "mask" else torch.ones_like(has_eos)
        return _Round(prompts, groups.to(score.device), input_ids, attention_mask, P, has_eos, engine_logprobs, raw,
                      score, overlong, valid, source_means, t1 - t0, t2 - t1)

    def filter_groups(self, iteration: int, first: _Round) -> tuple[_Round | None, list[_Round], dict[str, float]]:
        """DAPO's dynamic sampling (`ppo.filter_groups`; Yu et al. 2025, sec. 3.2): keep the groups of `first`
        whose scores vary (`core.informative_groups`) and sample further rounds (`prompt_batch(iteration, r)`)
        while any rank holds fewer than its share of `ppo.rollout_batch_size` groups, for at most
        `ppo.filter_groups_max_rounds` extra rounds (every rank runs the same rounds: sampling may be collective).
        Every rank then keeps its first k kept groups in round order, k the fewest any rank has (capped at its
        share), rounded down to whole minibatches (`ppo.mini_batch_size` completions over all ranks: the optimizer
        steps after a fixed number of micro-batches, so a partial minibatch would carry its gradient into the next
        iteration's step); every rank's update then has the same shape. Returns (the kept rows as one round, or
        None when k = 0; every round sampled; `groups/dropped_frac`, `groups/extra_rounds`, `groups/kept_frac`)."""
        p, G = self.p, self.p.n_samples_per_prompt
        share = p.rollout_batch_size // engine.world_size()
        mini_rows = p.mini_batch_size // engine.world_size()
        unit = mini_rows // math.gcd(G, mini_rows)  # the fewest groups that fill whole minibatches
        rounds, kept = [first], [informative_groups(first.score, first.groups, first.valid)]
        while True:
            n_kept = sum(int(k.sum()) for k in kept) // G  # whole groups are kept or dropped
            short = engine.all_reduce_sum(torch.tensor(float(n_kept < share))).item() > 0
            if not short or len(rounds) > p.filter_groups_max_rounds:
                break
            prompts, seeds, groups = self.prompt_batch(iteration, len(rounds))
            rounds.append(self.sample(prompts, seeds, groups, push=False))
            kept.append(informative_groups(rounds[-1].score, rounds[-1].groups, rounds[-1].valid))
        fewest = min(engine.all_gather_object(min(n_kept, share)))
        k = fewest - fewest % unit
        sampled = len(rounds) * share
        stats = {"groups/dropped_frac": (sampled - n_kept) / sampled, "groups/extra_rounds": float(len(rounds) - 1),
                 "groups/kept_frac": k / share}
        if k == 0:
            if engine.is_main():
                log.warning("iteration %d trains nothing: %s in %d round(s) (ppo.filter_groups=true, "
                            "ppo.filter_groups_max_rounds=%d)", iteration + 1,
                            "every group sampled has equal scores" if fewest == 0 else
                            f"{fewest} group(s) with varied scores kept, fewer than the {unit} × "
                            f"ppo.n_samples_per_prompt={G} completions of a minibatch (ppo.mini_batch_size="
                            f"{p.mini_batch_size})", len(rounds), p.filter_groups_max_rounds)
            return None, rounds, stats
        rows, left = [], k * G  # the first k kept groups, in round order (a group's rows are adjacent)
        for keep in kept:
            idx = keep.nonzero().flatten()[:left]
            rows.append(idx)
            left -= len(idx)
        return join_rounds(rounds, rows, self.pad_id), rounds, stats

    def make_experience(self, iteration: int) -> tuple[Experience | None, dict[str, float], dict[str, Any]]:
        """One iteration's rollout on this rank: sample and score (`sample`; with `ppo.filter_groups`, more rounds
        until the batch holds informative groups, `filter_groups`), the passes by the update's plan
        (`rollout_passes`), shaping (`shape`). Returns the `Experience` (carrying the plan; None when
        `ppo.filter_groups` kept no group: the iteration trains nothing), the rollout's statistics (means over
        ranks; its KL statistics come after the update, `stats.kl_stats`) and a few samples (prompts, responses,
        raw scores) for the log. The statistics of the sampled responses (`objective/scores`, `reward/*`,
        `response/*`, `groups/score_*`, `groups/zero_var_frac`) are the first round's, the prompts an iteration
        takes with or without the filter; `advantages/*` and `val/*` are those of the batch trained on."""
        p = self.p
        prompts, seeds, groups = self.prompt_batch(iteration)
        first = self.sample(prompts, seeds, groups)
        batch, rounds, filter_stats = (self.filter_groups(iteration, first) if p.filter_groups
                                       else (first, [first], {}))
        gen_seconds = sum(r.gen_seconds for r in rounds) - self.generator.sync_seconds
        gen_tokens = float(sum(r.attention_mask[:, r.P:].sum() for r in rounds))
        lengths = first.attention_mask[:, first.P:].float().sum(1)
        stats = {
            "objective/scores": first.raw.mean().item(),
            "objective/scores_norm": first.score.mean().item(),
            "objective/kl_beta": self.kl_ctl.value,
            "response/length_mean": lengths.mean().item(),
            "response/eos_frac": first.has_eos.float().mean().item(),
            **({"reward/overlong_penalty": first.overlong.mean().item()} if p.overlong_buffer else {}),
            "time/generation": gen_seconds,
            "time/engine_sync": self.generator.sync_seconds,  # the engine's start, push and probe (vllm; hf: 0)
            "throughput/gen_tokens_per_s": gen_tokens / max(gen_seconds, 1e-9),
            **first.source_means,
            **filter_stats,
        }
        if p.n_samples_per_prompt > 1:
            stats.update(group_metrics(first.score, first.groups, first.valid))
        samples = {"prompts": [x.get("prompt_text", "") for x in first.prompts[:3]],
                   "responses": self.tokenizer.batch_decode(first.input_ids[:3, first.P:], skip_special_tokens=True),
                   "scores": first.raw[:3].tolist()}
        reward_seconds = sum(r.reward_seconds for r in rounds)
        if batch is None:  # ppo.filter_groups kept nothing (said once, in filter_groups)
            stats["time/scoring"] = reward_seconds
            return None, engine.reduce_stats(stats), samples
        exp, exp_stats = self.experience(iteration, batch, reward_seconds)
        stats.update(exp_stats)
        return exp, engine.reduce_stats(stats), samples

    def experience(self, iteration: int, batch: _Round, reward_seconds: float) -> tuple[Experience, dict[str, float]]:
        """The `Experience` of the rows trained on (`batch`): the passes by the update's plan (`rollout_passes`),
        shaping (`shape`), and their statistics (this rank's; `advantages/*`, `val/*`, `time/scoring*`, the bf16 KL
        check). reward_seconds: the reward passes' seconds of every round."""
        input_ids, attention_mask, P, groups = batch.input_ids, batch.attention_mask, batch.P, batch.groups
        t1 = time.perf_counter()
        self.pass_seconds = {"reward": reward_seconds, "reference": 0.0, "policy": 0.0, "critic": 0.0,
                             "packing": 0.0}
        response_mask = attention_mask[:, P:].float()
        plan = self.plan(iteration, groups)  # the update's, computed once: the passes run over its micro-batches
        old_logprobs, ref_logprobs, values, layouts, forwards = self.rollout_passes(input_ids, attention_mask, P,
                                                                                    plan)
        t2 = time.perf_counter()
        carried_seconds = sum(fwd.seconds for fwd in forwards.values())
        loss_mask = response_mask * batch.valid.float()[:, None]
        beta = self.kl_ctl.value
        rewards, advantages, returns = self.shape(batch.score, old_logprobs, ref_logprobs, values, response_mask,
                                                  loss_mask, batch.valid, groups, beta)
        exp = Experience(input_ids, attention_mask, loss_mask, old_logprobs, ref_logprobs,
                         values if values is not None else torch.zeros_like(old_logprobs), rewards, advantages,
                         returns, batch.score, groups, layouts, forwards, plan, batch.engine_logprobs)
        stats = {
            **self.advantage_stats(advantages, loss_mask, iteration),
            "time/scoring": reward_seconds + t2 - t1 - carried_seconds,  # the carried forwards count in time/training
            **{f"time/scoring_{k}": v for k, v in self.pass_seconds.items()},
            **self.kl_fp32_check(exp),  # the rollout's other KL statistics come after the update (`kl_stats`)
        }
        if values is not None:
            stats["val/values_mean"] = ((values * response_mask).sum() / response_mask.sum().clamp(min=1)).item()
            stats["val/explained_var"] = explained_variance_across_ranks(values, returns, loss_mask)
        return exp, stats

    def advantage_stats(self, advantages: torch.Tensor, loss_mask: torch.Tensor, iteration: int) -> dict[str, float]:
        """`advantages/mean` and `advantages/abs_mean`: token means over all ranks of the advantages (B, R) the update
        uses (after whitening), over `loss_mask`; an iteration with no trainable token says so (it trains nothing)."""
        adv_sums = engine.all_reduce_sum(torch.stack([(advantages * loss_mask).sum(),
                                                      (advantages.abs() * loss_mask).sum(), loss_mask.sum()]))
        if adv_sums[2] == 0 and engine.is_main():
            log.warning("iteration %d trains nothing: every response is masked (ppo.truncated=mask and none ended "
                        "with EOS within ppo.max_new_tokens=%d)", iteration + 1, self.p.max_new_tokens)
        return {"advantages/mean": (adv_sums[0] / adv_sums[2].clamp(min=1)).item(),
                "advantages/abs_mean": (adv_sums[1] / adv_sums[2].clamp(min=1)).item()}

    def shape(self, score: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
              values: torch.Tensor | None, response_mask: torch.Tensor, loss_mask: torch.Tensor, valid: torch.Tensor,
              groups: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token rewards (B, R) float32: −β·kl_t plus the score (B,) at the last real token with
        `ppo.kl_in=reward`, the score alone with `loss` (β·KL is then a loss term); then (advantages, returns)
        (B, R) by `ppo.advantage_estimator`, the advantages whitened over `loss_mask`'s tokens of all ranks when
        `ppo.whiten_advantages` (or the estimator's default) says so. old_logprobs, ref_logprobs: (B, R) float32;
        response_mask: (B, R), 1 = real response token (EOS included); loss_mask: (B, R), its tokens that enter the
        loss; valid: (B,) bool, rows that count in a group baseline; groups: (B,) long group ids."""
        p = self.p
        if p.kl_in == "reward":
            rewards = kl_penalized_rewards(score, old_logprobs, ref_logprobs, response_mask, beta, p.kl_estimator)
        else:  # β·KL is a loss term (PolicyLearner.losses): the reward is the score alone
            rewards = add_at_last_token(torch.zeros_like(old_logprobs), response_mask, score)
        advantages, returns = self.estimator(rewards, response_mask, scores=score, groups=groups, valid=valid,
                                             values=values, gamma=p.gamma, lam=p.lam)
        if self.whiten:
            advantages = whiten_across_ranks(advantages, loss_mask)
        return rewards, advantages, returns


class _Round(NamedTuple):
    """One generation round on this rank (`ExperienceMaker.sample`), B rows: prompts (B dicts), groups (B,) long,
    input_ids / attention_mask (B, P+R), P, has_eos (B,) bool, engine_logprobs (B, R) or None, raw (B,) the raw
    score, score (B,) the score the advantages see (normalised, penalties, overlong shaping), overlong (B,) its
    overlong part, valid (B,) bool, source_means (`reward/<source>`), gen_seconds and reward_seconds."""

    prompts: list[dict[str, Any]]
    groups: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    P: int
    has_eos: torch.Tensor
    engine_logprobs: torch.Tensor | None
    raw: torch.Tensor
    score: torch.Tensor
    overlong: torch.Tensor
    valid: torch.Tensor
    source_means: dict[str, float]
    gen_seconds: float
    reward_seconds: float


def join_rounds(rounds: Sequence[_Round], rows: Sequence[torch.Tensor], pad_id: int) -> _Round:
    """The rows `rows[i]` (long indices) of each round `rounds[i]`, in order, as one round
    (`generation.join_rollout_batches`: one [left-padded prompt | right-padded response] layout; the engine's
    log-probs padded with 0 to its response width). Timings are summed; source_means are the first round's."""
    parts = [(r, i.to(r.input_ids.device)) for r, i in zip(rounds, rows) if len(i)]
    input_ids, attention_mask, P = join_rollout_batches(
        [(r.input_ids[i], r.attention_mask[i], r.P) for r, i in parts], pad_id)
    R = input_ids.shape[1] - P
    engine_logprobs = None
    if parts[0][0].engine_logprobs is not None:
        engine_logprobs = torch.cat([torch.nn.functional.pad(r.engine_logprobs[i], (0, R))[:, :R] for r, i in parts])

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name)[i] for r, i in parts])

    return _Round([r.prompts[j] for r, i in parts for j in i.tolist()], cat("groups"), input_ids, attention_mask, P,
                  cat("has_eos"), engine_logprobs, cat("raw"), cat("score"), cat("overlong"), cat("valid"),
                  rounds[0].source_means, sum(r.gen_seconds for r in rounds), sum(r.reward_seconds for r in rounds))


class _ChunkPasses(NamedTuple):
    """One chunk's rollout passes (`ExperienceMaker._chunk_passes`): ref logprobs, old logprobs (None when the plan
    is on-policy), old values (None without a critic) and, for a carried micro-batch, its training forward."""

    ref_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    training: Forward | None


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
