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

Batch layout: `[prompt | response]`, prompts left-padded to P columns, responses right-padded to R
columns, the response mask ending at the first EOS (inclusive). logits at column P-1+t predict
response token t; values[:, t] is the critic's head at the same column (see models/scalar.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from omegaconf import OmegaConf
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from rlhf_cli import engine
from rlhf_cli.config import ConfigError
from rlhf_cli.core import (
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    kl_penalized_rewards,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from rlhf_cli.data import PromptCollator, check_answers, load_prompt_data
from rlhf_cli.models import (
    count_parameters,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    new_scalar_head,
    read_reward_stats,
    require_scalar_model_dir,
    response_values,
    save_hf,
)
from rlhf_cli.runs import MetricsLogger, Progress, read_pointer, set_status, write_pointer
from rlhf_cli.stages.common import (
    batched_rewards,
    check_same_tokenizer,
    ckpt_dir,
    commit_checkpoint,
    drop_checkpoints,
    epoch_order,
    latest_tag,
    prepare_run_dir,
    print_table,
    rng_state,
    seed_everything,
    set_rng_state,
)

log = logging.getLogger(__name__)

PROGRESS_KEYS = ["objective/scores", "objective/kl", "policy/clipfrac", "response/length_mean"]


# ----------------------------------------------------------------------------------------------
# the rollout record


@dataclass
class Experience:
    """One rollout batch on one rank. B rows, P prompt columns, R response columns."""

    input_ids: torch.Tensor  # (B, P+R) long, [left-padded prompt | right-padded response]
    attention_mask: torch.Tensor  # (B, P+R) long, 1 = real token
    mask: torch.Tensor  # (B, R) float, 1 = real response token (EOS included) that enters the loss
    logprobs: torch.Tensor  # (B, R) float32, old log π(a_t|s_t) at temperature, 0 on padding
    ref_logprobs: torch.Tensor  # (B, R) float32, log π_ref(a_t|s_t) at temperature
    values: torch.Tensor  # (B, R) float32, old V(s_t)
    rewards: torch.Tensor  # (B, R) float32, −β·kl_t plus the score at the last real token
    advantages: torch.Tensor  # (B, R) float32, GAE (whitened if ppo.whiten_advantages)
    returns: torch.Tensor  # (B, R) float32, advantages (unwhitened) + values
    scores: torch.Tensor  # (B,) float32, the score added at the EOS (after normalisation/penalty)

    def rows(self, idx: torch.Tensor) -> "Experience":
        return Experience(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.mask.shape[1]


# ----------------------------------------------------------------------------------------------
# models


class PolicyWithValueHead(torch.nn.Module):
    """`ppo.critic=shared`: the policy's trunk carries a scalar value head `score` next to its LM head."""

    def __init__(self, lm: torch.nn.Module, seed: int) -> None:
        super().__init__()
        self.lm = lm
        self.score = new_scalar_head(lm.config.get_text_config().hidden_size, seed, next(lm.parameters()))

    @property
    def config(self) -> Any:
        return self.lm.config


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def _lm(model: Any) -> Any:
    model = _unwrap(model)
    return model.lm if isinstance(model, PolicyWithValueHead) else model


def policy_forward(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, temperature: float,
    with_entropy: bool = False, with_values: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Log-probs of the response tokens under the policy at `temperature`.

    input_ids, attention_mask: (B, P+R). Returns logprobs (B, R) float32, entropy (B, R) nats or
    None, and, for a shared critic, values (B, R) float32 or None. Only the R response positions go
    through the LM head; position ids count real tokens, so padding side does not matter.
    """
    lm = _lm(model)
    trunk = getattr(lm, lm.base_model_prefix)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).last_hidden_state[:, prompt_len - 1:-1]  # (B, R, H)
    logits = lm.lm_head(hidden).float() / temperature  # (B, R, V)
    labels = input_ids[:, prompt_len:]
    logprobs = logprobs_from_logits(logits, labels)
    entropy = entropy_from_logits(logits) if with_entropy else None
    values = None
    if with_values:
        values = _unwrap(model).score(hidden).squeeze(-1).float()
    return logprobs, entropy, values


@torch.no_grad()
def sequence_kl(policy: Any, reference: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                temperature: float, batch_size: int, precision: str,
                estimators: Sequence[str] = ("k1",)) -> Dict[str, torch.Tensor]:
    """KL(policy ‖ reference) per sequence, nats: {estimator: (B,) float32}, the per-token estimate (`core.
    kl_estimate`) summed over each response's real tokens, on tokens the policy sampled at `temperature`.

    input_ids, attention_mask: (B, P+R) laid out as `policy_forward` reads them; both models run `batch_size`
    rows at a time under `engine.autocast(precision)`.
    """
    out: Dict[str, List[torch.Tensor]] = {k: [] for k in estimators}
    for i in range(0, input_ids.shape[0], batch_size):
        ids, am = input_ids[i:i + batch_size], attention_mask[i:i + batch_size]
        with engine.autocast(precision):
            lp, _, _ = policy_forward(policy, ids, am, prompt_len, temperature)
            ref_lp, _, _ = policy_forward(reference, ids, am, prompt_len, temperature)
        mask = am[:, prompt_len:].float()
        for k in estimators:
            out[k].append((kl_estimate(lp, ref_lp, k) * mask).sum(1))
    return {k: torch.cat(v) for k, v in out.items()}


def critic_values(critic: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B, R) float32 values of a separate critic, aligned with `policy_forward`'s logprobs."""
    return response_values(critic, input_ids, attention_mask, prompt_len)


def response_mask(responses: torch.Tensor, eos_id: int, pad_id: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut generated tokens at the first EOS.

    responses: (B, R) long as returned by generate (anything after the EOS is filler).
    Returns (responses with everything after the first EOS set to pad, mask (B, R) float with 1 up
    to and including the first EOS, has_eos (B,) bool).
    """
    is_eos = responses == eos_id
    before_or_at = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0  # no EOS strictly before t
    mask = before_or_at.float()
    cleaned = torch.where(before_or_at, responses, torch.full_like(responses, pad_id))
    return cleaned, mask, is_eos.any(dim=1)


def prompt_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative integer keys, e.g. (run seed, iteration, position in the rollout).

    Each key is encoded as two 32-bit words after a tag and the key count, so (s, j) and (s, j, 0), or keys
    that differ only across a 32-bit boundary, give different seeds.
    """
    words = [0x5EED, len(keys)]
    for k in keys:
        k = int(k) % 2**64
        words += [k & 0xFFFFFFFF, k >> 32]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


class PerRowSampler(LogitsProcessor):
    """Sampling with one random stream per row, run inside HF `generate`'s greedy loop (Gumbel-max).

    argmax(logits / T + g), g ~ Gumbel(0, 1) i.i.d., is a sample from softmax(logits / T) (Gumbel 1954;
    Maddison et al. 2014); tokens a top-p filter set to -inf are never drawn. Each row draws its noise from
    its own `torch.Generator` on the scores' device, so a prompt's sample depends only on its seed, not on
    which rows share its batch, the chunk size or the number of ranks (up to float differences in the
    logits). The noise is float32: u in [2^-24, 1 - 2^-24] truncates the Gumbel tail at ~16.6 (an event of
    probability ~6e-8 per token and row).

    seeds: one int per row of the `generate` batch. Scores (B, V) float; returns scores + noise, same shape.
    """

    def __init__(self, seeds: Sequence[int]) -> None:
        self.seeds = [int(s) for s in seeds]
        self.generators: List[torch.Generator] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"PerRowSampler: {scores.shape[0]} rows but {len(self.seeds)} seeds")
        if not self.generators:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        V, dev = scores.shape[-1], scores.device
        u = torch.stack([torch.rand(V, generator=g, device=dev) for g in self.generators])
        u = u.clamp(2.0**-24, 1.0 - 2.0**-24)
        return scores + (-torch.log(-torch.log(u))).to(scores.dtype)


@torch.no_grad()
def sample_responses(
    lm: Any, prompts: List[Dict[str, Any]], pad_id: int, eos_id: int, max_new_tokens: int, temperature: float,
    top_p: float, precision: str, chunk: int = 32, seeds: Optional[Sequence[int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Sample one response per prompt (HF generate with KV cache), cut at the first EOS.

    prompts: dicts with `prompt_ids`. Returns input_ids (B, P+R) `[left-padded prompt | right-padded
    response]`, attention_mask (B, P+R) (response part 1 up to and including the first EOS), P, and
    has_eos (B,) bool. R is the longest response (<= max_new_tokens).

    Tokens are drawn from softmax(logits / temperature) after top-p filtering, with one random stream per
    prompt (`PerRowSampler`): `seeds` (one int per prompt) make a prompt's response independent of the batch
    it is in and of the world size, and give two models the same noise (common random numbers). Without
    `seeds`, they are drawn from torch's global generator.
    """
    dev = engine.device()
    batch = PromptCollator(pad_id)(prompts)
    prompt_ids, prompt_mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
    P = prompt_ids.shape[1]
    if seeds is None:
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
    elif len(seeds) != len(prompts):
        raise ValueError(f"sample_responses: {len(seeds)} seeds for {len(prompts)} prompts")
    # greedy decoding over warped, noised scores == sampling
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                                  pad_token_id=pad_id, use_cache=True)
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
    was_training, model_gen_config = lm.training, lm.generation_config
    lm.eval()
    # HF fills every option our config leaves unset from the model's own generation_config (repetition
    # penalty, suppressed tokens, beams...): a blank one for the duration, so nothing but ours applies
    lm.generation_config = GenerationConfig()
    outs = []
    try:
        with engine.autocast(precision):
            for i in range(0, len(prompts), chunk):
                processors = LogitsProcessorList([*warpers, PerRowSampler(seeds[i:i + chunk])])
                out = lm.generate(input_ids=prompt_ids[i:i + chunk], attention_mask=prompt_mask[i:i + chunk],
                                  generation_config=gen_config, logits_processor=processors)
                resp = out[:, P:]
                if resp.shape[1] < max_new_tokens:  # every chunk to the same width
                    resp = torch.nn.functional.pad(resp, (0, max_new_tokens - resp.shape[1]), value=pad_id)
                outs.append(resp)
    finally:
        lm.generation_config = model_gen_config
        lm.train(was_training)
    responses, rmask, has_eos = response_mask(torch.cat(outs), eos_id, pad_id)
    R = max(int(rmask.sum(1).max().item()), 1)  # drop all-pad columns
    input_ids = torch.cat([prompt_ids, responses[:, :R]], dim=1)
    attention_mask = torch.cat([prompt_mask, rmask[:, :R].long()], dim=1)
    return input_ids, attention_mask, P, has_eos


def _moments_across_ranks(x: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, float, float, float]:
    """(x − mean masked to 0 (float64), n, mean, unbiased var) over the real tokens of ALL ranks.

    Two passes in float64 (the mean, then the squared deviations), so a large mean does not swamp the
    variance; var is 1.0 with a single real token and 0.0 with none.
    """
    m = mask.bool()
    xd = torch.where(m, x.double(), torch.zeros_like(x, dtype=torch.float64))
    n, s = engine.all_reduce_sum(torch.stack([m.double().sum(), xd.sum()])).tolist()
    if n < 1:
        return torch.zeros_like(xd), 0.0, 0.0, 0.0
    mean = s / n
    centred = torch.where(m, xd - mean, torch.zeros_like(xd))
    ss = engine.all_reduce_sum(centred.square().sum()).item()
    return centred, n, mean, (ss / (n - 1) if n > 1 else 1.0)


def whiten_across_ranks(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean)/std over real tokens of ALL ranks (unbiased std), 0 on padding.

    x, mask: (B, T); mask 1 = real token. Returns (B, T) float32. Equals `core.masked_whiten(x, mask)`
    on one rank (tested); with one real token the std is taken as 1, like masked_whiten's documented
    fallback.
    """
    centred, n, _, var = _moments_across_ranks(x, mask)
    if n < 1:
        return centred.float()
    return (centred / math.sqrt(var + eps)).float()


def explained_variance_across_ranks(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[returns − values] / Var[returns] over the real tokens of the whole rollout (all ranks).

    values, returns, mask: (B, T). 1 is a perfect critic, 0 one no better than the mean return, < 0
    worse; 0 when the returns do not vary (as `core.value_loss`). Computed once per rollout on the critic's old values, so
    it does not depend on how the rollout is split into micro-batches or ranks.
    """
    _, n, _, var_r = _moments_across_ranks(returns, mask)
    _, _, _, var_d = _moments_across_ranks(returns - values, mask)
    return 1.0 - var_d / var_r if n > 1 and var_r > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# the stage


class PPOTrainer:
    """Holds the engines and state of one PPO run; `run()` below walks it step by step."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg, self.p, self.run_dir = cfg, cfg.ppo, run_dir
        self.precision = cfg.precision  # sampling, separate critic
        # log-prob passes of policy (old logprobs, training forward) and reference, reward-model scores
        self.score_precision = engine.scoring_precision(cfg.precision, cfg.scoring_precision)
        self.tokenizer = load_tokenizer(cfg.model)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        self.bad_steps = 0  # micro-steps skipped for NaN/inf losses

    # -- build -----------------------------------------------------------------------------
    def load_data(self) -> None:
        self.prompts = load_prompt_data(self.cfg.data, self.tokenizer, split="train")
        if len(self.prompts) < self.p.rollout_batch_size:
            raise ConfigError(f"only {len(self.prompts)} prompts, fewer than ppo.rollout_batch_size={self.p.rollout_batch_size}")
        if self.cfg.reward.type == "checker" and any(x.get("answer") is None for x in self.prompts):
            raise ConfigError("reward.type=checker needs prompts with answers (the built-in task)")

    def reward_model_path(self) -> Optional[str]:
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
        self.reward_model = None
        self.reward_stats = None
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
            self.critic = None
        else:
            if p.critic_init == "reward_model" and self.reward_model is not None:
                critic = load_scalar_model(self.rm_path, self.precision, cfg.seed)
            else:
                critic = load_scalar_model(None, self.precision, cfg.seed, init_from=reference)
            critic = disable_dropout(critic).requires_grad_(True)  # a copy of the (already frozen) reference would train only its head
            self.actor = engine.TrainEngine(policy, cfg.deepspeed, self.score_precision, lr=p.actor_lr, **common)
            self.critic = engine.TrainEngine(critic, cfg.deepspeed, self.precision, lr=p.critic_lr, **common)
        self.kl_ctl = (FixedKLController(p.kl_beta) if p.kl_target is None
                       else AdaptiveKLController(p.kl_beta, p.kl_target, p.kl_horizon))

    # -- rollout -----------------------------------------------------------------------------
    def prompt_batch(self, iteration: int) -> Tuple[List[Dict[str, Any]], List[int]]:
        """This rank's prompts of an iteration and their sampling seeds.

        Prompts: a seeded walk through epochs of shuffled prompts (the same on every rank). Seeds: one
        per (run seed, iteration, position in the rollout), so a prompt's response is the same whatever
        the world size.
        """
        n, R = len(self.prompts), self.p.rollout_batch_size
        idx = []
        for k in range(iteration * R, (iteration + 1) * R):
            epoch, pos = divmod(k, n)
            if epoch != getattr(self, "_order_epoch", None):
                self._order, self._order_epoch = epoch_order(n, self.cfg.data.seed + self.cfg.seed, epoch), epoch
            idx.append(self._order[pos])
        per_rank = R // engine.world_size()
        lo = engine.rank() * per_rank
        seeds = [prompt_seed(self.cfg.seed, iteration, k) for k in range(lo, lo + per_rank)]
        return [self.prompts[i] for i in idx[lo:lo + per_rank]], seeds

    def generate(self, prompts: List[Dict[str, Any]], seeds: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Sample one response per prompt with the current policy (see `sample_responses`)."""
        p = self.p
        with self.actor.gathered_params():
            return sample_responses(_lm(self.actor.module), prompts, self.pad_id, self.eos_id, p.max_new_tokens,
                                    p.temperature, p.top_p, self.precision, chunk=p.micro_batch_size * 4, seeds=seeds)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
              prompts: List[Dict[str, Any]]) -> Tuple[torch.Tensor, torch.Tensor]:
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
    def forward_no_grad(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int) -> Tuple[torch.Tensor, ...]:
        """Old logprobs, ref logprobs and old values, micro-batch by micro-batch, as training computes them."""
        with self.reference.on_device() as reference:
            return self._forward_no_grad(input_ids, attention_mask, P, reference)

    def _forward_no_grad(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                         reference: torch.nn.Module) -> Tuple[torch.Tensor, ...]:
        mb, T = self.p.micro_batch_size, self.p.temperature
        lps, refs, vals = [], [], []
        shared = self.critic is None
        for i in range(0, input_ids.shape[0], mb):
            ids, am = input_ids[i:i + mb], attention_mask[i:i + mb]
            with self.actor.autocast():
                lp, _, v = policy_forward(self.actor.module, ids, am, P, T, with_values=shared)
            with self.reference.autocast():
                ref, _, _ = policy_forward(reference, ids, am, P, T)
            if not shared:
                with self.critic.autocast():
                    v = critic_values(self.critic.module, ids, am, P)
            lps.append(lp); refs.append(ref); vals.append(v.float())
        return torch.cat(lps), torch.cat(refs), torch.cat(vals)

    @torch.no_grad()
    def kl_fp32_check(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                      kl_seq: torch.Tensor) -> Dict[str, float]:
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

    def make_experience(self, iteration: int) -> Tuple[Experience, Dict[str, float], Dict[str, Any]]:
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
        advantages, returns = compute_gae(rewards, values, mask, p.gamma, p.lam)
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
    def train_on(self, exp: Experience, iteration: int) -> Dict[str, float]:
        """`ppo.epochs` passes of shuffled minibatches over the rollout; returns mean stats."""
        p = self.p
        ws = engine.world_size()
        n = exp.input_ids.shape[0]
        mini = p.mini_batch_size // ws
        P, T = exp.prompt_len, p.temperature
        shared = self.critic is None
        g = torch.Generator().manual_seed(self.cfg.seed * 7919 + iteration * 1009 + engine.rank())
        sums: Dict[str, float] = {}
        count, tokens = 0, 0.0
        t0 = time.perf_counter()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        for epoch in range(p.epochs):
            perm = torch.randperm(n, generator=g)
            for s in range(0, n, mini):
                mb_rows = perm[s:s + mini]
                # the minibatch's real-token count over all ranks: the divisor of every micro-batch loss
                num_tokens = engine.all_reduce_sum(exp.mask[mb_rows].sum()).item()
                for m in range(0, mini, p.micro_batch_size):
                    b = exp.rows(mb_rows[m:m + p.micro_batch_size])
                    tokens += float(b.attention_mask.sum())
                    with self.actor.autocast():
                        lp, ent, v = policy_forward(self.actor.module, b.input_ids, b.attention_mask, P, T,
                                                    with_entropy=True, with_values=shared)
                    agg = dict(num_tokens=num_tokens, num_seqs=float(p.mini_batch_size), aggregation=p.aggregation)
                    pg_loss, pg_stats = policy_loss(lp, b.logprobs, b.advantages, b.mask, p.clip, **agg)
                    ent_bonus, ent_stats = entropy_bonus(None, b.mask, entropy=ent, **agg)
                    actor_loss = pg_loss - p.c2 * ent_bonus
                    if not shared:
                        with self.critic.autocast():
                            v = critic_values(self.critic.module, b.input_ids, b.attention_mask, P)
                    vf_loss, vf_stats = value_loss(v, b.values, b.returns, b.mask, p.value_clip, **agg)
                    # shared: one objective, c1 weighs the value loss; separate: c1 scales the critic's gradient
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
                    # the losses are already means over the whole minibatch (all micro-batches and ranks);
                    # DeepSpeed averages gradients over ranks, so undo that average
                    self.actor.backward(actor_loss * ws)
                    self.actor.step()
                    if not shared:
                        self.critic.backward(critic_loss * ws)
                        self.critic.step()
                    # per-micro-batch stats: losses summed over micro-batches give the minibatch loss
                    step_stats = {**pg_stats, **vf_stats, **ent_stats}
                    step_stats.pop("val/explained_var", None)  # per rollout, in make_experience
                    for k, val in step_stats.items():
                        sums[k] = sums.get(k, 0.0) + val
                    sums["policy/loss_sum"] = sums.get("policy/loss_sum", 0.0) + pg_loss.item()
                    sums["val/loss_sum"] = sums.get("val/loss_sum", 0.0) + vf_loss.item()
                    count += 1
        dt = time.perf_counter() - t0
        stats = {k: v / max(count, 1) for k, v in sums.items()}
        n_minibatches = p.epochs * math.ceil(n / mini)
        stats["policy/loss"] = sums.get("policy/loss_sum", 0.0) / n_minibatches * ws
        stats["val/loss"] = sums.get("val/loss_sum", 0.0) / n_minibatches * ws
        stats.pop("policy/loss_sum", None), stats.pop("val/loss_sum", None)
        stats["time/training"] = dt
        stats["throughput/train_tokens_per_s"] = tokens * ws / max(dt, 1e-9)
        stats["policy/grad_norm"] = self.actor.grad_norm()
        stats["lr/actor"] = self.actor.lr()
        return engine.reduce_stats(stats)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[List[int]]:
    """SIGINT/SIGTERM inside the block are recorded (in the yielded list), not raised, so the block runs to
    its end; a second signal raises KeyboardInterrupt at once. Outside the main thread: no change."""
    pending: List[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return

    def record(signum: int, frame: Any) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)
        log.warning("interrupt received: finishing this iteration's update, then saving a checkpoint "
                    "(interrupt again to stop now, without one)")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, record)
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 so that the rollout's old logprobs and values and the
    training forward see the same function (TRL and OpenRLHF do the same)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention modules
            module.attention_dropout = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, key) and isinstance(getattr(model.config, key), float):
            setattr(model.config, key, 0.0)
    return model


def _zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A zero loss attached to every trainable parameter (keeps DeepSpeed's accumulation in step)."""
    return sum((p.float() * 0).sum() for p in model.parameters() if p.requires_grad)


def run(cfg: Any, run_dir: Path) -> Optional[float]:
    engine.init_distributed()
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    p = cfg.ppo

    # 1. data, reward source, models
    tr = PPOTrainer(cfg, run_dir)
    tr.load_data()
    if cfg.dry_run:
        tr.rm_path = tr.reward_model_path()
        policy = load_causal_lm(cfg.model, cfg.precision, cfg.seed, tokenizer=tr.tokenizer)
        print_table(f"train-ppo (dry run): {run_dir}", {
            "policy": cfg.model.name, "params (non-embedding)": count_parameters(policy),
            "reward": tr.rm_path or "checker", "prompts": len(tr.prompts), "iterations": p.iterations,
            "rollout / mini / micro / world": f"{p.rollout_batch_size} / {p.mini_batch_size} / {p.micro_batch_size} / {engine.world_size()}",
            "precision": f"{cfg.precision} (scoring passes: {tr.score_precision})",
            "zero stage": cfg.deepspeed.zero_stage})
        if engine.is_main():
            set_status(run_dir, "dry_run")
        return None
    tr.build_models()
    print_table(f"train-ppo: {run_dir}", {
        "policy": cfg.model.name, "params (non-embedding)": tr.n_params, "reward": tr.rm_path or "checker (built-in task)",
        "reward normalisation": tr.reward_stats if p.normalize_reward else None, "critic": f"{p.critic} ({p.critic_init})",
        "prompts": len(tr.prompts), "iterations": p.iterations,
        "rollout / mini / micro / world": f"{p.rollout_batch_size} / {p.mini_batch_size} / {p.micro_batch_size} / {engine.world_size()}",
        "γ λ ε c1 c2 β": f"{p.gamma} {p.lam} {p.clip} {p.c1} {p.c2} {p.kl_beta}",
        "precision": f"{cfg.precision} (scoring passes: {tr.score_precision})"})
    metrics = MetricsLogger(run_dir, enabled=engine.is_main(), tensorboard=cfg.tensorboard)

    # 2. resume
    start = 0
    tag = latest_tag(run_dir) if cfg.resume else None
    if tag is not None:
        state = tr.actor.load(str(ckpt_dir(run_dir) / tag), "actor")
        if tr.critic is not None:
            tr.critic.load(str(ckpt_dir(run_dir) / tag), "critic")
        start = int(state["iteration"])
        tr.kl_ctl.load_state_dict(state["kl_ctl"])
        tr.bad_steps = int(state.get("bad_steps", 0))
        set_rng_state(state["rng"])
        log.info("resumed from %s at iteration %d", tag, start)
    if cfg.resume:  # drop records a crashed attempt logged after its last checkpoint
        metrics.truncate_after(start)

    # 3. loop
    progress = Progress(p.iterations, "train-ppo", PROGRESS_KEYS, enabled=engine.is_main(), start=start)
    done = start  # iterations complete: the weights of a checkpoint taken now
    updating = False
    record: Dict[str, float] = {}
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
                save_checkpoint(tr, run_dir, done, cfg.paths.keep_checkpoints)
            if engine.all_reduce_sum(torch.tensor(float(bool(pending)))).item() > 0:  # every rank stops together
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        progress.close()
        if updating:
            log.warning("stopped in the middle of iteration %d's update: no checkpoint of it (resume=true "
                        "continues from the last one)", done + 1)
            raise
        log.warning("interrupted after %d iterations: saving a checkpoint before exit", done)
        save_checkpoint(tr, run_dir, done, cfg.paths.keep_checkpoints)
        raise
    except FloatingPointError as e:
        progress.close()
        if engine.is_main():
            set_status(run_dir, "aborted", reason=str(e))
        raise ConfigError(str(e)) from None
    progress.close()

    # 4. save
    # done > ppo.iterations when a longer run is resumed with fewer
    save_checkpoint(tr, run_dir, done, cfg.paths.keep_checkpoints)
    final = run_dir / "final"
    actor_sd = tr.actor.consolidated_state_dict()
    critic_sd = tr.critic.consolidated_state_dict() if tr.critic is not None else None
    if engine.is_main():
        extra = {"rlhf_stage": "ppo", "rlhf_reference_model": tr.reference_spec,
                 "rlhf_reward_model_path": _abs(tr.rm_path), "rlhf_reward_type": cfg.reward.type}
        if tr.critic is None:
            lm = _lm(tr.actor.module)
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
        (final / "rlhf_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        pointer = write_pointer(cfg.paths.root, "ppo", final)
        set_status(run_dir, "finished", final=str(final.resolve()), iterations=done)
        drop_checkpoints(run_dir, cfg.paths.keep_checkpoints)
        print_table("train-ppo finished", {k: record.get(k) for k in
                                           ("objective/scores", "objective/kl", "objective/kl_beta", "response/length_mean")}
                    | {"checkpoint": str(final), "pointer": str(pointer)})
    engine.barrier()
    metrics.close()
    return record.get("objective/scores")


def _abs(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    p = Path(path)
    return str(p.resolve()) if p.exists() else path


def _log_samples(run_dir: Path, iteration: int, samples: Dict[str, Any]) -> None:
    import json

    with open(run_dir / "samples.jsonl", "a") as fh:
        for prompt, resp, score in zip(samples["prompts"], samples["responses"], samples["scores"]):
            fh.write(json.dumps({"iteration": iteration, "prompt": prompt, "response": resp, "score": score}) + "\n")
    log.info("sample (iteration %d, score %.3f): %r", iteration, samples["scores"][0], samples["responses"][0][:200])


def save_checkpoint(tr: PPOTrainer, run_dir: Path, iteration: int, keep: int) -> None:
    """Resumable checkpoint `ds/step-<iteration>/{actor,critic}`; `ds/latest` moves once both are written.
    A no-op when `ds/latest` already is that iteration (nothing changed since: never rewrite the good one)."""
    tag = f"step-{iteration}"
    if latest_tag(run_dir) == tag:
        return
    state = {"iteration": iteration, "kl_ctl": tr.kl_ctl.state_dict(), "rng": rng_state(), "bad_steps": tr.bad_steps}
    tr.actor.save(str(ckpt_dir(run_dir) / tag), "actor", state)
    if tr.critic is not None:
        tr.critic.save(str(ckpt_dir(run_dir) / tag), "critic", {})
    commit_checkpoint(run_dir, tag, keep)
