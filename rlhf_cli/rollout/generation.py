"""Sampling responses: the seam a sampling engine plugs into, and its HF implementation.

    Sampling            the settings of one call: the ids that end a response, pad, length, τ, top-p
    Generation          what an engine returns: responses (B, R), mask, has_eos, its own log-probs or None
    Generator           the protocol an engine implements: `generate(prompt_ids, seeds, sampling)` and
                        `update_weights(model)`
    HFGenerator         `rollout.engine=hf`: HF `generate` with one random stream per prompt (`PerRowSampler`)
    resolve_dtype       the dtype of an engine holding its own weights (`rollout.engine_dtype`)
    rollout_batch       prompt ids + a `Generation` -> the rollout batch `[left-padded prompt | right-padded
                        response]` the stages score and train on
    join_rollout_batches  several rollout batches as one (`ppo.filter_groups`' rounds)
    response_mask       the cut at the first EOS (any id of `eos_ids`)
    sample_responses    the one-call form of `HFGenerator` + `rollout_batch` (tests)

An engine takes token ids and gives token ids: tokenizing and detokenizing stay with the caller. Each prompt
has its own seed, and its response depends only on (the weights, its prompt, its seed, the sampling settings),
never on the batch it is in, the chunk size or the world size: two models given the same seeds sample with
the same noise (the eval pairs its policy and reference samples on this). A new engine is one class
implementing `Generator`, one entry of the registry `engines.GENERATORS` and one `rollout.engine` value
(`config.ROLLOUT_ENGINES`): `vllm` is `rollout/vllm_engine.py`. This module imports no engine of its own
(`engines.py` builds them), so an engine's module may import it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_cli import engine
from rlhf_cli.data import pad_sequences

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """The settings of one `Generator.generate` call."""

    eos_ids: tuple[int, ...]
    """Every token id that ends a response (the tokenizer's EOS; a chat template's end-of-turn id too)."""
    pad_id: int
    """The id written after a response's end (and to the left of shorter prompts)."""
    max_new_tokens: int
    """Longest response, in tokens (>= 1); a response that reaches it without an EOS is cut there."""
    temperature: float
    """τ > 0: tokens are drawn from softmax(logits / τ)."""
    top_p: float
    """Nucleus sampling in (0, 1]: after the temperature, only the smallest set of tokens whose probability
    reaches top_p can be drawn; 1 = no filter."""
    stop: Callable[[int, Sequence[int]], bool] | None = None
    """`stop(b, ids)`: row b of the call may end early, without an EOS, once this is true of its response ids so far
    (`environments.EnvironmentRunner`: a turn's tool calls are complete). The `hf` engine checks it after each token
    and ends the row there (mask 0 after it); an engine may also ignore it, so the caller cuts what follows the
    stop itself. Stopping changes no token before the stop (each row's noise is its own). None: only an EOS or
    `max_new_tokens` ends a row."""


Gather = Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]]
"""`gather(params)`: a context in which `params` are whole (`TrainEngine.gathered`: ZeRO-3's partitions)."""


class Generation(NamedTuple):
    """One response per prompt, as an engine returns them (rows in the order of the prompts).

    responses  (B, R) long     the sampled ids, right-padded with `pad_id` after the first EOS (R <= max_new_tokens;
                               columns past the longest response are all pad)
    mask       (B, R) float32  1 = a response token, up to and including the first EOS
    has_eos    (B,) bool       the response ended with an id of `eos_ids` (else `max_new_tokens` cut it)
    logprobs   (B, R) float32  the engine's own log-probs (nats) of the sampled tokens after temperature (and
               | None          top-p), 0 where mask is 0; None when the engine gives none (HF)
    """

    responses: torch.Tensor
    mask: torch.Tensor
    has_eos: torch.Tensor
    logprobs: torch.Tensor | None


@runtime_checkable
class Generator(Protocol):
    """A sampling engine: prompt token ids in, response token ids out.

    Contract:
      - `generate(prompt_ids, seeds, sampling)`: one response per prompt (B prompts of any lengths, ids without
        padding), returned as a `Generation` in the prompts' order.
      - One seed per prompt. A prompt's response depends only on (the weights, its prompt, its seed,
        `sampling`), not on which prompts share its batch, the chunk size or the world size (up to float
        differences in the logits), so two models given the same seeds sample with the same noise (common random
        numbers): `rlhf eval` pairs its policy's and its reference's samples of a prompt on this.
      - A response ends at the first id of `sampling.eos_ids` (kept, mask 1) or at `sampling.max_new_tokens`;
        everything after the first EOS is `sampling.pad_id`, mask 0.
      - `update_weights(model, gather=None)`: the engine samples from `model`'s current weights from then on (a
        causal LM, the live training module; an engine with its own copy of the weights copies them here).
        `gather(params)`, a context manager over a list of parameters (`TrainEngine.gathered`), makes ZeRO-3's
        partitioned parameters whole while it is open; None: the weights are whole as held.
      - `own_weights`: whether the engine holds its own copy (then train-ppo calls `update_weights` with `gather`,
        one layer's parameters gathered at a time, and samples without the full weights gathered); else it
        samples from the live module, and train-ppo calls both inside the actor's `gathered_params()` (ZeRO-3's
        full weights). `rlhf eval` calls `update_weights` once for the policy, then once for the reference.
      - `close()`: the run is over; the engine frees what it holds (an engine's model dir, its process state).
    """

    sync_seconds: float
    """Seconds spent bringing the engine to the current weights since the last `update_weights`: its start or the
    push, and a check of them (0 for an engine that samples from the live module). train-ppo logs it as
    `time/engine_sync`, and `time/generation` without it."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], sampling: Sampling) -> Generation:
        ...

    own_weights: bool
    """The engine samples from its own copy of the weights (see the contract)."""

    tensors_changed: int | None
    """How many of the engine's tensors its last push changed (`VLLMGenerator.tensors_changed`); None for an engine
    that samples from the live module (`hf`) and after a start. train-ppo logs it and stops on 0 after a step
    (`stats.PushGuard`)."""

    probes: bool
    """The engine checks each push itself (a greedy probe against the trainer's forward: `VLLMGenerator.probe`),
    where it computes as the trainer's scoring passes do; train-ppo's bf16 drift guard (`stats.EngineDriftGuard`)
    then stays off. False for an engine that samples from the live module (`hf`): nothing to drift."""

    def update_weights(self, model: Any, gather: Gather | None = None) -> None:
        ...

    def close(self) -> None:
        ...


def response_mask(responses: torch.Tensor, eos_ids: int | Sequence[int],
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut generated tokens at the first EOS, any id of `eos_ids` (one int or several).

    responses: (B, R) long as returned by generate (anything after the EOS is filler).
    Returns (responses with everything after the first EOS set to pad, mask (B, R) float with 1 up
    to and including the first EOS, has_eos (B,) bool).
    """
    ids = (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
    is_eos = torch.isin(responses, torch.tensor(ids, dtype=responses.dtype, device=responses.device))
    before_or_at = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0  # no EOS strictly before t
    mask = before_or_at.float()
    cleaned = torch.where(before_or_at, responses, torch.full_like(responses, pad_id))
    return cleaned, mask, is_eos.any(dim=1)


def rollout_batch(prompt_ids: Sequence[Sequence[int]], generation: Generation,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """The rollout batch of prompts and their responses, the layout every stage scores and trains on.

    Returns input_ids (B, P+R) `[left-padded prompt | right-padded response]`, attention_mask (B, P+R) long
    (response part 1 up to and including the first EOS), P (the longest prompt) and has_eos (B,) bool, on the
    responses' device. R is the longest response (at least 1): the all-pad columns after it are dropped.
    """
    prompts = pad_sequences(prompt_ids, pad_id, side="left")
    dev = generation.responses.device
    prompt_ids_t, prompt_mask = prompts["input_ids"].to(dev), prompts["attention_mask"].to(dev)
    R = max(int(generation.mask.sum(1).max().item()), 1)  # drop all-pad columns
    input_ids = torch.cat([prompt_ids_t, generation.responses[:, :R]], dim=1)
    attention_mask = torch.cat([prompt_mask, generation.mask[:, :R].long()], dim=1)
    return input_ids, attention_mask, prompt_ids_t.shape[1], generation.has_eos


def join_rollout_batches(parts: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
                         pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rollout batches (`rollout_batch`'s input_ids (B_i, P_i+R_i), attention_mask, P_i) as one: each prompt part
    left-padded and each response part right-padded to the widest (pad_id, attention 0), rows in order; then the
    columns no row uses are dropped (prompt columns on the left; response columns on the right, keeping R >= 1).
    Returns input_ids (ΣB_i, P+R), attention_mask (ΣB_i, P+R) long, P. Raises ValueError when `parts` is empty."""
    if not parts:
        raise ValueError("join_rollout_batches: no batch to join")
    P = max(p for _, _, p in parts)
    R = max(ids.shape[1] - p for ids, _, p in parts)
    ids, am = [], []
    for x, m, p in parts:
        pad = (P - p, R - (x.shape[1] - p))
        ids.append(torch.nn.functional.pad(x, pad, value=pad_id))
        am.append(torch.nn.functional.pad(m, pad, value=0))
    input_ids, attention_mask = torch.cat(ids), torch.cat(am)
    used_p = int(attention_mask[:, :P].sum(1).max().item()) if P else 0
    used_r = max(int(attention_mask[:, P:].sum(1).max().item()), 1)
    return (input_ids[:, P - used_p:P + used_r], attention_mask[:, P - used_p:P + used_r], used_p)


class PerRowSampler(LogitsProcessor):
    """Sampling with one random stream per row, run inside HF `generate`'s greedy loop (Gumbel-max).

    argmax(logits / τ + g), with g ~ Gumbel(0, 1) i.i.d. and τ the temperature (`ppo.temperature`), is a
    sample from softmax(logits / τ) (Gumbel 1954; Maddison et al. 2014); tokens a top-p filter set to -inf
    are never drawn. Each row draws its noise from
    its own `torch.Generator` on the scores' device, so a prompt's sample depends only on its seed, not on
    which rows share its batch, the chunk size or the number of ranks (up to float differences in the
    logits). The noise is float32: u in [2^-24, 1 - 2^-24] truncates the Gumbel tail at ~16.6 (an event of
    probability ~6e-8 per token and row).

    seeds: one int per row of the `generate` batch. Scores (B, V) float; returns scores + noise, same shape.
    """

    def __init__(self, seeds: Sequence[int]) -> None:
        self.seeds = [int(s) for s in seeds]
        self.generators: list[torch.Generator] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"PerRowSampler: {scores.shape[0]} rows but {len(self.seeds)} seeds")
        if not self.generators:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        V, dev = scores.shape[-1], scores.device
        u = torch.stack([torch.rand(V, generator=g, device=dev) for g in self.generators])
        u = u.clamp(2.0**-24, 1.0 - 2.0**-24)
        return scores + (-torch.log(-torch.log(u))).to(scores.dtype)


class RowStop(StoppingCriteria):
    """HF `generate`'s per-row stop for `Sampling.stop`: row b (row `first + b` of the engine's call) is done once
    `stop(first + b, its response ids so far)` is true; `lengths[b]` is then its response's length (None: it ran
    on). Rows that sampled an EOS are not asked again. P: the prompt columns of `generate`'s input ids."""

    def __init__(self, stop: Callable[[int, Sequence[int]], bool], first: int, rows: int, P: int,
                 eos_ids: Sequence[int]) -> None:
        self.stop, self.first, self.P, self.eos_ids = stop, first, P, set(eos_ids)
        self.lengths: list[int | None] = [None] * rows

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        for b, length in enumerate(self.lengths):
            ids = input_ids[b, self.P:].tolist()
            if length is None and not self.eos_ids.intersection(ids) and self.stop(self.first + b, ids):
                self.lengths[b] = len(ids)
        return torch.tensor([n is not None for n in self.lengths], dtype=torch.bool, device=input_ids.device)


class HFGenerator:
    """`rollout.engine=hf`: HF `generate` (KV cache) on the live model, one random stream per prompt.

    Greedy decoding over temperature- and top-p-warped scores plus each row's Gumbel noise (`PerRowSampler`)
    is sampling; `chunk` prompts per `generate` call (the samples do not depend on it), under `precision`'s
    autocast (`engine.autocast`). The model's own `generation_config` (repetition penalty, suppressed tokens,
    beams...) is set aside for the call. Gives no log-probs (`Generation.logprobs` is None).
    """

    def __init__(self, precision: str, chunk: int = 32) -> None:
        self.precision, self.chunk = precision, int(chunk)
        self.lm: Any = None
        self.sync_seconds = 0.0  # nothing is copied
        self.own_weights = False  # samples from the live module: under ZeRO-3, inside the full weights' gather
        self.probes = False  # nothing is pushed, so nothing to check
        self.tensors_changed = None  # nor counted

    def update_weights(self, model: Any, gather: Gather | None = None) -> None:
        """Sample from `model` (a causal LM) from now on: the module itself, nothing is copied (`gather` unused)."""
        self.lm = model

    def close(self) -> None:
        """Let go of the model."""
        self.lm = None

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], sampling: Sampling) -> Generation:
        """One response per prompt (see `Generator`): responses (B, max_new_tokens), on `engine.device()`."""
        if self.lm is None:
            raise RuntimeError("HFGenerator.generate before update_weights(model)")
        seeds = [int(s) for s in seeds]
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"HFGenerator.generate: {len(seeds)} seeds for {len(prompt_ids)} prompts")
        lm, chunk, n = self.lm, self.chunk, sampling.max_new_tokens
        dev = engine.device()
        prompts = pad_sequences(prompt_ids, sampling.pad_id, side="left")
        ids, am = prompts["input_ids"].to(dev), prompts["attention_mask"].to(dev)
        P = ids.shape[1]
        # greedy decoding over warped, noised scores == sampling
        gen_config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=list(sampling.eos_ids),
                                      pad_token_id=sampling.pad_id, use_cache=True)
        warpers = ([TemperatureLogitsWarper(sampling.temperature)]
                   + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1.0 else []))
        was_training, model_gen_config = lm.training, lm.generation_config
        lm.eval()
        # HF fills every option our config leaves unset from the model's own generation_config (repetition
        # penalty, suppressed tokens, beams...): a blank one for the duration, so nothing but ours applies
        lm.generation_config = GenerationConfig()
        outs, stops = [], []
        try:
            with engine.autocast(self.precision):
                for i in range(0, len(seeds), chunk):
                    processors = LogitsProcessorList([*warpers, PerRowSampler(seeds[i:i + chunk])])
                    stop = RowStop(sampling.stop, i, len(seeds[i:i + chunk]), P, sampling.eos_ids) \
                        if sampling.stop is not None else None
                    out = lm.generate(input_ids=ids[i:i + chunk], attention_mask=am[i:i + chunk],
                                      generation_config=gen_config, logits_processor=processors,
                                      stopping_criteria=StoppingCriteriaList([stop] if stop else []))
                    stops += stop.lengths if stop else [None] * len(seeds[i:i + chunk])
                    resp = out[:, P:]
                    if resp.shape[1] < n:  # every chunk to the same width
                        resp = torch.nn.functional.pad(resp, (0, n - resp.shape[1]), value=sampling.pad_id)
                    outs.append(resp)
        finally:
            lm.generation_config = model_gen_config
            lm.train(was_training)
        responses, mask, has_eos = response_mask(torch.cat(outs), sampling.eos_ids, sampling.pad_id)
        for b, length in enumerate(stops):  # a row stopped by `sampling.stop`: nothing after it is its
            if length is not None:
                responses[b, length:], mask[b, length:] = sampling.pad_id, 0.0
        return Generation(responses, mask, has_eos, None)


ENGINE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""`rollout.engine_dtype`'s values but `auto` (`config.ENGINE_DTYPES`), as torch dtypes."""


def resolve_dtype(precision: str, setting: str = "auto", score_precision: str | None = None) -> torch.dtype:
    """The dtype an engine with its own copy of the weights (`vllm`) holds them and computes in.

    setting: `rollout.engine_dtype`: `fp32` or `bf16` as named; `auto`: the dtype of the scoring passes the samples
    are trained against (`score_precision`, train-ppo's `engine.scoring_precision`; None where nothing trains on
    them, as in eval: `precision`), so fp32 under `precision=fp32` and beside bf16-autocast's fp32 passes, where
    the engine samples exactly the distribution they score and `experiment=grpo` learned as well as on `hf`
    (docs/results.md, "Sampling with vLLM"; a bf16 engine there did not), and bf16 beside bf16 passes. Raises
    KeyError on another setting (config validation refuses it first).
    """
    if setting == "auto":
        setting = "fp32" if (score_precision or precision) == "fp32" else "bf16"
    return ENGINE_DTYPES[setting]


def dtype_setting(dtype: torch.dtype) -> str:
    """The `rollout.engine_dtype` value naming an engine's dtype (`fp32`, `bf16`), as start tables and eval.json
    show it. Raises StopIteration for another dtype."""
    return next(k for k, v in ENGINE_DTYPES.items() if v == dtype)


def sample_responses(
    lm: Any, prompts: list[dict[str, Any]], pad_id: int, eos_ids: int | Sequence[int], max_new_tokens: int,
    temperature: float, top_p: float, precision: str, chunk: int = 32, seeds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Sample one response per prompt from `lm` in one call: `HFGenerator` then `rollout_batch`.

    prompts: dicts with `prompt_ids`. Returns input_ids (B, P+R) `[left-padded prompt | right-padded
    response]`, attention_mask (B, P+R) (response part 1 up to and including the first EOS), P, and
    has_eos (B,) bool. R is the longest response (<= max_new_tokens).

    `eos_ids`: the ids that end a response (`eos.eos_ids`; one int is the set of that id alone). `seeds`: one int
    per prompt (see `Generator`); without them, they are drawn from torch's global generator.
    """
    if seeds is None:
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
    generator = HFGenerator(precision, chunk)
    generator.update_weights(lm)
    prompt_ids = [p["prompt_ids"] for p in prompts]
    eos = (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
    sampling = Sampling(eos_ids=eos, pad_id=pad_id, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p)
    return rollout_batch(prompt_ids, generator.generate(prompt_ids, seeds, sampling), pad_id)
