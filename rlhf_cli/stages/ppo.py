"""`rlhf train-ppo`: PPO against a reward model (or the built-in checker) on DeepSpeed.

Each iteration (Ouyang et al. 2022; Ziegler et al. 2019; Schulman et al. 2017):
  1. rollout   sample `ppo.rollout_batch_size` prompts, generate one response each (KV cache)
  2. score     no-grad passes: old logprobs (policy), ref_logprobs (reference), values (critic),
               the sequence score (reward model or checker), all in the training forward's layout
  3. shape     per-token rewards −β·kl_t, plus the score at the EOS token; GAE(γ, λ); whitening
  4. learn     `ppo.epochs` passes over shuffled minibatches: clipped surrogate, clipped value loss,
               entropy bonus, aggregated over the minibatch's real tokens (all micro-batches, ranks)
  5. adapt     update the KL controller with the rollout's per-sequence KL

Precision: sampling and a separate critic run in `precision`; the policy's and the reference's log-prob
passes (old logprobs, ref_logprobs, the training forward, with a shared critic's values) and the reward
model in the precision `scoring_precision` gives (fp32 under bf16-autocast by default: bf16 rounding of the
moved weights swamps the KL of small updates).

Batch layout: see `rlhf_cli/rollout/__init__.py`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_cli import engine
from rlhf_cli.config import ConfigError
from rlhf_cli.core import (
    ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    entropy_bonus,
    kl_estimate,
    kl_penalized_rewards,
    policy_loss,
    value_loss,
)
from rlhf_cli.data import check_answers, epoch_order, load_prompt_data
from rlhf_cli.lifecycle import Checkpoints, deferred_interrupts, finish_run, prepare_run_dir, seed_everything
from rlhf_cli.models import (
    count_parameters,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    read_reward_stats,
    require_scalar_model_dir,
    save_hf,
)
from rlhf_cli.rollout import (
    Experience,
    PolicyWithValueHead,
    batched_rewards,
    critic_values,
    disable_dropout,
    explained_variance_across_ranks,
    lm_of,
    policy_forward,
    sample_responses,
    sequence_kl,
    whiten_across_ranks,
)
from rlhf_cli.runs import MetricsLogger, Progress, read_pointer, set_status
from rlhf_cli.seeds import derive_seed
from rlhf_cli.stages.common import check_same_tokenizer, print_table

log = logging.getLogger(__name__)

PROGRESS_KEYS = ["objective/scores", "objective/kl", "policy/clipfrac", "response/length_mean"]



class PPOTrainer:
    """Holds the engines and state of one PPO run; `run()` below walks it step by step:
    `load_data` → `build_models` → per iteration `make_experience` then `train_on`."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg, self.p, self.run_dir = cfg, cfg.ppo, run_dir
        self.precision = cfg.precision  # sampling, separate critic
        # log-prob passes of policy (old logprobs, training forward) and reference, reward-model scores
        self.score_precision = engine.scoring_precision(cfg.precision, cfg.scoring_precision)
        self.tokenizer = load_tokenizer(cfg.model)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        self.bad_steps = 0  # micro-steps skipped for NaN/inf losses
        # load_data
        self.prompts: list[dict[str, Any]] = []
        self._order: list[int] = []  # prompt order of data epoch `_order_epoch` (prompt_batch)
        self._order_epoch: int | None = None
        # build_models
        self.rm_path: str | None = None
        self.reward_model: engine.FrozenModel | None = None
        self.reward_stats: tuple[float, float] | None = None  # the RM's held-out (mean, std)
        self.reference: engine.FrozenModel | None = None
        self.reference_spec: dict[str, Any] = {}  # how eval rebuilds the reference
        self.actor: engine.TrainEngine | None = None  # the policy (with the value head when ppo.critic=shared)
        self.critic: engine.TrainEngine | None = None  # ppo.critic=separate only
        self.kl_ctl: FixedKLController | AdaptiveKLController | None = None
        self.n_params = 0

    # -- build -----------------------------------------------------------------------------
    def load_data(self) -> None:
        self.prompts = load_prompt_data(self.cfg.data, self.tokenizer, split="train")
        if len(self.prompts) < self.p.rollout_batch_size:
            raise ConfigError(f"only {len(self.prompts)} prompts, fewer than "
                              f"ppo.rollout_batch_size={self.p.rollout_batch_size}")
        if self.cfg.reward.type == "checker" and any(x.get("answer") is None for x in self.prompts):
            raise ConfigError("reward.type=checker needs prompts with answers (the built-in task)")
        if self.cfg.data.group_by_length:
            log.warning("data.group_by_length=true has no effect in train-ppo: prompts are drawn in a plain "
                        "shuffled order (it groups train-rm's pairs)")

    def reward_model_path(self) -> str | None:
        if self.cfg.reward.type != "model":
            return None
        path = self.cfg.reward_model.path
        if path is None:
            target = read_pointer(self.cfg.paths.root, "rm")
            if target is None:
                raise ConfigError(f"no reward model: set reward_model.path=<run dir or HF dir>, or run `rlhf train-rm` "
                                  f"first (no {Path(self.cfg.paths.root) / 'latest_rm'}), or use reward.type=checker")
            path = str(target)
        return require_scalar_model_dir(path, "reward model")

    def build_models(self) -> None:
        cfg, p = self.cfg, self.p
        policy = disable_dropout(load_causal_lm(cfg.model, self.precision, cfg.seed, tokenizer=self.tokenizer))
        ref_source = cfg.reference.path or cfg.model
        reference = load_causal_lm(ref_source, self.precision, cfg.seed, tokenizer=self.tokenizer)
        # how to rebuild the reference later (eval): a path, or the model config and seed it was built from
        self.reference_spec = ({"name_or_path": _abs(cfg.reference.path)} if cfg.reference.path else
                               {**OmegaConf.to_container(cfg.model, resolve=True), "seed": cfg.seed})
        self.rm_path = self.reward_model_path()
        if self.rm_path is not None:
            check_same_tokenizer(self.tokenizer, self.rm_path, "reward model")
            self.reward_model = engine.FrozenModel(load_scalar_model(self.rm_path, self.precision, cfg.seed),
                                                   self.score_precision, offload=p.offload_reference)
            self.reward_stats = read_reward_stats(self.rm_path)
        self.reference = engine.FrozenModel(reference, self.score_precision, offload=p.offload_reference)

        steps_per_iter = p.epochs * (p.rollout_batch_size // p.mini_batch_size)
        total = p.iterations * steps_per_iter
        common = dict(train_batch_size=p.mini_batch_size, micro_batch_size=p.micro_batch_size, total_steps=total,
                      warmup_steps=p.warmup_steps, scheduler="constant", weight_decay=p.weight_decay,
                      max_grad_norm=p.max_grad_norm)
        self.n_params = count_parameters(policy)
        if p.critic == "shared":
            model = PolicyWithValueHead(policy, cfg.seed)
            self.actor = engine.TrainEngine(model, cfg.deepspeed, self.score_precision, lr=p.actor_lr, **common)
        else:
            if p.critic_init == "reward_model" and self.reward_model is not None:
                critic = load_scalar_model(self.rm_path, self.precision, cfg.seed)
            else:
                critic = load_scalar_model(None, self.precision, cfg.seed, init_from=reference)
            # requires_grad: a copy of the (already frozen) reference would train only its head
            critic = disable_dropout(critic).requires_grad_(True)
            self.actor = engine.TrainEngine(policy, cfg.deepspeed, self.score_precision, lr=p.actor_lr, **common)
            self.critic = engine.TrainEngine(critic, cfg.deepspeed, self.precision, lr=p.critic_lr, **common)
        self.kl_ctl = (FixedKLController(p.kl_beta) if p.kl_target is None
                       else AdaptiveKLController(p.kl_beta, p.kl_target, p.kl_horizon))

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the weights, optimizer and RNG states (`lifecycle.Checkpoints`)."""
        return {"kl_ctl": self.kl_ctl.state_dict(), "bad_steps": self.bad_steps}

    # -- rollout -----------------------------------------------------------------------------
    def prompt_batch(self, iteration: int) -> tuple[list[dict[str, Any]], list[int]]:
        """This rank's prompts of an iteration and their sampling seeds.

        Prompts: a seeded walk through epochs of shuffled prompts (the same on every rank). Seeds: one
        per (run seed, iteration, position in the rollout), so a prompt's response is the same whatever
        the world size.
        """
        n, R = len(self.prompts), self.p.rollout_batch_size
        idx = []
        for k in range(iteration * R, (iteration + 1) * R):
            epoch, pos = divmod(k, n)
            if epoch != self._order_epoch:
                self._order, self._order_epoch = epoch_order(n, (self.cfg.data.seed, self.cfg.seed), epoch), epoch
            idx.append(self._order[pos])
        per_rank = R // engine.world_size()
        lo = engine.rank() * per_rank
        seeds = [derive_seed(self.cfg.seed, iteration, k) for k in range(lo, lo + per_rank)]
        return [self.prompts[i] for i in idx[lo:lo + per_rank]], seeds

    def generate(self, prompts: list[dict[str, Any]],
                 seeds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Sample one response per prompt with the current policy (see `sample_responses`)."""
        p = self.p
        with self.actor.gathered_params():
            return sample_responses(lm_of(self.actor.module), prompts, self.pad_id, self.eos_id, p.max_new_tokens,
                                    p.temperature, p.top_p, self.precision, chunk=p.micro_batch_size * 4, seeds=seeds)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
              prompts: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw scores (B,), normalised scores (B,)) from the reward model or the checker."""
        if self.reward_model is None:
            texts = self.tokenizer.batch_decode(input_ids[:, prompt_len:], skip_special_tokens=True)
            raw = torch.tensor(check_answers(texts, [x["answer"] for x in prompts]), dtype=torch.float32)
            return raw.to(input_ids.device), raw.to(input_ids.device)
        with self.reward_model.on_device() as rm:
            raw = batched_rewards(rm, input_ids, attention_mask, self.p.micro_batch_size, self.score_precision)
        norm = raw
        if self.p.normalize_reward and self.reward_stats is not None:
            mean, std = self.reward_stats
            norm = (raw - mean) / (std if std > 1e-6 else 1.0)  # a constant RM has std 0: only centre
        return raw, norm

    @torch.no_grad()
    def forward_no_grad(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        P: int) -> tuple[torch.Tensor, ...]:
        """Old logprobs, ref logprobs and old values, micro-batch by micro-batch, as training computes them."""
        with self.reference.on_device() as reference:
            return self._forward_no_grad(input_ids, attention_mask, P, reference)

    def _forward_no_grad(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                         reference: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        mb, temperature = self.p.micro_batch_size, self.p.temperature
        lps, refs, vals = [], [], []
        shared = self.critic is None
        for i in range(0, input_ids.shape[0], mb):
            ids, am = input_ids[i:i + mb], attention_mask[i:i + mb]
            with self.actor.autocast():
                lp, _, v = policy_forward(self.actor.module, ids, am, P, temperature, with_values=shared)
            with self.reference.autocast():
                ref, _, _ = policy_forward(reference, ids, am, P, temperature)
            if not shared:
                with self.critic.autocast():
                    v = critic_values(self.critic.module, ids, am, P)
            lps.append(lp)
            refs.append(ref)
            vals.append(v.float())
        return torch.cat(lps), torch.cat(refs), torch.cat(vals)

    @torch.no_grad()
    def kl_fp32_check(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                      kl_seq: torch.Tensor) -> dict[str, float]:
        """The noise floor of bf16 log-probs: `objective/kl_fp32`, the KL (k1, nats/seq) of this rank's first
        `ppo.kl_check_rows` rollout rows computed in fp32, and `objective/kl_check`, the reported KL of the same
        rows. Only when the scoring passes run under bf16 autocast (`scoring_precision=same`); else {}."""
        k = min(self.p.kl_check_rows, input_ids.shape[0])
        if k == 0 or self.score_precision != "bf16-autocast":
            return {}
        with self.reference.on_device() as reference:  # the weights are fp32 under bf16-autocast
            kl_fp32 = sequence_kl(self.actor.module, reference, input_ids[:k], attention_mask[:k], P,
                                  self.p.temperature, k, "fp32")["k1"]
        return {"objective/kl_fp32": kl_fp32.mean().item(), "objective/kl_check": kl_seq[:k].mean().item()}

    def make_experience(self, iteration: int) -> tuple[Experience, dict[str, float], dict[str, Any]]:
        p = self.p
        prompts, seeds = self.prompt_batch(iteration)
        t0 = time.perf_counter()
        input_ids, attention_mask, P, has_eos = self.generate(prompts, seeds)
        t1 = time.perf_counter()
        raw, score = self.score(input_ids, attention_mask, P, prompts)
        mask = attention_mask[:, P:].float()
        if p.truncated == "penalize":
            score = score - p.missing_eos_penalty * (~has_eos).float()
        logprobs, ref_logprobs, values = self.forward_no_grad(input_ids, attention_mask, P)
        t2 = time.perf_counter()
        loss_mask = mask * has_eos.float()[:, None] if p.truncated == "mask" else mask
        beta = self.kl_ctl.value
        rewards = kl_penalized_rewards(score, logprobs, ref_logprobs, mask, beta, p.kl_estimator)
        advantages, returns = ESTIMATORS[p.estimator](rewards, mask, values=values, gamma=p.gamma, lam=p.lam)
        if p.whiten_advantages:
            advantages = whiten_across_ranks(advantages, loss_mask)
        exp = Experience(input_ids, attention_mask, loss_mask, logprobs, ref_logprobs, values, rewards,
                         advantages, returns, score)
        kl_tok = kl_estimate(logprobs, ref_logprobs, "k1") * mask
        kl_seq = kl_tok.sum(1)  # nats per sequence
        lengths = mask.sum(1)
        gen_tokens = float(lengths.sum())
        stats = {
            "objective/scores": raw.mean().item(),
            "objective/scores_norm": score.mean().item(),
            "objective/kl": kl_seq.mean().item(),
            "objective/kl_k3": (kl_estimate(logprobs, ref_logprobs, "k3") * mask).sum(1).mean().item(),
            "objective/kl_beta": beta,
            "objective/rlhf_reward": (score - beta * kl_seq).mean().item(),
            "objective/entropy_sampled": (-(logprobs * mask).sum(1)).mean().item(),
            "response/length_mean": lengths.mean().item(),
            "response/eos_frac": has_eos.float().mean().item(),
            "val/values_mean": ((values * mask).sum() / mask.sum().clamp(min=1)).item(),
            "val/explained_var": explained_variance_across_ranks(values, returns, loss_mask),
            "time/generation": t1 - t0,
            "time/scoring": t2 - t1,
            "throughput/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            **self.kl_fp32_check(input_ids, attention_mask, P, kl_seq),
        }
        stats = engine.reduce_stats(stats)
        samples = {"prompts": [x.get("prompt_text", "") for x in prompts[:3]],
                   "responses": self.tokenizer.batch_decode(input_ids[:3, P:], skip_special_tokens=True),
                   "scores": raw[:3].tolist()}
        return exp, stats, samples

    # -- learn -------------------------------------------------------------------------------
    def micro_batches(self, exp: Experience, iteration: int) -> Iterator[tuple[Experience, float]]:
        """The update's order: `ppo.epochs` passes over the rollout in shuffled minibatches of `ppo.mini_batch_size`
        rows (over all ranks), each cut into micro-batches of `ppo.micro_batch_size` rows. Yields (micro-batch,
        real response tokens of its minibatch over all ranks: the divisor of every micro-batch loss)."""
        p = self.p
        n, mini = exp.input_ids.shape[0], p.mini_batch_size // engine.world_size()
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, iteration, engine.rank()))
        for _ in range(p.epochs):
            perm = torch.randperm(n, generator=g)
            for s in range(0, n, mini):
                rows = perm[s:s + mini]
                num_tokens = engine.all_reduce_sum(exp.mask[rows].sum()).item()
                for m in range(0, mini, p.micro_batch_size):
                    yield exp.rows(rows[m:m + p.micro_batch_size]), num_tokens

    def micro_step(self, b: Experience, num_tokens: float, iteration: int) -> tuple[dict[str, float], float, float]:
        """Forward, losses and backward of one micro-batch; the optimizers step at accumulation boundaries.

        Losses (Schulman et al. 2017, eq. 9): clipped surrogate (`ppo.clip`) minus `ppo.c2` × entropy bonus,
        plus `ppo.c1` × clipped value loss (`ppo.value_clip`): in the actor's objective with a shared critic,
        as the separate critic's objective otherwise. Each is aggregated over the whole minibatch
        (`ppo.aggregation`), so micro-batch losses sum to the minibatch's. Returns (stats, policy loss, value
        loss); a non-finite loss on any rank is skipped on all of them (`ppo.max_bad_steps`).
        """
        p, P = self.p, b.prompt_len
        shared = self.critic is None
        with self.actor.autocast():
            lp, ent, v = policy_forward(self.actor.module, b.input_ids, b.attention_mask, P, p.temperature,
                                        with_entropy=True, with_values=shared)
        agg = dict(num_tokens=num_tokens, num_seqs=float(p.mini_batch_size), aggregation=p.aggregation)
        pg_loss, pg_stats = policy_loss(lp, b.logprobs, b.advantages, b.mask, p.clip, **agg)
        ent_bonus, ent_stats = entropy_bonus(None, b.mask, entropy=ent, **agg)
        actor_loss = pg_loss - p.c2 * ent_bonus
        if not shared:
            with self.critic.autocast():
                v = critic_values(self.critic.module, b.input_ids, b.attention_mask, P)
        vf_loss, vf_stats = value_loss(v, b.values, b.returns, b.mask, p.value_clip, **agg)
        if shared:
            actor_loss = actor_loss + p.c1 * vf_loss
        critic_loss = p.c1 * vf_loss
        finite = torch.isfinite(actor_loss.detach()) & torch.isfinite(critic_loss.detach())
        if engine.all_reduce_sum((~finite).float().cpu()).item() > 0:  # every rank skips together
            self.bad_steps += 1
            log.warning("non-finite loss at iteration %d (bad steps: %d)", iteration + 1, self.bad_steps)
            if self.bad_steps > p.max_bad_steps:
                raise FloatingPointError(f"aborting: {self.bad_steps} micro-steps with NaN/inf losses "
                                         f"(ppo.max_bad_steps={p.max_bad_steps})")
            actor_loss = _zero_loss(self.actor.module)
            critic_loss = _zero_loss(self.critic.module) if not shared else critic_loss
        self.actor.backward_global(actor_loss)
        self.actor.step()
        if not shared:
            self.critic.backward_global(critic_loss)
            self.critic.step()
        stats = {**pg_stats, **vf_stats, **ent_stats}
        stats.pop("val/explained_var", None)  # per rollout, in make_experience
        return stats, pg_loss.item(), vf_loss.item()

    def train_on(self, exp: Experience, iteration: int) -> dict[str, float]:
        """The update on one rollout (`micro_batches` in order, `micro_step` each); returns its mean stats."""
        ws = engine.world_size()
        sums: dict[str, float] = {}
        count, tokens = 0, 0.0
        t0 = time.perf_counter()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        for b, num_tokens in self.micro_batches(exp, iteration):
            tokens += float(b.attention_mask.sum())
            step_stats, pg_loss, vf_loss = self.micro_step(b, num_tokens, iteration)
            # per-micro-batch stats: losses summed over micro-batches give the minibatch loss
            for k, val in step_stats.items():
                sums[k] = sums.get(k, 0.0) + val
            sums["policy/loss_sum"] = sums.get("policy/loss_sum", 0.0) + pg_loss
            sums["val/loss_sum"] = sums.get("val/loss_sum", 0.0) + vf_loss
            count += 1
        dt = time.perf_counter() - t0
        stats = {k: v / max(count, 1) for k, v in sums.items()}
        n_minibatches = self.p.epochs * math.ceil(exp.input_ids.shape[0] / (self.p.mini_batch_size // ws))
        stats["policy/loss"] = sums.get("policy/loss_sum", 0.0) / n_minibatches * ws
        stats["val/loss"] = sums.get("val/loss_sum", 0.0) / n_minibatches * ws
        stats.pop("policy/loss_sum", None), stats.pop("val/loss_sum", None)
        stats["time/training"] = dt
        stats["throughput/train_tokens_per_s"] = tokens * ws / max(dt, 1e-9)
        stats["policy/grad_norm"] = self.actor.grad_norm()
        stats["lr/actor"] = self.actor.lr()
        return engine.reduce_stats(stats)


def _zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A zero loss attached to every trainable parameter (keeps DeepSpeed's accumulation in step)."""
    return sum((p.float() * 0).sum() for p in model.parameters() if p.requires_grad)


def run(cfg: Any, run_dir: Path) -> float | None:
    engine.init_distributed()
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    p = cfg.ppo

    # 1. data, reward source, models
    tr = PPOTrainer(cfg, run_dir)
    tr.load_data()
    batches = f"{p.rollout_batch_size} / {p.mini_batch_size} / {p.micro_batch_size} / {engine.world_size()}"
    if cfg.dry_run:
        tr.rm_path = tr.reward_model_path()
        policy = load_causal_lm(cfg.model, cfg.precision, cfg.seed, tokenizer=tr.tokenizer)
        print_table(f"train-ppo (dry run): {run_dir}", {
            "policy": cfg.model.name, "params (non-embedding)": count_parameters(policy),
            "reward": tr.rm_path or "checker", "prompts": len(tr.prompts), "iterations": p.iterations,
            "rollout / mini / micro / world": batches,
            "precision": f"{cfg.precision} (scoring passes: {tr.score_precision})",
            "zero stage": cfg.deepspeed.zero_stage})
        if engine.is_main():
            set_status(run_dir, "dry_run")
        return None
    tr.build_models()
    print_table(f"train-ppo: {run_dir}", {
        "policy": cfg.model.name, "params (non-embedding)": tr.n_params,
        "reward": tr.rm_path or "checker (built-in task)",
        "reward normalisation": tr.reward_stats if p.normalize_reward else None,
        "critic": f"{p.critic} ({p.critic_init})", "prompts": len(tr.prompts), "iterations": p.iterations,
        "rollout / mini / micro / world": batches,
        "γ λ ε c1 c2 β": f"{p.gamma} {p.lam} {p.clip} {p.c1} {p.c2} {p.kl_beta}",
        "precision": f"{cfg.precision} (scoring passes: {tr.score_precision})"})
    metrics = MetricsLogger(run_dir, enabled=engine.is_main(), tensorboard=cfg.tensorboard)

    # 2. resume
    ckpts = Checkpoints(run_dir, {"actor": tr.actor, **({"critic": tr.critic} if tr.critic is not None else {})},
                        cfg.paths.keep_checkpoints)
    start, state = ckpts.resume(cfg.resume, metrics)
    if state:
        tr.kl_ctl.load_state_dict(state["kl_ctl"])
        tr.bad_steps = int(state.get("bad_steps", 0))

    # 3. loop
    progress = Progress(p.iterations, "train-ppo", PROGRESS_KEYS, enabled=engine.is_main(), start=start)
    done = start  # iterations complete: the weights of a checkpoint taken now
    updating = False
    record: dict[str, float] = {}
    try:
        for it in range(start, p.iterations):
            exp, roll_stats, samples = tr.make_experience(it)
            if p.max_kl is not None and roll_stats["objective/kl"] > p.max_kl:
                raise FloatingPointError(f"aborting at iteration {it + 1}: KL to the reference is "
                                         f"{roll_stats['objective/kl']:.2f} nats/sequence > ppo.max_kl={p.max_kl}")
            # a checkpoint mid-update would hold half an iteration's weights: a Ctrl-C/SIGTERM here lets
            # the update finish (a second one stops at once, without a checkpoint)
            with deferred_interrupts() as pending:
                updating = True
                train_stats = tr.train_on(exp, it)
                updating = False
            tr.kl_ctl.update(roll_stats["objective/kl"], p.rollout_batch_size)
            record = {**roll_stats, **train_stats, "ppo/bad_steps": tr.bad_steps}
            metrics.log(it + 1, record)
            if engine.is_main() and p.sample_every and (it + 1) % p.sample_every == 0:
                _log_samples(run_dir, it + 1, samples)
            progress.update(1, record)
            done = it + 1
            if p.save_every and done % p.save_every == 0 and done < p.iterations:
                ckpts.save(done, tr.state())
            if engine.all_reduce_sum(torch.tensor(float(bool(pending)))).item() > 0:  # every rank stops together
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        progress.close()
        if updating:
            log.warning("stopped in the middle of iteration %d's update: no checkpoint of it (resume=true "
                        "continues from the last one)", done + 1)
            raise
        log.warning("interrupted after %d iterations: saving a checkpoint before exit", done)
        ckpts.save(done, tr.state())
        raise
    except FloatingPointError as e:
        progress.close()
        if engine.is_main():
            set_status(run_dir, "aborted", reason=str(e))
        raise ConfigError(str(e)) from None
    progress.close()

    # 4. save
    # done > ppo.iterations when a longer run is resumed with fewer
    ckpts.save(done, tr.state())
    final = run_dir / "final"
    actor_sd = tr.actor.consolidated_state_dict()
    critic_sd = tr.critic.consolidated_state_dict() if tr.critic is not None else None
    if engine.is_main():
        extra = {"rlhf_stage": "ppo", "rlhf_reference_model": tr.reference_spec,
                 "rlhf_reward_model_path": _abs(tr.rm_path), "rlhf_reward_type": cfg.reward.type}
        if tr.critic is None:
            lm = lm_of(tr.actor.module)
            lm_sd = {k[len("lm."):]: v for k, v in actor_sd.items() if k.startswith("lm.")}
            save_hf(lm, tr.tokenizer, final, extra_config=extra, state_dict=lm_sd)
            from safetensors.torch import save_file

            save_file({"score.weight": actor_sd["score.weight"].contiguous()}, str(final / "value_head.safetensors"))
        else:
            save_hf(tr.actor.module, tr.tokenizer, final, extra_config=extra, state_dict=actor_sd)
            save_hf(tr.critic.module, tr.tokenizer, run_dir / "critic", state_dict=critic_sd)
            import os
            import shutil

            if (final / "critic").exists():
                shutil.rmtree(final / "critic")
            os.replace(run_dir / "critic", final / "critic")
        pointer = finish_run(cfg, run_dir, final, "ppo", iterations=done)
        summary = ("objective/scores", "objective/kl", "objective/kl_beta", "response/length_mean")
        print_table("train-ppo finished", {k: record.get(k) for k in summary}
                    | {"checkpoint": str(final), "pointer": str(pointer)})
    engine.barrier()
    metrics.close()
    return record.get("objective/scores")


def _abs(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    return str(p.resolve()) if p.exists() else path


def _log_samples(run_dir: Path, iteration: int, samples: dict[str, Any]) -> None:
    import json

    with open(run_dir / "samples.jsonl", "a") as fh:
        for prompt, resp, score in zip(samples["prompts"], samples["responses"], samples["scores"]):
            fh.write(json.dumps({"iteration": iteration, "prompt": prompt, "response": resp, "score": score}) + "\n")
    log.info("sample (iteration %d, score %.3f): %r", iteration, samples["scores"][0], samples["responses"][0][:200])

