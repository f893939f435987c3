"""train-sft's demonstrations: the `completion` and `messages` formats, their detection and row errors, the loss
mask (response tokens only: an assistant turn's content and its EOS, never the prompt or the template's own text),
template-safe truncation with whole responses, counted drops, and the padded and packed collators."""

import pytest
import torch
from data_fixtures import make_cfg, write  # noqa: F401 (pytest fixtures)

from rlhf_cli.data import (
    DataError,
    PackedSFTCollator,
    SFTCollator,
    load_preference_data,
    load_prompt_data,
    load_sft_data,
)

COMPLETION = [
    {"prompt": "What is 2 + 2?", "completion": "It is 4."},
    {"prompt": "Name a colour.", "completion": "Blue."},
    {"prompt": "Say hi.", "completion": "Hi!"},
    {"prompt": "Capital of France?", "completion": "Paris."},
]
MESSAGES = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"},
                  {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "thanks"}]},  # a last user turn: no loss after the last assistant
]


def _trained_text(tokenizer, ex):
    """The decoded targets of an example, each run of loss_mask 1 as one string."""
    runs, cur = [], []
    for tok, m in zip(ex["input_ids"], ex["loss_mask"]):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


def test_completion_rows_train_only_the_response_and_its_eos(write, make_cfg, tokenizer):
    for key in ("completion", "response"):
        rows = [{"prompt": r["prompt"], key: r["completion"]} for r in COMPLETION]
        data = load_sft_data(make_cfg(path=write("c.jsonl", rows), test_size=1), tokenizer)
        assert data.summary.format == "completion"
        assert len(data.train) == 3 and len(data.eval) == 1
        by_row = {ex["row"]: ex for ex in data.train + data.eval}
        for row, r in enumerate(COMPLETION, 1):
            ex = by_row[row]
            assert _trained_text(tokenizer, ex) == [r["completion"] + "<|im_end|>"]
            assert ex["loss_mask"][0] == 0 and ex["loss_mask"][-1] == 1  # ends at the response's EOS
            prompt = tokenizer.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m])
            assert prompt.endswith(f"{r['prompt']}<|im_end|>\n<|im_start|>assistant\n")  # the template: context


def test_a_completion_ending_in_any_eos_text_of_the_set_ends_there(write, make_cfg, tokenizer):
    """The EOS rule (`eos.eos_ids`): a completion whose text ends in the text of another id of the model's EOS set
    (here `<|endoftext|>`, as a model listing two ids in its generation_config) ends there and is trained with the
    tokenizer's EOS once, as train-rm's responses are."""
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    rows = [{"prompt": r["prompt"], "completion": r["completion"] + "<|endoftext|>"} for r in COMPLETION]
    cfg = make_cfg(path=write("c.jsonl", rows), test_size=1)
    data = load_sft_data(cfg, tokenizer, eos_ids=(tokenizer.eos_token_id, other))
    for ex in data.train + data.eval:
        assert _trained_text(tokenizer, ex) == [COMPLETION[ex["row"] - 1]["completion"] + "<|im_end|>"]
    kept = load_sft_data(cfg, tokenizer)  # without the set, the text is the user's response
    assert all(_trained_text(tokenizer, ex)[0].endswith("<|endoftext|><|im_end|>") for ex in kept.train)


def test_completion_ids_are_the_prompt_ids_ppo_samples_from_plus_the_response(write, make_cfg, tokenizer):
    """The SFT sequence is exactly the prompt PPO renders (`load_prompt_data`) followed by the response + EOS, so
    the policy is fine-tuned in the format it is later sampled in."""
    path = write("c.jsonl", COMPLETION)
    sft = load_sft_data(make_cfg(path=path, test_size=1), tokenizer)
    prompts = load_prompt_data(make_cfg(path=path, test_size=1), tokenizer)  # auto: the prompt column
    by_row = {p["row"]: p["prompt_ids"] for p in prompts}
    for ex in sft.train:
        n = len(by_row[ex["row"]])
        assert ex["input_ids"][:n] == by_row[ex["row"]] and not any(ex["loss_mask"][:n]) and all(ex["loss_mask"][n:])


def test_messages_rows_train_every_assistant_turn_and_nothing_else(write, make_cfg, tokenizer):
    data = load_sft_data(make_cfg(path=write("m.jsonl", MESSAGES), test_size=1, seed=3), tokenizer)
    assert data.summary.format == "messages"
    by_row = {ex["row"]: ex for ex in data.train + data.eval}
    assert _trained_text(tokenizer, by_row[1]) == ["Hello! How can I help?<|im_end|>", "It is 4.<|im_end|>"]
    assert _trained_text(tokenizer, by_row[2]) == ["Blue.<|im_end|>"]
    assert _trained_text(tokenizer, by_row[3]) == ["Hi!<|im_end|>"]
    assert tokenizer.decode(by_row[3]["input_ids"]).endswith("Hi!<|im_end|>")  # the last user turn left out
    # the second turn's context is the template's text and the user's content: the whole is the chat rendering
    text = tokenizer.decode(by_row[1]["input_ids"])
    rendered = tokenizer.apply_chat_template(MESSAGES[0]["messages"], tokenize=False)
    assert rendered.startswith(text) and rendered[len(text):] == "\n"  # the template's text after the last EOS


def test_auto_tells_messages_from_conversation_and_each_loader_refuses_the_other(write, make_cfg, tokenizer):
    conv = [{"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
             "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]}] * 3
    with pytest.raises(DataError, match=r"cannot read demonstrations from preference pairs"):
        load_sft_data(make_cfg(path=write("p.jsonl", conv), test_size=1), tokenizer)
    with pytest.raises(DataError, match=r"format 'conversation' holds preference pairs; supervised fine-tuning"):
        load_sft_data(make_cfg(path=write("p.jsonl", conv), test_size=1, format="conversation"), tokenizer)
    with pytest.raises(DataError, match=r"format 'messages' holds demonstrations \(supervised fine-tuning\)"):
        load_preference_data(make_cfg(path=write("m.jsonl", MESSAGES), test_size=1, format="messages"), tokenizer)
    # PPO reads a demonstration file's prompts (auto: a messages column is a prompt column there)
    prompts = load_prompt_data(make_cfg(path=write("m.jsonl", MESSAGES), test_size=1), tokenizer)
    assert len(prompts) == 2


@pytest.mark.parametrize("row, field, reason", [
    ({"prompt": "q", "completion": ""}, "completion", "empty_response"),
    ({"prompt": "", "completion": "a"}, "prompt", "empty_prompt"),
    ({"prompt": "q", "completion": 3}, "completion", "not_string"),
    ({"prompt": "q", "completion": [{"role": "user", "content": "a"}]}, "completion", "bad_messages"),
])
def test_bad_completion_rows_name_file_row_and_field(write, make_cfg, tokenizer, row, field, reason):
    rows = COMPLETION[:2] + [row] + COMPLETION[2:]
    with pytest.raises(DataError) as e:
        load_sft_data(make_cfg(path=write("c.jsonl", rows), test_size=1), tokenizer)
    assert "c.jsonl" in str(e.value) and "row 3" in str(e.value) and f"'{field}'" in str(e.value), str(e.value)
    data = load_sft_data(make_cfg(path=write("c.jsonl", rows), test_size=1, skip_invalid=True), tokenizer)
    assert data.summary.dropped == {reason: 1}


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "user", "content": "hi"}], "no_assistant_turn"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}], "empty_response"),
    ([{"role": "assistant", "content": "hello"}], "empty_prompt"),
    ([{"role": "user"}], "bad_messages"),
])
def test_bad_messages_rows_are_row_errors(write, make_cfg, tokenizer, messages, reason):
    rows = MESSAGES + [{"messages": messages}]
    with pytest.raises(DataError) as e:
        load_sft_data(make_cfg(path=write("m.jsonl", rows), test_size=1), tokenizer)
    assert "row 4" in str(e.value) and "'messages'" in str(e.value), str(e.value)
    data = load_sft_data(make_cfg(path=write("m.jsonl", rows), test_size=1, skip_invalid=True), tokenizer)
    assert data.summary.dropped == {reason: 1}


def test_truncation_keeps_responses_whole_and_counts_rows_with_no_response_left(write, make_cfg, tokenizer):
    """A long prompt is cut template-safely (its start goes, the template stays); a response too long to fit
    whole beside any prompt leaves no response token: the row is dropped and counted, not trained on empty."""
    long_prompt = "Tell me about this: " + "blah " * 200
    rows = [*COMPLETION, {"prompt": long_prompt, "completion": "Short."},
            {"prompt": "q?", "completion": "word " * 200}]
    data = load_sft_data(make_cfg(path=write("c.jsonl", rows), test_size=1, max_length=64, max_prompt_length=48),
                         tokenizer)
    s = data.summary
    assert s.dropped == {"no_response_left": 1} and s.truncated == 1
    assert sum(s.kept.values()) + sum(s.dropped.values()) + s.unused == s.rows_read == 6
    for ex in data.train + data.eval:
        assert len(ex["input_ids"]) <= 64 and sum(ex["loss_mask"]) >= 1 and ex["loss_mask"][-1] == 1
        if ex["row"] == 5:
            assert _trained_text(tokenizer, ex) == ["Short.<|im_end|>"]
            assert tokenizer.decode(ex["input_ids"]).endswith("blah<|im_end|>\n<|im_start|>assistant\nShort.<|im_end|>")
    # a conversation keeps the turns that fit whole, and ends before the first that does not
    conv = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "More"}, {"role": "assistant", "content": "word " * 60}]}] * 2
    data = load_sft_data(make_cfg(path=write("m.jsonl", conv), test_size=1, max_length=64), tokenizer)
    (ex,) = data.train
    assert _trained_text(tokenizer, ex) == ["Hello.<|im_end|>"] and data.summary.truncated == 2


def test_builtin_task_gives_its_correct_worked_solutions(make_cfg, tokenizer):
    from rlhf_cli.data import builtin_splits

    cfg = make_cfg(**{"builtin.rm_train": 12, "builtin.rm_eval": 4, "builtin.ppo_train": 4, "builtin.ppo_eval": 4})
    data = load_sft_data(cfg, tokenizer)
    splits = builtin_splits(cfg.builtin)
    assert len(data.train) == 12 and len(data.eval) == 4
    for ex in data.train:
        p = splits["rm_train"][ex["row"] - 1]
        assert _trained_text(tokenizer, ex) == [p.chosen + "<|im_end|>"]


def test_packed_batch_reads_the_same_tokens_and_isolates_segments(write, make_cfg, tokenizer):
    data = load_sft_data(make_cfg(path=write("m.jsonl", MESSAGES + [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]),
        test_size=1), tokenizer)
    exs = data.train + data.eval
    padded = SFTCollator(tokenizer.pad_token_id)(exs)
    packed = PackedSFTCollator(tokenizer.pad_token_id, attention_tokens=64.0)(exs)
    assert int(padded["tokens"]) == int(packed["tokens"]) == sum(len(ex["input_ids"]) for ex in exs)
    for batch in (padded, packed):
        t, s = batch["target"], batch["source"]
        assert t.shape == s.shape == (sum(sum(ex["loss_mask"]) for ex in exs), 2)
        want = [tok for ex in exs for tok, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
        assert batch["input_ids"][t[:, 0], t[:, 1]].tolist() == want
    # packed: each target's source is the token before it in its own demonstration, at the position before it
    pos, allowed = packed["position_ids"], packed["allowed"]
    t, s = packed["target"], packed["source"]
    assert (pos[t[:, 0], t[:, 1]] == pos[s[:, 0], s[:, 1]] + 1).all()
    assert (s[:, 0] == t[:, 0]).all() and allowed[t[:, 0], 0, t[:, 1], s[:, 1]].all()
    # segments are isolated: a token attends to exactly its own sequence's tokens before it (its position + 1 keys)
    real = packed["attention_mask"].bool()
    assert (allowed[:, 0].sum(-1)[real] == pos[real] + 1).all()
    assert int(real.sum()) < int(padded["tokens"])  # the examples' common first tokens computed once
    with pytest.raises(ValueError, match="first token cannot be a target"):
        SFTCollator(0)([{"input_ids": [5, 6], "loss_mask": [1, 1]}])
    assert torch.equal(padded["attention_mask"].sum(), padded["tokens"])


def test_raw_text_and_conversational_completions(write, make_cfg, tokenizer):
    """`data.chat_template=false`: a conversation is its raw transcript, each assistant turn " content" + EOS
    trained; a completion row may give its prompt as messages and its completion as one assistant message."""
    data = load_sft_data(make_cfg(path=write("m.jsonl", MESSAGES), test_size=1, seed=3, chat_template=False),
                         tokenizer)
    (ex,) = [ex for ex in data.train + data.eval if ex["row"] == 1]
    assert _trained_text(tokenizer, ex) == [" Hello! How can I help?<|im_end|>", " It is 4.<|im_end|>"]
    assert tokenizer.decode(ex["input_ids"]) == ("\n\nHuman: Hi\n\nAssistant: Hello! How can I help?<|im_end|>"
                                                 "\n\nHuman: 2+2?\n\nAssistant: It is 4.<|im_end|>")
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}]} for r in COMPLETION]
    data = load_sft_data(make_cfg(path=write("c.jsonl", rows), test_size=1), tokenizer)
    assert data.summary.format == "completion"
    for ex in data.train + data.eval:
        assert _trained_text(tokenizer, ex) == [COMPLETION[ex["row"] - 1]["completion"] + "<|im_end|>"]
