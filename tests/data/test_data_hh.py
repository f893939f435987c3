"""The real Anthropic HH file (../shared/data): strict load, skipping load, exact prompt/response split."""

import gzip
import json
import random

import pytest
from data_fixtures import make_cfg  # noqa: F401 (pytest fixtures)

from rlhf_cli.data import DataError, load_preference_data, load_prompt_data

A = "\n\nAssistant:"
N_ROWS = 2312


@pytest.fixture(scope="module")
def raw_rows(hh_path):
    with gzip.open(hh_path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _reference_problems(rows):
    """Plain-Python reference: (row, field, reason) of each bad row, first problem per row."""
    out = []
    for i, r in enumerate(rows, 1):
        c, j = r["chosen"], r["rejected"]
        ic, ij = c.rfind(A), j.rfind(A)
        if c[:ic] != j[:ij]:
            out.append((i, "rejected", "prefix_mismatch"))
        elif not c[ic + len(A):].strip():
            out.append((i, "chosen", "empty_response"))
        elif not j[ij + len(A):].strip():
            out.append((i, "rejected", "empty_response"))
        elif c[ic + len(A):].strip() == j[ij + len(A):].strip():
            out.append((i, "rejected", "identical_responses"))
    return out


@pytest.fixture(scope="module")
def skipped(hh_path, make_cfg, tokenizer):
    cfg = make_cfg(path=hh_path, skip_invalid=True, max_length=4096, max_prompt_length=4000)
    return load_preference_data(cfg, tokenizer)


def test_strict_load_names_the_first_bad_row_and_field(hh_path, raw_rows, make_cfg, tokenizer):
    first = _reference_problems(raw_rows)[0]
    assert first == (87, "chosen", "empty_response")
    with pytest.raises(DataError) as err:
        load_preference_data(make_cfg(path=hh_path), tokenizer)
    assert str(err.value) == ("harmless-base-test.jsonl.gz row 87, field 'chosen': empty final assistant response "
                              "(set data.skip_invalid=true to skip such rows)")


def test_skipping_load_accounts_for_every_row(skipped, raw_rows):
    s = skipped.summary
    expected = {}
    for _, _, reason in _reference_problems(raw_rows):
        expected[reason] = expected.get(reason, 0) + 1
    assert s.rows_read == N_ROWS == len(raw_rows)
    assert s.dropped == expected == {"empty_response": 4, "prefix_mismatch": 5}
    assert len(skipped.train) + len(skipped.eval) + sum(s.dropped.values()) + s.unused == N_ROWS
    assert (s.kept["train"], s.kept["eval"]) == (len(skipped.train), len(skipped.eval))
    assert s.unused == 0 and s.truncated == 0
    rows = [ex["row"] for ex in skipped.train + skipped.eval]
    assert len(set(rows)) == len(rows)  # train and eval are disjoint
    # the held-out part is round(0.1 * rows) source rows, chosen by row number; its valid rows are the eval split
    bad_rows = {row for row, _, _ in _reference_problems(raw_rows)}
    held_out = {ex["row"] for ex in skipped.eval}
    assert len(held_out) == round(N_ROWS * 0.1) - len(bad_rows & _held_out_rows())
    assert not held_out & bad_rows
    line = s.line()
    assert "2312 rows read" in line and "4 empty_response" in line and "5 prefix_mismatch" in line
    assert s.lengths["p50"] <= s.lengths["p90"] <= s.lengths["max"]


def test_chat_split_is_exact(skipped, raw_rows, tokenizer):
    """Response = final assistant content + one EOS; prompt + response = the template's rendering minus
    its trailing newline."""
    from rlhf_cli.data.formats import hh_messages

    for ex in random.Random(0).sample(skipped.train, 25):
        raw = raw_rows[ex["row"] - 1]["chosen"]
        cut = raw.rfind(A)
        content = raw[cut + len(A):].strip()
        assert ex["chosen_ids"][-1] == tokenizer.eos_token_id
        assert tokenizer.eos_token_id not in ex["chosen_ids"][:-1]
        assert tokenizer.decode(ex["chosen_ids"]) == content + "<|im_end|>"
        full = hh_messages(raw[:cut]) + [{"role": "assistant", "content": content}]
        rendered = tokenizer.apply_chat_template(full, tokenize=False)
        assert tokenizer.decode(ex["prompt_ids"] + ex["chosen_ids"]) + "\n" == rendered


def test_raw_split_is_exact(hh_path, raw_rows, make_cfg, tokenizer):
    cfg = make_cfg(path=hh_path, skip_invalid=True, chat_template=False, max_length=4096, max_prompt_length=4000,
                   max_samples=200)
    data = load_preference_data(cfg, tokenizer, splits=("train",))
    s = data.summary  # 200 rows kept by max_samples, 20 of them held out for eval; bad rows among them dropped
    assert s.rows_read == s.kept["train"] + sum(s.dropped.values()) + s.unused
    assert 180 - 9 <= s.kept["train"] <= 180
    for ex in data.train[:40]:
        raw = raw_rows[ex["row"] - 1]
        prompt = tokenizer.decode(ex["prompt_ids"])
        assert prompt.endswith(A)
        assert prompt + tokenizer.decode(ex["chosen_ids"][:-1]) == raw["chosen"]
        assert prompt + tokenizer.decode(ex["rejected_ids"][:-1]) == raw["rejected"]
        assert ex["chosen_ids"][-1] == ex["rejected_ids"][-1] == tokenizer.eos_token_id


def test_prompts_of_the_hh_file(hh_path, make_cfg, tokenizer):
    prompts = load_prompt_data(make_cfg(path=hh_path, max_samples=50, max_prompt_length=64), tokenizer, split="eval")
    assert 5 - 1 <= len(prompts) <= 5  # 5 held-out rows; an identical prompt would be kept once
    assert all(len(p["prompt_ids"]) <= 64 for p in prompts)
    assert all(p["prompt_text"].endswith("<|im_start|>assistant\n") for p in prompts)


def _held_out_rows():
    from rlhf_cli.config import DataConfig
    from rlhf_cli.data.datasets import row_parts

    parts = row_parts(N_ROWS, DataConfig(test_size=0.1), "hh")
    return {row for row, part in parts.items() if part == "eval"}


def test_three_way_split_is_disjoint_for_pairs_and_prompts(hh_path, tokenizer):
    """RM pairs, PPO prompts and held-out rows of one file never share a source row."""
    from rlhf_cli.config import DataConfig
    from rlhf_cli.data import load_preference_data, load_prompt_data

    cfg = DataConfig(path=hh_path, format="hh", skip_invalid=True, test_size=0.1, ppo_size=0.2, max_length=256,
                     max_prompt_length=192)
    pairs = load_preference_data(cfg, tokenizer)
    ppo = load_prompt_data(cfg, tokenizer, split="train")
    held = load_prompt_data(cfg, tokenizer, split="eval")
    rm_rows = {ex["row"] for ex in pairs.train}
    ppo_rows = {ex["row"] for ex in ppo}
    eval_rows = {ex["row"] for ex in pairs.eval} | {ex["row"] for ex in held}
    assert rm_rows and ppo_rows and eval_rows
    assert not rm_rows & ppo_rows and not rm_rows & eval_rows and not ppo_rows & eval_rows
    assert abs(len(ppo) - 0.2 * N_ROWS) < 0.05 * N_ROWS
