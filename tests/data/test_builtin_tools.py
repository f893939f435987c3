"""The built-in task with tools (issue 57 part C): the calculator (`builtin_envs.calculate`, `Calculator`) and the
general form without tools (`Retry`) run by the environment runner, train-sft's tool demonstrations
(`data.builtin.tool_calls`), the hard split (`data.builtin.difficulty=hard`) and `experiment=tools`."""

import json

import pytest
import torch
from data_fixtures import make_cfg  # noqa: F401 (pytest fixture)
from test_data_sft import _trained_text

from rlhf_cli.data import builtin, builtin_envs, load_sft_data
from rlhf_cli.rollout import Generation, Sampling
from rlhf_cli.rollout.environments import EnvironmentRunner, EnvSettings, environment_tools, turn_seed

EOS, PAD = 2, 0  # SmolLM2: <|im_end|>, <|endoftext|>


@pytest.mark.parametrize(("expression", "want"), [("347 * 28", 9716), ("7 / 2", 3.5), ("(3 + 4) * 2", 14),
                                                  ("-5 + 2", -3), ("2 ** 10", 1024), ("12 × 7", 84), ("9 // 2", 4)])
def test_calculate_evaluates_arithmetic(expression, want):
    got = builtin_envs.calculate(expression)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(("expression", "why"), [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("'a' * 3", "only numbers"),
    ("1 / 0", "division by zero"), ("2 ** 100", "an exponent over"), ("((10**64)**64)**64", "too large"),
    ("(-8) ** 0.5", "complex"), ("1e400", "too large"), ("3 +", "not an arithmetic"), ("", "give an arithmetic"),
    ("1" * 300, "longer than"), ("True + 1", "only numbers")])
def test_calculate_refuses_anything_else_in_one_line_the_model_reads(expression, why):
    with pytest.raises(ValueError, match=why) as e:
        builtin_envs.calculate(expression)
    assert "\n" not in str(e.value)


class Turns:
    """A generator answering every row with the same scripted turns (text; "<EOT>" at its end = the end-of-turn
    id), turn t found from the rows' seeds (`turn_seed`)."""

    own_weights, sync_seconds, probes, tensors_changed = False, 0.0, False, None

    def __init__(self, tokenizer, turns, seeds):
        self.tok, self.turns = tokenizer, turns
        self.turn_of = {turn_seed(s, t): t for s in seeds for t in range(len(turns))}

    def generate(self, prompt_ids, seeds, sampling):
        rows = []
        for s in seeds:
            text = self.turns[self.turn_of[int(s)]]
            ids = self.tok(text.removesuffix("<EOT>"), add_special_tokens=False)["input_ids"]
            rows.append((ids + [EOS] * text.endswith("<EOT>"))[:sampling.max_new_tokens])
        n = sampling.max_new_tokens
        responses, mask = torch.full((len(rows), n), PAD), torch.zeros(len(rows), n)
        for b, ids in enumerate(rows):
            responses[b, :len(ids)], mask[b, :len(ids)] = torch.tensor(ids), 1
        return Generation(responses, mask, torch.tensor([r[-1] == EOS for r in rows]), None)


def run_env(tokenizer, env, turns, problems):
    runner = EnvironmentRunner(f"rlhf_cli.data.builtin_envs:{env}", tokenizer, EnvSettings())
    seeds = list(range(7, 7 + len(problems)))
    rows = [{"messages": [{"role": "user", "content": p.question}], "answer": p.answer, "row": i}
            for i, p in enumerate(problems, 1)]
    sampling = Sampling(eos_ids=(EOS,), pad_id=PAD, max_new_tokens=64, temperature=1.0, top_p=1.0)
    return runner, runner.run(rows, seeds, Turns(tokenizer, turns, seeds), sampling)


def hard_problems(n=2):
    cfg = make_builtin(difficulty="hard")
    return builtin.builtin_splits(cfg)["ppo_eval"][:n]


def make_builtin(**kw):
    from omegaconf import OmegaConf

    from rlhf_cli.config import BuiltinTaskConfig

    cfg = OmegaConf.structured(BuiltinTaskConfig)
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def test_the_calculator_environment_answers_a_call_with_its_value(tokenizer):
    """`Calculator` in the environment runner: one `calculate` tool (its schema `calculator_schema`), a call's
    result the value as the model reads it; the run's checker then scores the policy's own final words."""
    problems = hard_problems()
    (p,) = problems[:1]
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "' + p.expression + '"}}</tool_call>'
    runner, ep = run_env(tokenizer, "Calculator", [call, f"The answer is {p.answer}.<EOT>"], problems[:1])
    tools, schemas = environment_tools(builtin_envs.Calculator(), "spec")
    assert list(tools) == ["calculate"] and schemas == [builtin_envs.calculator_schema()]
    completion = ep.conversations[0].completion
    assert completion[1] == {"role": "tool", "name": "calculate", "content": str(p.answer)}
    assert ep.turns.tolist() == [2] and ep.score is None  # no get_reward: the run's reward sources score it
    sampled = tokenizer.decode(ep.sampled_view(PAD)[0][0, ep.P:], skip_special_tokens=True)
    assert builtin.check_answer(sampled, p.answer) == 1.0
    assert runner.stats["episode/tool_errors"] == 0


def test_the_retry_environment_asks_once_after_a_wrong_answer(tokenizer):
    """`Retry`, the general form without tools: a wrong first answer gets `RETRY` and a second turn, whose answer
    is the one the checker reads (the last "answer is"); a right first answer ends the episode."""
    problems = builtin.builtin_splits(make_builtin())["ppo_eval"][:1]
    (p,) = problems
    _, wrong_first = run_env(tokenizer, "Retry", [f"The answer is {p.answer + 1}.<EOT>",
                                                  f"The answer is {p.answer}.<EOT>"], problems)
    assert wrong_first.turns.tolist() == [2]
    completion = wrong_first.conversations[0].completion
    assert completion[1] == {"role": "user", "content": builtin_envs.RETRY}
    sampled = tokenizer.decode(wrong_first.sampled_view(PAD)[0][0, wrong_first.P:], skip_special_tokens=True)
    assert builtin.check_answer(sampled, p.answer) == 1.0
    _, right_first = run_env(tokenizer, "Retry", [f"The answer is {p.answer}.<EOT>", "unused<EOT>"], problems)
    assert right_first.turns.tolist() == [1]
    _, wrong_twice = run_env(tokenizer, "Retry", [f"The answer is {p.answer + 1}.<EOT>",
                                                  f"The answer is {p.answer + 2}.<EOT>"], problems)
    assert wrong_twice.turns.tolist() == [2]  # asked once only


def test_the_hard_split_is_three_digit_by_two_digit_products_and_the_easy_one_is_unchanged():
    hard = builtin.builtin_splits(make_builtin(difficulty="hard"))
    for p in hard["ppo_train"]:
        a, b = (int(x) for x in p.expression.split(" * "))
        assert 100 <= a <= 999 and 10 <= b <= 99 and p.answer == a * b
        assert builtin.check_answer(p.chosen, p.answer) == 1.0
    easy = builtin.builtin_splits(make_builtin())
    first = easy["ppo_eval"][0]  # seed 1234's, as before the hard split existed
    assert (first.question, first.answer, first.expression) == (
        "Finn has 9 pears. Finn gets 21 more. How many pears does Finn have now?", 30, "9 + 21")
    for p in easy["ppo_train"]:
        assert builtin_envs.calculate(p.expression) == p.answer
    from stage_helpers import compose

    from rlhf_cli.config import ConfigError
    from rlhf_cli.preflight import VALIDATORS

    with pytest.raises(ConfigError, match="data.builtin.difficulty=.medium. is not one of easy, hard"):
        VALIDATORS["train_sft"](compose("train_sft", ["model=tiny", "data.builtin.difficulty=medium"]))


def test_the_tool_demonstrations_train_the_call_and_the_answer(make_cfg, tokenizer):  # noqa: F811
    """`data.builtin.tool_calls=true`: each demonstration is the question, an assistant turn calling `calculate` on
    the problem's expression, the tool's result, then the worked answer, rendered with the shipped tool template
    (the tools block: `calculator_schema`); the trained tokens are exactly the call turn and the answer turn, each
    with its end-of-turn id, and the result is context."""
    cfg = make_cfg(**{"builtin__tool_calls": True, "builtin__difficulty": "hard", "builtin__max_samples": 8})
    data = load_sft_data(cfg, tokenizer)
    problems = {p.question: p for p in builtin.builtin_splits(cfg.builtin)["rm_train"]}
    ex = data.train[0]
    text = tokenizer.decode(ex["input_ids"])
    p = next(q for question, q in problems.items() if question in text)
    call = json.dumps({"name": "calculate", "arguments": {"expression": p.expression}})
    assert _trained_text(tokenizer, ex) == [f"<tool_call>\n{call}\n</tool_call><|im_end|>", f"{p.chosen}<|im_end|>"]
    context = tokenizer.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m])
    assert f"<tool_response>\n{p.answer}\n</tool_response>" in context
    assert json.dumps(builtin_envs.calculator_schema()) in context
    plain = load_sft_data(make_cfg(**{"builtin__max_samples": 8}), tokenizer)
    assert _trained_text(tokenizer, plain.train[0])[0].endswith("<|im_end|>") and "<tool_call>" not in \
        tokenizer.decode(plain.train[0]["input_ids"])


@pytest.mark.parametrize("command", ["train_sft", "train_ppo", "eval"])
def test_experiment_tools_selects_the_calculator_for_each_command(command):
    from stage_helpers import compose

    from rlhf_cli.preflight import VALIDATORS

    cfg = compose(command, ["experiment=tools", "model=tiny"])
    VALIDATORS[command](cfg)
    assert cfg.data.builtin.tool_calls and cfg.rollout.env == "rlhf_cli.data.builtin_envs:Calculator"
    assert cfg.reward.type == "checker"


def test_experiment_tools_trains_and_evaluates_end_to_end(run_stage):
    """`experiment=tools` on the tiny model: train-sft on the tool demonstrations, train-ppo with the calculator in
    the loop, and eval with it on both sides, each to its end with its episode figures."""
    _, sft_dir, _ = run_stage("train_sft", ["experiment=tools", "sft.max_steps=2", "sft.batch_size=4",
                                            "sft.micro_batch_size=4", "data.builtin.max_samples=8"])
    assert (sft_dir / "final" / "config.json").exists()
    _, ppo_dir, _ = run_stage("train_ppo", ["experiment=tools", "ppo.iterations=1", "ppo.rollout_batch_size=2",
                                            "ppo.n_samples_per_prompt=2", "ppo.mini_batch_size=4",
                                            "ppo.micro_batch_size=4", "ppo.max_new_tokens=8",
                                            "data.builtin.max_samples=8"])
    rows = [json.loads(line) for line in (ppo_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("episode/turns_mean" in r for r in rows) and any("reward/checker" in r for r in rows)
    _, eval_dir, _ = run_stage("eval", ["experiment=tools", f"policy.path={ppo_dir}", "eval.num_prompts=4",
                                        "eval.max_new_tokens=8"])
    out = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert out["policy/episode_turns_mean"] >= 1 and "policy/accuracy" in out and out["prompts"] == 4
