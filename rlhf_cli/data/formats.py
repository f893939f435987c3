"""Row formats of preference and prompt data: detection, parsing and validation.

Every supported shape of row is parsed into one of three records before anything is tokenised:

    Prompt  the context: chat `messages` (for the tokenizer's chat template) and `text` (raw form)
    Pair    a Prompt plus the `chosen` and `rejected` responses, in raw form (see below)
    Demo    a Prompt plus the demonstrated response (train-sft), and any later turns of a conversation

Formats (`data.format`, detected when `auto`; column names from `data.*_key`):

    explicit      prompt / chosen / rejected strings
    implicit      chosen / rejected full texts sharing a prefix: split at their longest common prefix,
                  backed up to a word boundary ("... is 7." / "... is 8." -> prompt "... is", " 7." / " 8.")
    hh            Anthropic HH transcripts "\\n\\nHuman: ...\\n\\nAssistant: ...": everything up to and including
                  the last "\\n\\nAssistant:" is the prompt, the rest is the response
    conversation  chosen / rejected lists of {role, content} messages ending in an assistant turn; an
                  optional prompt column (messages or a string) is prepended to both
    prompt        prompts only (PPO): a prompt string or message list, or a `messages` column
    completion    SFT demonstrations: prompt / completion (or prompt / response) strings; the prompt may also be
                  a message list and the completion a one-message assistant list (TRL's conversational form)
    messages      SFT demonstrations: a `messages` list of {role, content} with at least one assistant turn;
                  every assistant turn is trained on (distinct from `conversation`, a preference format). A tool
                  transcript: assistant turns may hold `tool_calls` (OpenAI/TRL form, `[{"type": "function",
                  "function": {"name", "arguments"}}]`, arguments an object or a JSON string of one), `tool`
                  messages the calls' results, and an optional `tools` column the tools' JSON schemas
    unpaired      KTO rows: prompt / completion strings (as `completion`) and a boolean label (true = the
                  completion is desirable); train-kto reads a preference format too, each pair as two rows
                  (TRL's `unpair_preference_dataset`): prompt + chosen labelled true, prompt + rejected false

Detection (`auto`) reads the columns: chosen/rejected make a preference format, prompt/messages a prompt format;
train-sft's loader asks for demonstrations (`detect_format(..., sft=True)`): a `messages` column is `messages`,
prompt with completion (or response) is `completion`; train-kto's asks for unpaired rows (`unpaired=True`): prompt,
completion (or response) and label make `unpaired`, chosen/rejected a preference format.

Raw vs chat form: a response's raw form is the exact text that follows the raw prompt (e.g. HH's
" Sure, ..." after "Assistant:"), so raw prompt + raw response reproduces the source text. The chat form
is the same text stripped of surrounding whitespace, used as the assistant message content.

Invalid rows raise `RowError(field, reason, detail)`; the loader turns it into a `DataError` naming the
file, the 1-based row and the field, or (with `data.skip_invalid=true`) counts it under `reason`.
Every string that reaches the tokenizer is checked to be encodable text: JSON can spell a lone UTF-16
surrogate ("\\ud800"), which Python keeps but no tokenizer accepts (`invalid_unicode`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_cli.errors import DataError

FORMATS = ("explicit", "implicit", "hh", "conversation", "prompt", "completion", "messages", "unpaired")
PREFERENCE_FORMATS = ("explicit", "implicit", "hh", "conversation")
SFT_FORMATS = ("completion", "messages")
UNPAIRED_FORMATS = ("unpaired", *PREFERENCE_FORMATS)
"""What train-kto reads: unpaired rows, or preference pairs split into two rows each."""
TOOLS_COLUMN = "tools"
"""A `messages` row's optional column of tool JSON schemas, the chat template's `tools=` (TRL's name)."""
RESPONSE_FALLBACK = "response"
"""The response column a `completion`-format file may have instead of `data.completion_key`."""

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"
_TURN_RE = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_RAW_ROLES = {"user": "Human", "assistant": "Assistant", "system": "System"}
_SURROGATE_RE = re.compile("[\ud800-\udfff]")

# reasons a row is rejected (the keys of the drop counters)
BAD_JSON = "bad_json"
"""A line of a JSON-lines file that is not valid UTF-8, not valid JSON, or not a JSON object."""
MISSING_FIELD = "missing_field"
NOT_STRING = "not_string"
BAD_MESSAGES = "bad_messages"
EMPTY_PROMPT = "empty_prompt"
EMPTY_RESPONSE = "empty_response"
IDENTICAL_RESPONSES = "identical_responses"
NO_ASSISTANT_TURN = "no_assistant_turn"
PREFIX_MISMATCH = "prefix_mismatch"
BAD_MARGIN = "bad_margin"
BAD_LABEL = "bad_label"
"""An `unpaired` row whose label is not a boolean (train-kto)."""
INVALID_UNICODE = "invalid_unicode"
BAD_TOOL_CALL = "bad_tool_call"
"""A tool transcript's call without a function name or with arguments that are not an object, or a `tool`
message before any call (train-sft)."""
BAD_TOOLS = "bad_tools"
"""A `tools` value that is not a list of JSON schema objects (train-sft)."""
# reasons a valid row is dropped later (tokenisation / selection)
RESPONSE_TOO_LONG = "response_too_long"
PROMPT_TOO_LONG = "prompt_too_long"
IDENTICAL_AFTER_TRUNCATION = "identical_after_truncation"
DUPLICATE_PROMPT = "duplicate_prompt"
TEMPLATE_ERROR = "chat_template_error"
NO_RESPONSE_LEFT = "no_response_left"
"""A demonstration none of whose assistant turns fits `data.max_length` whole after its prompt (train-sft)."""

SKIP_HINT = "set data.skip_invalid=true to skip such rows"


class RowError(Exception):
    """One row is invalid: `field` (column name; None when the row itself is unreadable), `reason`
    (counter key) and a human `detail`."""

    def __init__(self, field: str | None, reason: str, detail: str):
        super().__init__(detail)
        self.field, self.reason, self.detail = field, reason, detail


@dataclass
class Prompt:
    """A prompt in both forms: chat messages and raw text."""

    messages: list[dict[str, str]]
    """[{role, content}, ...] rendered with the chat template and `add_generation_prompt=True`."""
    text: str
    """Raw text, used when there is no chat template or `data.chat_template=false`."""
    answer: Any = None
    """Ground-truth answer when the data has one (the built-in task, or `data.answer_key`)."""
    columns: dict[str, Any] | None = None
    """A prompt row's columns as the data file holds them (`parse_prompt`), which a reward server receives
    (`reward.type=http`); None for the built-in task."""
    tools: list[dict[str, Any]] | None = None
    """A tool transcript's tools (train-sft: its `tools` column, [] when it has calls but no such column), rendered
    with the template that renders tools (`chat_tools.choose_tool_template`); None: not a tool transcript."""


@dataclass
class Pair:
    """A preference pair: the prompt, the chosen and rejected responses in raw form, an optional margin."""

    prompt: Prompt
    chosen: str
    rejected: str
    margin: float | None = None
    row: int = 0
    """1-based row number in the source."""


@dataclass
class Demo:
    """A demonstration (train-sft): the prompt, its response in raw form, and the later turns of a conversation.

    The chat form of the conversation is `prompt.messages`, the assistant message `response` (stripped), then
    for each later turn its messages and its assistant message. The raw form is `prompt.text` + `response`, then
    each later turn's `raw_transcript(messages)` + its response."""

    prompt: Prompt
    response: str
    later: list[tuple[list[dict[str, str]], str]]
    """Later assistant turns of a `messages` conversation: (the messages between the previous assistant turn and
    this one, this turn's response in raw form)."""
    row: int = 0
    """1-based row number in the source."""
    calls: list[list[dict[str, Any]]] | None = None
    """A tool transcript's tool calls per assistant turn (the first, then each later one; [] for a turn without),
    each `{"type": "function", "function": {"name": str, "arguments": dict}}`; None: no tool calls anywhere."""

    def assistant(self, k: int) -> dict[str, Any]:
        """Assistant turn k's message (0: the first): its stripped content and its tool calls, if any."""
        raw = self.response if k == 0 else self.later[k - 1][1]
        calls = self.calls[k] if self.calls else []
        return {"role": "assistant", "content": raw.strip(), **({"tool_calls": calls} if calls else {})}


@dataclass
class Unpaired:
    """An unpaired row (train-kto): the prompt, one completion in raw form, and whether it is desirable."""

    prompt: Prompt
    completion: str
    desirable: bool
    row: int = 0
    """1-based row number in the source (a preference pair's two rows share it)."""


@dataclass(frozen=True)
class Keys:
    """Column names, from `data.*_key` (the defaults live in config.DataConfig only: build with `from_cfg`)."""

    prompt: str
    chosen: str
    rejected: str
    messages: str
    answer: str
    margin: str | None
    completion: str = "completion"
    label: str = "label"

    @classmethod
    def from_cfg(cls, data_cfg: Any) -> Keys:
        return cls(prompt=data_cfg.prompt_key, chosen=data_cfg.chosen_key, rejected=data_cfg.rejected_key,
                   messages=data_cfg.messages_key, answer=data_cfg.answer_key, margin=data_cfg.margin_key,
                   completion=data_cfg.completion_key, label=data_cfg.label_key)


# ----------------------------------------------------------------------------------------------
# format detection


def _first_value(rows: Sequence[dict[str, Any]], key: str, limit: int = 100) -> Any:
    for r in rows[:limit]:
        if r.get(key) is not None:
            return r[key]
    return None


def _looks_hh(rows: Sequence[dict[str, Any]], key: str, limit: int = 100) -> bool:
    return any(isinstance(r.get(key), str) and (ASSISTANT in r[key] or r[key].startswith(HUMAN))
               for r in rows[:limit])


def completion_column(keys: Keys, columns: Any) -> str:
    """The column a `completion`-format row's response is read from: `data.completion_key`, or `response` when
    `columns` (the file's columns, or one row's keys) has that and not the other."""
    if keys.completion not in columns and RESPONSE_FALLBACK in columns:
        return RESPONSE_FALLBACK
    return keys.completion


def detect_format(columns: Sequence[str], rows: Sequence[dict[str, Any]], keys: Keys, source: str,
                  sft: bool = False, unpaired: bool = False) -> str:
    """Guess the format from the column names and the first rows' value types; `sft`: the loader wants
    demonstrations (train-sft), so a `messages` column is `messages` and prompt + completion (or response) is
    `completion`; `unpaired`: it wants unpaired rows (train-kto), so prompt + completion (or response) + label is
    `unpaired`, and chosen/rejected a preference format. Raises DataError."""
    cols = set(columns)
    if unpaired:
        if keys.prompt in cols and completion_column(keys, cols) in cols and keys.label in cols:
            return "unpaired"
        if not (keys.chosen in cols and keys.rejected in cols):
            raise DataError(source, f"cannot read unpaired rows from the columns {sorted(cols)}: expected "
                                    f"'{keys.prompt}' + '{keys.completion}' + '{keys.label}' for data.format=unpaired, "
                                    f"or preference pairs ('{keys.chosen}'/'{keys.rejected}'); set data.format and "
                                    f"data.prompt_key/completion_key/label_key")
    if sft:
        if keys.messages in cols:
            return "messages"
        if keys.prompt in cols and completion_column(keys, cols) in cols:
            return "completion"
        held = (f"preference pairs ('{keys.chosen}'/'{keys.rejected}')" if keys.chosen in cols and keys.rejected in cols
                else f"the columns {sorted(cols)}")
        raise DataError(source, f"cannot read demonstrations from {held}: expected '{keys.prompt}' + "
                                f"'{keys.completion}' (or '{RESPONSE_FALLBACK}') for data.format=completion, or "
                                f"'{keys.messages}' (lists of {{role, content}}) for data.format=messages; set "
                                f"data.format and data.prompt_key/completion_key/messages_key")
    if keys.chosen in cols and keys.rejected in cols:
        if isinstance(_first_value(rows, keys.chosen), list):
            return "conversation"
        if keys.prompt in cols:
            return "explicit"
        return "hh" if _looks_hh(rows, keys.chosen) else "implicit"
    if keys.prompt in cols or keys.messages in cols:
        return "prompt"
    raise DataError(source, f"cannot tell the data format from the columns {sorted(cols)}: expected "
                            f"'{keys.chosen}'/'{keys.rejected}' (+ optional '{keys.prompt}') for preference "
                            f"pairs or '{keys.prompt}'/'{keys.messages}' for prompts; set data.format and "
                            f"data.prompt_key/chosen_key/rejected_key/messages_key")


def required_columns(fmt: str, keys: Keys, columns: Sequence[str]) -> list[str]:
    """The columns a format needs that `columns` lacks (empty when all are there)."""
    if fmt == "explicit":
        need = [keys.prompt, keys.chosen, keys.rejected]
    elif fmt in ("implicit", "hh", "conversation"):
        need = [keys.chosen, keys.rejected]
    elif fmt == "prompt":
        need = [] if (keys.prompt in columns or keys.messages in columns) else [keys.prompt]
    elif fmt == "completion":
        need = [keys.prompt, completion_column(keys, columns)]
    elif fmt == "unpaired":
        need = [keys.prompt, completion_column(keys, columns), keys.label]
    elif fmt == "messages":
        need = [keys.messages]
    else:
        raise ValueError(f"unknown data format {fmt!r}")
    if keys.margin and fmt in PREFERENCE_FORMATS:
        need.append(keys.margin)
    return [c for c in need if c not in columns]


# ----------------------------------------------------------------------------------------------
# field helpers


def _text(value: str, key: str) -> str:
    """`value` unchanged, or RowError(invalid_unicode) when it holds a lone surrogate (from a JSON
    escape such as "\\ud800"): Python keeps such strings, but they are not text a tokenizer can encode."""
    bad = _SURROGATE_RE.search(value)
    if bad:
        raise RowError(key, INVALID_UNICODE, f"unpaired UTF-16 surrogate \\u{ord(bad.group()):04x} at character "
                                             f"{bad.start()}: not valid Unicode text")
    return value


def _string(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        raise RowError(key, MISSING_FIELD, "missing or null")
    if not isinstance(value, str):
        raise RowError(key, NOT_STRING, f"expected a string, got {type(value).__name__}")
    return _text(value, key)


def _messages(value: Any, key: str) -> list[dict[str, str]]:
    if value is None:
        raise RowError(key, MISSING_FIELD, "missing or null")
    if not isinstance(value, list):
        raise RowError(key, BAD_MESSAGES, f"expected a list of {{role, content}} messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(key, BAD_MESSAGES, f"message {i} is not a {{role: str, content: str}} dict")
        out.append({"role": _text(m["role"], key), "content": _text(m["content"], key)})
    return out


def _margin(row: dict[str, Any], key: str | None) -> float | None:
    if not key:
        return None
    value = row.get(key)
    if value is None:
        raise RowError(key, MISSING_FIELD, "missing or null")
    try:
        if isinstance(value, bool):
            raise TypeError
        m = float(value)
    except (TypeError, ValueError):
        raise RowError(key, BAD_MARGIN, f"margin must be a number, got {value!r:.40}") from None
    if not math.isfinite(m):
        raise RowError(key, BAD_MARGIN, f"margin must be finite, got {m}")
    return m


def hh_messages(text: str) -> list[dict[str, str]]:
    """`\\n\\nHuman: a\\n\\nAssistant: b` -> [{user, a}, {assistant, b}] (contents stripped).

    Text before the first turn marker, if any, becomes a user message. A trailing empty assistant turn
    (a prompt ending in "Assistant:") is dropped.
    """
    parts = _TURN_RE.split(text)
    msgs = []
    if parts[0].strip():
        msgs.append({"role": "user", "content": parts[0].strip()})
    for role, content in zip(parts[1::2], parts[2::2]):
        msgs.append({"role": _HH_ROLES[role], "content": content.strip()})
    if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1]["content"]:
        msgs.pop()
    return msgs


def raw_transcript(messages: Sequence[dict[str, str]]) -> str:
    """Messages as an HH-style raw prompt ending in "\\n\\nAssistant:" (for chat_template=false)."""
    turns = "".join(f"\n\n{_RAW_ROLES.get(m['role'], m['role'].capitalize())}: {m['content'].strip()}"
                    for m in messages)
    return turns + ASSISTANT


def text_prompt(text: str) -> Prompt:
    """A prompt given as a string; HH-style transcripts are split into turns for the chat template."""
    if ASSISTANT in text or text.startswith(HUMAN):
        return Prompt(messages=hh_messages(text), text=text)
    return Prompt(messages=[{"role": "user", "content": text.strip()}], text=text)


def _check_responses(chosen: str, rejected: str, keys: Keys) -> None:
    if not chosen.strip():
        raise RowError(keys.chosen, EMPTY_RESPONSE, "empty final assistant response")
    if not rejected.strip():
        raise RowError(keys.rejected, EMPTY_RESPONSE, "empty final assistant response")
    if chosen.strip() == rejected.strip():
        raise RowError(keys.rejected, IDENTICAL_RESPONSES, f"response is identical to '{keys.chosen}'")


def _first_difference(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


# ----------------------------------------------------------------------------------------------
# per-format parsers


def _split_hh(text: str, key: str):
    i = text.rfind(ASSISTANT)
    if i < 0:
        raise RowError(key, NO_ASSISTANT_TURN, "HH transcript has no '\\n\\nAssistant:' turn")
    return text[:i + len(ASSISTANT)], text[i + len(ASSISTANT):]


def _parse_hh(row: dict[str, Any], keys: Keys, need_responses: bool) -> Pair:
    chosen_text = _string(row, keys.chosen)
    prompt_c, chosen = _split_hh(chosen_text, keys.chosen)
    prompt = Prompt(messages=hh_messages(prompt_c), text=prompt_c)
    if not need_responses:
        return Pair(prompt, chosen, "")
    rejected_text = _string(row, keys.rejected)
    prompt_r, rejected = _split_hh(rejected_text, keys.rejected)
    if prompt_c != prompt_r:
        at = _first_difference(prompt_c, prompt_r)
        raise RowError(keys.rejected, PREFIX_MISMATCH,
                       f"transcript differs from '{keys.chosen}' before the final assistant turn (at character {at})")
    _check_responses(chosen, rejected, keys)
    return Pair(prompt, chosen, rejected)


def split_common_prefix(chosen: str, rejected: str) -> int:
    """Where an implicit pair splits into prompt and responses: the longest common prefix, backed up
    to a word boundary (the whitespace before the first differing word goes to the responses)."""
    lcp = os.path.commonprefix([chosen, rejected])
    k = len(lcp)
    if k < len(chosen) and k < len(rejected) and not (lcp and lcp[-1].isspace()):
        while k > 0 and not lcp[k - 1].isspace():  # back out of the word the texts differ in
            k -= 1
    while k > 0 and lcp[k - 1].isspace():  # whitespace belongs to the response
        k -= 1
    return k


def _parse_implicit(row: dict[str, Any], keys: Keys, need_responses: bool) -> Pair:
    chosen_text = _string(row, keys.chosen)
    rejected_text = _string(row, keys.rejected)
    if chosen_text.strip() == rejected_text.strip():
        raise RowError(keys.rejected, IDENTICAL_RESPONSES, f"text is identical to '{keys.chosen}'")
    k = split_common_prefix(chosen_text, rejected_text)
    prompt = text_prompt(chosen_text[:k])
    pair = Pair(prompt, chosen_text[k:], rejected_text[k:])
    if need_responses:
        _check_responses(pair.chosen, pair.rejected, keys)
    return pair


def _parse_explicit(row: dict[str, Any], keys: Keys, need_responses: bool) -> Pair:
    prompt = text_prompt(_string(row, keys.prompt))
    if not need_responses:
        return Pair(prompt, "", "")
    chosen, rejected = _string(row, keys.chosen), _string(row, keys.rejected)
    _check_responses(chosen, rejected, keys)
    return Pair(prompt, chosen, rejected)


def _conversation_prompt(row: dict[str, Any], keys: Keys) -> list[dict[str, str]]:
    if row.get(keys.prompt) is None:
        return []
    value = row[keys.prompt]
    if isinstance(value, str):
        return text_prompt(_text(value, keys.prompt)).messages
    return _messages(value, keys.prompt)


def _parse_conversation(row: dict[str, Any], keys: Keys, need_responses: bool) -> Pair:
    head = _conversation_prompt(row, keys)
    full_c = head + _messages(row.get(keys.chosen), keys.chosen)
    if not full_c or full_c[-1]["role"] != "assistant":
        raise RowError(keys.chosen, NO_ASSISTANT_TURN, "conversation does not end with an assistant message")
    msgs = full_c[:-1]
    prompt = Prompt(messages=msgs, text=raw_transcript(msgs))
    chosen = " " + full_c[-1]["content"].strip()
    if not need_responses:
        return Pair(prompt, chosen, "")
    full_r = head + _messages(row.get(keys.rejected), keys.rejected)
    if not full_r or full_r[-1]["role"] != "assistant":
        raise RowError(keys.rejected, NO_ASSISTANT_TURN, "conversation does not end with an assistant message")
    if full_r[:-1] != msgs:
        raise RowError(keys.rejected, PREFIX_MISMATCH,
                       f"conversation differs from '{keys.chosen}' before the final assistant message")
    rejected = " " + full_r[-1]["content"].strip()
    _check_responses(chosen, rejected, keys)
    return Pair(prompt, chosen, rejected)


_PARSERS = {"hh": _parse_hh, "implicit": _parse_implicit, "explicit": _parse_explicit,
            "conversation": _parse_conversation}


def parse_pair(row: dict[str, Any], fmt: str, keys: Keys) -> Pair:
    """One source row -> a validated Pair. Raises RowError naming the field and reason."""
    pair = _PARSERS[fmt](row, keys, True)
    pair.margin = _margin(row, keys.margin)
    pair.prompt.answer = row.get(keys.answer)
    return pair


def _completion_prompt(row: dict[str, Any], keys: Keys) -> Prompt:
    value = row.get(keys.prompt)
    if isinstance(value, list):
        msgs = _messages(value, keys.prompt)
        prompt, empty = Prompt(messages=msgs, text=raw_transcript(msgs)), not any(m["content"].strip() for m in msgs)
    else:
        text = _string(row, keys.prompt)
        prompt, empty = text_prompt(text), not text.strip()
    if empty:
        raise RowError(keys.prompt, EMPTY_PROMPT, "empty prompt")
    return prompt


def _parse_completion(row: dict[str, Any], keys: Keys) -> Demo:
    prompt = _completion_prompt(row, keys)
    key = completion_column(keys, row)
    value = row.get(key)
    if isinstance(value, list):  # conversational prompt-completion: [{"role": "assistant", "content": ...}]
        msgs = _messages(value, key)
        if len(msgs) != 1 or msgs[0]["role"] != "assistant":
            raise RowError(key, BAD_MESSAGES, "a completion given as messages must be one assistant message")
        response = " " + msgs[0]["content"].strip()
    else:
        response = _string(row, key)
    if not response.strip():
        raise RowError(key, EMPTY_RESPONSE, "empty completion")
    return Demo(prompt, response, [])


def _tool_call(call: Any, where: str, key: str) -> dict[str, Any]:
    """One entry of an assistant message's `tool_calls` normalised to `{"type": "function", "function": {"name",
    "arguments": dict}}` (TRL's form; `{"name", "arguments"}` without the `function` wrapper is read too)."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise RowError(key, BAD_TOOL_CALL, f"{where} has no function name (expected {{\"type\": \"function\", "
                                           f"\"function\": {{\"name\": str, \"arguments\": {{...}}}}}})")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise RowError(key, BAD_TOOL_CALL, f"{where}'s arguments are not valid JSON: {args!r:.60}") from None
    if not isinstance(args, dict):
        raise RowError(key, BAD_TOOL_CALL, f"{where}'s arguments must be an object (or a JSON string of one), got "
                                           f"{type(args).__name__}")
    out = {"type": "function", "function": {"name": _text(fn["name"], key), "arguments": args}}
    return {**out, "id": call["id"]} if isinstance(call.get("id"), str) else out


def _transcript(value: Any, key: str) -> tuple[list[dict[str, Any]], bool]:
    """A `messages` list that may be a tool transcript: its messages (assistant `tool_calls` normalised by
    `_tool_call`, an assistant content of null read as "", a `tool` message's `name` and `tool_call_id` kept), and
    whether it holds a tool call or a `tool` message."""
    if not isinstance(value, list) or not any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                              for m in value):
        return _messages(value, key), False
    out, called = [], False
    for i, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        content = "" if calls and m.get("content") is None else m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise RowError(key, BAD_MESSAGES, f"message {i} is not a {{role: str, content: str}} dict")
        msg = {"role": _text(m["role"], key), "content": _text(content, key)}
        if calls is not None:
            if not isinstance(calls, list):
                raise RowError(key, BAD_TOOL_CALL, f"message {i}'s tool_calls is not a list")
            msg["tool_calls"] = [_tool_call(c, f"message {i}'s tool_calls[{j}]", key) for j, c in enumerate(calls)]
            called = called or bool(calls)
        if m["role"] == "tool":
            if not called:
                raise RowError(key, BAD_TOOL_CALL, f"message {i} (tool) comes before any assistant tool call")
            msg.update({f: _text(m[f], key) for f in ("name", "tool_call_id") if isinstance(m.get(f), str)})
        out.append(msg)
    return out, True


def _tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A row's `tools` column: a list of JSON schema objects, or None when absent."""
    value = row.get(TOOLS_COLUMN)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        got = "a list holding a non-object" if isinstance(value, list) else type(value).__name__
        raise RowError(TOOLS_COLUMN, BAD_TOOLS, f"expected a list of tool JSON schemas (objects), got {got}")
    return value


def _parse_messages(row: dict[str, Any], keys: Keys) -> Demo:
    msgs, tooled = _transcript(row.get(keys.messages), keys.messages)
    tools = _tools(row)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise RowError(keys.messages, NO_ASSISTANT_TURN, "conversation has no assistant message to train on")
    for i in turns:
        if not msgs[i]["content"].strip() and not msgs[i].get("tool_calls"):
            raise RowError(keys.messages, EMPTY_RESPONSE, f"message {i} (assistant) is empty")
    head = msgs[:turns[0]]
    if not any(m["content"].strip() for m in head):
        raise RowError(keys.messages, EMPTY_PROMPT, "the first assistant message has no non-empty message before it")
    later = [(msgs[a + 1:b], " " + msgs[b]["content"].strip()) for a, b in zip(turns, turns[1:])]
    prompt = Prompt(messages=head, text=raw_transcript(head))
    if tooled or tools is not None:
        prompt.tools = tools or []
    calls = [msgs[i].get("tool_calls", []) for i in turns] if tooled else None
    return Demo(prompt, " " + msgs[turns[0]]["content"].strip(), later, calls=calls)


def parse_demo(row: dict[str, Any], fmt: str, keys: Keys) -> Demo:
    """One source row of a `completion` or `messages` format -> a validated Demo (train-sft). Messages after the
    last assistant turn carry no loss and are left out. Raises RowError naming the field and reason."""
    demo = _parse_completion(row, keys) if fmt == "completion" else _parse_messages(row, keys)
    demo.prompt.answer = row.get(keys.answer)
    return demo


def _label(row: dict[str, Any], key: str) -> bool:
    value = row.get(key)
    if value is None:
        raise RowError(key, MISSING_FIELD, "missing or null")
    if not isinstance(value, bool):
        raise RowError(key, BAD_LABEL, f"the label must be a boolean (true = desirable, false = undesirable), got "
                                       f"{value!r:.40} ({type(value).__name__})")
    return value


def parse_unpaired(row: dict[str, Any], fmt: str, keys: Keys) -> list[Unpaired]:
    """One source row -> its validated unpaired rows (train-kto): one for `unpaired` (prompt and completion as a
    `completion` row's, the label a boolean), two for a preference format (the chosen completion desirable, the
    rejected one not: TRL's `unpair_preference_dataset`). Raises RowError naming the field and reason."""
    if fmt == "unpaired":
        demo = _parse_completion(row, keys)
        out = [Unpaired(demo.prompt, demo.response, _label(row, keys.label))]
    else:
        pair = _PARSERS[fmt](row, keys, True)
        out = [Unpaired(pair.prompt, pair.chosen, True), Unpaired(pair.prompt, pair.rejected, False)]
    for u in out:
        u.prompt.answer = row.get(keys.answer)
    return out


def parse_prompt(row: dict[str, Any], fmt: str, keys: Keys) -> Prompt:
    """The prompt of one row of any format (responses of preference and demonstration rows are not validated;
    a `messages` row's prompt is its messages but a last assistant one, as a `prompt` row's message list)."""
    if fmt in ("completion", "unpaired"):
        prompt = _completion_prompt(row, keys)
    elif fmt in ("prompt", "messages"):
        if fmt == "messages" or (row.get(keys.prompt) is None and keys.messages in row):
            value, field_ = row.get(keys.messages), keys.messages
        else:
            value, field_ = row.get(keys.prompt), keys.prompt
        if isinstance(value, list) or fmt == "messages":
            msgs = _messages(value, field_)
            if msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]  # a reference reply is not part of the prompt
            prompt = Prompt(messages=msgs, text=raw_transcript(msgs))
            empty = not any(m["content"].strip() for m in msgs)
        else:
            text = _string(row, field_)
            prompt, empty = text_prompt(text), not text.strip()
        if empty:
            raise RowError(field_, EMPTY_PROMPT, "empty prompt")
    else:
        prompt = _PARSERS[fmt](row, keys, False).prompt
    prompt.answer = row.get(keys.answer)
    prompt.columns = dict(row)
    return prompt
