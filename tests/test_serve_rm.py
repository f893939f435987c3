"""`rlhf serve-rm`: a tiny reward model served on 127.0.0.1 answers OpenRLHF's protocol with the scores the
in-process reward model computes for the same rows, gathers concurrent requests into one forward, and stops
cleanly on Ctrl-C."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from reward_server import free_port
from stage_helpers import compose, subprocess_env
from test_reward_http import batch

from rlhf_cli.forwards import batched_scores
from rlhf_cli.reward_http import HttpReward, queries

pytest.importorskip("fastapi", reason="the serve extra: pip install 'rlhf_cli[serve]'")
from rlhf_cli.stages.serve_rm import Batcher, RewardScorer  # noqa: E402

RM_MEAN, RM_STD = 0.5, 0.25


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tiny_model_cfg, tokenizer):
    from rlhf_cli.models import load_scalar_model, save_hf

    return save_hf(load_scalar_model(tiny_model_cfg, "fp32", 3), tokenizer, tmp_path_factory.mktemp("rm") / "rm",
                   extra_config={"rlhf_reward_mean": RM_MEAN, "rlhf_reward_std": RM_STD})


def test_the_batcher_gathers_concurrent_requests_into_one_call():
    calls = []

    def score(texts):
        calls.append(len(texts))
        return [float(len(t)) for t in texts]

    batcher = Batcher(score, batch_size=12, max_wait_s=0.3)
    texts = [["a" * (i + 1)] * (1 + i % 2) for i in range(8)]  # 12 rows in 8 requests
    futures = [None] * 8

    def send(i):
        futures[i] = batcher.submit(texts[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [f.result(timeout=5) for f in futures] == [[float(len(x)) for x in t] for t in texts]
    assert sum(calls) == 12 and len(calls) < 8 and batcher.calls == len(calls)
    failing = Batcher(lambda texts: 1 / 0, batch_size=4, max_wait_s=0.0)  # a scorer that raises: each request hears
    with pytest.raises(ZeroDivisionError):
        failing.submit(["x"]).result(timeout=5)
    batcher.close()
    failing.close()


def test_the_scorer_normalises_with_the_stored_mean_and_std(rm_dir, tokenizer):
    from rlhf_cli.models import load_scalar_model

    ids, am, _, _ = batch(tokenizer)
    rm = load_scalar_model(rm_dir, "fp32", 0).eval()
    texts = queries(tokenizer, ids, am)
    raw = torch.tensor(RewardScorer(rm, tokenizer, 2, "fp32")(texts))
    norm = torch.tensor(RewardScorer(rm, tokenizer, 2, "fp32", (RM_MEAN, RM_STD))(texts))
    torch.testing.assert_close(norm, (raw - RM_MEAN) / RM_STD)


def test_a_bad_request_a_missing_extra_and_a_taken_port_are_one_line(monkeypatch, tmp_path):
    import importlib.util

    from fastapi.testclient import TestClient

    from rlhf_cli.config import ConfigError, validate_serve
    from rlhf_cli.stages.serve_rm import check_port_free, make_app

    batcher = Batcher(lambda texts: [float(len(t)) for t in texts], batch_size=4, max_wait_s=0.0)
    client = TestClient(make_app(batcher, "rm"))
    assert client.post("/get_reward", json={"query": ["ab", "c"]}).json() == {"rewards": [2.0, 1.0],
                                                                             "scores": [2.0, 1.0]}
    for bad in ({"queries": ["a"]}, {"query": "a"}, {"query": [1]}, ["a"]):
        reply = client.post("/get_reward", json=bad)
        assert reply.status_code == 400 and "expected {\"query\": [text, ...]}" in reply.json()["detail"]
    batcher.close()
    cfg = compose("serve_rm", [f"paths.root={tmp_path}"])
    validate_serve(cfg)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else find_spec(name))
    with pytest.raises(ConfigError, match=r"serving a reward model needs uvicorn: pip install 'rlhf_cli\[serve\]'"):
        validate_serve(cfg)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=f"serve.port={taken.getsockname()[1]}: cannot listen there"):
            check_port_free("127.0.0.1", taken.getsockname()[1])


def wait_for_port(port, proc, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"rlhf serve-rm exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail("rlhf serve-rm did not listen within 120 s")


def test_serve_rm_answers_the_in_process_reward_models_scores(tmp_path, rm_dir, tokenizer):
    """`rlhf serve-rm` on a tiny RM: the client's scores (the trainer's request) equal the in-process reward
    model's scores of the same ids (the numbers `rlhf eval` and train-ppo compute), whatever the request batching;
    Ctrl-C stops it with exit status 0 and the run marked finished."""
    from rlhf_cli.models import load_scalar_model

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_cli", "serve-rm", "model=tiny", "precision=fp32",
                             f"reward_model.path={rm_dir}", f"serve.port={port}", "serve.batch_size=4",
                             f"paths.root={tmp_path}"], env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, proc)
        ids, am, P, rows = batch(tokenizer)
        texts = tokenizer.batch_decode(ids[:, P:], skip_special_tokens=True)
        url = f"http://127.0.0.1:{port}/get_reward"
        one = HttpReward(url, batch_size=1, max_concurrency=3).score(queries(tokenizer, ids, am), texts, rows)
        whole = HttpReward(url, batch_size=64).score(queries(tokenizer, ids, am), texts, rows)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    want = batched_scores(load_scalar_model(rm_dir, "fp32", 0).eval(), ids, am, 4, "fp32")
    torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
    assert proc.returncode == 0, err[-3000:]
    assert f"serving {rm_dir} at http://127.0.0.1:{port}/get_reward (raw scores" in err
    (run,) = (tmp_path / "serve").iterdir()
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


def test_a_bad_request_fails_alone_when_batched_with_good_ones():
    def score(texts):
        if "bad" in texts:
            raise ValueError("an empty query (no tokens) cannot be scored")
        return [float(len(t)) for t in texts]

    batcher = Batcher(score, batch_size=8, max_wait_s=0.3)
    good, bad, other = batcher.submit(["aa"]), batcher.submit(["bad"]), batcher.submit(["abc", "d"])
    assert good.result(timeout=5) == [2.0] and other.result(timeout=5) == [3.0, 1.0]
    with pytest.raises(ValueError, match="empty query"):
        bad.result(timeout=5)
    gone = batcher.submit(["x"])
    gone.cancel()  # a client that left: its answer is dropped, the worker goes on
    assert batcher.submit(["xyz"]).result(timeout=5) == [3.0]
    batcher.close()


def test_openrlhf_style_queries_with_pads_score_as_clean_ones(rm_dir, tokenizer):
    """OpenRLHF's trainer sends `batch_decode(..., skip_special_tokens=False)` of its padded sequences: left pads,
    and pads after the response's EOS (or after a response cut without one, which its serve_rm closes with EOS)."""
    from rlhf_cli.models import load_scalar_model

    rm = load_scalar_model(rm_dir, "fp32", 0).eval()
    scorer = RewardScorer(rm, tokenizer, 4, "fp32")
    pad, eos = tokenizer.pad_token, tokenizer.eos_token
    clean = ["Question? Answer." + eos, "Another question? A reply" + eos]
    padded = [pad * 3 + clean[0] + pad * 2, clean[1] + eos + pad]
    assert [scorer.clean(t) for t in padded] == clean and [scorer.clean(t) for t in clean] == clean
    assert scorer.clean("cut short") == "cut short" and scorer.clean("cut short" + pad) == "cut short" + eos
    assert scorer(padded) == scorer(clean)
