"""Chat rendering, tokenisation and truncation of prompts and responses.

Prompt and response are tokenised SEPARATELY and concatenated, so the boundary is exact: no token
straddles it, and `ids[:len(prompt_ids)]` is the prompt whatever the tokenizer's merges.

    with a chat template (and data.chat_template=true):
        prompt_ids   = the template's text with the generation prompt, its own markers as special ids and every
                       message's content as plain text                 # ends "<|im_start|>assistant\\n"
        response_ids = tok(assistant content, plain) + [eos]            # nothing after the EOS
    raw text:
        prompt_ids   = [bos if the tokenizer adds one] + tok(prompt text, plain)
        response_ids = tok(response text, plain) + [eos]

Plain: a special-token string inside user text (`<|im_end|>`, `<|im_start|>user`) is tokenised as the
characters it is, so user text can neither end a response early nor forge a turn; only the template's markers
and the one appended EOS are special ids. A prompt whose user text holds no such string is tokenised whole,
exactly as `apply_chat_template(..., tokenize=True)` tokenises it; one that holds one is tokenised piece by
piece (`Encoder.segments`): the template's text with its markers, each message's content as plain text. A
response's trailing EOS string, the text of any id of the EOS set (`eos.eos_ids`: `<|end|>` as well as the
tokenizer's `<|endoftext|>`), is taken as its end: removed, and the tokenizer's EOS id appended once, so the
reward model always reads its score at the tokenizer's EOS.

The template's own text after the EOS (SmolLM2 writes "<|im_end|>\\n") is not part of the response: a
policy stops at the EOS, and the reward model reads its score at the EOS.

Truncation keeps every response whole, with its EOS; the prompt gets min(max_prompt_length, max_length -
longest response) tokens (`pair_budget`). A raw-text prompt is cut from the LEFT (a leading BOS kept). A chat
prompt keeps its template whole: the oldest turns go first, then the last message's content is cut from the
left, and a system turn is kept (`Encoder.fit_prompt`). A pair is dropped when a response alone is longer than
max_length (`response_too_long`), when chosen and rejected tokenise identically, or when no prompt with at
least one token of content fits (`prompt_too_long`).

A demonstration (train-sft, `Encoder.fit_demo`) is the prompt's ids, its response's ids (content + EOS), then for
each later assistant turn of a conversation the template's text and messages since the previous one
(`followup_segments`) and that turn's ids; its loss mask is 1 on response ids only. The same rules hold: responses
whole, the prompt fitted to min(max_prompt_length, max_length - first response); later turns that do not fit whole
are left out, and a row whose first response does not fit is dropped (`no_response_left`). A tool transcript
(`Prompt.tools` set) renders with its tools and the template that renders them (`chat_tools.choose_tool_template`);
an assistant turn's response is its content then its tool calls as the template writes them (`calls_text`), plain
text, + EOS; the tools block and the `tool` messages are context.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from rlhf_cli.data.chat_tools import choose_tool_template
from rlhf_cli.data.formats import (
    IDENTICAL_AFTER_TRUNCATION,
    NO_RESPONSE_LEFT,
    PROMPT_TOO_LONG,
    RESPONSE_TOO_LONG,
    Demo,
    Prompt,
    raw_transcript,
)
from rlhf_cli.eos import eos_texts

logger = logging.getLogger(__name__)


SENTINEL = "\ue000{}\ue001"  # stands in for message i's content while the template is rendered (private-use chars)
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


class Encoder:
    """Renders and tokenises prompts and responses for one tokenizer.

    `use_chat` is true when `chat_template` is requested and the tokenizer has a template.
    User text (message contents, raw prompts, responses) is tokenised as plain text: a special-token string in
    it (`<|im_end|>`, `<|im_start|>user`) stays those characters and never becomes a control id. Only the
    template's own markers, and the one EOS appended to a response, are special ids.
    """

    def __init__(self, tokenizer: Any, chat_template: bool = True, system_prompt: str | None = None,
                 eos_ids: Sequence[int] = (), tools: list[dict[str, Any]] | None = None, template: str | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.tools, self.template = tools, template
        """The tools' JSON schemas the prompts are rendered with (`rollout.env`'s), and a chat template in place of
        the tokenizer's (the shipped tool template); None: none, the tokenizer's own."""
        self.use_chat = bool(chat_template) and bool(template or getattr(tokenizer, "chat_template", None))
        self.eos_id: int = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no EOS token; responses must end in one")
        self.eos_token: str = tokenizer.eos_token
        self.eos_texts = eos_texts(tokenizer, eos_ids)
        """The texts of the EOS set (`eos.eos_texts`), longest first: a response ending in one ends there."""
        bos = tokenizer.bos_token_id
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        self.bos_id: int | None = bos if bos is not None and probe[:1] == [bos] else None
        """The BOS id when the tokenizer prepends one (at most one is kept at the prompt's start)."""
        self.template_edits_text = False
        """Set when the chat template changed a message's text beyond trimming it: such a prompt is one piece,
        so a special-token string inside its user text is not kept plain (warned once)."""
        self._tool_chat: str | None | bool = False
        """The template tool transcripts render with (`choose_tool_template`, chosen at the first; False: not yet)."""
        self.special_texts = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                     if t.special} | set(getattr(tokenizer, "all_special_tokens", [])), key=len)
        """The special-token strings: a piece of user text holding one is tokenised plain, piece by piece."""

    # -- rendering ----------------------------------------------------------------------------
    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The prompt's messages with `data.system_prompt` put first when it has no system message."""
        messages = list(prompt.messages)
        if self.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return messages

    def _template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                  generation: bool = True) -> str:
        """The chat rendering of `messages`; `tools` not None: a tool transcript's (`Prompt.tools`), rendered with
        those tools and the template that renders them (`choose_tool_template`, the same choice as the
        environment runner's), else with the encoder's own tools and template."""
        template = self.template
        if tools is not None:
            if self._tool_chat is False:
                self._tool_chat = choose_tool_template(self.tokenizer, tools)[0]
            template = self._tool_chat
        return self.tokenizer.apply_chat_template(messages, tools=self.tools if tools is None else tools or None,
                                                  chat_template=template, tokenize=False,
                                                  add_generation_prompt=generation)

    def _pieces(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                ) -> list[tuple[str, bool, int | None]] | None:
        """The chat rendering of `messages` (with the generation prompt) as (text, plain, message index) pieces:
        the template's own text (plain=False, index None) and each message's content (plain=True, its index),
        joined exactly the rendered text; None when the template changes message text beyond trimming it. A tool
        call is the template's text."""
        marked = self._template([{**m, "content": SENTINEL.format(i)} for i, m in enumerate(messages)], tools)
        whole = self._template(messages, tools)
        for edit in (lambda text: text, str.strip):  # as given, or as a trimming template (Llama 3, Gemma) writes it
            out: list[tuple[str, bool, int | None]] = []
            pos = 0
            for m in _SENTINEL.finditer(marked):
                i = int(m.group(1))
                out += [(marked[pos:m.start()], False, None), (edit(messages[i]["content"]), True, i)]
                pos = m.end()
            out.append((marked[pos:], False, None))
            if "".join(t for t, _, _ in out) == whole:
                return out
        return None

    def render_prompt(self, prompt: Prompt) -> str:
        """The prompt as the model sees it: the chat template with the generation prompt, or raw text."""
        return self._template(self.messages(prompt), prompt.tools) if self.use_chat else prompt.text

    def segments(self, prompt: Prompt, messages: list[dict[str, str]] | None = None) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, plain) pieces in order: the template's own text (plain=False: its
        special-token strings are control ids) and each message's content (plain=True: user text); joined, their
        texts are `render_prompt`'s. Raw text is one plain piece. Raises what the chat template raises for
        messages it rejects."""
        if not self.use_chat:
            return [(prompt.text, True)]
        messages = self.messages(prompt) if messages is None else messages
        pieces = self._pieces(messages, prompt.tools)
        if pieces is not None:
            return [(t, plain) for t, plain, _ in pieces if t]
        # the template edits message text in another way: this prompt is one piece, its markers read as markers
        if not self.template_edits_text:
            logger.warning("the chat template changes message text beyond trimming it: such prompts are tokenised "
                           "whole, so special-token strings inside their text are read as special tokens")
        self.template_edits_text = True
        return [(self._template(messages, prompt.tools), False)]

    def followup_segments(self, messages: list[dict[str, Any]], after: int,
                          tools: list[dict[str, Any]] | None = None) -> list[tuple[str, bool]]:
        """The text between an assistant turn and the next one of a conversation, as (text, plain) pieces like
        `segments`: `messages` ends just before the next assistant turn, and the pieces are those of its
        rendering with the generation prompt that follow the content of message `after` (the previous assistant
        turn), less that turn's tool calls (`calls_text`: they belong to its response) and the template's EOS
        string right after them (the EOS id ends the previous response: `encode_responses`). Raw text:
        `raw_transcript` of the messages after `after`. `tools`: a tool transcript's (`Prompt.tools`). Raises
        ValueError when the chat template changes message text beyond trimming it or renders the calls otherwise
        in context, and what the template raises."""
        if not self.use_chat:
            return [(raw_transcript(messages[after + 1:]), True)]
        pieces = self._pieces(messages, tools)
        if pieces is None:
            raise ValueError("the chat template changes message text beyond trimming it")
        start = next(k for k, (_, _, i) in enumerate(pieces) if i == after) + 1
        out = [(t, plain) for t, plain, _ in pieces[start:] if t]
        calls = self.calls_text(messages[:after + 1], tools) if messages[after].get("tool_calls") else ""
        if calls:
            if not (out and out[0][0].startswith(calls)):
                raise ValueError("the chat template renders an assistant turn's tool calls differently in context")
            out[0] = (out[0][0][len(calls):], out[0][1])
        if out and self.eos_token and out[0][0].startswith(self.eos_token):
            out[0] = (out[0][0][len(self.eos_token):], out[0][1])
        return [(t, plain) for t, plain in out if t]

    def continuation_segments(self, messages: list[dict[str, Any]], n_old: int) -> list[tuple[str, bool]] | None:
        """What the rendering of `messages` with the generation prompt adds to that of its first `n_old` messages
        without it (the new messages and the next assistant header), as (text, plain) pieces like `segments`: the
        template's text, and each new message's content as plain text (a tool result or an environment's reply is
        encoded as user text is: `encode_segments`). None when the template changes message text beyond trimming
        it or does not render the conversation as the start of its continuation. Raises what the template raises."""
        pieces = self._pieces(messages)
        before = self._template(messages[:n_old], generation=False)
        if pieces is None or not "".join(t for t, _, _ in pieces).startswith(before):
            return None
        out, pos = [], 0
        for text, plain, _ in pieces:
            cut = max(0, len(before) - pos)
            pos += len(text)
            if cut and cut < len(text) and plain:  # the old conversation ends inside a message's content
                return None
            out.append((text[cut:], plain))
        return [(t, plain) for t, plain in out if t]

    def calls_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The text the chat template writes for the tool calls of `messages[-1]`, an assistant turn, between its
        content and its end: the difference of its rendering with and without them ("" when it has none). The
        policy writes this text, so it is part of the turn's response (`encode_responses`). Raises ValueError
        when the template writes the calls elsewhere, and what the template raises."""
        last = messages[-1]
        if not last.get("tool_calls"):
            return ""
        mark = SENTINEL.format(len(messages))
        bare = {k: v for k, v in last.items() if k != "tool_calls"}
        with_calls = self._template([*messages[:-1], {**last, "content": mark}], tools, generation=False)
        without = self._template([*messages[:-1], {**bare, "content": mark}], tools, generation=False)
        head, _, tail = with_calls.partition(mark)
        bare_head, _, bare_tail = without.partition(mark)
        if head != bare_head or not tail.endswith(bare_tail) or tail == bare_tail:
            raise ValueError("the chat template does not write an assistant turn's tool calls between its content "
                             "and its end")
        return tail[:len(tail) - len(bare_tail)]

    def response_text(self, raw: str) -> str:
        """The text tokenised for a response: stripped content (chat) or the raw text; a trailing EOS
        string in the data (the text of any id of the EOS set) is removed (the tokenizer's EOS id is appended once by
        `encode_responses`)."""
        text = raw.strip() if self.use_chat else raw
        while end := next((t for t in self.eos_texts if t and text.endswith(t)), None):
            text = text[: -len(end)]
            text = text.rstrip() if self.use_chat else text
        return text

    # -- tokenising (batched: one call into the fast tokenizer per kind of text) ------------------
    def _ids(self, texts: Sequence[str], plain: bool = True) -> list[list[int]]:
        if not texts:
            return []
        kwargs = {"split_special_tokens": True} if plain else {}
        return [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False, **kwargs)["input_ids"]]

    def _holds_special(self, text: str) -> bool:
        return any(s in text for s in self.special_texts)

    def encode_segments(self, prompts: Sequence[list[tuple[str, bool]]], bos: bool = True) -> list[list[int]]:
        """Token ids of prompts given as `segments`, with exactly one leading BOS if the tokenizer uses one
        (`bos=False`: none added). A prompt whose user text holds no special-token string is tokenised whole,
        exactly as `apply_chat_template(..., tokenize=True)` does; one that holds one is tokenised piece by piece,
        its user text as plain text."""
        prompts = [segs if any(plain and self._holds_special(t) for t, plain in segs)
                   else [("".join(t for t, _ in segs), False)] for segs in prompts]
        pieces = [(i, t, plain) for i, segs in enumerate(prompts) for t, plain in segs]
        ids: dict[bool, list[list[int]]] = {}
        for kind in (True, False):
            ids[kind] = self._ids([t for _, t, plain in pieces if plain is kind], plain=kind)[::-1]
        out: list[list[int]] = [[] for _ in prompts]
        for i, _, plain in pieces:
            out[i] += ids[plain].pop()
        if bos and self.bos_id is not None:
            out = [x if x[:1] == [self.bos_id] else [self.bos_id] + x for x in out]
        return out

    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of whole (untruncated) prompts; see `segments` and `encode_segments`."""
        return self.encode_segments([self.segments(p) for p in prompts])

    def encode_responses(self, raws: Sequence[str], calls: Sequence[str] = ()) -> list[list[int]]:
        """Token ids of responses (raw form, see formats.py), plain text each ending in exactly one EOS id;
        `calls`: each response's tool calls as the template writes them after its content (`calls_text`),
        tokenised with it as one plain text (none when empty)."""
        calls = list(calls) or [""] * len(raws)
        texts = [self.response_text(r) + c for r, c in zip(raws, calls, strict=True)]
        return [ids + [self.eos_id] for ids in self._ids(texts)]

    # -- truncation ---------------------------------------------------------------------------------
    def fit_prompt(self, prompt: Prompt, ids: list[int], budget: int) -> list[int] | None:
        """`ids` (the prompt's `encode_prompts` ids) made to fit `budget` tokens, or None when it cannot fit
        with a non-empty prompt (dropped as `prompt_too_long`).

        Raw text is cut from the left (a leading BOS kept). With a chat template the scaffolding stays whole:
        the oldest whole turns are dropped first (up to the last user message; a system message, yours or
        `data.system_prompt`, is kept, and so is the template's own default system turn), then the last
        message's content is cut from the left, and the prompt is rendered again. None when the template's
        text and the system turn alone leave no room for one token of the last message.
        """
        if len(ids) <= budget:
            return ids
        if not self.use_chat or not any(plain for _, plain in self.segments(prompt)):  # raw text, or one piece
            cut = truncate_left(ids, budget, self.bos_id)
            return cut if len(cut) > (self.bos_id is not None) else None
        messages = self.messages(prompt)
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        turns = messages[len(system):]
        while len(ids) > budget:
            later = [i for i in range(1, len(turns)) if turns[i]["role"] == "user"]
            if not later:
                break
            turns = turns[later[0]:]
            (ids,) = self.encode_segments([self.segments(prompt, system + turns)])
        if len(ids) <= budget:
            return ids
        segs = self.segments(prompt, system + turns)
        last = max(i for i, (_, plain) in enumerate(segs) if plain)
        content = self._ids([segs[last][0]])[0]
        keep = len(content) - (len(ids) - budget)
        if keep < 1:
            return None
        (head,), (tail,) = self.encode_segments([segs[:last]]), self.encode_segments([segs[last + 1:]], bos=False)
        return head + content[-keep:] + tail


    def fit_demo(self, demo: Demo, prompt_ids: list[int], response_ids: list[int], max_length: int,
                 max_prompt_length: int) -> tuple[list[int], list[int], bool] | str:
        """A demonstration as (input_ids, loss_mask, truncated), or the reason it is dropped.

        `prompt_ids`: the prompt's `encode_prompts` ids; `response_ids`: its first response's `encode_responses`
        ids. loss_mask[t] = 1 where token t is a response token (an assistant turn's content and its EOS id): a
        target of the next-token loss, predicted from position t - 1; 0 on the prompt and the template's own text.
        Responses are kept whole, with their EOS (as pairs' are): the prompt gets min(`max_prompt_length`,
        `max_length` - first response) tokens (`fit_prompt`: template-safe); each later assistant turn of a
        conversation (`Demo.later`) is kept, with the text before it, while the whole stays within `max_length`,
        and the conversation ends before the first that does not fit. Dropped: `prompt_too_long` (no prompt
        with a token of content fits `max_prompt_length`), `no_response_left` (the first response does not fit
        whole beside such a prompt: no response token would be left). `truncated`: the prompt was cut or later
        turns left out. A tool transcript (`Demo.calls`): each turn's response is its content and its tool calls as the
        template writes them (`calls_text`), and the `tool` messages are context. Raises what the chat template raises
        for a later turn's messages, ValueError for a tool transcript without a chat template."""
        tools = demo.prompt.tools
        if tools is not None:
            if not self.use_chat:
                raise ValueError("a tool transcript needs a chat template (data.chat_template=true)")
            first = self.messages(demo.prompt) + [demo.assistant(0)]
            (response_ids,) = self.encode_responses([demo.response], [self.calls_text(first, tools)])
        budget = min(max_prompt_length, max_length - len(response_ids))
        fitted = self.fit_prompt(demo.prompt, prompt_ids, budget) if budget >= 1 else None
        if fitted is None:
            return NO_RESPONSE_LEFT if self.fit_prompt(demo.prompt, prompt_ids, max_prompt_length) else PROMPT_TOO_LONG
        ids, mask = fitted + response_ids, [0] * len(fitted) + [1] * len(response_ids)
        truncated = fitted != prompt_ids
        messages = self.messages(demo.prompt) + [demo.assistant(0)]
        for k, (between, raw) in enumerate(demo.later, 1):
            after = len(messages) - 1
            messages = messages + list(between)
            (context,) = self.encode_segments([self.followup_segments(messages, after, tools)], bos=False)
            calls = self.calls_text(messages + [demo.assistant(k)], tools) if tools is not None else ""
            (response,) = self.encode_responses([raw], [calls])
            if len(ids) + len(context) + len(response) > max_length:
                truncated = True
                break
            ids, mask = ids + context + response, mask + [0] * len(context) + [1] * len(response)
            messages = messages + [demo.assistant(k)]
        return ids, mask, truncated


def truncate_left(ids: list[int], budget: int, bos_id: int | None = None) -> list[int]:
    """The last `budget` tokens of `ids`; a leading BOS stays in front (counted in the budget)."""
    if len(ids) <= budget:
        return ids
    if budget <= 0:
        return []
    if bos_id is not None and ids[:1] == [bos_id]:
        return [bos_id] + (ids[len(ids) - budget + 1:] if budget > 1 else [])
    return ids[len(ids) - budget:]


def pair_budget(chosen_ids: list[int], rejected_ids: list[int], max_length: int,
                max_prompt_length: int) -> tuple[int | None, str | None]:
    """The prompt's token budget for a tokenised pair: min(max_prompt_length, max_length - longer response),
    or (None, reason) when the pair must be dropped: `response_too_long` (a response alone exceeds
    max_length) or `identical_after_truncation` (chosen and rejected have the same ids). Responses are never
    cut."""
    longest = max(len(chosen_ids), len(rejected_ids))
    if longest > max_length:
        return None, RESPONSE_TOO_LONG
    if chosen_ids == rejected_ids:
        return None, IDENTICAL_AFTER_TRUNCATION
    return min(max_prompt_length, max_length - longest), None


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
