"""The rollout half of a PPO iteration (OpenRLHF's experience maker): prompts → sampled responses → scores →
no-grad passes (old logprobs, ref_logprobs, values) → KL-shaped rewards → advantages and returns, as one
`Experience` per rank, with the rollout's statistics.

Precision: sampling and a separate critic run in `precision`; the policy's and the reference's log-prob
passes and the reward model in the one `scoring_precision` gives (see config.py, `scoring_precision`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.core import ESTIMATORS, kl_estimate, kl_penalized_rewards
from rlhf_cli.data import check_answers, epoch_order
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.policy import critic_values, lm_of, policy_forward, sequence_kl
from rlhf_cli.rollout.sampling import sample_responses
from rlhf_cli.rollout.scoring import batched_rewards
from rlhf_cli.rollout.stats import explained_variance_across_ranks, whiten_across_ranks
from rlhf_cli.seeds import derive_seed


class ExperienceMaker:
    """Makes one iteration's `Experience` on this rank from the run's models.

    cfg: the run config (`ppo.*`, `seed`, `data.seed`, `precision`, `scoring_precision`); prompts: the
    tokenized prompt rows; actor/critic: the `engine.TrainEngine`s (critic None when `ppo.critic=shared`);
    reference/reward_model: `engine.FrozenModel`s (reward_model None for `reward.type=checker`);
    reward_stats: the RM's held-out (mean, std) or None; kl_ctl: the KL controller whose `value` is β;
    score_precision: the precision of the scoring passes, as `engine.scoring_precision` resolved it for the run.
    """

    def __init__(self, cfg: Any, tokenizer: Any, prompts: Sequence[dict[str, Any]], actor: Any, reference: Any,
                 critic: Any, reward_model: Any, reward_stats: tuple[float, float] | None, kl_ctl: Any,
                 score_precision: str) -> None:
        self.cfg, self.p = cfg, cfg.ppo
        self.tokenizer, self.prompts = tokenizer, prompts
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.actor, self.reference, self.critic = actor, reference, critic
        self.reward_model, self.reward_stats, self.kl_ctl = reward_model, reward_stats, kl_ctl
        self.precision = cfg.precision  # sampling, separate critic
        self.score_precision = score_precision  # resolved once per run (it warns under precision=bf16)
        self._order: list[int] = []  # prompt order of data epoch `_order_epoch` (prompt_batch)
        self._order_epoch: int | None = None

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
