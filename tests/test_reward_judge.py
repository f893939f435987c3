"""`reward.type=judge` (`rlhf_cli.reward_judge`): an LLM judge behind an OpenAI-compatible endpoint, here a fake
one the tests start on 127.0.0.1 (`reward_server.FakeRewardServer` answering `POST /v1/chat/completions`): the
pattern reads the score, a reply it cannot read is an unscorable row, each request is temperature 0 with
max_tokens, the run's seed and vLLM's structured output, identical messages are judged once per call, a 429 is
retried and a failing endpoint stops in one line naming it, the API key travels only as the bearer token, and a
template naming a field the data lacks is refused at the start."""

import math
import re

import pytest
import torch
from reward_server import FakeRewardServer, free_port
from stage_helpers import compose

from rlhf_cli import reward_http
from rlhf_cli.config import ConfigError, validate_reward
from rlhf_cli.errors import RewardServerError
from rlhf_cli.preflight import VALIDATORS
from rlhf_cli.reward_judge import JudgeReward, read_score

pytest.importorskip("openai", reason="the judge extra: pip install 'rlhf_cli[judge]'")

TEMPLATE = "Question: {prompt}\nGold: {answer}\nLevel: {difficulty}\nResponse: {completion}"
ROWS = [{"prompt_text": f"<|im_start|>user\nWhat is {i} + {i}?<|im_end|>\n<|im_start|>assistant\n",
         "answer": str(2 * i), "row": i + 1, "columns": {"question": f"{i} + {i}", "difficulty": i % 3}}
        for i in range(4)]


def chat(text):
    """An OpenAI chat-completion reply whose message is `text` (HTTP 200)."""
    return 200, {"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "judge",
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": text}}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def message(body):
    """The one user message of a chat request."""
    (m,) = body["messages"]
    assert m["role"] == "user"
    return m["content"]


def length_judge(body):
    """A judge scoring the response by its length, and unable to score a response containing 'mumble'."""
    response = message(body).rpartition("Response: ")[2]
    return chat("I cannot tell." if "mumble" in response else f"Fine work.\nScore: {len(response) / 10}")


def judge_at(server, **kwargs):
    return JudgeReward(base_url=f"http://127.0.0.1:{server.port}/v1", model="judge-7b", prompt=TEMPLATE,
                       pattern=r"Score:\s*(-?\d+(?:\.\d+)?)", **{"timeout_s": 5, **kwargs})


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(reward_http, "BACKOFF_S", 0.01)


def test_the_pattern_reads_the_score_and_anything_else_is_unscorable():
    p = re.compile(r"Score:\s*(\S+)")
    assert read_score(p, "Reasoning...\nScore: 7") == 7.0
    assert read_score(p, "Score: -2.5 and Score: 9") == -2.5  # the first match
    for reply in ("I cannot tell", "Score: high", "Score: inf", "Score: nan", "", None):
        assert math.isnan(read_score(p, reply)), reply
    assert math.isnan(read_score(re.compile(r"Score: (\d+)|(none)"), "none"))  # the first group did not take part


def test_each_request_is_one_user_message_at_temperature_0_with_max_tokens_seed_and_regex(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-0123")
    with FakeRewardServer(length_judge) as server:
        judge = judge_at(server, max_tokens=12, seed=77, guided_regex=r"Score: \d", api_key_env="MY_JUDGE_KEY")
        got = judge.score([" 0", " four", " six mumble", " 8"], ROWS)
    want = [len(c) / 10 for c in (" 0", " four")] + [math.nan, 0.2]
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got, torch.tensor(want), equal_nan=True)
    body = next(b for b in server.requests if message(b).endswith("Response:  four"))
    assert message(body) == "Question: What is 1 + 1?\nGold: 2\nLevel: 1\nResponse:  four"
    assert body["model"] == "judge-7b" and body["temperature"] == 0 and body["max_tokens"] == 12
    assert body["seed"] == 77 and body["structured_outputs"] == {"regex": r"Score: \d"}  # vLLM 0.32's field
    assert "n" not in body and "stream" not in body
    assert {h["authorization"] for h in server.headers} == {"Bearer sk-test-0123"}
    assert all(h["host"] == f"127.0.0.1:{server.port}" for h in server.headers)
    monkeypatch.delenv("MY_JUDGE_KEY")
    with FakeRewardServer(length_judge) as server:  # no key: vLLM's placeholder; no regex, no seed: none sent
        judge_at(server, api_key_env="MY_JUDGE_KEY").score([" 0"], ROWS[:1])
    assert server.headers[0]["authorization"] == "Bearer EMPTY"
    assert "structured_outputs" not in server.requests[0] and "seed" not in server.requests[0]


def test_identical_messages_are_judged_once_per_call():
    completions = [" 4", " 4", " 5", " 4"]
    rows = [ROWS[2], ROWS[2], ROWS[2], ROWS[3]]  # rows 0 and 1: the same prompt and response
    with FakeRewardServer(length_judge) as server:
        judge = judge_at(server, max_concurrency=3)
        first = judge.score(completions, rows)
        assert len(server.requests) == 3
        second = judge.score(completions, rows)  # a new call (a new iteration) asks again
    assert len(server.requests) == 6 and torch.equal(first, second) and first[0] == first[1] == 0.2


def failing(times, status):
    calls = {"n": 0}

    def answer(body):
        calls["n"] += 1
        return (status, {"error": {"message": "busy", "type": "x"}}) if calls["n"] <= times else length_judge(body)

    return answer


def test_a_429_is_retried_and_a_failing_endpoint_stops_in_one_line():
    with FakeRewardServer(failing(2, 429)) as server:
        assert judge_at(server, retries=2).score([" 1"], ROWS[:1]).tolist() == [pytest.approx(0.2)]
    assert len(server.requests) == 3
    with FakeRewardServer(failing(99, 500)) as server:
        with pytest.raises(RewardServerError) as e:
            judge_at(server, retries=1).score([" 1"], ROWS[:1])
    msg = str(e.value)
    assert msg.startswith(f"judge endpoint http://127.0.0.1:{server.port}/v1 failed 2 times (last: HTTP 500")
    assert "\n" not in msg and len(server.requests) == 2  # the resume advice: the CLI adds it for a training run
    with FakeRewardServer(failing(99, 400)) as server:  # a refusal is final
        with pytest.raises(RewardServerError, match=r"answered HTTP 400 .*\(not retried; reward.judge.model="):
            judge_at(server, retries=3).score([" 1"], ROWS[:1])
    assert len(server.requests) == 1


def test_a_slow_endpoint_times_out_and_an_unreachable_one_is_refused_at_the_start():
    import time

    def slow(body):
        time.sleep(0.6)
        return length_judge(body)

    with FakeRewardServer(slow) as server:
        with pytest.raises(RewardServerError, match=r"failed once \(last: no answer within reward.judge.timeout_s"):
            judge_at(server, timeout_s=0.2, retries=0).score([" 1"], ROWS[:1])
    url = f"http://127.0.0.1:{free_port()}/v1"
    judge = ["reward.type=judge", f"reward.judge.base_url={url}", "reward.judge.model=m"]
    with pytest.raises(ConfigError) as e:
        VALIDATORS["train_ppo"](compose("train_ppo", ["model=tiny", *judge]))
    assert str(e.value).startswith(f"reward.judge.base_url={url}: no judge endpoint answers at 127.0.0.1:")
    assert "Score with an LLM judge" in str(e.value)


J = ["reward.judge.base_url=http://h/v1", "reward.judge.model=m"]


@pytest.mark.parametrize("overrides,said", [
    ([], "the reward source `judge` needs reward.judge.base_url="),
    (["reward.judge.base_url=localhost:8000"], "reward.judge.base_url='localhost:8000' is not an http"),
    (["reward.judge.base_url=http://h/v1"], "needs reward.judge.model="),
    ([*J, "reward.judge.prompt='Rate {prompt}'"], "must name {completion}"),
    ([*J, "reward.judge.prompt='Rate {completion} {}'"], r"names \{\}: a field is a plain name"),
    ([*J, "reward.judge.prompt='Rate {completion.text}'"], r"names \{completion.text\}"),
    ([*J, "reward.judge.prompt='Rate {completion'"], "does not parse as a template"),
    ([*J, "reward.judge.pattern='Score: [0-9]+'"], "has no capture group"),
    ([*J, "reward.judge.pattern='Score: ([0-9]+'"], "is not a regex"),
    ([*J, "reward.judge.guided_regex='(a'"], r"reward.judge.guided_regex='\(a' is not a regex"),
    ([*J, "reward.judge.max_tokens=0"], "reward.judge.max_tokens must be > 0"),
    ([*J, "reward.judge.max_concurrency=0"], "reward.judge.max_concurrency must be > 0"),
    ([*J, "reward.judge.timeout_s=0"], "reward.judge.timeout_s must be"),
    ([*J, "reward.judge.retries=-1"], "reward.judge.retries must be >= 0"),
])
def test_the_judge_settings_are_checked(overrides, said):
    with pytest.raises(ConfigError, match=said):
        validate_reward(compose("train_ppo", ["reward.weights={judge:1.0,checker:0.5}", *overrides]))
    validate_reward(compose("train_ppo", ["reward.type=checker", *overrides]))  # no judge source: not read


def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs the openai client: pip install 'rlhf_cli\[judge\]'"):
        validate_reward(compose("train_ppo", ["reward.type=judge", "reward.judge.base_url=http://h/v1",
                                              "reward.judge.model=m"]))


def test_a_template_field_the_rows_lack_is_named():
    judge = JudgeReward(base_url="http://h/v1", model="m", prompt="{prompt} {completion} {answer} {reference}",
                        pattern=r"(\d)")
    with pytest.raises(ConfigError) as e:
        judge.check_rows(ROWS, "the train split")
    assert str(e.value).startswith("reward.judge.prompt names {reference}, but 4 of 4 rows of the train split have "
                                   "no 'reference' (its columns are difficulty, question;")
    no_answers = [{k: v for k, v in r.items() if k != "answer"} for r in ROWS]
    with pytest.raises(ConfigError, match=r"names \{answer\}, but 4 of 4 rows"):
        judge.check_rows(no_answers)
    JudgeReward(base_url="http://h/v1", model="m", prompt=TEMPLATE, pattern=r"(\d)").check_rows(ROWS)


def test_the_judge_keys_without_a_judge_source_are_refused():
    from rlhf_cli.commands import COMMANDS
    from rlhf_cli.overrides import ignored_keys

    typed = ["reward.type=checker", "reward.judge.model=m"]
    ((key, why),) = ignored_keys(COMMANDS["train-ppo"], typed, compose("train_ppo", typed))
    assert key == "reward.judge.model" and "no `judge` reward source" in why
    typed = ["reward.type=judge", "reward.judge.model=m"]
    assert ignored_keys(COMMANDS["train-ppo"], typed, compose("train_ppo", typed)) == []
