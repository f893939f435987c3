"""Every format parsed from small files of every type; each kind of bad row gives its own error."""

import pytest
from data_fixtures import make_cfg, write  # noqa: F401 (pytest fixtures)

from rlhf_cli.config import DataConfig
from rlhf_cli.data import DataError, Keys, load_preference_data, load_prompt_data
from rlhf_cli.data.formats import detect_format, hh_messages, split_common_prefix

EXTS = ["json", "jsonl", "jsonl.gz", "parquet", "csv"]

EXPLICIT = [
    {"prompt": "What is 2 + 2?", "chosen": "It is 4.", "rejected": "It is 5."},
    {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "A car."},
    {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."},
    {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
]
HH = [
    {"chosen": "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke"
               "\n\nAssistant: Why did the chicken cross the road?",
     "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke"
                 "\n\nAssistant: No."},
    {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"},
    {"chosen": "\n\nHuman: Colour of the sky?\n\nAssistant: Blue",
     "rejected": "\n\nHuman: Colour of the sky?\n\nAssistant: Green"},
]
IMPLICIT = [
    {"chosen": "Q: capital of France? A: The capital is Paris.",
     "rejected": "Q: capital of France? A: The capital is Lyon."},
    {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 22"},
    {"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: bleu"},
]


def _conv(user, good, bad):
    return {"chosen": [{"role": "user", "content": user}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": user}, {"role": "assistant", "content": bad}]}


CONVERSATION = [_conv("2+2?", "4", "5"), _conv("Sky colour?", "Blue", "Green"), _conv("Hi", "Hello!", "Go away.")]


def _dec(tokenizer, ids):
    return tokenizer.decode(ids)


@pytest.mark.parametrize("ext", EXTS)
def test_explicit_every_file_type(ext, write, make_cfg, tokenizer):
    path = write(f"pairs.{ext}", EXPLICIT)
    data = load_preference_data(make_cfg(path=path, test_size=1), tokenizer)
    assert data.summary.format == "explicit" and data.summary.rows_read == 4
    assert (len(data.train), len(data.eval)) == (3, 1)
    by_row = {ex["row"]: ex for ex in data.train + data.eval}
    assert sorted(by_row) == [1, 2, 3, 4]
    ex = by_row[1]
    assert _dec(tokenizer, ex["prompt_ids"]).endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                                                      "<|im_start|>assistant\n")
    assert _dec(tokenizer, ex["chosen_ids"]) == "It is 4.<|im_end|>"
    assert _dec(tokenizer, ex["rejected_ids"]) == "It is 5.<|im_end|>"


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_hh_transcripts(ext, write, make_cfg, tokenizer):
    path = write(f"hh.{ext}", HH)
    data = load_preference_data(make_cfg(path=path, test_size=1, seed=3), tokenizer)
    assert data.summary.format == "hh"
    ex = next(e for e in data.train + data.eval if e["row"] == 1)
    prompt = _dec(tokenizer, ex["prompt_ids"])
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n"
                           "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
                           "<|im_start|>user\nTell me a joke<|im_end|>\n<|im_start|>assistant\n")
    assert _dec(tokenizer, ex["chosen_ids"]) == "Why did the chicken cross the road?<|im_end|>"
    raw = load_preference_data(make_cfg(path=path, test_size=1, chat_template=False), tokenizer)
    ex = next(e for e in raw.train + raw.eval if e["row"] == 1)
    assert _dec(tokenizer, ex["prompt_ids"]) + _dec(tokenizer, ex["rejected_ids"]) == HH[0]["rejected"] + "<|im_end|>"


@pytest.mark.parametrize("ext", ["jsonl.gz", "csv"])
def test_implicit_shared_prefix(ext, write, make_cfg, tokenizer):
    path = write(f"implicit.{ext}", IMPLICIT)
    data = load_preference_data(make_cfg(path=path, test_size=1, chat_template=False), tokenizer)
    assert data.summary.format == "implicit"
    ex = next(e for e in data.train + data.eval if e["row"] == 1)
    assert _dec(tokenizer, ex["prompt_ids"]) == "Q: capital of France? A: The capital is"
    assert _dec(tokenizer, ex["chosen_ids"]) == " Paris.<|im_end|>"
    assert _dec(tokenizer, ex["rejected_ids"]) == " Lyon.<|im_end|>"


def test_split_common_prefix_backs_up_to_a_word_boundary():
    assert split_common_prefix("The answer is 7.", "The answer is 8.") == len("The answer is")
    assert split_common_prefix("I like apples", "I like apricots") == len("I like")
    assert split_common_prefix("cat sat", "cats sat") == 0
    assert split_common_prefix("A: yes\n\nok", "A: yes\n\nno") == len("A: yes")


@pytest.mark.parametrize("ext", ["json", "jsonl", "parquet"])
def test_conversation_messages(ext, write, make_cfg, tokenizer):
    path = write(f"conv.{ext}", CONVERSATION)
    data = load_preference_data(make_cfg(path=path, test_size=1), tokenizer)
    assert data.summary.format == "conversation"
    ex = next(e for e in data.train + data.eval if e["row"] == 2)
    assert _dec(tokenizer, ex["prompt_ids"]).endswith("<|im_start|>user\nSky colour?<|im_end|>\n"
                                                      "<|im_start|>assistant\n")
    assert _dec(tokenizer, ex["chosen_ids"]) == "Blue<|im_end|>"


def test_conversation_with_separate_prompt_column(write, make_cfg, tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
             "chosen": [{"role": "assistant", "content": a}], "rejected": [{"role": "assistant", "content": b}]}
            for q, a, b in [("2+2?", "4", "5"), ("1+1?", "2", "3"), ("3+3?", "6", "7")]]
    data = load_preference_data(make_cfg(path=write("conv.jsonl", rows), test_size=1), tokenizer)
    ex = next(e for e in data.train + data.eval if e["row"] == 1)
    assert _dec(tokenizer, ex["prompt_ids"]) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                 "<|im_start|>user\n2+2?<|im_end|>\n"
                                                 "<|im_start|>assistant\n")
    assert _dec(tokenizer, ex["rejected_ids"]) == "5<|im_end|>"


def test_custom_column_names_format_override_and_margin(write, make_cfg, tokenizer):
    rows = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "m": float(i)}
            for i, r in enumerate(EXPLICIT)]
    cfg = make_cfg(path=write("custom.parquet", rows), prompt_key="question", chosen_key="good", rejected_key="bad",
                   margin_key="m", format="explicit", test_size=1)
    data = load_preference_data(cfg, tokenizer)
    assert sorted(ex["margin"] for ex in data.train + data.eval) == [0.0, 1.0, 2.0, 3.0]
    assert all(ex["margin"] == float(ex["row"] - 1) for ex in data.train)


@pytest.mark.parametrize("ext", ["jsonl", "csv"])
def test_prompt_only_file(ext, write, make_cfg, tokenizer):
    rows = [{"prompt": "Write a haiku.", "answer": "1"}, {"prompt": "Count to 3.", "answer": "2"},
            {"prompt": "Write a haiku.", "answer": "3"}, {"prompt": "Say hi.", "answer": "4"}]
    cfg = make_cfg(path=write(f"prompts.{ext}", rows), test_size=1)
    train = load_prompt_data(cfg, tokenizer, split="train")
    evals = load_prompt_data(cfg, tokenizer, split="eval")
    assert train.summary.format == "prompt"
    assert train.summary.dropped == {"duplicate_prompt": 1}
    assert len(train) + len(evals) == 3 and not {e["row"] for e in train} & {e["row"] for e in evals}
    for ex in list(train) + list(evals):
        assert ex["prompt_text"].endswith("<|im_start|>assistant\n")
        assert tokenizer.decode(ex["prompt_ids"]) == ex["prompt_text"]
        assert str(ex["answer"]) == str(ex["row"])  # csv reads "1" back as 1
    with pytest.raises(DataError, match="holds prompts only"):
        load_preference_data(cfg, tokenizer)


def test_prompt_messages_column_and_prompts_of_a_preference_file(write, make_cfg, tokenizer):
    rows = [{"messages": [{"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "ref"}]}
            for i in range(4)]
    out = load_prompt_data(make_cfg(path=write("msgs.jsonl", rows), test_size=1), tokenizer)
    assert len(out) == 3
    assert all(ex["prompt_text"].endswith(f"Question {ex['row'] - 1}<|im_end|>\n<|im_start|>assistant\n") for ex in out)
    # prompts of an HH preference file; a duplicated transcript prefix is kept once
    path = write("hh.jsonl", HH + [HH[1]])
    got = load_prompt_data(make_cfg(path=path, test_size=1, chat_template=False), tokenizer)
    assert got.summary.dropped == {"duplicate_prompt": 1}
    assert all(ex["prompt_text"].endswith("\n\nAssistant:") for ex in got)


def test_detect_format_from_columns_and_types():
    k = Keys.from_cfg(DataConfig())
    assert detect_format(["prompt", "chosen", "rejected"], [{"chosen": "a"}], k, "f") == "explicit"
    assert detect_format(["chosen", "rejected"], [{"chosen": "\n\nHuman: a\n\nAssistant: b"}], k, "f") == "hh"
    assert detect_format(["chosen", "rejected"], [{"chosen": "plain text"}], k, "f") == "implicit"
    assert detect_format(["chosen", "rejected"], [{"chosen": None}, {"chosen": [{"role": "user"}]}], k,
                         "f") == "conversation"
    assert detect_format(["prompt"], [], k, "f") == "prompt"
    assert detect_format(["messages"], [], k, "f") == "prompt"
    with pytest.raises(DataError, match=r"f: cannot tell the data format from the columns \['x'\]"):
        detect_format(["x"], [], k, "f")


def test_hh_messages():
    assert hh_messages("\n\nHuman: a \n\nAssistant:  b\n\nHuman: c\n\nAssistant:") == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert hh_messages("context\n\nHuman: q") == [
        {"role": "user", "content": "context"}, {"role": "user", "content": "q"}]


# ----------------------------------------------------------------------------------------------
# bad rows: one error naming file, row and field; skip mode counts the reason

GOOD = {"prompt": "p", "chosen": "yes", "rejected": "no"}
HH_GOOD = {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: q\n\nAssistant: no"}
CONV_GOOD = _conv("q", "yes", "no")
BAD_ROWS = [
    # (good row, bad row, extra config, field, reason, message)
    (GOOD, {"prompt": "p", "rejected": "no"}, {}, "chosen", "missing_field", "missing or null"),
    (GOOD, {"prompt": "p", "chosen": "yes", "rejected": 5}, {}, "rejected", "not_string", "expected a string, got int"),
    (GOOD, {"prompt": 7, "chosen": "yes", "rejected": "no"}, {}, "prompt", "not_string", "expected a string, got int"),
    (GOOD, {"prompt": "p", "chosen": "  \n", "rejected": "no"}, {}, "chosen", "empty_response",
     "empty final assistant response"),
    (GOOD, {"prompt": "p", "chosen": "same", "rejected": " same "}, {}, "rejected", "identical_responses",
     "response is identical to 'chosen'"),
    (HH_GOOD, {"chosen": "\n\nHuman: q only", "rejected": "\n\nHuman: q\n\nAssistant: no"}, {}, "chosen",
     "no_assistant_turn", "HH transcript has no '\\n\\nAssistant:' turn"),
    (HH_GOOD, {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: other q\n\nAssistant: no"}, {},
     "rejected", "prefix_mismatch", "transcript differs from 'chosen' before the final assistant turn"),
    (HH_GOOD, {"chosen": "\n\nHuman: q\n\nAssistant: ", "rejected": "\n\nHuman: q\n\nAssistant: no"}, {}, "chosen",
     "empty_response", "empty final assistant response"),
    (HH_GOOD, {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: q\n\nAssistant: yes"}, {},
     "rejected", "identical_responses", "identical to 'chosen'"),
    (CONV_GOOD, {"chosen": [{"role": "user", "content": "q"}], "rejected": CONV_GOOD["rejected"]}, {}, "chosen",
     "no_assistant_turn", "conversation does not end with an assistant message"),
    (CONV_GOOD, {"chosen": CONV_GOOD["chosen"], "rejected": [{"role": "user", "content": "other"},
                                                             {"role": "assistant", "content": "no"}]}, {},
     "rejected", "prefix_mismatch", "conversation differs from 'chosen' before the final assistant message"),
    (CONV_GOOD, {"chosen": [{"role": "user"}], "rejected": CONV_GOOD["rejected"]}, {}, "chosen", "bad_messages",
     "message 0 is not a {role: str, content: str} dict"),
    ({**GOOD, "m": 1.0}, {**GOOD, "m": "lots"}, {"margin_key": "m"}, "m", "bad_margin", "margin must be a number"),
]


@pytest.mark.parametrize("good,bad,extra,field,reason,message", BAD_ROWS, ids=[f"{r[4]}-{r[3]}" for r in BAD_ROWS])
def test_each_bad_row_gives_its_error(good, bad, extra, field, reason, message, write, make_cfg, tokenizer):
    path = write("data.jsonl", [good, bad, good, good])
    with pytest.raises(DataError) as err:
        load_preference_data(make_cfg(path=path, **extra), tokenizer)
    e = err.value
    assert (e.row, e.field, e.reason) == (2, field, reason)
    assert str(e) == f"data.jsonl row 2, field '{field}': {e.detail} (set data.skip_invalid=true to skip such rows)"
    assert message in e.detail
    data = load_preference_data(make_cfg(path=path, skip_invalid=True, test_size=1, **extra), tokenizer)
    assert data.summary.dropped == {reason: 1}
    assert len(data.train) + len(data.eval) == 3


def test_empty_prompt_in_prompt_file(write, make_cfg, tokenizer):
    path = write("p.jsonl", [{"prompt": "ok"}, {"prompt": " "}, {"prompt": "fine"}])
    with pytest.raises(DataError, match=r"^p.jsonl row 2, field 'prompt': empty prompt"):
        load_prompt_data(make_cfg(path=path), tokenizer)


def test_file_level_errors(tmp_path, write, make_cfg, tokenizer):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        load_preference_data(make_cfg(path=str(tmp_path / "nope.jsonl")), tokenizer)
    bad_json = tmp_path / "broken.jsonl"
    bad_json.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"broken.jsonl: row 2: not valid JSON"):
        load_preference_data(make_cfg(path=str(bad_json)), tokenizer)
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="x.txt: unsupported file type"):
        load_preference_data(make_cfg(path=str(tmp_path / "x.txt")), tokenizer)
    path = write("cols.jsonl", [{"chosen": "a b", "rejected": "a c"}] * 3)
    with pytest.raises(DataError, match="cols.jsonl: column 'prompt' not found for format 'explicit'"):
        load_preference_data(make_cfg(path=path, format="explicit"), tokenizer)
    with pytest.raises(DataError, match="leaving none for training"):
        load_preference_data(make_cfg(path=write("two.jsonl", EXPLICIT[:2]), test_size=5), tokenizer)


def test_chat_template_that_rejects_a_prompt(write, make_cfg, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", "{% if messages|length > 1 %}{{ raise_exception('roles must "
                        "alternate') }}{% endif %}{{ messages[0]['content'] }}")
    strict = tokenizer
    rows = HH[1:] + [HH[0]] + HH[1:]  # row 3 has a multi-turn prompt
    path = write("hh.jsonl", rows)
    with pytest.raises(DataError, match=r"^hh.jsonl row 3, field 'prompt': the tokenizer's chat template rejects"):
        load_preference_data(make_cfg(path=path, test_size=1), strict)
    data = load_preference_data(make_cfg(path=path, test_size=1, skip_invalid=True), strict)
    assert data.summary.dropped == {"chat_template_error": 1} and len(data.train) + len(data.eval) == 4


def test_hub_name_offline_is_a_clear_error(make_cfg, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="^no-such-org/no-such-dataset: not a local file, and loading it from the hub"):
        load_preference_data(make_cfg(path="no-such-org/no-such-dataset"), tokenizer)


def _numbered(n, tag=""):
    return [{"prompt": f"{tag}q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]


def test_seeded_split_test_size_and_max_samples(write, make_cfg, tokenizer):
    path = write("ten.jsonl", _numbered(10))
    a = load_preference_data(make_cfg(path=path, test_size=0.2, seed=1), tokenizer)
    b = load_preference_data(make_cfg(path=path, test_size=0.2, seed=1), tokenizer)
    c = load_preference_data(make_cfg(path=path, test_size=0.2, seed=2), tokenizer)
    rows = lambda xs: [x["row"] for x in xs]  # noqa: E731
    assert (len(a.train), len(a.eval)) == (8, 2) and not set(rows(a.train)) & set(rows(a.eval))
    assert rows(a.train) == rows(b.train) and rows(a.eval) == rows(b.eval) and rows(a.eval) != rows(c.eval)
    capped = load_preference_data(make_cfg(path=path, test_size=2, max_samples=6, seed=1), tokenizer)
    assert (len(capped.train), len(capped.eval), capped.summary.unused) == (4, 2, 4)


def test_eval_path(write, make_cfg, tokenizer):
    train, evals = write("train.jsonl", _numbered(6)), write("eval.parquet", _numbered(3, tag="e"))
    data = load_preference_data(make_cfg(path=train, eval_path=evals, max_samples=4), tokenizer)
    s = data.summary
    assert (len(data.train), len(data.eval), s.rows_read, s.unused) == (4, 3, 9, 2)
    assert s.source == "train.jsonl + eval.parquet"
    assert all(tokenizer.decode(ex["prompt_ids"]).endswith(f"eq{ex['row'] - 1}<|im_end|>\n<|im_start|>assistant\n")
               for ex in data.eval)
    only_train = load_preference_data(make_cfg(path=train, eval_path=evals), tokenizer, splits=("train",))
    assert only_train.summary.rows_read == 6 and only_train.eval == [] and len(only_train.train) == 6
