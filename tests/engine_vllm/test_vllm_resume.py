"""Resume reloads the engine from the restored weights (issue 60): a run that died after iteration 1's checkpoint
leaves `<run>/engine_model/` holding the weights the engine first started from (pushes reach vLLM in memory, never
that dir). The resumed run must start its engine from the checkpoint it restores, never from that stale dir: its
first probe then matches the trainer's restored policy, and its iteration 2 equals the uninterrupted run's.
Run by CI's vLLM job (`pytest -m vllm`); skipped without vllm.
"""

import shutil

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_engine import PPO, spy_probes  # noqa: E402

from rlhf_cli.rollout import vllm_engine  # noqa: E402
from rlhf_cli.runs import read_metrics, set_status  # noqa: E402


def test_a_resumed_run_starts_its_engine_from_the_restored_weights_not_a_stale_dir(run_stage, monkeypatch, tmp_path):
    starts, real_start = [], vllm_engine.VLLMGenerator._start

    def keeping_the_first_dir(self, model, gather):  # the dir a run that died would leave behind
        real_start(self, model, gather)
        if not starts:
            shutil.copytree(self.model_dir, tmp_path / "first_engine_model")
        starts.append(dict(self.fingerprints))

    monkeypatch.setattr(vllm_engine.VLLMGenerator, "_start", keeping_the_first_dir)
    overrides = [*PPO, "ppo.advantage_estimator=gae", "ppo.iterations=2", "ppo.save_every=1"]
    _, run_dir, _ = run_stage("train_ppo", overrides)
    whole = read_metrics(run_dir)

    # as if the run had died right after iteration 1's checkpoint, its engine's first dir still there
    (run_dir / "ds" / "latest").write_text("step-1\n")
    set_status(run_dir, "running")
    shutil.rmtree(run_dir / "final")
    shutil.copytree(tmp_path / "first_engine_model", run_dir / "engine_model")
    probes = spy_probes(monkeypatch)
    run_stage("train_ppo", [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    resumed = read_metrics(run_dir)

    assert len(starts) == 2 and starts[1] != starts[0]  # restarted from iteration 1's weights, not the start's
    assert probes == [torch.float32]  # the resumed engine's first probe: the restored policy's greedy log-probs
    assert [r["step"] for r in resumed] == [1, 2]
    assert resumed[1]["rollout/engine_logprob_diff_max"] <= 1e-4
    for k in ("objective/scores", "objective/kl", "response/length_mean", "policy/loss", "val/loss"):
        assert resumed[1][k] == pytest.approx(whole[1][k], rel=1e-5, abs=1e-7), k
    assert not (run_dir / "engine_model").exists()
