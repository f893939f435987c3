"""Real task generators and verifiers (issue 58, step 4): `data=reasoning_gym` prompts scored by the package's
own `score_answer` in train-ppo and `rlhf eval`, and `rlhf_cli.verifiers:math_answer` (math-verify), tiny random
model, CPU."""

import sys

import pytest
import torch
from stage_helpers import compose
from test_stage_eval import MAX_NEW_TOKENS, fake_sampling, read_results, tiny_dirs  # noqa: F401 - a fixture
from test_stage_ppo import build_trainer, edit_generate

from rlhf_cli.data import load_preference_data, load_prompt_data
from rlhf_cli.data.reasoning_gym import checker, extract, reasoning_gym_splits
from rlhf_cli.errors import ConfigError
from rlhf_cli.verifiers import math_answer

RG = ["data=reasoning_gym", "data.reasoning_gym.tasks=[basic_arithmetic,chain_sum]", "data.reasoning_gym.size=12",
      "data.reasoning_gym.eval_size=6", "data.reasoning_gym.seed=3"]


def rg_cfg(overrides=()):
    return compose("train_ppo", ["model=tiny", *RG, *overrides])


def test_splits_are_generated_per_task_deduplicated_and_disjoint():
    splits = reasoning_gym_splits(rg_cfg().data)
    train, held = splits["train"], splits["eval"]
    texts = [p.text for _, p in train], [p.text for _, p in held]
    assert 12 < len(train) <= 24 and 6 < len(held) <= 12  # two tasks; a repeated question is kept once
    more = reasoning_gym_splits(rg_cfg(["data.reasoning_gym.size=20"]).data)
    assert [p.text for _, p in more["eval"]] == texts[1]  # the held-out set does not move with the training size
    assert len(set(texts[0])) == len(texts[0]) and len(set(texts[1])) == len(texts[1])
    assert not set(texts[0]) & set(texts[1])
    assert [row for row, _ in train] == list(range(1, len(train) + 1))
    _, first = train[0]
    assert first.messages[0]["role"] == "system" and "<answer>" in first.messages[0]["content"]
    assert first.messages[1] == {"role": "user", "content": first.text}
    assert first.answer == first.columns["answer"] and first.columns["metadata"]["source_dataset"] in (
        "basic_arithmetic", "chain_sum")
    assert reasoning_gym_splits(rg_cfg().data)["train"][0][1].text == first.text  # the seed decides
    assert reasoning_gym_splits(rg_cfg(["data.reasoning_gym.seed=4"]).data)["train"][0][1].text != first.text
    own = reasoning_gym_splits(rg_cfg(["data.system_prompt=Be brief."]).data)["train"][0][1]
    assert own.messages[0] == {"role": "system", "content": "Be brief."}


def test_a_tasks_settings_reach_its_generator_in_both_splits_and_the_other_task_keeps_its_defaults():
    """`data.reasoning_gym.task_config.chain_sum`: sums of two one-digit numbers, training and held-out; the
    package's default chain_sum draws up to 6 terms of up to 4 digits, and basic_arithmetic is left as it was."""
    import re

    easy = reasoning_gym_splits(rg_cfg(["+data.reasoning_gym.task_config.chain_sum={max_terms:2,max_digits:1}"]).data)
    default = reasoning_gym_splits(rg_cfg().data)

    def sums(splits, split):
        return [re.findall(r"\d+", p.text.split(":")[-1]) for _, p in splits[split]
                if p.columns["metadata"]["source_dataset"] == "chain_sum"]

    for split in ("train", "eval"):
        assert sums(easy, split) and all(len(n) == 2 and all(len(d) == 1 for d in n) for n in sums(easy, split))
        assert any(len(n) > 2 or any(len(d) > 1 for d in n) for n in sums(default, split))
        others = [[p.text for _, p in s[split] if p.columns["metadata"]["source_dataset"] == "basic_arithmetic"]
                  for s in (easy, default)]
        assert others[0] == others[1]


def test_the_checker_is_the_package_score_with_partial_credit():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1)[0]
    cols = {"question": [entry["question"]] * 5, "metadata": [entry["metadata"]] * 4 + [None]}
    a = entry["answer"]
    completions = [f"Let me see.\n<answer>{a}</answer>", f"<answer>{a}.0</answer>", "<answer>12345</answer>",
                   f"so it is\n{a}\n", f"<answer>{a}</answer>"]
    got = checker(["p"] * 5, completions, [a] * 5, **cols)
    want = [reasoning_gym.get_score_answer_fn("basic_arithmetic")(extract(c), entry) for c in completions[:4]]
    assert got[:4] == want and got[0] == 1.0 and 0 < got[1] < 1 and got[2] == 0.0 and got[3] == 1.0
    assert got[4] is None  # a row that is not reasoning-gym's: unscorable
    assert extract("") == "" and extract("a\n\n b \n") == "b"


def test_prompts_load_with_answers_and_columns_and_the_supervised_commands_refuse(tokenizer):
    cfg = rg_cfg()
    train = load_prompt_data(cfg.data, tokenizer, "train")
    held = load_prompt_data(cfg.data, tokenizer, "eval")
    assert len(train) == len(reasoning_gym_splits(cfg.data)["train"]) and len(held) > 0
    x = train[0]
    assert x["answer"] == x["columns"]["answer"] and "metadata" in x["columns"] and x["prompt_ids"]
    assert x["columns"]["question"] in x["prompt_text"]
    with pytest.raises(ConfigError, match="data.reasoning_gym gives prompts only"):
        load_preference_data(cfg.data, tokenizer)


@pytest.mark.parametrize(("overrides", "needle"), [
    (["data.reasoning_gym.tasks=[basic_arithmatic]"], "no task 'basic_arithmatic' in reasoning-gym (did you mean "
                                                      "basic_arithmetic"),
    (["data.path=x.jsonl"], "data.path=x.jsonl and data.reasoning_gym.tasks=['basic_arithmetic', 'chain_sum'] both"),
    (["+data.reasoning_gym.task_config.gcd={max_value:5}"], "task_config.gcd: gcd is not among data.reasoning_gym"),
    (["+data.reasoning_gym.task_config.chain_sum={max_trms:2}"], "chain_sum.max_trms: chain_sum has no setting "
                                                                 "'max_trms' (its settings: min_terms, max_terms"),
    (["+data.reasoning_gym.task_config.chain_sum={min_terms:3,max_terms:2}"], "chain_sum: reasoning-gym refuses "
                                                                              "{'min_terms': 3, 'max_terms': 2}"),
    (["+data.reasoning_gym.task_config.chain_sum={seed:1}"], "task_config.chain_sum.seed: set data.reasoning_gym.seed"),
    (["+data.reasoning_gym.task_config.chain_sum=3"], "task_config.chain_sum must be a mapping"),
])
def test_bad_settings_are_one_line(tokenizer, overrides, needle):
    from rlhf_cli.preflight import VALIDATORS

    cfg = rg_cfg(overrides)
    with pytest.raises(ConfigError) as e:
        VALIDATORS["train_ppo"](cfg)
        load_prompt_data(cfg.data, tokenizer)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_scorer_that_raises_is_a_wrong_answer_and_hash_seeded_tasks_need_pythonhashseed(monkeypatch):
    import reasoning_gym

    from rlhf_cli.data.reasoning_gym import check_tasks

    entry = reasoning_gym.create_dataset("prime_factorization", size=1, seed=0)[0]
    assert checker(["p"], ["<answer>]]]{{</answer>"], [entry["answer"]], question=[entry["question"]],
                   metadata=[entry["metadata"]]) == [0.0]  # its scorer raises on this text
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError, match="ransom_note draws its questions with Python's string hashing"):
        check_tasks(["basic_arithmetic", "ransom_note"])
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_tasks(["ransom_note"])


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package: pip install 'rlhf_cli\[reasoning\]'"):
        reasoning_gym_splits(rg_cfg().data)
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError, match=r"pip install 'rlhf_cli\[math\]'"):
        math_answer(["p"], ["1"], ["1"])


def test_train_ppo_scores_reasoning_gym_rollouts_with_the_package(tmp_path, monkeypatch):
    tr = build_trainer(tmp_path, [*RG, "reward.type=checker", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=4",
                                  "ppo.missing_eos_penalty=0", "ppo.max_new_tokens=12"])
    prompts, _, _ = tr.maker.prompt_batch(0)
    right = tr.tokenizer.encode(f"It is {prompts[0]['answer']}", add_special_tokens=False) + [tr.tokenizer.eos_token_id]

    def answer_row_0(responses):  # row 0 gives its answer untagged (the last line), then pads
        responses[0, :len(right)] = torch.tensor(right)
        responses[0, len(right):] = tr.tokenizer.pad_token_id

    edit_generate(monkeypatch, tr, answer_row_0)
    exp, stats, _ = tr.maker.make_experience(0)
    texts = tr.tokenizer.batch_decode(exp.input_ids[:, exp.prompt_len:], skip_special_tokens=True)
    cols = {k: [p["columns"][k] for p in prompts] for k in ("question", "metadata")}
    want = torch.tensor(checker([""] * len(texts), texts, [p["answer"] for p in prompts], **cols))
    torch.testing.assert_close(exp.scores, want)
    assert 0 < want[0] < 1  # the package's partial credit; the built-in checker would give 1.0 for the number
    assert stats["reward/checker"] == pytest.approx(want.mean().item())


def test_eval_accuracy_is_the_package_score(run_stage, tiny_dirs, tokenizer, monkeypatch):  # noqa: F811
    seen = fake_sampling(monkeypatch, tiny_dirs, tokenizer)
    _, eval_dir, _ = run_stage("eval", [
        f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}", "reward.type=checker",
        *RG, "data.max_samples=6", f"eval.max_new_tokens={MAX_NEW_TOKENS}"])
    out = read_results(eval_dir)
    cfg = rg_cfg(["data.max_samples=6"])
    prompts = load_prompt_data(cfg.data, tokenizer, "eval")
    for role in ("policy", "reference"):
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in seen[role][1]]
        cols = {k: [p["columns"][k] for p in prompts] for k in ("question", "metadata")}
        want = checker([""] * len(texts), texts, [p["answer"] for p in prompts], **cols)
        assert out[f"{role}/accuracy"] == pytest.approx(sum(want) / len(want))


@pytest.mark.parametrize(("completion", "answer", "want"), [
    ("The answer is 42.", 42, 1.0),
    ("So x = \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("We get $0.5$.", "$\\frac{1}{2}$", 1.0),
    ("It is 7.", "8", 0.0),
    ("I am not sure.", "3", 0.0),
    ("The answer is 42.", None, None),
    ("The answer is 42.", "", None),
])
def test_math_answer_compares_mathematics_and_leaves_bad_labels_unscored(completion, answer, want):
    assert math_answer(["p"], [completion], [answer]) == [want]
