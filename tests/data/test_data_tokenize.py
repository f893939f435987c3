"""Rendering, the exact prompt/response boundary, EOS, BOS and left truncation."""

import pytest
from data_fixtures import make_cfg, write  # noqa: F401 (pytest fixtures)

from rlhf_cli.data import Encoder, Prompt, load_preference_data, load_prompt_data, truncate_left


class CharTokenizer:
    """A character-level tokenizer that prepends a BOS (id 1), like Llama's; EOS is id 2."""

    eos_token_id, eos_token, bos_token_id, chat_template = 2, "</s>", 1, None

    def __call__(self, text, add_special_tokens=True, split_special_tokens=False):
        def enc(t):
            return ([1] if add_special_tokens else []) + [ord(c) + 10 for c in t]
        return {"input_ids": [enc(t) for t in text] if isinstance(text, list) else enc(text)}


def test_truncate_left_hand_computed():
    assert truncate_left([5, 6, 7, 8], 2) == [7, 8]
    assert truncate_left([5, 6, 7, 8], 9) == [5, 6, 7, 8]
    assert truncate_left([5, 6, 7, 8], 0) == []
    assert truncate_left([1, 6, 7, 8], 3, bos_id=1) == [1, 7, 8]  # the BOS stays in front
    assert truncate_left([1, 6, 7, 8], 1, bos_id=1) == [1]


def test_at_most_one_bos_and_boundary_with_a_bos_tokenizer():
    enc = Encoder(CharTokenizer(), chat_template=True)
    assert not enc.use_chat and enc.bos_id == 1
    prompt = Prompt(messages=[], text="ab")
    (p_ids,) = enc.encode_prompts([prompt])
    assert p_ids == [1, ord("a") + 10, ord("b") + 10]
    assert enc.encode_responses([" c", "d</s>"]) == [[ord(" ") + 10, ord("c") + 10, 2], [ord("d") + 10, 2]]
    fitted = enc.fit_prompt(prompt, p_ids + [20] * 10, 4)
    assert fitted == [1, 20, 20, 20] and fitted.count(1) == 1


def test_chat_response_is_content_plus_one_eos(tokenizer):
    enc = Encoder(tokenizer, chat_template=True)
    assert enc.use_chat and enc.bos_id is None
    prompt = Prompt(messages=[{"role": "user", "content": "Hi"}], text="Hi")
    rendered = enc.render_prompt(prompt)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    (ids,) = enc.encode_responses(["  Hello there!\n<|im_end|>"])
    assert ids[-1] == tokenizer.eos_token_id == 2 and ids.count(2) == 1
    assert tokenizer.decode(ids) == "Hello there!<|im_end|>"
    raw = Encoder(tokenizer, chat_template=False)
    assert raw.render_prompt(prompt) == "Hi"
    assert tokenizer.decode(raw.encode_responses([" Hello\n"])[0]) == " Hello\n<|im_end|>"


def test_boundary_has_no_merged_tokens(tokenizer):
    """Where joint tokenisation would merge across the boundary ("wor" + "ld" -> "world"), the prompt
    ids are still exactly the prompt's own tokens."""
    enc = Encoder(tokenizer, chat_template=False)
    (p_ids,), (r_ids,) = enc.encode_prompts([Prompt(messages=[], text="Hello wor")]), enc.encode_responses(["ld"])
    joint = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert joint != p_ids + r_ids[:-1]  # the merge we avoid
    assert p_ids == tokenizer("Hello wor", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(p_ids) == "Hello wor" and tokenizer.decode(r_ids) == "ld<|im_end|>"


def test_truncation_keeps_eos_and_cuts_the_prompt_from_the_left(write, make_cfg, tokenizer):
    words = " ".join(f"w{i}" for i in range(120))
    rows = [{"prompt": words, "chosen": "Short yes.", "rejected": "Short no, longer reply here."},
            {"prompt": "tiny", "chosen": "x " * 200, "rejected": "y"},          # a response alone > max_length
            {"prompt": "same", "chosen": "ok", "rejected": "ok<|im_end|>"},      # identical once tokenised
            {"prompt": words, "chosen": "A", "rejected": "B"}]
    path = write("long.jsonl", rows)
    cfg = make_cfg(path=path, max_length=40, max_prompt_length=24, chat_template=False, test_size=1, seed=1)
    data = load_preference_data(cfg, tokenizer)
    s = data.summary
    assert s.dropped == {"response_too_long": 1, "identical_after_truncation": 1}
    assert s.rows_read == 4 and sum(s.kept.values()) == 2 and s.truncated == 2
    full = tokenizer(words, add_special_tokens=False)["input_ids"]
    for ex in data.train + data.eval:
        longest = max(len(ex["chosen_ids"]), len(ex["rejected_ids"]))
        assert len(ex["prompt_ids"]) == min(24, 40 - longest)
        assert ex["prompt_ids"] == full[-len(ex["prompt_ids"]):]  # the END of the prompt is kept
        assert ex["chosen_ids"][-1] == ex["rejected_ids"][-1] == tokenizer.eos_token_id
    first = next(ex for ex in data.train + data.eval if ex["row"] == 1)
    assert tokenizer.decode(first["chosen_ids"]) == "Short yes.<|im_end|>"
    assert tokenizer.decode(first["prompt_ids"]).endswith("w118 w119")


def test_prompt_data_is_cut_from_the_left(write, make_cfg, tokenizer):
    """Raw text: the end of the prompt is kept. (Chat prompts keep their template: test_data_boundaries.py.)"""
    words = " ".join(f"w{i}" for i in range(100))
    path = write("p.jsonl", [{"prompt": words}, {"prompt": "short"}, {"prompt": words + " end"}])
    cfg = make_cfg(path=path, max_prompt_length=40, test_size=1, chat_template=False)
    out = [*load_prompt_data(cfg, tokenizer), *load_prompt_data(cfg, tokenizer, split="eval")]
    assert sorted(ex["row"] for ex in out) == [1, 2, 3]
    for ex in out:
        full = tokenizer(ex["prompt_text"], add_special_tokens=False)["input_ids"]
        assert ex["prompt_ids"] == full[-40:]  # short prompts whole, long ones cut from the left
        assert (len(full) > 40) == (ex["row"] != 2)


@pytest.mark.parametrize("chat", [True, False])
def test_builtin_pairs_rendering(chat, make_cfg, tokenizer):
    data = load_preference_data(make_cfg(chat_template=chat, max_samples=4), tokenizer)
    ex = data.train[0]
    prompt = tokenizer.decode(ex["prompt_ids"])
    if chat:
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
        assert "The answer is" in tokenizer.decode(ex["chosen_ids"])
    else:
        assert prompt.startswith("Question: ") and prompt.endswith("\nAnswer:")
        assert tokenizer.decode(ex["chosen_ids"]).startswith(" ")
    assert tokenizer.decode(ex["chosen_ids"]).endswith(".<|im_end|>")


def test_system_prompt_replaces_the_template_default(make_cfg, tokenizer):
    default = load_prompt_data(make_cfg(max_samples=2), tokenizer, split="eval")
    short = load_prompt_data(make_cfg(max_samples=2, system_prompt="Solve it."), tokenizer, split="eval")
    assert "You are a helpful AI assistant" in default[0]["prompt_text"]
    assert short[0]["prompt_text"].startswith("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n")
    assert len(short[0]["prompt_ids"]) < len(default[0]["prompt_ids"])
