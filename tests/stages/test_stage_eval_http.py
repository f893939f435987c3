"""`rlhf eval` with `reward.type=http`: the policy and reference samples scored by `rlhf serve-rm`'s app (in a
thread on 127.0.0.1) give the figures the in-process reward model gives, and eval.json names the source."""

import threading
import time

import pytest
from reward_server import free_port
from test_stage_eval import MAX_NEW_TOKENS, fake_sampling, read_results, tiny_dirs  # noqa: F401 - a fixture

pytest.importorskip("fastapi", reason="the serve extra: pip install 'rlhf_cli[serve]'")


@pytest.fixture
def served_rm(tiny_dirs, tokenizer):  # noqa: F811 - the imported fixture
    """The tiny reward model behind serve-rm's app (`make_app`, `Batcher`, `RewardScorer`) in a uvicorn thread."""
    import uvicorn

    from rlhf_cli.models import load_scalar_model
    from rlhf_cli.stages.serve_rm import Batcher, RewardScorer, make_app

    scorer = RewardScorer(load_scalar_model(str(tiny_dirs["rm"]), "fp32", 0).eval(), tokenizer, 4, "fp32")
    batcher = Batcher(scorer, 8, 0.005)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(batcher, str(tiny_dirs["rm"])), host="127.0.0.1", port=port,
                                           log_level="warning", log_config=None))  # leave this process's logging be
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/get_reward"
    server.should_exit = True
    thread.join(timeout=10)
    batcher.close()


def test_policy_eval_scores_with_a_reward_server_as_with_the_reward_model(run_stage, tiny_dirs, tokenizer,  # noqa: F811
                                                                         monkeypatch, served_rm):
    fake_sampling(monkeypatch, tiny_dirs, tokenizer)
    models = [f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}",
              "data.builtin.ppo_eval=6", f"eval.max_new_tokens={MAX_NEW_TOKENS}"]
    _, in_process, _ = run_stage("eval", [*models, f"reward_model.path={tiny_dirs['rm']}"])
    _, served, _ = run_stage("eval", [*models, "reward.type=http", f"reward.url={served_rm}"])
    want, got = read_results(in_process), read_results(served)
    assert want["reward_source"] == f"reward model {tiny_dirs['rm']}"
    assert got["reward_source"] == f"reward server {served_rm}"
    for key in ("policy/score_mean", "reference/score_mean", "score_gain", "score_gain_ci95", "win_rate"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key
    assert got["policy/accuracy"] == want["policy/accuracy"]  # the checker, as before
