"""train-ppo and eval with `reward.type=judge` against a fake OpenAI-compatible endpoint on 127.0.0.1
(`test_reward_judge`'s): a reply the pattern cannot read leaves its row unscorable and the run goes on; the API key
reaches the endpoint as the bearer token and no file or printed line; eval's score figures come from the judge and
eval.json names it."""

import json
import math
import zlib

import pytest
import torch
from reward_server import FakeRewardServer
from test_reward_judge import chat, length_judge, message
from test_stage_critic_free import GROUPS
from test_stage_eval import tiny_dirs  # noqa: F401 - a fixture
from test_stage_ppo import build_trainer

pytest.importorskip("openai", reason="the judge extra: pip install 'rlhf_cli[judge]'")


def crc_judge(body):
    """A judge that cannot score a response whose CRC is odd, and scores the others by their length."""
    response = message(body).rpartition("Response: ")[2]
    return chat("Hmm." if zlib.crc32(response.encode()) % 2 else f"Score: {len(response)}")


def test_a_run_turns_unreadable_replies_into_unscorable_rows_and_goes_on(tmp_path):
    """A tiny train-ppo iteration (GRPO, 2 prompts × 4) scored by the judge: rows whose reply does not parse get no
    advantage and no weight, the others the judge's score, and the update runs."""
    with FakeRewardServer(crc_judge) as server:
        judge = ["reward.type=judge", f"reward.judge.base_url=http://127.0.0.1:{server.port}/v1",
                 "reward.judge.model=m", "reward.judge.prompt='Q: {prompt} Gold: {answer} Response: {completion}'",
                 "reward.max_unscorable_frac=1"]
        tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "ppo.kl_in=loss", "ppo.kl_estimator=k3",
                                      *judge])
        exp, stats, _ = tr.maker.make_experience(0)
        completions = tr.tokenizer.batch_decode(exp.input_ids[:, exp.prompt_len:], skip_special_tokens=True)
        want = torch.tensor([math.nan if zlib.crc32(c.encode()) % 2 else float(len(c)) for c in completions])
        assert len(server.requests) == len(set(completions))  # identical completions of a prompt: asked once
        assert set(server.requests[0]) >= {"model", "messages", "temperature", "max_tokens", "seed"}
        assert server.requests[0]["seed"] == tr.cfg.seed
        train = tr.train_on(exp, 0)
    unscored = want.isnan()
    assert 0 < unscored.sum() < 8, "the seeded samples should give both kinds of rows"
    assert torch.equal(exp.scored, ~unscored) and exp.loss_mask[unscored].sum() == 0
    assert torch.equal(exp.advantages[unscored], torch.zeros_like(exp.advantages[unscored]))
    assert stats["reward/unscorable_frac"] == unscored.float().mean().item()
    assert stats["reward/judge"] == pytest.approx(want[~unscored].mean().item())
    assert all(math.isfinite(v) for v in {**stats, **train}.values() if isinstance(v, float))


def test_train_ppo_sends_the_key_as_the_bearer_token_and_writes_it_nowhere(tmp_path, monkeypatch, capfd, caplog):
    """`rlhf train-ppo reward.type=judge` (`cli.main`, in this process), one iteration: the key from
    `reward.judge.api_key_env` reaches the endpoint and appears in no file of the run, no line it prints and no log
    record; the start table names the judge."""
    from rlhf_cli import cli

    secret = "sk-judge-secret-4242"
    monkeypatch.setenv("RLHF_TEST_JUDGE_KEY", secret)
    with FakeRewardServer(length_judge) as server:
        base_url = f"http://127.0.0.1:{server.port}/v1"
        cli.main(["train-ppo", "experiment=smoke", "ppo.iterations=1", "reward.type=judge",
                  f"reward.judge.base_url={base_url}", "reward.judge.model=m",
                  "reward.judge.api_key_env=RLHF_TEST_JUDGE_KEY", f"paths.root={tmp_path}"])
    printed = "".join(capfd.readouterr()) + caplog.text
    assert server.requests and {h["authorization"] for h in server.headers} == {f"Bearer {secret}"}
    assert f"judge m at {base_url}" in printed
    assert secret not in printed
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in files)
    for p in files:
        assert secret.encode() not in p.read_bytes(), p
    (run,) = (tmp_path / "ppo").iterdir()
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/judge" in metrics


def test_an_endpoint_failing_mid_run_stops_it_as_a_reward_server_does(tmp_path):
    """A judge that answers 503 past its retries raises RewardServerError (the CLI leaves such a run resumable,
    tests/test_reward_http.py) on the rollout's path, naming the endpoint, before any update."""
    from rlhf_cli.errors import RewardServerError

    with FakeRewardServer(lambda body: (503, {"error": {"message": "overloaded"}})) as server:
        base_url = f"http://127.0.0.1:{server.port}/v1"
        tr = build_trainer(tmp_path, [*GROUPS, "ppo.advantage_estimator=grpo", "reward.type=judge",
                                      f"reward.judge.base_url={base_url}", "reward.judge.model=m",
                                      "reward.judge.retries=0"])
        with pytest.raises(RewardServerError, match=f"^judge endpoint {base_url} failed once \\(last: HTTP 503"):
            tr.maker.make_experience(0)
    assert len(server.requests) >= 1


def test_a_template_field_the_data_lacks_stops_train_ppo_before_any_model_loads(tmp_path):
    from rlhf_cli.errors import ConfigError

    with FakeRewardServer(length_judge) as server:
        judge = ["reward.type=judge", f"reward.judge.base_url=http://127.0.0.1:{server.port}/v1",
                 "reward.judge.model=m", "reward.judge.prompt='{prompt} {completion} vs {reference}'"]
        with pytest.raises(ConfigError, match=r"^reward.judge.prompt names \{reference\}, but \d+ of \d+ rows of "
                                              r"the train split have no 'reference'"):
            build_trainer(tmp_path, [*GROUPS, *judge])
    assert server.requests == []


def test_eval_scores_with_the_judge_and_names_it(run_stage, tiny_dirs, tokenizer, monkeypatch):  # noqa: F811 - the fixture
    """`rlhf eval reward.type=judge`: each side's score is the judge's on its responses, the paired figures follow,
    and eval.json names the judge."""
    from test_stage_eval import MAX_NEW_TOKENS, fake_sampling, read_results

    seen = fake_sampling(monkeypatch, tiny_dirs, tokenizer)
    with FakeRewardServer(length_judge) as server:
        base_url = f"http://127.0.0.1:{server.port}/v1"
        _, eval_dir, _ = run_stage("eval", [
            f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}",
            "data.builtin.ppo_eval=6", f"eval.max_new_tokens={MAX_NEW_TOKENS}", "reward.type=judge",
            f"reward.judge.base_url={base_url}", "reward.judge.model=m",
            "reward.judge.prompt='Q: {prompt} Response: {completion}'"])
    got = read_results(eval_dir)
    assert got["reward_source"] == f"judge m at {base_url}"
    rewards = json.loads((eval_dir / "rewards.json").read_text())
    for side in ("policy", "reference"):
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in seen[side][1]]
        want = [len(t) / 10 for t in texts]
        assert rewards[side] == pytest.approx(want), side
        assert got[f"{side}/score_mean"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert "score_gain" in got and "win_rate" in got
