"""Scalar-head models: the reward model and the critic.

A scalar model is an LM trunk whose LM head is replaced by `score = Linear(hidden, 1, bias=False)`:
exactly transformers' `*ForSequenceClassification` layout with `num_labels=1`, so a saved reward
model loads with plain `AutoModelForSequenceClassification.from_pretrained(dir)`.

    load_scalar_model(source, precision, seed, init_from=None)   build or load one
    scalar_skeleton(like, precision)                             its shapes only (meta device), for size estimates
    new_scalar_head(hidden, seed, like)                           a seeded float32-computing head `score`
    token_values(model, input_ids, attention_mask)                head output at every position (B, T)
    sequence_scores(model, input_ids, attention_mask)             head output at the last real token (B,)
    scores_at(model, input_ids, attention_mask, index, position_ids=None)    head output at given positions
    response_values(model, input_ids, attention_mask, response_start)   critic values (B, T_resp)
    trunk_hidden(model, input_ids, attention_mask)                last hidden states (B, T, H)

Padding. Positions come from the attention mask, `(attention_mask.cumsum(-1) - 1).clamp(min=0)`,
and the last real token is found from the mask, never from the pad id. So left and right padding
give the same numbers, and a pad id equal to the EOS id (SmolLM2's tokenizer ships that way) cannot
move the score off the EOS. Our tokenizers use a pad distinct from EOS anyway (`fix_pad_token`),
which is what transformers' own pooling (rightmost token != pad id) needs to agree with us on
right-padded input.

Alignment with log-probs (critic). For a batch laid out as `[prompt | response]` with every
response starting at column P = `response_start` (prompts left-padded to P, responses
right-padded), the policy's log-prob of response token t is read from the logits at position
P-1+t (logits[:, i] predict input_ids[:, i+1]). The critic's value of the state before response
token t is the head output at the same position P-1+t:

    values   = token_values(critic, ids, mask)[:, P-1:-1]            # (B, T-P) == response_values(...)
    logprobs = log_softmax(policy(ids, mask).logits[:, P-1:-1]).gather(-1, ids[:, P:, None])[..., 0]

so values[:, t] = V(s_t), the state after the prompt and response tokens < t, and logprobs[:, t] is
the log-prob of the action taken from that state.

Precision. The head always computes in float32 (`Float32Head`), whatever `precision` says: under
bf16 autocast or with bf16 weights a bf16 head output keeps 8 significant bits, so nearby scores
collapse onto the bf16 grid (the demo reward model gave 68 distinct scores over 256 sequences, and
tied pairs). The trunk keeps the run's precision.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch

from rlhf_cli.models.checkpoint import is_scalar_model_dir
from rlhf_cli.models.loading import (
    as_model_config,
    configure_training,
    is_checkpointing,
    load_causal_lm,
    resolve_hf_dir,
    torch_dtype_for,
    with_attention_fallback,
)

log = logging.getLogger(__name__)


class Float32Head(torch.nn.Linear):
    """`nn.Linear` that computes in float32 whatever autocast or its weight's dtype say.

    x: (..., in_features) any float dtype. Returns (..., out_features) float32. Input, weight and bias
    are upcast (exact) and autocast is off for this one matmul; the parameters keep their own dtype
    (bfloat16 under `precision=bf16`). Call it as a module, never read `.weight` directly: under
    DeepSpeed ZeRO-3 the forward hooks gather the partitioned weight before `forward` runs. State-dict
    keys are those of `nn.Linear`, so checkpoints load with plain transformers classes.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


def float32_head(linear: torch.nn.Linear) -> Float32Head:
    """The same parameters behind a `Float32Head` (no copy); a Float32Head is returned as is."""
    if isinstance(linear, Float32Head):
        return linear
    head = Float32Head(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    head.weight = linear.weight
    if linear.bias is not None:
        head.bias = linear.bias
    head.train(linear.training)
    return head


def new_scalar_head(hidden: int, seed: int, like: torch.Tensor) -> Float32Head:
    """A new head `Linear(hidden, 1, bias=False)` computing in float32, weight ~ N(0, 1/(hidden+1)) drawn
    from a CPU generator seeded with `seed` (the same numbers on any device), on `like`'s device and dtype.
    The one initialisation of every scalar head: reward model, separate critic and `ppo.critic=shared`."""
    head = Float32Head(hidden, 1, bias=False, device=like.device, dtype=like.dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden, generator=gen) / math.sqrt(hidden + 1))
    return head


def load_scalar_model(
    source: Any = None,
    precision: str = "fp32",
    seed: int = 0,
    init_from: Any = None,
) -> Any:
    """Build or load a scalar-head model (reward model or critic).

    `source` is a ModelConfig or a path / hub id:
      - a saved scalar model (a dir whose config has a `*ForSequenceClassification` architecture;
        a run dir or its `final/` works too) is loaded as is, head included;
      - anything else names a causal LM (`load_causal_lm`): its trunk is kept, its LM head dropped,
        and a new head `score` initialised N(0, 1/(hidden+1)) from a generator seeded with `seed`.
    `init_from`, an in-memory model, replaces `source` (which may then be None): a causal LM gives
    a copy of its trunk and a new head; a scalar model is copied whole. The original is untouched.

    Weights get `torch_dtype_for(precision)`; the head `score` is a `Float32Head` (float32 output
    under every precision). The result has `config.num_labels == 1` and `config.pad_token_id` set
    (from the tokenizer, via the causal LM's config).
    """
    dtype = torch_dtype_for(precision)
    if init_from is not None:
        if _is_scalar(init_from):
            model = copy.deepcopy(init_from).to(dtype)
            model.score = float32_head(model.score)
            log.info("scalar model: copied from an in-memory %s", type(init_from).__name__)
            return model
        return scalar_from_causal_lm(copy.deepcopy(init_from).to(dtype), seed)
    if source is None:
        raise ValueError("load_scalar_model needs a source (ModelConfig or path) or init_from")
    cfg = as_model_config(source)
    if cfg.init != "random" and cfg.name_or_path and is_scalar_model_dir(cfg.name_or_path):
        from transformers import AutoModelForSequenceClassification

        path = resolve_hf_dir(cfg.name_or_path)
        model = with_attention_fallback(lambda a: AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, attn_implementation=a), cfg.attn_implementation, path)
        if model.config.num_labels != 1:
            raise ValueError(f"'{path}' has {model.config.num_labels} labels; a reward model or critic has 1")
        model.score = float32_head(model.score)
        configure_training(model, cfg.gradient_checkpointing)
        log.info("scalar model: loaded %s", path)
        return model
    return scalar_from_causal_lm(load_causal_lm(cfg, precision, seed), seed)


def scalar_skeleton(like: Any, precision: str = "fp32") -> Any:
    """A scalar model's shapes without its weights: the `*ForSequenceClassification` model of `like`'s
    architecture (an in-memory causal LM or scalar model, or a local dir or hub id of either, read from its
    config.json) with `num_labels=1`, every tensor on the meta device in `torch_dtype_for(precision)` and
    trainable. Nothing is allocated or loaded: for counting what a model to be built will train and save
    (`rlhf train-ppo --dry-run`'s critic). Raises ValueError for an architecture without such a class."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    config = copy.deepcopy(like.config) if hasattr(like, "config") else AutoConfig.from_pretrained(
        resolve_hf_dir(str(like)))
    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(config), None)
    if cls is None:
        raise ValueError(f"{type(config).__name__} has no AutoModelForSequenceClassification class")
    config.num_labels = 1
    with torch.device("meta"):
        model = cls(config).to(torch_dtype_for(precision))
    model.score = float32_head(model.score)
    return model.requires_grad_(True)


def scalar_from_causal_lm(causal: Any, seed: int = 0) -> Any:
    """Turn `causal` (consumed: its trunk is moved, not copied) into its `*ForSequenceClassification`
    counterpart with a new seeded head `score`; the LM head is dropped."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    config = causal.config  # mutated in place: the trunk's modules hold this same object
    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(config), None)
    if cls is None:
        raise ValueError(f"{type(config).__name__} has no AutoModelForSequenceClassification class")
    config.num_labels = 1
    config.architectures = [cls.__name__]
    config.problem_type = "regression"
    with torch.device("meta"):  # skeleton only; trunk and head are put in below
        model = cls(config)
    trunk = getattr(causal, causal.base_model_prefix)
    setattr(model, model.base_model_prefix, trunk)
    model.score = new_scalar_head(config.get_text_config().hidden_size, seed, next(trunk.parameters()))
    model.train(causal.training)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"tensors left on the meta device: {left}"
    if is_checkpointing(causal):
        configure_training(model, True)
    log.info("scalar model: %s trunk with a new head (seed %d)", type(causal).__name__, seed)
    return model


def _is_scalar(model: Any) -> bool:
    return hasattr(model, "score") and type(model).__name__.endswith("ForSequenceClassification")


def trunk_hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states (B, T, H) of the trunk of a causal LM or a scalar model (wrapped or not).

    attention_mask: (B, T) 1 = real token, 0 = padding; position ids are then counted over real tokens only
    (`(attention_mask.cumsum(-1) - 1).clamp(min=0)`: the one position rule of the package, so the padding
    side never changes a number), and `position_ids` must be None. Or a packed layout: a (B, 1, T, T) bool
    mask ([b, 0, q, k] = query q may attend key k, at least one True per query row) with its (B, T)
    `position_ids`, as `data.PackedPairCollator` builds; see `custom_mask_support` for the attention
    implementations that take one. Raises ValueError for a 4D mask without position ids or on an
    attention implementation that cannot take it.
    """
    model = getattr(model, "module", model)  # DeepSpeed / DDP wrapper
    if attention_mask.dim() == 4:
        if position_ids is None:
            raise ValueError("a 4D attention mask needs explicit position_ids")
        attention_mask = _attention_bias(model, attention_mask)
    elif position_ids is not None:
        raise ValueError("position_ids are counted from a 2D attention mask; pass them only with a 4D mask")
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    trunk = getattr(model, model.base_model_prefix)
    out = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def custom_mask_support(model: Any) -> str | None:
    """None when `model` takes a custom 4D mask: its attention implementation is `sdpa` (a boolean mask) or
    `eager` (converted to an additive one, since eager adds the mask to the scores and a boolean mask would be
    added as 0/1, silently wrong), and it has no sliding-window layers (Mistral, Gemma 2/3, Qwen2 with
    `use_sliding_window`), whose per-layer window mask a custom mask would replace. Else the reason, for the
    caller's one log line."""
    config = getattr(model, "module", model).config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attn_implementation={impl} takes no custom attention mask (sdpa and eager do)"
    text = config.get_text_config()
    sliding = any("sliding" in str(t) for t in (getattr(text, "layer_types", None) or []))
    if sliding or (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)):
        return (f"{text.model_type} has sliding-window attention layers, whose own mask a custom one would replace "
                f"(sliding_window={getattr(text, 'sliding_window', None)})")
    return None


def attention_tokens(model: Any) -> float | None:
    """The number of keys at which one query's attention costs what its linear layers cost, per decoder layer:
    (linear weights per layer) / (2 × heads × head_dim), from the model's config, since a query over L keys
    takes 4·L·heads·head_dim FLOPs (QKᵀ and AV) and a position 2 per linear weight (attention projections with
    `num_key_value_heads`, a gated MLP of `intermediate_size`: Llama and its kin; an ungated MLP is overstated by
    a third, which only moves the row widths chosen). SmolLM2-135M: 3072. Used to choose packed row widths
    (`rlhf_cli.data.row_width`), never for a number a run reports. None when the config lacks a field or has zeros."""
    try:
        text = getattr(model, "module", model).config.get_text_config()
        hidden, heads, inner = int(text.hidden_size), int(text.num_attention_heads), int(text.intermediate_size)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    width = heads * head_dim
    if min(hidden, width, kv, inner) <= 0:
        return None
    weights = 2 * hidden * width + 2 * hidden * kv * head_dim + 3 * hidden * inner
    return weights / (2 * width)


def _attention_bias(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """The 4D mask `allowed` (bool, True = attend) as `model`'s attention implementation reads it."""
    reason = custom_mask_support(model)
    if reason is not None:
        raise ValueError(reason)
    if allowed.dtype != torch.bool:
        raise ValueError(f"a 4D attention mask must be boolean (got {allowed.dtype})")
    if model.config._attn_implementation == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def _score(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Head output (..., ) float32 of hidden states (..., H); the head computes in float32 itself."""
    return getattr(model, "module", model).score(hidden).squeeze(-1)


def token_values(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Head output at every position.

    input_ids, attention_mask: (B, T), mask 1 = real token, 0 = padding (left, right or both).
    Returns (B, T) float32; entry [b, i] is the scalar read after tokens 0..i of row b (the value of
    the state "prefix up to i"); 0 at padding positions. Differentiable.
    """
    values = _score(model, trunk_hidden(model, input_ids, attention_mask))  # (B, T)
    return torch.where(attention_mask.bool(), values, torch.zeros_like(values))


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last real token (rightmost 1 in the mask); any padding side."""
    T = attention_mask.shape[-1]
    positions = torch.arange(T, device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Score of each sequence: the head output at its last real token (the EOS), (B,) float32.

    The index comes from `attention_mask`, not from the pad id, so pad == eos cannot shift it.
    Equals `AutoModelForSequenceClassification(...)(input_ids, attention_mask).logits[:, 0]` on
    right-padded input whose pad id is not used inside the text. Differentiable.
    """
    last = last_token_index(attention_mask)  # (B,)
    return scores_at(model, input_ids, attention_mask, torch.stack([torch.arange(len(last), device=last.device),
                                                                    last], -1))


def scores_at(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Head outputs (N,) float32 read at N (row, column) positions `index` (N, 2) long of one trunk forward
    over `input_ids` (B, T); the mask and position ids as `trunk_hidden` takes them (2D, or a packed 4D mask
    with position ids). Differentiable."""
    hidden = trunk_hidden(model, input_ids, attention_mask, position_ids)  # (B, T, H)
    return _score(model, hidden[index[:, 0], index[:, 1]])


def response_values(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int
) -> torch.Tensor:
    """Critic values aligned with the response tokens' log-probs, (B, T - response_start) float32.

    input_ids, attention_mask: (B, T) laid out as [prompt | response] with every response starting
    at column `response_start` (P >= 1). values[:, t] = V(state before response token t) = the head
    output at position P-1+t, the position whose logits give that token's log-prob. Entries whose
    response token is padding are 0 only if position P-1+t is padding too; mask them with the
    rollout's action mask (`rollout.Episodes.action_mask`, 1 = a token the policy sampled).
    """
    if not 1 <= response_start < input_ids.shape[1]:
        raise ValueError(f"response_start={response_start} must be in [1, T={input_ids.shape[1]})")
    return token_values(model, input_ids, attention_mask)[:, response_start - 1 : -1]


__all__ = [
    "Float32Head",
    "float32_head",
    "new_scalar_head",
    "load_scalar_model",
    "scalar_from_causal_lm",
    "token_values",
    "sequence_scores",
    "response_values",
    "trunk_hidden",
    "last_token_index",
    "custom_mask_support",
    "scores_at",
]
