"""Hostile data files: each one ends in a clear DataError or in a counted skip, never in a crash or a
silent drop.

The contract (datasets.py's docstring has the decisions): with `data.skip_invalid=false` a bad row is a
DataError naming the file, the row and (where there is one) the field; with `skip_invalid=true` it is
counted under its reason. Valid rows the config cannot use (too long, identical once tokenised) are
dropped and counted in both modes; damage to the whole file is a DataError in both modes. In every
successful load the summary accounts for each non-blank line of the file:

    rows_read == non-blank lines == sum(kept) + sum(dropped) + unused

The second half generates rows of random JSON values per field with hypothesis and checks the same.
"""

import gzip
import json
from pathlib import Path

import pytest
from data_fixtures import make_cfg  # noqa: F401 (pytest fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_cli.data import DataError, load_preference_data, load_prompt_data, read_rows


def good(i):
    return {"prompt": f"Question {i}?", "chosen": f"Good answer {i}.", "rejected": f"Bad answer {i}."}


def hh(prompt, answer):
    return f"\n\nHuman: {prompt}\n\nAssistant: {answer}"


def conv(user, answer):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def lines_of(*rows):
    """JSON-lines text; a str item is written as it is (a malformed line), a dict as JSON."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def with_bad_row(bad, n_good=4, at=3, make=good):
    """`n_good` good rows with `bad` (a dict, or a raw line) inserted as row `at`."""
    rows = [make(i) for i in range(n_good)]
    rows.insert(at - 1, bad)
    return lines_of(*rows)


def non_blank_lines(data: bytes) -> int:
    return sum(1 for ln in data.split(b"\n") if ln.strip())


def load(path, make_cfg, tokenizer, want="pairs", **overrides):
    """The summary of a successful load (after checking it accounts for every row), or the DataError.
    Any other exception escapes and fails the test."""
    cfg = make_cfg(path=str(path), **{"test_size": 1, **overrides})
    try:
        if want == "pairs":
            data = load_preference_data(cfg, tokenizer)
            kept = len(data.train) + len(data.eval)
        else:
            data = load_prompt_data(cfg, tokenizer, split="train")
            kept = len(data)
    except DataError as e:
        return e
    s = data.summary
    assert sum(s.kept.values()) == kept
    assert s.rows_read == sum(s.kept.values()) + sum(s.dropped.values()) + s.unused, s.line()
    return s


def check_clear_error(e, name, row=None, field=None, reason=None):
    """A DataError whose one-line message starts with the file name and names the row and field."""
    assert isinstance(e, DataError), f"expected a DataError, got a load that kept rows: {e}"
    msg = str(e)
    assert msg.startswith(name) and "\n" not in msg and "Traceback" not in msg
    assert (e.row, e.field) == (row, field), msg
    if row is not None:
        assert f"row {row}" in msg and "data.skip_invalid=true" in msg
        assert e.reason == reason
    if field is not None:
        assert f"field '{field}'" in msg


# ----------------------------------------------------------------------------------------------
# one bad row among good ones: an error naming it, or one counted skip

SURROGATE = '{"prompt": "q", "chosen": "ok \\ud800 then", "rejected": "no"}'  # a JSON escape of a lone surrogate
HH_GOOD = lambda i: {"chosen": hh(f"q{i}", "yes"), "rejected": hh(f"q{i}", "no")}  # noqa: E731
CONV_GOOD = lambda i: {"chosen": conv(f"q{i}", "yes"), "rejected": conv(f"q{i}", "no")}  # noqa: E731

BAD_ROWS = [
    # (id, file text, extra config, field, reason)
    ("malformed-json", with_bad_row('{"prompt": "q", "chosen": oops}'), {}, None, "bad_json"),
    ("cut-off-json", with_bad_row('{"prompt": "q", "chos'), {}, None, "bad_json"),
    ("array-line", with_bad_row("[1, 2]"), {}, None, "bad_json"),
    ("number-line", with_bad_row("42"), {}, None, "bad_json"),
    ("null-line", with_bad_row("null"), {}, None, "bad_json"),
    ("bom-mid-file", with_bad_row("\ufeff" + json.dumps(good(9))), {}, None, "bad_json"),
    ("int-chosen", with_bad_row({**good(9), "chosen": 5}), {}, "chosen", "not_string"),
    ("float-prompt", with_bad_row({**good(9), "prompt": 1.5}), {}, "prompt", "not_string"),
    ("bool-rejected", with_bad_row({**good(9), "rejected": True}), {}, "rejected", "not_string"),
    ("list-prompt", with_bad_row({**good(9), "prompt": ["a", "b"]}), {}, "prompt", "not_string"),
    ("dict-chosen", with_bad_row({**good(9), "chosen": {"text": "a"}}), {}, "chosen", "not_string"),
    ("null-rejected", with_bad_row({**good(9), "rejected": None}), {}, "rejected", "missing_field"),
    ("missing-chosen", with_bad_row({"prompt": "q", "rejected": "no"}), {}, "chosen", "missing_field"),
    ("empty-chosen", with_bad_row({**good(9), "chosen": ""}), {}, "chosen", "empty_response"),
    ("whitespace-rejected", with_bad_row({**good(9), "rejected": " \t\n\u3000 "}), {}, "rejected", "empty_response"),
    ("chosen-equals-rejected", with_bad_row({"prompt": "q", "chosen": "same", "rejected": "same"}), {}, "rejected",
     "identical_responses"),
    ("lone-surrogate-response", with_bad_row(SURROGATE), {}, "chosen", "invalid_unicode"),
    ("lone-surrogate-prompt", with_bad_row('{"prompt": "\\udc00", "chosen": "a", "rejected": "b"}'), {}, "prompt",
     "invalid_unicode"),
    ("hh-without-assistant", with_bad_row({"chosen": "\n\nHuman: only a question", "rejected": hh("q", "no")},
                                          make=HH_GOOD), {}, "chosen", "no_assistant_turn"),
    ("hh-int", with_bad_row({"chosen": 7, "rejected": hh("q", "no")}, make=HH_GOOD), {"format": "hh"}, "chosen",
     "not_string"),
    ("hh-identical", with_bad_row({"chosen": hh("q", "same"), "rejected": hh("q", "same")}, make=HH_GOOD), {},
     "rejected", "identical_responses"),
    ("conversation-not-a-list", with_bad_row({"chosen": "text", "rejected": conv("q", "no")}, make=CONV_GOOD),
     {"format": "conversation"}, "chosen", "bad_messages"),
    ("conversation-null-content", with_bad_row({"chosen": [{"role": "user", "content": None}],
                                                "rejected": conv("q", "no")}, make=CONV_GOOD), {}, "chosen",
     "bad_messages"),
    ("conversation-surrogate", with_bad_row({"chosen": conv("q", "yes\ud800"), "rejected": conv("q", "no")},
                                            make=CONV_GOOD), {}, "chosen", "invalid_unicode"),
    ("margin-nan", with_bad_row({**good(9), "m": float("nan")}, make=lambda i: {**good(i), "m": 1.0}),
     {"margin_key": "m"}, "m", "bad_margin"),
]


@pytest.mark.parametrize("text,extra,field,reason", [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS])
def test_a_bad_row_is_an_error_naming_it_or_a_counted_skip(text, extra, field, reason, tmp_path, make_cfg,
                                                           tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check_clear_error(load(path, make_cfg, tokenizer, **extra), "data.jsonl", row=3, field=field, reason=reason)
    s = load(path, make_cfg, tokenizer, skip_invalid=True, **extra)
    assert s.rows_read == 5 and s.dropped == {reason: 1}, s


def test_invalid_utf8_bytes_are_one_bad_row(tmp_path, make_cfg, tokenizer):
    path = tmp_path / "data.jsonl"
    latin1 = b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}'  # "café" in Latin-1, not UTF-8
    path.write_bytes(with_bad_row("BAD").encode().replace(b"BAD", latin1))
    e = load(path, make_cfg, tokenizer)
    check_clear_error(e, "data.jsonl", row=3, reason="bad_json")
    assert "not valid UTF-8" in str(e)
    assert load(path, make_cfg, tokenizer, skip_invalid=True).dropped == {"bad_json": 1}


def test_error_after_blank_lines_names_the_file_line_too(tmp_path, make_cfg, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(lines_of(good(0), "", "   ", good(1), {**good(2), "chosen": 3}, good(3)))
    e = load(path, make_cfg, tokenizer)
    check_clear_error(e, "data.jsonl", row=3, field="chosen", reason="not_string")
    assert "(line 5 of the file)" in str(e)
    assert load(path, make_cfg, tokenizer, skip_invalid=True).rows_read == 4  # blank lines are not rows


def test_prompt_file_bad_rows(tmp_path, make_cfg, tokenizer):
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    for bad, field, reason in [({"prompt": 3}, "prompt", "not_string"), ({"prompt": "  "}, "prompt", "empty_prompt"),
                               ({"prompt": "\ud800"}, "prompt", "invalid_unicode"), ("{oops", None, "bad_json"),
                               ({"prompt": [{"role": "user"}]}, "prompt", "bad_messages")]:
        path = tmp_path / "prompts.jsonl"
        path.write_text(lines_of(*rows[:2], bad, *rows[2:]), encoding="utf-8", errors="surrogatepass")
        check_clear_error(load(path, make_cfg, tokenizer, want="prompts"), "prompts.jsonl", row=3, field=field,
                          reason=reason)
        s = load(path, make_cfg, tokenizer, want="prompts", skip_invalid=True)
        assert s.dropped == {reason: 1} and s.rows_read == 5


def test_json_array_file_with_a_non_object_element(tmp_path, make_cfg, tokenizer):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([good(0), good(1), "not a row", good(2), good(3)]))
    check_clear_error(load(path, make_cfg, tokenizer), "data.json", row=3, reason="bad_json")
    assert load(path, make_cfg, tokenizer, skip_invalid=True).dropped == {"bad_json": 1}
    path.write_text(json.dumps([good(0), good(1)])[:-5])  # a cut-off array: no row to skip
    for skip in (False, True):
        e = load(path, make_cfg, tokenizer, skip_invalid=skip)
        check_clear_error(e, "data.json")
        assert "not valid JSON" in str(e) and "line 1 column" in str(e)


# ----------------------------------------------------------------------------------------------
# rows that are valid, odd or too big: kept (whole or truncated) or dropped and counted in both modes


@pytest.mark.parametrize("skip", [False, True])
def test_unicode_edge_cases_are_kept(skip, tmp_path, make_cfg, tokenizer):
    odd = ["nul \x00 inside", "rtl \u200f\u202eمرحبا\u202c", "emoji 😀👍🏽🧑‍🚀",
           "combining e\u0301\u0301\u0302",
           "zero width \u200b\u2060", "line sep \u2028 and \u2029", "bom \ufeff inside", "\U0010ffff max code point"]
    rows = [{"prompt": f"{t} ?", "chosen": f"yes {t}", "rejected": f"no {t}"} for t in odd]
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + lines_of(*rows).encode("utf-8"))  # a BOM at the start of the file
    s = load(path, make_cfg, tokenizer, skip_invalid=skip)
    assert s.rows_read == len(odd) and sum(s.kept.values()) == len(odd) and s.dropped == {}
    data = load_preference_data(make_cfg(path=str(path), test_size=1), tokenizer)
    texts = {tokenizer.decode(ex["chosen_ids"], skip_special_tokens=True) for ex in data.train + data.eval}
    assert "yes emoji 😀👍🏽🧑‍🚀" in texts and "yes nul \x00 inside" in texts


@pytest.mark.parametrize("skip", [False, True])
def test_huge_and_long_rows_are_counted(skip, tmp_path, make_cfg, tokenizer):
    huge = "word " * 200_000  # 1 MB
    rows = [good(0), good(1),
            {"prompt": "q", "chosen": huge, "rejected": "short"},          # a response alone > max_length
            {"prompt": huge, "chosen": "yes", "rejected": "no"},           # a prompt > max_length: cut from the left
            {"prompt": "w " * 300, "chosen": "yes", "rejected": "no"},     # a prompt > max_prompt_length
            {"prompt": "q", "chosen": "ok", "rejected": "ok<|im_end|>"},   # identical once tokenised
            good(2)]
    path = tmp_path / "big.jsonl"
    path.write_text(lines_of(*rows))
    s = load(path, make_cfg, tokenizer, skip_invalid=skip, max_length=128, max_prompt_length=64)
    assert s.rows_read == 7 and sum(s.kept.values()) == 5 and s.truncated == 2
    assert s.dropped == {"response_too_long": 1, "identical_after_truncation": 1}
    data = load_preference_data(make_cfg(path=str(path), test_size=1, max_length=128, max_prompt_length=64), tokenizer)
    assert all(len(ex["prompt_ids"]) <= 64 for ex in data.train + data.eval)


def test_duplicate_pairs_are_kept_and_counted(tmp_path, make_cfg, tokenizer):
    path = tmp_path / "dups.jsonl"
    path.write_text(lines_of(good(0), good(1), good(0), good(2), good(0), good(3)))
    s = load(path, make_cfg, tokenizer)
    assert sum(s.kept.values()) == 6 and s.duplicates == 2 and s.dropped == {}
    assert "(incl. 2 duplicate pairs)" in s.line()
    assert load(path, make_cfg, tokenizer, want="prompts").dropped == {"duplicate_prompt": 2}  # prompt data drops them


# ----------------------------------------------------------------------------------------------
# damaged files: a DataError in both modes


def _gzip_cut(rows, keep=0.5):
    blob = gzip.compress(lines_of(*rows).encode())
    return blob[: int(len(blob) * keep)]


FILES = [
    # (id, file name, content, message)
    ("empty", "data.jsonl", b"", "holds no rows"),
    ("blank-lines", "data.jsonl", b"\n  \n\t\n\r\n", "holds no rows"),
    ("empty-gzip", "data.jsonl.gz", gzip.compress(b""), "holds no rows"),
    ("truncated-gzip", "data.jsonl.gz", _gzip_cut([good(i) for i in range(200)]), "compressed file is truncated"),
    ("not-gzip", "data.jsonl.gz", lines_of(good(0)).encode(), "cannot read the file"),
    ("only-bad-lines", "data.jsonl", b"{oops\n[1]\n", "row 1: not valid JSON"),
    ("json-object-file", "data.json", json.dumps({"rows": [good(0), good(1)]}, indent=2).encode(),
     "holds a single JSON object spread over several lines"),
    ("json-scalar-file", "data.json", b"[1, 2, 3]", "row 1: not a JSON object"),
]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name,content,message", [c[1:] for c in FILES], ids=[c[0] for c in FILES])
def test_damaged_file_is_a_clear_error(name, content, message, skip, tmp_path, make_cfg, tokenizer):
    path = tmp_path / name
    path.write_bytes(content)
    for want in ("pairs", "prompts"):
        e = load(path, make_cfg, tokenizer, want=want, skip_invalid=skip)
        assert isinstance(e, DataError), e
        assert str(e).startswith(name) and "\n" not in str(e)
        if skip and message.startswith("row 1"):
            message = "no valid rows"
        assert message in str(e), str(e)


def test_all_rows_skipped_is_a_clear_error(tmp_path, make_cfg, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(lines_of({"prompt": "q", "chosen": "", "rejected": "x"},
                             {"prompt": "q", "chosen": 1, "rejected": "x"}))
    e = load(path, make_cfg, tokenizer, skip_invalid=True)
    assert str(e) == "data.jsonl: no valid rows: all 2 rows are skipped (1 empty_response, 1 not_string)"


def test_read_rows_reports_the_first_bad_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(lines_of(good(0), "{oops", good(1)))
    with pytest.raises(DataError, match=r"^data.jsonl: row 2: not valid JSON \(Expecting property name"):
        read_rows(str(path))


# ----------------------------------------------------------------------------------------------
# property-based: files of near-valid rows of one format, some fields replaced by random JSON values

KEYS = ["prompt", "chosen", "rejected", "messages", "answer", "m"]
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
texts = (st.text(max_size=12)
         | st.sampled_from(["", " ", "\n\n", "\ud800", "a\x00b", "\u200f", "\ufeff", "😀", "e\u0301", "<|im_end|>",
                            "\n\nAssistant:", "\n\nHuman:"])
         | st.builds(lambda a, b: hh(a, b), st.text(max_size=6), st.text(max_size=6)))
roles = st.sampled_from(["user", "assistant", "system", "tool", ""])
messages = st.lists(st.fixed_dictionaries({"role": roles | scalars, "content": texts | scalars}), max_size=3)
field_values = texts | texts | messages | json_values
bad_lines = st.sampled_from(["{oops", "[]", "7", '"text"', "null", "\ufeff{}"])
KINDS = ["explicit", "implicit", "hh", "conversation", "prompt"]


def template(kind, i, a, b):
    """A valid row of `kind` (row i; `a`, `b` distinct answer words), with a margin and an answer."""
    q = f"question {i}"
    row = {"explicit": {"prompt": q, "chosen": a, "rejected": b},
           "implicit": {"chosen": f"{q} {a}", "rejected": f"{q} {b}"},
           "hh": {"chosen": hh(q, a), "rejected": hh(q, b)},
           "conversation": {"chosen": conv(q, a), "rejected": conv(q, b)},
           "prompt": {"prompt": q}}[kind]
    return {**row, "m": float(i), "answer": i}


@st.composite
def fuzz_files(draw):
    """(rows, data.format): 2-6 rows, mostly valid rows of one format with 0-2 fields replaced by a random
    value or removed, some wholly random objects, some lines that are not JSON objects."""
    kind = draw(st.sampled_from(KINDS))
    rows = []
    for _ in range(draw(st.integers(2, 6))):
        pick = draw(st.integers(0, 9))
        if pick == 0:
            rows.append(draw(bad_lines))
        elif pick == 1:
            rows.append(draw(st.dictionaries(st.sampled_from(KEYS), field_values, max_size=len(KEYS))))
        else:
            a = draw(st.sampled_from(["yes", "no", "maybe", "four", "five"]))
            row = template(kind, draw(st.integers(0, 3)), a, draw(st.sampled_from(["nope", "wrong", a])))
            for key in draw(st.lists(st.sampled_from(KEYS), max_size=2)):
                if draw(st.booleans()):
                    row.pop(key, None)
                else:
                    row[key] = draw(field_values)
            rows.append(row)
    return rows, draw(st.sampled_from(["auto", "auto", kind, *KINDS]))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fuzz_files(), margin=st.booleans())
def test_random_rows_end_in_a_clear_error_or_a_full_account(case, margin, fuzz_dir, make_cfg, tokenizer):
    rows, fmt = case
    path = Path(fuzz_dir) / "fuzz.jsonl"
    data = lines_of(*rows).encode("utf-8", errors="surrogatepass")
    path.write_bytes(data)
    extra = {"format": fmt, "margin_key": "m" if margin else None, "max_length": 64, "max_prompt_length": 32}
    for want in ("pairs", "prompts"):
        for skip in (False, True):
            out = load(path, make_cfg, tokenizer, want=want, skip_invalid=skip, **extra)
            if isinstance(out, DataError):
                msg = str(out)
                assert msg.startswith("fuzz.jsonl") and "\n" not in msg
                if out.row is not None:  # a row's error: only without skip_invalid, naming row and field
                    assert not skip and f"row {out.row}" in msg and out.reason
                    assert out.field is None or f"field '{out.field}'" in msg
            else:
                assert out.rows_read == non_blank_lines(data)
