"""Tiny random configs of the causal-LM families users bring (issue 41), over the SmolLM2 tokenizer's vocabulary:
hidden 64, 2 layers, heads of 16, so a family's own code paths (absolute positions, biases, soft-capping, fused
projections, tied or untied heads) run in seconds on a CPU.

    FAMILIES                     the families' names
    tiny_config(family, tok)     the transformers config of one (or of "llama", the family every other test uses)
    save_tiny(family, tok, out)  a seeded random causal LM of that config and the tokenizer, saved to `out`
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HIDDEN, LAYERS, HEAD_DIM, FFN, POSITIONS = 64, 2, 16, 128, 512


def tiny_config(family: str, tok: Any, head_dim: int = HEAD_DIM) -> Any:
    """The config of a tiny random `family` model over `tok`'s vocabulary and special ids; `head_dim` 32 gives 2
    heads (the smallest head size vLLM's CPU attention serves)."""
    import transformers as tf

    heads = HIDDEN // head_dim
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=POSITIONS, **ids)
    if family == "llama":
        return tf.LlamaConfig(**llama_like, head_dim=head_dim, tie_word_embeddings=True)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=heads, n_positions=POSITIONS, n_inner=FFN, **ids)
    if family == "opt":
        return tf.OPTConfig(hidden_size=HIDDEN, ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=heads,
                            max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN, **ids)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                num_attention_heads=heads, max_position_embeddings=POSITIONS, rotary_pct=0.25,
                                tie_word_embeddings=False, **ids)
    if family == "qwen2":
        return tf.Qwen2Config(**llama_like, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**llama_like, head_dim=head_dim, tie_word_embeddings=True)
    if family == "gemma2":
        return tf.Gemma2Config(**llama_like, head_dim=head_dim, sliding_window=8)
    if family == "phi3":
        return tf.Phi3Config(**llama_like, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**llama_like, head_dim=head_dim, sliding_window=None)
    raise ValueError(f"no tiny config for {family!r}")


FAMILIES = ("gpt2", "opt", "gpt_neox", "qwen2", "qwen3", "gemma2", "phi3", "mistral")


def save_tiny(family: str, tok: Any, out: Path, seed: int = 0, head_dim: int = HEAD_DIM) -> Path:
    """A seeded random causal LM of `tiny_config(family, tok, head_dim)` and `tok`, saved to `out` as an HF model dir
    (eager attention while building: every family supports it). Returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, tok, head_dim),
                                                     attn_implementation="eager")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return Path(out)
