"""The one rule by which a run finds the ids that end a response.

The EOS set is the tokenizer's EOS together with every id of the model's `generation_config.eos_token_id`
(an int or a list: Qwen3, Gemma 3 and Phi-3.5 end an assistant turn with an id that is not the tokenizer's EOS,
as `<|end|>` or `<end_of_turn>`). Everything that asks "did the response end?" reads this one set:

    sampling        a response stops at the first id of the set (`rollout.generation.Sampling.eos_ids`)
    masks           the response mask runs up to and including that id; `response/eos_frac`, `ppo.truncated`
                    and `ppo.missing_eos_penalty` count a response as ended when it holds one
    reward model    it reads its score at the tokenizer's EOS (the set's first id): a data response whose text
                    ends in the text of any id of the set is cut there and gets the tokenizer's EOS appended
                    (`data.tokenize.Encoder`), a sampled response that ended with another id of the set is scored
                    with that id read as the tokenizer's EOS (`forwards.batched_scores`), and the exported
                    reward model's chat template ends a conversation the same way (`models.with_scoring_template`)
    saved models    `generation_config.json` lists the whole set, so HF `generate` and vLLM stop where the run did
                    (a reward model's `config.json`, as its `eos_token_id`)

    eos_ids(tokenizer, generation_config)   the set, the tokenizer's EOS first
    eos_texts(tokenizer, ids)                its texts, as a response's or a template's text may end in them
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def eos_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The EOS set: `tokenizer.eos_token_id` first, then the ids of `generation_config.eos_token_id` (None, an int or
    a list of ints), each once, in that order. `generation_config` may be None (a model without one: a reward
    model's sequence-classification class).

    Returns a non-empty tuple of ints; its first id is the tokenizer's EOS when the tokenizer has one.
    Raises ValueError (one line) when neither names an EOS id.
    """
    ids: list[int] = []
    found = [getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)]
    for x in found:
        for i in ([] if x is None else [x] if isinstance(x, int) else list(x)):
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("no EOS id: the tokenizer has no eos_token and the model's generation_config names no "
                         "eos_token_id, so a response could never end")
    return tuple(ids)


def eos_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The texts of an EOS set `ids` (`eos_ids`) as they appear in text: the tokenizer's `eos_token` and the content
    of every id of the set that is a special (added) token, each once, longest first (so that `<|endoftext|>` is
    matched before a shorter text it ends with). Ids that are ordinary tokens are left out: their text also ends
    ordinary words."""
    special = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {special[int(i)].content for i in ids if int(i) in special}
    if getattr(tokenizer, "eos_token", None):
        texts.add(tokenizer.eos_token)
    return sorted(texts, key=len, reverse=True)
