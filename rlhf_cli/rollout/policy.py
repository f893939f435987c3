"""The forwards of a policy and its critic over `[prompt | response]` batches: response log-probs at the
sampling temperature (with entropy and a shared value head's values), a separate critic's values, and the
per-sequence KL of two policies. Also the model wrappers these forwards read: the shared value head, a LoRA
policy's reference (its adapters off) and dropout switched off."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlhf_cli import engine
from rlhf_cli.core import entropy_from_logits, kl_estimate, logprobs_from_logits
from rlhf_cli.models import (
    ADAPTER_DIR,
    attention_tokens,
    has_lora,
    merged_state_dict,
    new_scalar_head,
    response_values,
    save_adapter,
    save_hf,
    trunk_hidden,
    without_adapters,
)
from rlhf_cli.rollout.packing import PackedRollout, pack_rollout, use_packing


class PolicyWithValueHead(torch.nn.Module):
    """`ppo.critic=shared`: the policy's trunk carries a scalar value head `score` next to its LM head."""

    def __init__(self, lm: torch.nn.Module, seed: int) -> None:
        super().__init__()
        self.lm = lm
        self.score = new_scalar_head(lm.config.get_text_config().hidden_size, seed, next(lm.parameters()))

    @property
    def config(self) -> Any:
        return self.lm.config


def unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def has_value_head(model: Any) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) is a policy carrying a shared value head."""
    return isinstance(unwrap(model), PolicyWithValueHead)


def lm_of(model: Any) -> Any:
    model = unwrap(model)
    return model.lm if isinstance(model, PolicyWithValueHead) else model


class FrozenWithoutAdapters:
    """A LoRA model with its adapters off (`models.without_adapters`), read as an `engine.FrozenModel` is
    (`module`, `autocast()`, `on_device()`): the reference policy of a LoRA run (the trained policy's own
    weights), or the reward model under a LoRA critic grown from it (the critic's own weights, its head the
    original that peft keeps). No second copy of the base weights is held; the passes run under no_grad as that
    model's do, and it is never offloaded (its weights are the trained model's)."""

    def __init__(self, model: torch.nn.Module, precision: str) -> None:
        self.module = without_adapters(model)
        self.precision = precision

    def autocast(self) -> contextlib.AbstractContextManager:
        return engine.autocast(self.precision)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[Any]:
        yield self.module


def save_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer: Any, out: Path,
               base: str | None = None, **kwargs: Any) -> None:
    """`models.save_hf` of a trained model; a LoRA one (`models.has_lora`) is saved as its merged plain weights
    (`models.merged_state_dict`), its adapter beside them in `out/adapter/` (peft's format, `base` recorded as
    the base model). `kwargs` go to `save_hf` (`extra_config`)."""
    if not has_lora(model):
        save_hf(model, tokenizer, out, state_dict=state_dict, **kwargs)
        return
    save_hf(model, tokenizer, out, state_dict=merged_state_dict(model, state_dict), **kwargs)
    save_adapter(model, state_dict, out / ADAPTER_DIR, base)


def save_policy(
    final: Path,
    policy: torch.nn.Module,
    policy_sd: dict[str, torch.Tensor],
    tokenizer: Any,
    extra_config: dict[str, Any],
    critic: torch.nn.Module | None = None,
    critic_sd: dict[str, torch.Tensor] | None = None,
    base: str | None = None,
    critic_base: str | None = None,
) -> None:
    """Write a trained policy to `final` in HF format (rank 0; the state dicts are consolidated ones).

    A `PolicyWithValueHead` is saved as its causal LM plus `value_head.safetensors` (`score.weight`), so that
    `final/` loads with `AutoModelForCausalLM`; a separate critic goes to `final/critic/` (written beside
    `final/` first, then moved in, so a crash leaves no half-written critic inside `final/`).
    `extra_config` is added to the policy's config.json (the `rlhf_*` lineage keys). LoRA models are merged, and
    their adapters saved in `final/adapter/` and `final/critic/adapter/` (`save_model`; `base`, `critic_base`: the
    models they adapt, recorded in each adapter's config).
    """
    if isinstance(policy, PolicyWithValueHead):
        lm_sd = {k[len("lm."):]: v for k, v in policy_sd.items() if k.startswith("lm.")}
        save_model(policy.lm, lm_sd, tokenizer, final, base, extra_config=extra_config)
        save_file({"score.weight": policy_sd["score.weight"].contiguous()}, str(final / "value_head.safetensors"))
    else:
        save_model(policy, policy_sd, tokenizer, final, base, extra_config=extra_config)
    if critic is not None:
        staging = final.parent / "critic"
        save_model(critic, critic_sd, tokenizer, staging, critic_base)
        if (final / "critic").exists():
            shutil.rmtree(final / "critic")
        os.replace(staging, final / "critic")


def response_hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                    packing: bool | PackedRollout = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trunk's last hidden states that read the response entries, (B, R, H): entry t is the position of the
    token before response token t (the prompt's last token for t = 0), as `policy_forward` and `critic_values`
    read them. With `packing` (and a model that takes a custom mask: `rollout.use_packing`) the batch runs packed
    (`rollout.pack_rollout`: a shared prompt once, no padding between sequences) and the second result is the
    (B, R) bool mask of entries computed from real tokens; else the padded forward and None. `packing` may be
    the batch's `PackedRollout`, built once for several passes (it must be `pack_rollout` of these rows; it is
    moved to the batch's device for the call)."""
    if use_packing(model, _wants_packing(packing)):
        pk = packing.to(input_ids.device) if isinstance(packing, PackedRollout) else pack_rollout(
            input_ids, attention_mask, prompt_len, attention_tokens=attention_tokens(model))
        hidden = trunk_hidden(model, pk.packed.input_ids, pk.packed.allowed, pk.packed.position_ids)
        return hidden[pk.source[..., 0], pk.source[..., 1]], pk.computed
    return trunk_hidden(model, input_ids, attention_mask)[:, prompt_len - 1:-1], None


def _wants_packing(packing: bool | PackedRollout) -> bool:
    return isinstance(packing, PackedRollout) or bool(packing)


def _zero_outside(x: torch.Tensor | None, computed: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or computed is None else torch.where(computed, x, torch.zeros_like(x))


def policy_forward(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, temperature: float,
    with_entropy: bool = False, with_values: bool = False, packing: bool | PackedRollout = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs of the response tokens under the policy at `temperature`.

    input_ids, attention_mask: (B, P+R). Returns logprobs (B, R) float32, entropy (B, R) float32 nats
    (None unless `with_entropy`), and, for a shared critic, values (B, R) float32 or None. Only the R response
    positions go through the LM head; position ids count real tokens, so padding side does not matter.
    `entropy_grad=False` computes the entropy outside the autograd graph (a statistic only: `ppo.c2=0`), sparing
    the backward its (B, R, V) softmax. `packing`
    (`data.packing`, or the batch's `PackedRollout`) runs the batch packed (`response_hidden`): the same
    numbers to float rounding on every entry the padded forward reads from a real token, 0 on the rest (entries
    after a response's EOS, which every loss masks).
    """
    lm = lm_of(model)
    hidden, computed = response_hidden(lm, input_ids, attention_mask, prompt_len, packing)  # (B, R, H)
    logits = lm.lm_head(hidden).float() / temperature  # (B, R, V)
    labels = input_ids[:, prompt_len:]
    logprobs = logprobs_from_logits(logits, labels)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    values = None
    if with_values:
        values = unwrap(model).score(hidden).squeeze(-1).float()
    return _zero_outside(logprobs, computed), _zero_outside(entropy, computed), _zero_outside(values, computed)


@torch.no_grad()
def sequence_kl(policy: Any, reference: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                temperature: float, batch_size: int, precision: str,
                estimators: Sequence[str] = ("k1",), packing: bool = False) -> dict[str, torch.Tensor]:
    """KL(policy ‖ reference) per sequence, nats: {estimator: (B,) float32}, the per-token estimate (`core.
    kl_estimate`) summed over each response's real tokens, on tokens the policy sampled at `temperature`.

    input_ids, attention_mask: (B, P+R) laid out as `policy_forward` reads them; both models run `batch_size`
    rows at a time under `engine.autocast(precision)`, packed or not as `packing` says.
    """
    out: dict[str, list[torch.Tensor]] = {k: [] for k in estimators}
    for i in range(0, input_ids.shape[0], batch_size):
        ids, am = input_ids[i:i + batch_size], attention_mask[i:i + batch_size]
        with engine.autocast(precision):
            lp, _, _ = policy_forward(policy, ids, am, prompt_len, temperature, packing=packing)
            ref_lp, _, _ = policy_forward(reference, ids, am, prompt_len, temperature, packing=packing)
        mask = am[:, prompt_len:].float()
        for k in estimators:
            out[k].append((kl_estimate(lp, ref_lp, k) * mask).sum(1))
    return {k: torch.cat(v) for k, v in out.items()}


def critic_values(critic: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  packing: bool | PackedRollout = False) -> torch.Tensor:
    """(B, R) float32 values of a separate critic, aligned with `policy_forward`'s logprobs: V(s_t) read at the
    position before response token t, 0 where that position is padding (`models.response_values`); packed or not
    as `packing` says (`response_hidden`), with the same numbers to float rounding."""
    critic = unwrap(critic)
    if not use_packing(critic, _wants_packing(packing)):
        return response_values(critic, input_ids, attention_mask, prompt_len)
    hidden, computed = response_hidden(critic, input_ids, attention_mask, prompt_len, packing)
    return _zero_outside(critic.score(hidden).squeeze(-1).float(), computed)


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
