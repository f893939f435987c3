"""Chat rendering, tokenisation and truncation of prompts and responses.

Prompt and response are tokenised SEPARATELY and concatenated, so the boundary is exact: no token
straddles it, and `ids[:len(prompt_ids)]` is the prompt whatever the tokenizer's merges.

    with a chat template (and data.chat_template=true):
        prompt_ids   = tok(apply_chat_template(messages, add_generation_prompt=True))  # ends "<|im_start|>assistant\\n"
        response_ids = tok(assistant content) + [eos]                                  # nothing after the EOS
    raw text:
        prompt_ids   = [bos if the tokenizer adds one] + tok(prompt text)
        response_ids = tok(response text) + [eos]

The template's own text after the EOS (SmolLM2 writes "<|im_end|>\\n") is not part of the response: a
policy stops at the EOS, and the reward model reads its score at the EOS.

Truncation keeps every response whole, with its EOS, and cuts the prompt from the LEFT (keeping a
leading BOS): the prompt gets min(max_prompt_length, max_length - longest response) tokens. A pair is
dropped only when a response alone is longer than max_length, or when chosen and rejected tokenise
identically.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from rlhf_cli.data.formats import IDENTICAL_AFTER_TRUNCATION, RESPONSE_TOO_LONG, Prompt


class Encoder:
    """Renders and tokenises prompts and responses for one tokenizer.

    `use_chat` is true when `chat_template` is requested and the tokenizer has a template.
    """

    def __init__(self, tokenizer: Any, chat_template: bool = True, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.use_chat = bool(chat_template) and bool(getattr(tokenizer, "chat_template", None))
        self.eos_id: int = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no EOS token; responses must end in one")
        self.eos_token: str = tokenizer.eos_token
        bos = tokenizer.bos_token_id
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        self.bos_id: int | None = bos if bos is not None and probe[:1] == [bos] else None
        """The BOS id when the tokenizer prepends one (at most one is kept at the prompt's start)."""

    # -- rendering ----------------------------------------------------------------------------
    def render_prompt(self, prompt: Prompt) -> str:
        """The prompt as the model sees it: the chat template with the generation prompt, or raw text."""
        if self.use_chat:
            messages = list(prompt.messages)
            if self.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
                messages = [{"role": "system", "content": self.system_prompt}] + messages
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt.text

    def response_text(self, raw: str) -> str:
        """The text tokenised for a response: stripped content (chat) or the raw text; a trailing EOS
        string in the data is removed (the EOS id is appended once by `encode_responses`)."""
        text = raw.strip() if self.use_chat else raw
        while self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
            text = text.rstrip() if self.use_chat else text
        return text

    # -- tokenising (batched: one call into the fast tokenizer) ---------------------------------
    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def encode_prompts(self, rendered: Sequence[str]) -> list[list[int]]:
        """Token ids of rendered prompts, with exactly one leading BOS if the tokenizer uses one."""
        out = self._ids(rendered)
        if self.bos_id is not None:
            out = [ids if ids[:1] == [self.bos_id] else [self.bos_id] + ids for ids in out]
        return out

    def encode_responses(self, raws: Sequence[str]) -> list[list[int]]:
        """Token ids of responses (raw form, see formats.py), each ending in exactly one EOS id."""
        return [ids + [self.eos_id] for ids in self._ids([self.response_text(r) for r in raws])]


def truncate_left(ids: list[int], budget: int, bos_id: int | None = None) -> list[int]:
    """The last `budget` tokens of `ids`; a leading BOS stays in front (counted in the budget)."""
    if len(ids) <= budget:
        return ids
    if budget <= 0:
        return []
    if bos_id is not None and ids[:1] == [bos_id]:
        return [bos_id] + (ids[len(ids) - budget + 1:] if budget > 1 else [])
    return ids[len(ids) - budget:]


def fit_pair(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int,
             max_prompt_length: int, bos_id: int | None = None) -> tuple[list[int] | None, str | None]:
    """Fit a tokenised pair into `max_length` (prompt + longer response) and `max_prompt_length`.

    Returns (prompt_ids, None) with the prompt cut from the left as needed, or (None, reason) when the
    pair must be dropped: `response_too_long` (a response alone exceeds max_length) or
    `identical_after_truncation` (chosen and rejected have the same ids). Responses are never cut.
    """
    longest = max(len(chosen_ids), len(rejected_ids))
    if longest > max_length:
        return None, RESPONSE_TOO_LONG
    if chosen_ids == rejected_ids:
        return None, IDENTICAL_AFTER_TRUNCATION
    budget = min(max_prompt_length, max_length - longest)
    return truncate_left(prompt_ids, budget, bos_id), None


def lengths_summary(lengths: Sequence[int]) -> dict[str, int]:
    """{p50, p90, max} of token lengths (nearest-rank percentiles); zeros when empty."""
    if not lengths:
        return {"p50": 0, "p90": 0, "max": 0}
    s = sorted(lengths)

    def rank(q: float) -> int:
        return s[max(0, math.ceil(q * len(s)) - 1)]

    return {"p50": rank(0.5), "p90": rank(0.9), "max": s[-1]}


def last_user_turn(rendered: str) -> str:
    """The readable question inside a chat-rendered prompt: the text after the last `user` header,
    with the template's special tokens removed (raw-text prompts come back unchanged)."""
    parts = re.split(r"<\|im_start\|>user\n|\[INST\]|<start_of_turn>user\n", rendered)
    text = re.sub(r"<\|im_start\|>\w+\n?|<start_of_turn>\w+\n?", "", parts[-1])  # the assistant header
    return re.sub(r"<\|[^|>]*\|>|<[a-z_]+_of_turn>|\[/INST\]", "", text).strip()
