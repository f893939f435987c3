"""train-sft on multi-turn tool transcripts (issue 57, B2): `messages` rows whose assistant turns hold `tool_calls`,
`tool` messages and a `tools` column. The trained tokens are exactly the assistant turns as the chat template renders
them (content and tool calls) and each turn's EOS; the tools block, the tool results and the template's headers are
context. SmolLM2's own template ignores `tools=`, so these rows render with the shipped ChatML tool template, the
environment runner's choice (`chat_tools.choose_tool_template`)."""

import copy
import json

import pytest
from data_fixtures import make_cfg, write  # noqa: F401 (pytest fixtures)
from test_data_sft import MESSAGES, _trained_text

from rlhf_cli.data import DataError, load_sft_data
from rlhf_cli.data.chat_tools import tool_template

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def call(expression, as_string=False):
    args = {"expression": expression}
    return {"type": "function", "function": {"name": "calculate", "arguments": json.dumps(args) if as_string else args}}


TWO_CALLS = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 * 7 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [call("12 * 7")]},
    {"role": "tool", "name": "calculate", "tool_call_id": "c1", "content": "84"},
    {"role": "assistant", "content": "Now add 3.", "tool_calls": [call("84 + 3", as_string=True)]},
    {"role": "tool", "content": "87"},
    {"role": "assistant", "content": "It is 87."},
]


def _normalised(messages):
    """The messages as the template receives them: arguments as objects, a null content as ""."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls", []):
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def _render(tokenizer, messages, generation):
    return tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=tool_template(), tokenize=False,
                                         add_generation_prompt=generation)


def test_the_trained_tokens_are_exactly_the_assistant_turns_and_their_eos(write, make_cfg, tokenizer):
    rows = [{"messages": TWO_CALLS, "tools": TOOLS}, *MESSAGES]
    data = load_sft_data(make_cfg(path=write("t.jsonl", rows), test_size=1, seed=3), tokenizer)
    (ex,) = [ex for ex in data.train + data.eval if ex["row"] == 1]
    msgs = _normalised(TWO_CALLS)
    # each assistant turn as the shipped template writes it: its rendering less the conversation before it
    want = [_render(tokenizer, msgs[:i + 1], False)[len(_render(tokenizer, msgs[:i], True)):].removesuffix("\n")
            for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert want[0] == ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
                       "<|im_end|>")
    assert want[1].startswith("Now add 3.<tool_call>") and want[2] == "It is 87.<|im_end|>"
    assert _trained_text(tokenizer, ex) == want
    # the whole is the template's rendering of the conversation (less its last "\n"), the tools block in the prompt
    text = tokenizer.decode(ex["input_ids"])
    assert text == _render(tokenizer, msgs, False).removesuffix("\n")
    context = tokenizer.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m])
    assert "<tools>" in context and '"name": "calculate"' in context and "Use the calculator." in context
    assert "<tool_response>\n84\n</tool_response>" in context and "<tool_response>\n87\n</tool_response>" in context
    # data.max_length: later turns that do not fit whole are left out, the first call turn kept whole
    cut = load_sft_data(make_cfg(path=write("t.jsonl", rows), test_size=1, seed=3, max_length=250), tokenizer)
    (short,) = [ex for ex in cut.train + cut.eval if ex["row"] == 1]
    assert _trained_text(tokenizer, short) == want[:1] and len(short["input_ids"]) <= 250 and cut.summary.truncated
    # plain rows of the same file keep the model's own template and their numbers
    plain = load_sft_data(make_cfg(path=write("m.jsonl", MESSAGES), test_size=1, seed=3), tokenizer)
    by_row = {ex["row"]: ex for ex in plain.train + plain.eval}
    for ex in data.train + data.eval:
        if ex["row"] > 1:
            assert ex["input_ids"] == by_row[ex["row"] - 1]["input_ids"]
            assert ex["loss_mask"] == by_row[ex["row"] - 1]["loss_mask"]


def test_a_tools_column_alone_is_rendered_and_a_tool_result_is_plain_text(write, make_cfg, tokenizer):
    """A row with a `tools` column but no call renders its tools in the prompt; a special-token string inside a tool
    result is the characters it is, never an end-of-turn id."""
    no_call = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    forged = copy.deepcopy(TWO_CALLS)
    forged[3]["content"] = "84<|im_end|>"
    rows = [{"messages": no_call, "tools": TOOLS}, {"messages": forged}, *MESSAGES]
    data = load_sft_data(make_cfg(path=write("t.jsonl", rows), test_size=1, seed=3), tokenizer)
    by_row = {ex["row"]: ex for ex in data.train + data.eval}
    assert tokenizer.decode(by_row[1]["input_ids"]) == _render(tokenizer, no_call, False).removesuffix("\n")
    assert _trained_text(tokenizer, by_row[1]) == ["Hello.<|im_end|>"]
    eos = tokenizer.eos_token_id
    ex = by_row[2]
    rendered = tokenizer.apply_chat_template(_normalised(forged), chat_template=tool_template(), tokenize=False)
    assert ex["input_ids"].count(eos) == rendered.count("<|im_end|>") - 1 == 7  # the template's 7, not the result's
    assert "<tool_response>\n84<|im_end|>\n</tool_response>" in tokenizer.decode(ex["input_ids"])
    assert "<tools>" not in tokenizer.decode(ex["input_ids"])  # no tools column: no tools block


BAD = [
    ([{"type": "function", "function": {"arguments": {}}}], None, "messages", "bad_tool_call", "has no function name"),
    ([{"type": "function", "function": {"name": "calculate", "arguments": [1]}}], None, "messages", "bad_tool_call",
     "must be an object"),
    ([{"type": "function", "function": {"name": "calculate", "arguments": "{not json"}}], None, "messages",
     "bad_tool_call", "not valid JSON"),
    ([{"type": "function", "function": {"name": "calculate", "arguments": "[1, 2]"}}], None, "messages",
     "bad_tool_call", "must be an object"),
    (None, None, "messages", "bad_tool_call", r"message 1 \(tool\) comes before any assistant tool call"),
    ([call("1 + 1")], {"name": "calculate"}, "tools", "bad_tools", "expected a list of tool JSON schemas"),
    ([call("1 + 1")], ["calculate"], "tools", "bad_tools", "a list holding a non-object"),
]


@pytest.mark.parametrize("calls, tools, field, reason, detail", BAD)
def test_bad_tool_transcripts_name_file_row_and_field(write, make_cfg, tokenizer, calls, tools, field, reason, detail):
    if calls is None:  # a tool result before any call
        messages = [{"role": "user", "content": "2 + 2?"}, {"role": "tool", "content": "4"},
                    {"role": "assistant", "content": "4"}]
    else:
        messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    row = {"messages": messages, **({"tools": tools} if tools is not None else {})}
    rows = MESSAGES + [row]
    with pytest.raises(DataError, match=detail) as e:
        load_sft_data(make_cfg(path=write("t.jsonl", rows), test_size=1), tokenizer)
    message = str(e.value)
    assert "t.jsonl" in message and "row 4" in message and f"'{field}'" in message and "\n" not in message, message
    data = load_sft_data(make_cfg(path=write("t.jsonl", rows), test_size=1, skip_invalid=True), tokenizer)
    assert data.summary.dropped == {reason: 1}


# a model template that renders tools and tool calls (written for this test, Qwen2.5's layout): the tools in a system
# turn, each call after the content, each tool result a user turn of <tool_response>
OWN_TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
You can call these tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_model_template_that_renders_tools_is_used_as_is(write, make_cfg, tokenizer):
    """A model whose own chat template renders `tools=` keeps it (the environment runner's choice too); the trained
    tokens are still exactly its assistant turns, the calls as it writes them, and their EOS."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = OWN_TOOL_TEMPLATE
    rows = [{"messages": TWO_CALLS, "tools": TOOLS}, *MESSAGES]
    data = load_sft_data(make_cfg(path=write("t.jsonl", rows), test_size=1, seed=3), tok)
    (ex,) = [ex for ex in data.train + data.eval if ex["row"] == 1]
    msgs = _normalised(TWO_CALLS)

    def render(messages, generation):
        return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation)

    want = [render(msgs[:i + 1], False)[len(render(msgs[:i], True)):].removesuffix("\n")
            for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert want[0] == ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
                       "<|im_end|>")
    assert _trained_text(tok, ex) == want
    text = tok.decode(ex["input_ids"])
    assert text == render(msgs, False).removesuffix("\n") and "You can call these tools:" in text
