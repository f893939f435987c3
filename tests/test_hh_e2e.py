"""The real chain, a few steps of it: `experiment=hh_smollm2` (SmolLM2-135M-Instruct from the GGUF,
HH-RLHF harmless-base from ../shared/data) through train-rm -> train-ppo -> eval, as the CLI runs it.

Sized to a few minutes on 2 CPU cores: 40 rows of the file (4 held out, 12 PPO prompts, 24 RM pairs),
2 reward-model steps of 4 pairs, one PPO iteration of 4 rollouts of 16 tokens, eval on the 4 held-out
prompts. It proves the real path works (GGUF load, chat rendering of HH turns, three-way split, every
checkpoint the next stage reads), not the quality of the models; docs/results.md has the full-size runs.
"""

import json
import os
import subprocess
import sys

import pytest
from stage_helpers import HH_PATH, REPO, SMOLLM2, require

ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
SMALL = ["experiment=hh_smollm2", "data.max_samples=40", "data.max_length=192",
         "data.max_prompt_length=160",
         "paths.keep_checkpoints=0"]  # else ~5 GB of SmolLM2 DeepSpeed state stays on disk


def rlhf(*args):
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", *args], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def only_run(root, stage):
    (run,) = list((root / stage).iterdir())
    return run


@pytest.mark.slow
def test_hh_smollm2_chain_few_steps(tmp_path):
    require(os.path.isfile(HH_PATH), f"HH data not found at {HH_PATH}")
    from rlhf_cli.models.loading import ModelSourceError, resolve_gguf

    try:
        resolve_gguf(SMOLLM2)
    except ModelSourceError as e:
        require(False, str(e))
    root = f"paths.root={tmp_path}"
    rlhf("train-rm", *SMALL, root, "rm.max_steps=2", "rm.batch_size=4", "rm.micro_batch_size=4",
         "rm.eval_every=0", "rm.save_every=0", "rm.eval_batch_size=8")
    rm = only_run(tmp_path, "rm")
    records = [json.loads(ln) for ln in (rm / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "rm/loss" in r] == [1, 2]
    final_eval = [r for r in records if "eval/rm/accuracy" in r][-1]
    assert 0.0 <= final_eval["eval/rm/accuracy"] <= 1.0
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(rm / "final")
    assert config.num_labels == 1 and config.rlhf_reward_std > 0
    assert (tmp_path / "latest_rm").read_text().strip() == str(rm / "final")
    assert not (rm / "ds").exists()

    rlhf("train-ppo", *SMALL, root, "ppo.iterations=1", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4", "ppo.epochs=1", "ppo.max_new_tokens=16")
    ppo = only_run(tmp_path, "ppo")
    (it,) = [json.loads(ln) for ln in (ppo / "metrics.jsonl").read_text().splitlines()]
    for key in ("objective/scores", "objective/kl", "policy/loss", "val/loss", "response/length_mean"):
        assert it[key] == it[key], key  # logged and not NaN
    assert (tmp_path / "latest_policy").read_text().strip() == str(ppo / "final")
    assert not (ppo / "ds").exists()

    rlhf("eval", *SMALL, root, "eval.num_prompts=4", "eval.max_new_tokens=16", "eval.batch_size=4")
    results = json.loads((only_run(tmp_path, "eval") / "eval.json").read_text())["results"]
    assert results["prompts"] == 4
    for key in ("policy/score_mean", "reference/score_mean", "win_rate", "kl_k1", "policy/length_mean"):
        assert results[key] == results[key], key
    assert (only_run(tmp_path, "eval") / "report" / "report.html").is_file()
