"""The rollout half of a PPO iteration (OpenRLHF's experience maker), an orchestrator of its pieces:
prompts and seeds (`prompts.PromptSource`; `ppo.filter_groups`' rounds, `prompts.filter_groups`) → episodes
(`episodes.EpisodeRunner` sampling with the run's engine, a group of `ppo.n_samples_per_prompt` per prompt) →
scores (`scores.ScoreMixer` and the per-row score rules) → the no-grad passes (old logprobs, ref_logprobs, values
when there is a critic; here, over the update's micro-batches) → per-token rewards, advantages and returns
(`shaping.shape`), as one `Experience` per rank, with the rollout's statistics. With a teacher
(`reward.type=teacher`), its log-probs of the sampled tokens come from one more no-grad pass beside the
reference's, and each token's reward is log π_teacher − log π_old (`core.teacher_token_rewards`).

Precision: sampling and a separate critic run in `precision`; the policy's, the reference's and the teacher's
log-prob passes and the reward model in the one `scoring_precision` gives (see config.py, `scoring_precision`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.core import ESTIMATORS, group_stats, overlong_penalty, teacher_token_rewards
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
from rlhf_cli.rollout.engines import EngineSettings, make_generator, max_model_len, resolve_engine
from rlhf_cli.rollout.environments import environment_runner
from rlhf_cli.rollout.episodes import EpisodeRunner, Episodes, SingleTurnRunner
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.generation import Sampling
from rlhf_cli.rollout.plan import UpdatePlan
from rlhf_cli.rollout.prompts import PromptSource, Round, filter_groups
from rlhf_cli.rollout.scores import ScoreMixer, unscored_rows
from rlhf_cli.rollout.shaping import shape
from rlhf_cli.rollout.stats import explained_variance_across_ranks, response_kl, scored_means

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
    plan to the update in the `Experience`; workdir: the run dir (an engine with its own model dir writes it there);
    teacher: on-policy distillation's teacher, an `engine.FrozenModel` (None without `reward.type=teacher`), scored
    like the reference: in `scoring_precision`, over the same micro-batches, at `ppo.temperature` and `ppo.top_p`
    as the old log-probs are (so a teacher equal to the policy gives rewards 0).
    """

    def __init__(self, cfg: Any, tokenizer: Any, prompts: Sequence[dict[str, Any]], actor: Any, reference: Any,
                 critic: Any, score_mixer: ScoreMixer, kl_ctl: Any, score_precision: str,
                 plan: Callable[[int, torch.Tensor], UpdatePlan], workdir: Any = None, teacher: Any = None) -> None:
        self.cfg, self.p = cfg, cfg.ppo
        self.tokenizer = tokenizer
        self.source = PromptSource(cfg, prompts)
        """Which prompts each generation round samples, with which seeds and group ids."""
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids(tokenizer, lm_of(actor.module).generation_config)
        """Every id that ends a response (`eos.eos_ids`): sampling stops at the first, the masks and `has_eos` read
        them all."""
        self.actor, self.reference, self.critic, self.teacher = actor, reference, critic, teacher
        self.score_mixer, self.kl_ctl = score_mixer, kl_ctl
        self.estimator = ESTIMATORS[cfg.ppo.advantage_estimator]
        self.whiten = self.p.whiten_advantages if self.p.whiten_advantages is not None else self.estimator.whiten
        self.engine_name, why = resolve_engine(cfg.rollout.engine, lm_of(actor.module).config)
        """The sampling engine this run uses (`rollout.engine`, `auto` resolved: `engines.resolve_engine`)."""
        if why != "as set" and engine.is_main():
            log.info("rollout.engine=%s samples with %s (%s)", cfg.rollout.engine, self.engine_name, why)
        if cfg.rollout.is_correction != "none" and self.engine_name == "hf" and engine.is_main():
            log.warning("rollout.is_correction=%s does nothing with rollout.engine=hf: the trainer samples itself, so "
                        "there are no engine log-probs and the ratio is 1 (rollout.engine=vllm gives them)",
                        cfg.rollout.is_correction)
        self.generator = make_generator(self.engine_name, EngineSettings(
            precision=cfg.precision, chunk=self.p.micro_batch_size * 4, workdir=workdir,
            kv_cache_gb=cfg.rollout.kv_cache_gb, max_model_len=max_model_len(cfg, self.p.max_new_tokens),
            engine_dtype=cfg.rollout.engine_dtype, score_precision=score_precision,
            verbose=cfg.rollout.engine_verbose, selftest=cfg.rollout.engine_selftest,
            sync_timeout_s=cfg.rollout.sync_timeout_s))
        """The sampling engine (`rollout.engine`), pointed at the policy's weights before each rollout; the stage
        closes it (`generator.close()`) when the run ends."""
        self.runner: EpisodeRunner = SingleTurnRunner() if cfg.rollout.env is None else environment_runner(
            cfg, tokenizer, prompts)
        """How an episode runs (`episodes.EpisodeRunner`): one response per prompt, or several turns against
        `rollout.env` (`environments.EnvironmentRunner`)."""
        self.sampling = Sampling(eos_ids=self.eos_ids, pad_id=self.pad_id, max_new_tokens=self.p.max_new_tokens,
                                 temperature=self.p.temperature, top_p=self.p.top_p)
        self.score_precision = score_precision  # resolved once per run (it warns under precision=bf16)
        self.pass_seconds = self.clock(0.0)
        """Seconds of the last rollout's scoring, by pass: `reward` (reward model and functions), `reference`,
        `teacher` (with a teacher only), `policy` (the old log-probs; 0 when the plan is on-policy), `critic` (a
        separate critic) and `packing` (building the packed layouts of the other passes, once per micro-batch). The
        forwards of the update's first micro-batches (`UpdatePlan.carry`) are in none of them: they are training's
        (`time/training`)."""
        self.plan = plan

    def clock(self, reward_seconds: float) -> dict[str, float]:
        """`pass_seconds` at the start of a rollout's passes: `reward_seconds`, and 0 for every other pass."""
        passes = ("reference", *(("teacher",) if self.teacher is not None else ()), "policy", "critic", "packing")
        return {"reward": reward_seconds, **dict.fromkeys(passes, 0.0)}

    def prompt_batch(self, iteration: int,
                     round_: int = 0) -> tuple[list[dict[str, Any]], list[int], torch.Tensor]:
        """This rank's rows of an iteration's generation round: their prompts, sampling seeds and group ids
        (`PromptSource.batch`)."""
        return self.source.batch(iteration, round_)

    def generate(self, prompts: list[dict[str, Any]], seeds: Sequence[int], push: bool = True) -> Episodes:
        """Run one episode per prompt with the current policy, one seed per prompt (`self.runner` sampling with
        `self.generator`): the `Episodes` on the batch's device. `push=False`: the engine already holds these
        weights (a later generation round of one iteration), none are pushed."""
        lm = lm_of(self.actor.module)
        if self.generator.own_weights:  # ZeRO-3: one layer gathered at a time for the push, none while sampling
            if push:
                self.generator.update_weights(lm, gather=self.actor.gathered)
            return self.runner.run(prompts, seeds, self.generator, self.sampling)
        with self.actor.gathered_params():  # ZeRO-3: the full weights, for the engine to sample from
            if push:
                self.generator.update_weights(lm)
            return self.runner.run(prompts, seeds, self.generator, self.sampling)

    def rollout_passes(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                       plan: UpdatePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                  dict[tuple[int, ...], PackedRollout], dict[tuple[int, ...], Forward],
                                                  torch.Tensor | None]:
        """The rollout's passes over every row, as training computes them: (old_logprobs (B, R), ref_logprobs
        (B, R), old values (B, R) or None without a critic, packed layouts, training forwards, teacher_logprobs
        (B, R) or None without a teacher), float32.

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
               "values": torch.zeros(B, R, device=dev), "teacher_logprobs": torch.zeros(B, R, device=dev)}
        layouts: dict[tuple[int, ...], PackedRollout] = {}
        forwards: dict[tuple[int, ...], Forward] = {}
        has_values = False
        teaching = self.teacher.on_device() if self.teacher is not None else contextlib.nullcontext()
        with self.reference.on_device() as reference, teaching as teacher:
            for i, rows in enumerate(chunks[carry:] + chunks[:carry]):  # the carried graphs live the least time
                rows = rows.to(dev)
                key = tuple(rows.tolist())
                packing = self._layout(input_ids[rows], attention_mask[rows], P, plan.packed, key, layouts)
                fwd = self._chunk_passes(input_ids[rows], attention_mask[rows], P, reference, packing,
                                         on_policy=plan.on_policy, train=i >= len(chunks) - carry, teacher=teacher)
                out["ref_logprobs"][rows] = fwd.ref_logprobs
                if fwd.teacher_logprobs is not None:
                    out["teacher_logprobs"][rows] = fwd.teacher_logprobs
                if fwd.old_logprobs is not None:
                    out["old_logprobs"][rows] = fwd.old_logprobs
                if fwd.values is not None:
                    out["values"][rows], has_values = fwd.values.float(), True
                if fwd.training is not None:
                    forwards[key] = fwd.training
        return (out["old_logprobs"], out["ref_logprobs"], out["values"] if has_values else None, layouts, forwards,
                out["teacher_logprobs"] if self.teacher is not None else None)

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
                      packing: bool | PackedRollout, on_policy: bool, train: bool,
                      teacher: torch.nn.Module | None = None) -> _ChunkPasses:
        """One chunk's passes: the reference's log-probs, the teacher's (with one); then either the training
        forward (`train`: one of the update's first micro-batches, at these passes' weights) or the no-grad policy
        pass (none when `on_policy`) and a separate critic's."""
        clock, dev, temperature = self.pass_seconds, ids.device, self.p.temperature
        t0 = _clock(dev)
        with torch.no_grad(), self.reference.autocast():  # its whole softmax at any ppo.top_p (it samples nothing)
            ref_lp, _, _ = policy_forward(reference, ids, am, P, temperature, packing=packing)
        t1 = _clock(dev)
        clock["reference"] += t1 - t0
        teacher_lp = None
        if teacher is not None:
            with torch.no_grad(), self.teacher.autocast():  # scored as the old log-probs are: log π_t − log π_old
                teacher_lp, _, _ = policy_forward(teacher, ids, am, P, temperature, packing=packing,
                                                  top_p=self.p.top_p)
            clock["teacher"] += _clock(dev) - t1
            t1 = _clock(dev)
        if train:
            self.actor.train()
            if self.critic is not None:
                self.critic.train()
            with torch.enable_grad():
                fwd = training_forward(self.actor, self.critic, ids, am, P, temperature, self.p.c2 != 0, packing,
                                       top_p=self.p.top_p)
            fwd = fwd._replace(seconds=_clock(dev) - t1)
            values = None if fwd.values is None else fwd.values.detach()
            return _ChunkPasses(ref_lp, fwd.logprobs.detach(), values, fwd, teacher_lp)
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
        return _ChunkPasses(ref_lp, lp, v, None, teacher_lp)

    @torch.no_grad()
    def kl_fp32_check(self, exp: Experience) -> dict[str, float]:
        """The noise floor of bf16 log-probs: `objective/kl_fp32`, the KL (k1, nats/seq) of this rank's first
        `ppo.kl_check_rows` rollout rows computed in fp32 at the rollout's weights, and `objective/kl_check`, the
        reported KL of the same rows (`stats.response_kl`). Only when the scoring passes run under bf16 autocast
        (`scoring_precision=same`), which keeps the plan off-policy (`plan.fold_settings`); else {}."""
        input_ids, attention_mask, action_mask = exp.input_ids, exp.attention_mask, exp.action_mask
        k = min(self.p.kl_check_rows, input_ids.shape[0])
        if k == 0 or self.score_precision != "bf16-autocast":
            return {}
        kl_seq = response_kl(exp)
        # the first k rows packed together, a layout other than the rollout's micro-batches: in fp32 that moves
        # the KL by float rounding (~1e-6 nats), far below the bf16 noise this check measures
        with self.reference.on_device() as reference:  # the weights are fp32 under bf16-autocast
            kl_fp32 = sequence_kl(self.actor.module, reference, input_ids[:k], attention_mask[:k], action_mask[:k],
                                  self.p.temperature, k, "fp32", packing=exp.plan.packed, top_p=self.p.top_p)["k1"]
        return {"objective/kl_fp32": kl_fp32.mean().item(), "objective/kl_check": kl_seq[:k].mean().item()}

    def sample(self, iteration: int, prompts: list[dict[str, Any]], seeds: Sequence[int], groups: torch.Tensor,
               push: bool = True) -> Round:
        """One generation round: run the episodes (`generate`; `push=False` in an iteration's later rounds), score
        them (`score_mixer`), then the score rules that act per row: `ppo.truncated=penalize`'s missing-EOS penalty
        and the overlong shaping (`core.overlong_penalty`, on the sampled tokens). Which rows count in a group
        baseline and learn (`valid`): the scored ones (`scores.unscored_rows`, which stops a round with more than
        `reward.max_unscorable_frac` unscored) that ended with EOS under `ppo.truncated=mask`, else all of them."""
        p = self.p
        t0 = time.perf_counter()
        episodes = self.generate(prompts, seeds, push=push)
        t1 = time.perf_counter()
        if episodes.score is None:  # the sources score what the policy sampled (a tool's words earn nothing)
            conversations = {} if episodes.conversations is None else {"conversations": episodes.conversations}
            raw, score, sources = self.score_mixer(*episodes.sampled_view(self.pad_id), episodes.P, prompts,
                                                   **conversations)  # reward.function's, under rollout.env
        else:  # the episode's own score (an environment's get_reward): the run's reward sources are not called
            raw = score = episodes.score.float()
            sources = {"reward/env": raw}
        t2 = _clock(episodes.input_ids.device)
        raw, score, scored = unscored_rows(self.cfg, iteration, raw, score)  # 0 where no source could score
        if p.truncated == "penalize":
            score = score - p.missing_eos_penalty * (~episodes.has_eos).float()
        overlong = overlong_penalty(episodes.action_mask.sum(1), p.max_new_tokens, p.overlong_buffer,
                                    p.overlong_penalty).to(score.dtype) * scored
        score = (score + overlong) * scored  # DAPO's soft overlong punishment; 0 with ppo.overlong_buffer=0
        valid = (episodes.has_eos if p.truncated == "mask" else torch.ones_like(episodes.has_eos)) & scored
        return Round(prompts, groups.to(score.device), episodes, raw, score, overlong, valid, scored, sources,
                     t1 - t0, t2 - t1)

    def make_experience(self, iteration: int) -> tuple[Experience | None, dict[str, float], dict[str, Any]]:
        """One iteration's rollout on this rank: sample and score (`sample`; with `ppo.filter_groups`, more rounds
        until the batch holds informative groups, `prompts.filter_groups`), the passes by the update's plan
        (`rollout_passes`), shaping (`shaping.shape`). Returns the `Experience` (carrying the plan; None when
        `ppo.filter_groups` kept no group: the iteration trains nothing), the rollout's statistics (means over
        ranks; its KL statistics come after the update, `stats.kl_stats`) and a few samples (prompts, responses,
        raw scores) for the log. The statistics of the sampled responses (`objective/scores`, `reward/*`,
        `response/*`, `groups/score_*`, `groups/zero_var_frac`) are the first round's, the prompts an iteration
        takes with or without the filter; `advantages/*` and `val/*` are those of the batch trained on."""
        p = self.p
        prompts, seeds, groups = self.prompt_batch(iteration)
        first = self.sample(iteration, prompts, seeds, groups)
        episode_stats = dict(getattr(self.runner, "stats", {}))  # the first round's (`episode/*`, rollout.env)
        if p.filter_groups:
            def next_round(r: int) -> Round:
                return self.sample(iteration, *self.prompt_batch(iteration, r), push=False)

            batch, rounds, filter_stats = filter_groups(p, iteration, first, next_round, self.pad_id)
        else:
            batch, rounds, filter_stats = first, [first], {}
        gen_seconds = sum(r.gen_seconds for r in rounds) - self.generator.sync_seconds
        gen_tokens = float(sum(r.episodes.action_mask.sum() for r in rounds))
        lengths = first.episodes.action_mask.sum(1)
        stats = {
            **scored_means({"objective/scores": first.raw, "objective/scores_norm": first.score, **first.sources,
                            **({"reward/overlong_penalty": first.overlong} if p.overlong_buffer else {})},
                           first.scored),  # over all ranks: the same on each
            "reward/unscorable_frac": 1.0 - first.scored.float().mean().item(),
            "objective/kl_beta": self.kl_ctl.value,
            "response/length_mean": lengths.mean().item(),
            "response/eos_frac": first.episodes.has_eos.float().mean().item(),
            "time/generation": gen_seconds,
            "time/engine_sync": self.generator.sync_seconds,  # the engine's start, push and probe (vllm; hf: 0)
            "throughput/gen_tokens_per_s": gen_tokens / max(gen_seconds, 1e-9),
            **filter_stats,
            **episode_stats,
        }
        if p.n_samples_per_prompt > 1:
            stats.update(group_metrics(first.score, first.groups, first.valid))
        ep = first.episodes  # the prompts as the episodes began (under rollout.env: with the tools block)
        samples = {"prompts": [self.tokenizer.decode(ids[:ep.P][am[:ep.P].bool()])
                               for ids, am in zip(ep.input_ids[:3], ep.attention_mask[:3])],
                   "responses": self.tokenizer.batch_decode(ep.input_ids[:3, ep.P:], skip_special_tokens=True),
                   "scores": [x if ok else None for x, ok in zip(first.raw[:3].tolist(), first.scored[:3].tolist())]}
        reward_seconds = sum(r.reward_seconds for r in rounds)
        if batch is None:  # ppo.filter_groups kept nothing (said once, in filter_groups)
            stats["time/scoring"] = reward_seconds
            return None, engine.reduce_stats(stats), samples
        exp, exp_stats = self.experience(iteration, batch, reward_seconds)
        stats.update(exp_stats)
        return exp, engine.reduce_stats(stats), samples

    def experience(self, iteration: int, batch: Round, reward_seconds: float) -> tuple[Experience, dict[str, float]]:
        """The `Experience` of the rows trained on (`batch`): the passes by the update's plan (`rollout_passes`),
        shaping (`shaping.shape`), and their statistics (this rank's; `advantages/*`, `val/*`, `time/scoring*`, the
        bf16 KL check). reward_seconds: the reward passes' seconds of every round."""
        ep, groups = batch.episodes, batch.groups
        t1 = time.perf_counter()
        self.pass_seconds = self.clock(reward_seconds)
        plan = self.plan(iteration, groups)  # the update's, computed once: the passes run over its micro-batches
        old_logprobs, ref_logprobs, values, layouts, forwards, teacher_lp = self.rollout_passes(
            ep.input_ids, ep.attention_mask, ep.P, plan)
        t2 = time.perf_counter()
        carried_seconds = sum(fwd.seconds for fwd in forwards.values())
        loss_mask = ep.action_mask * batch.valid.float()[:, None]  # the sampled tokens of the rows that count
        teacher_rewards = (None if teacher_lp is None else self.score_mixer.weights["teacher"]
                           * teacher_token_rewards(teacher_lp, old_logprobs, ep.action_mask))
        rewards, advantages, returns = shape(
            self.p, self.estimator, self.whiten, self.kl_ctl.value, score=batch.score, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, values=values, action_mask=ep.action_mask, loss_mask=loss_mask,
            valid=batch.valid, groups=groups, teacher_rewards=teacher_rewards)
        exp = Experience(
            input_ids=ep.input_ids, attention_mask=ep.attention_mask, action_mask=ep.action_mask, loss_mask=loss_mask,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            values=values if values is not None else torch.zeros_like(old_logprobs), rewards=rewards,
            advantages=advantages, returns=returns, scores=batch.score, groups=groups, scored=batch.scored,
            layouts=layouts,
            forwards=forwards, plan=plan, engine_logprobs=ep.engine_logprobs)
        stats = {
            **self.advantage_stats(advantages, loss_mask, iteration, batch.scored),
            "time/scoring": reward_seconds + t2 - t1 - carried_seconds,  # the carried forwards count in time/training
            **{f"time/scoring_{k}": v for k, v in self.pass_seconds.items()},
            **self.kl_fp32_check(exp),  # the rollout's other KL statistics come after the update (`kl_stats`)
            **(distill_stats(teacher_lp, old_logprobs, ep.action_mask) if teacher_lp is not None else {}),
        }
        if values is not None:
            stats["val/values_mean"] = ((values * ep.action_mask).sum() / ep.action_mask.sum().clamp(min=1)).item()
            stats["val/explained_var"] = explained_variance_across_ranks(values, returns, loss_mask)
        return exp, stats

    def advantage_stats(self, advantages: torch.Tensor, loss_mask: torch.Tensor, iteration: int,
                        scored: torch.Tensor) -> dict[str, float]:
        """`advantages/mean` and `advantages/abs_mean`: token means over all ranks of the advantages (B, R) the update
        uses (after whitening), over `loss_mask`; an iteration with no trainable token says so, and why (it trains
        nothing). scored: (B,) bool, the rows a reward source scored."""
        adv_sums = engine.all_reduce_sum(torch.stack([(advantages * loss_mask).sum(),
                                                      (advantages.abs() * loss_mask).sum(), loss_mask.sum(),
                                                      (~scored).sum().to(loss_mask.dtype)]))
        if adv_sums[2] == 0 and engine.is_main():
            why = (f"ppo.truncated=mask and none ended with EOS within ppo.max_new_tokens={self.p.max_new_tokens}"
                   if adv_sums[3] == 0 else f"{int(adv_sums[3])} unscorable (reward/unscorable_frac), any others "
                   f"by ppo.truncated=mask")
            log.warning("iteration %d trains nothing: every response is masked (%s)", iteration + 1, why)
        return {"advantages/mean": (adv_sums[0] / adv_sums[2].clamp(min=1)).item(),
                "advantages/abs_mean": (adv_sums[1] / adv_sums[2].clamp(min=1)).item()}


class _ChunkPasses(NamedTuple):
    """One chunk's rollout passes (`ExperienceMaker._chunk_passes`): ref logprobs, old logprobs (None when the plan
    is on-policy), old values (None without a critic), for a carried micro-batch its training forward, and the
    teacher's logprobs (None without a teacher)."""

    ref_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    training: Forward | None
    teacher_logprobs: torch.Tensor | None = None


def _clock(device: torch.device) -> float:
    """`time.perf_counter()` after the device's queued work (a CUDA pass is charged to itself, not the next)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def distill_stats(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                  action_mask: torch.Tensor) -> dict[str, float]:
    """On-policy distillation's statistics, token means over every rank's sampled tokens (`action_mask`, (B, R)):
    `distill/reverse_kl`, log π_old − log π_teacher (nats per token, a one-sample estimate of KL(π_student ‖
    π_teacher); 0 when the student is the teacher), and `distill/teacher_logprob_mean`, log π_teacher (nats per
    token: how likely the teacher finds what the student sampled). A collective: call it on every rank."""
    m = action_mask.float()
    reverse = -teacher_token_rewards(teacher_logprobs, old_logprobs, m)
    sums = engine.all_reduce_sum(torch.stack([reverse.sum(), (teacher_logprobs.float() * m).sum(), m.sum()]))
    n = sums[2].clamp(min=1)
    return {"distill/reverse_kl": (sums[0] / n).item(), "distill/teacher_logprob_mean": (sums[1] / n).item()}


def group_metrics(scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Per-iteration statistics of the groups of all ranks (each group counted once): `groups/score_mean` (mean
    of the group means, over groups with a valid row), `groups/score_std` (mean within-group std, over groups with
    two) and `groups/zero_var_frac` (the fraction of groups without a learning signal for a group baseline: all
    valid scores equal, or fewer than 2 valid rows). A figure no group has rows for is left out. A collective."""
    st = group_stats(scores, groups, valid)
    first = torch.ones_like(groups, dtype=torch.bool)
    first[1:] = groups[1:] != groups[:-1]  # a group's rows are adjacent (prompt_batch)
    return {**scored_means({"groups/score_mean": st["mean"]}, first & (st["count"] >= 1)),
            **scored_means({"groups/score_std": st["std"]}, first & (st["count"] >= 2)),
            **scored_means({"groups/zero_var_frac": st["flat"]}, first)}
