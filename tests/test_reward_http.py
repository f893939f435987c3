"""`reward.type=http` (`rlhf_cli.reward_http`): OpenRLHF's remote reward protocol against fake servers that the
tests start on 127.0.0.1 (`reward_server.FakeRewardServer`): the scores equal the in-process function's whatever the
batching and concurrency, null/NaN become NaN, and timeouts, retries, a 500, a wrong count or type and an
unreachable URL each fail in one line naming the URL."""

import json
import math
import time

import pytest
import torch
from reward_server import FakeRewardServer, free_port, rewards_of
from stage_helpers import compose

from rlhf_cli import reward_http
from rlhf_cli.config import ConfigError, validate_reward
from rlhf_cli.errors import RewardServerError
from rlhf_cli.preflight import VALIDATORS
from rlhf_cli.reward_http import HttpReward, check_reachable, parse_rewards, queries
from rlhf_cli.rewards import call_reward_function
from rlhf_cli.rollout import ScoreMixer


def length_and_answer(prompts, completions, answer, **kwargs):
    """A reward function of the completion, the prompt and the label: every row a different score."""
    return [0.1 * len(c) + 0.01 * len(p) + (1.0 if a is not None and str(a) in c else 0.0)
            for p, c, a in zip(prompts, completions, answer)]


ROWS = [{"prompt_text": f"Question: {i} + {i}?\nAnswer:", "answer": str(2 * i), "row": i + 1,
         "columns": {"question": f"{i} + {i}", "answer": str(2 * i), "difficulty": i % 3}} for i in range(7)]
COMPLETIONS = [f" {2 * i if i % 2 else i} and some words" * (1 + i % 3) for i in range(7)]


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(reward_http, "BACKOFF_S", 0.01)


@pytest.mark.parametrize("batch_size,concurrency", [(64, 1), (1, 4), (3, 2)])
def test_http_scores_equal_the_function_whatever_the_batching(batch_size, concurrency):
    want = call_reward_function(length_and_answer, "f", [r["prompt_text"] for r in ROWS], COMPLETIONS,
                                [r["answer"] for r in ROWS], [r["row"] for r in ROWS])
    with FakeRewardServer(rewards_of(length_and_answer)) as server:
        client = HttpReward(server.url, batch_size=batch_size, max_concurrency=concurrency, timeout_s=5)
        got = client.score([r["prompt_text"] + c for r, c in zip(ROWS, COMPLETIONS)], COMPLETIONS, ROWS)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert sorted(len(b["query"]) for b in server.requests) == sorted(
        [min(batch_size, 7 - i) for i in range(0, 7, batch_size)])
    # the first batch (received in any order under concurrency): the protocol's fields, ours, the row's columns
    body = next(b for b in server.requests if b["prompts"][0] == ROWS[0]["prompt_text"])
    assert {"query", "prompts", "labels", "completions", "question", "difficulty"} <= set(body)
    assert body["labels"] == [r["answer"] for r in ROWS[:batch_size]]


def test_label_key_names_the_column_sent_as_labels():
    with FakeRewardServer(lambda body: (200, {"scores": [0.0] * len(body["query"])})) as server:  # the older key
        got = HttpReward(server.url, label_key="difficulty").score(["q"] * 3, ["c"] * 3, ROWS[:3])
    assert got.tolist() == [0.0, 0.0, 0.0] and server.requests[0]["labels"] == [0, 1, 2]


def test_a_null_or_nan_reward_is_an_unscorable_row():
    """The contract with the unscorable-row rule: null or NaN for a row -> NaN in the (B,) float32 tensor."""
    assert [math.isnan(v) for v in parse_rewards({"rewards": [1, None, float("nan"), -2.5]}, 4, "u")] == \
        [False, True, True, False]
    with FakeRewardServer(lambda body: (200, b'{"rewards": [0.5, null, NaN]}')) as server:
        got = HttpReward(server.url).score(["a", "b", "c"], ["a", "b", "c"], ROWS[:3])
    assert got.dtype == torch.float32 and got[0] == 0.5 and got[1:].isnan().all()


@pytest.mark.parametrize("reply,said", [({"rewards": [1.0, 2.0]}, "answered 2 rewards for 3 rows"),
                                        ({"rewards": [1.0, "high", 2.0]}, "answered 'high' for row 2 of 3"),
                                        ({"rewards": [1.0, float("inf"), 2.0]}, "answered inf for row 2"),
                                        ({"reward": [1.0, 2.0, 3.0]}, 'answered {"reward": [1.0, 2.0, 3.0]}'),
                                        ([1.0, 2.0, 3.0], "answered [1.0, 2.0, 3.0]")])
def test_a_wrong_count_or_type_stops_in_one_line_without_retrying(reply, said):
    with FakeRewardServer(lambda body: (200, reply)) as server:
        with pytest.raises(RewardServerError) as e:
            HttpReward(server.url, retries=3).score(["a", "b", "c"], ["a", "b", "c"], ROWS[:3])
    assert said in str(e.value) and server.url in str(e.value) and "\n" not in str(e.value)
    assert len(server.requests) == 1


def failing(times, status=500):
    """An answer that fails `times` times with `status`, then scores with `length_and_answer`."""
    calls = {"n": 0}

    def answer(body):
        calls["n"] += 1
        return (status, {"detail": "boom"}) if calls["n"] <= times else rewards_of(length_and_answer)(body)

    return answer


def test_a_500_is_retried_with_backoff_and_then_stops_the_run():
    with FakeRewardServer(failing(2)) as server:
        got = HttpReward(server.url, retries=2).score(["q"] * 2, COMPLETIONS[:2], ROWS[:2])
    assert len(server.requests) == 3 and got.shape == (2,)
    with FakeRewardServer(failing(5)) as server:
        with pytest.raises(RewardServerError) as e:
            HttpReward(server.url, retries=1).score(["q"] * 2, COMPLETIONS[:2], ROWS[:2])
    assert len(server.requests) == 2
    msg = str(e.value)
    assert f"reward server {server.url} failed 2 times" in msg and "HTTP 500" in msg and "\n" not in msg


def test_a_client_error_is_not_retried():
    with FakeRewardServer(failing(5, status=404)) as server:
        with pytest.raises(RewardServerError, match=r"answered HTTP 404 .*\(not retried\)"):
            HttpReward(server.url, retries=3).score(["q"], ["c"], ROWS[:1])
    assert len(server.requests) == 1


def test_a_server_slower_than_the_timeout_fails_after_its_retries():
    delay = [2.0]

    def slow(body):
        time.sleep(delay[0])
        return 200, {"rewards": [1.0] * len(body["query"])}

    with FakeRewardServer(slow) as server:
        start = time.perf_counter()
        with pytest.raises(RewardServerError, match="no answer within reward.timeout_s=0.1 s"):
            HttpReward(server.url, timeout_s=0.1, retries=1).score(["q"], ["c"], ROWS[:1])
        elapsed = time.perf_counter() - start
    assert elapsed < 1.5 and len(server.requests) == 2  # two tries cut at 0.1 s each, not 2 × 2 s (a loose bound)
    delay[0] = 0.5
    with FakeRewardServer(slow) as server:  # a longer timeout waits for it
        assert HttpReward(server.url, timeout_s=3, retries=0).score(["q"], ["c"], ROWS[:1]).tolist() == [1.0]


def test_an_unreachable_url_is_one_line_naming_it():
    url = f"http://127.0.0.1:{free_port()}/get_reward"
    with pytest.raises(ConfigError) as e:
        check_reachable(url, 2.0)
    assert str(e.value).startswith(f"reward.url={url}: no reward server answers at 127.0.0.1:")
    with pytest.raises(RewardServerError, match=f"reward server {url} failed 2 times .*ConnectError"):
        HttpReward(url, retries=1).score(["q"], ["c"], ROWS[:1])
    with pytest.raises(ConfigError, match=f"reward.url={url}: no reward server answers"):  # before any model loads
        VALIDATORS["train_ppo"](compose("train_ppo", ["model=tiny", "reward.type=http", f"reward.url={url}"]))
    with FakeRewardServer(failing(0)) as server:
        check_reachable(server.url, 2.0)


def test_the_http_keys_without_an_http_source_are_refused():
    from rlhf_cli.commands import COMMANDS
    from rlhf_cli.overrides import ignored_keys

    for command, typed in (("train-ppo", ["reward.type=function"]), ("eval", ["reward.weights={http:1.0}"])):
        cfg = compose(COMMANDS[command].config_name, [*typed, "reward.url=http://h/x"])
        ((key, why),) = ignored_keys(COMMANDS[command], [*typed, "reward.url=http://h/x"], cfg)
        assert key == "reward.url" and "no `http` reward source" in why
    cfg = compose("train_ppo", ["reward.weights={http:1.0}", "reward.url=http://h/x"])
    assert ignored_keys(COMMANDS["train-ppo"], ["reward.weights={http:1.0}", "reward.url=http://h/x"], cfg) == []


@pytest.mark.parametrize("overrides,said", [
    ([], "the reward source `http` needs reward.url="),
    (["reward.url=127.0.0.1:5000"], "is not an http:// or https:// URL"),
    (["reward.url=http://h:99999/x"], "the port is not a number"),
    (["reward.url=http://h/x", "reward.http_batch_size=0"], "reward.http_batch_size must be > 0"),
    (["reward.url=http://h/x", "reward.max_concurrency=0"], "reward.max_concurrency must be > 0"),
    (["reward.url=http://h/x", "reward.timeout_s=0"], "reward.timeout_s must be"),
    (["reward.url=http://h/x", "reward.retries=-1"], "reward.retries must be >= 0"),
])
def test_the_http_settings_are_checked(overrides, said):
    with pytest.raises(ConfigError, match=said):
        validate_reward(compose("train_ppo", ["reward.type=http", *overrides]))
    validate_reward(compose("train_ppo", ["reward.weights={function:1.0}", "reward.function=m:f", *overrides]))


def batch(tokenizer):
    """A `[left-padded prompt | right-padded response]` batch: rows ending with EOS and a truncated one."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = [tokenizer.encode(f"Question: {q}\nAnswer:") for q in ("1 + 1?", "what is 12 + 30?", "2 + 2?")]
    responses = [tokenizer.encode(" 2") + [eos], tokenizer.encode(" 42 is the answer"),
                 tokenizer.encode(" four") + [eos]]
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.tensor([[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)])
    am = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r))
                       for p, r in zip(prompts, responses)])
    rows = [{"prompt_text": tokenizer.decode(p), "answer": a, "row": i + 1}
            for i, (p, a) in enumerate(zip(prompts, ("2", "42", "4")))]
    return ids, am, P, rows


def test_the_score_mixer_scores_with_the_server_as_with_the_function(tmp_path, tokenizer):
    """One request protocol, the same numbers: `reward.type=http` against a server running the function equals
    `reward.type=function`; each query is the row's text, pad stripped, with its one EOS when it ended in one."""
    ids, am, P, rows = batch(tokenizer)
    fn = tmp_path / "fns.py"
    fn.write_text("from test_reward_http import length_and_answer\n")
    by_function = ScoreMixer(compose("train_ppo", ["reward.type=function", f"reward.function={fn}:length_and_answer"]),
                             tokenizer, None, None, 2, "fp32")
    want, _, means = by_function(ids, am, P, rows)
    with FakeRewardServer(rewards_of(length_and_answer)) as server:
        http = ["reward.weights={http:2.0}", f"reward.url={server.url}", "reward.http_batch_size=2",
                "reward.max_concurrency=1"]  # one request at a time: `sent` in the rows' order
        mixer = ScoreMixer(compose("train_ppo", http), tokenizer, None, None, 2, "fp32")
        raw, score, got_means = mixer(ids, am, P, rows)
    assert torch.equal(raw, 2 * want) and torch.equal(score, raw)
    assert got_means == {"reward/http": pytest.approx(means["reward/function"])}
    sent = [q for body in server.requests for q in body["query"]]
    eos, pad = tokenizer.eos_token, tokenizer.pad_token
    assert sent == queries(tokenizer, ids, am) and [q.count(eos) for q in sent] == [1, 0, 1]
    assert sent[0].endswith(" 2" + eos) and sent[0].startswith("Question: 1 + 1?") and pad not in "".join(sent)


def test_a_run_whose_server_goes_down_stops_cleanly_and_resumes_once_it_is_up(tmp_path, capsys):
    """train-ppo with `reward.type=http` (`cli.main`, as the `rlhf` command runs it, in this process): the server
    fails at iteration 3 -> one line naming it, exit 2, the run left resumable at its step-2 checkpoint; a resume
    while nothing listens is refused in one line before any model loads; with the server up again on the same port,
    `resume=true` finishes the run from step-2."""
    from rlhf_cli import cli

    calls = {"n": 0}

    def up_then_down(body):
        calls["n"] += 1
        return (503, {"detail": "down"}) if calls["n"] > 2 else rewards_of(length_and_answer)(body)

    def rlhf(*args):
        """(exit status, what the run wrote to stderr)"""
        capsys.readouterr()
        try:
            cli.main(["train-ppo", *args])
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err

    with FakeRewardServer(up_then_down) as server:
        common = ["experiment=smoke", "reward.type=http", f"reward.url={server.url}", "reward.retries=0",
                  "ppo.iterations=3", "ppo.save_every=1", f"paths.root={tmp_path}"]
        code, err = rlhf(*common)
    assert code == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: reward server {server.url} failed once for 8 rows (last: HTTP 503"), last
    assert last.endswith("the last checkpoint is kept: continue with resume=true once it is up"), last
    (run,) = (tmp_path / "ppo").iterdir()
    assert json.loads((run / "status.json").read_text())["state"] == "running"
    assert (run / "ds" / "latest").read_text().strip() == "step-2"
    code, err = rlhf(*common, "resume=true")  # the server is still down: refused before any model loads
    assert code == 2 and f"reward.url={server.url}: no reward server answers" in err
    with FakeRewardServer(rewards_of(length_and_answer), port=server.port) as again:
        code, err = rlhf(*common, "resume=true")
    assert code == 0, err[-3000:]
    assert f"continuing {run} from step-2" in err and len(again.requests) == 1
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and json.loads((run / "status.json").read_text())["state"] == "finished"
