"""Sampling responses for a rollout or an eval: per-prompt seeds, one random stream per row inside HF
`generate`, and the cut at the first EOS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_cli import engine
from rlhf_cli.data import PromptCollator


def response_mask(responses: torch.Tensor, eos_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@torch.no_grad()
def sample_responses(
    lm: Any, prompts: list[dict[str, Any]], pad_id: int, eos_id: int, max_new_tokens: int, temperature: float,
    top_p: float, precision: str, chunk: int = 32, seeds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
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
