"""Issue 42's new options together, with LoRA and with packing (tiny model, CPU): `ppo.filter_groups` (its rounds
joined into one batch) and `rollout.is_correction` (synthetic engine log-probs: vLLM is not installed here) train
the adapters under LoRA, and a packed iteration of them equals the padded one."""

import math

import pytest
import torch
from test_stage_filter_groups import FILTER, optimizer_steps, script_scores
from test_stage_ppo import build_trainer, snapshot

LORA = ["model.lora.r=4", "model.lora.alpha=8"]
OPTIONS = [*FILTER, "rollout.is_correction=tis", "ppo.policy_loss=cispo", "ppo.clip_high=0.28"]


def iteration(tr, monkeypatch):
    """One iteration: round 0 keeps 2 groups, round 1 the other 2; the engine's log-probs differ from the old ones
    by ρ = 3 on every second token (TIS clamps it at 2)."""
    script_scores(tr, [[0, 1], [2, 3]])
    exp, stats, _ = tr.maker.make_experience(0)
    shift = torch.zeros(exp.loss_mask.shape)
    shift[:, ::2] = math.log(3.0)
    exp.engine_logprobs = torch.where(exp.loss_mask.bool(), exp.old_logprobs - shift, 0.0)
    steps = optimizer_steps(monkeypatch, tr)
    train_stats = tr.train_on(exp, 0)
    assert stats["groups/extra_rounds"] == 1 and stats["groups/kept_frac"] == 1.0 and steps == [False, True] * 2
    return exp, stats, train_stats


def test_the_options_train_the_lora_adapters(tmp_path, monkeypatch):
    tr = build_trainer(tmp_path, [*OPTIONS, *LORA, "ppo.actor_lr=1e-3"])
    before = snapshot(tr.actor.module)
    exp, _, _ = iteration(tr, monkeypatch)
    after = tr.actor.module.state_dict()
    moved = {k for k in after if not torch.equal(before[k], after[k])}
    assert moved and all("lora_" in k for k in moved), sorted(moved)[:5]
    assert exp.groups.tolist() == [g for g in (2, 3, 4, 5) for _ in range(4)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_packed_iteration_of_the_options_equals_the_padded_one(tmp_path, monkeypatch, lora):
    runs = {}
    for packing in (True, False):
        tr = build_trainer(tmp_path / str(packing), [*OPTIONS, *(LORA if lora else []), "ppo.actor_lr=1e-4",
                                                    f"data.packing={str(packing).lower()}"])
        with monkeypatch.context() as mp:
            exp, _, train_stats = iteration(tr, mp)
        runs[packing] = (exp, train_stats, snapshot(tr.actor.module))
    (exp1, train1, w1), (exp0, train0, w0) = runs[True], runs[False]
    assert torch.equal(exp1.input_ids, exp0.input_ids)  # the same joined rounds
    m = exp0.loss_mask.bool()
    for name in ("old_logprobs", "ref_logprobs", "advantages"):
        torch.testing.assert_close(getattr(exp1, name)[m], getattr(exp0, name)[m], rtol=1e-4, atol=1e-5)
    assert train1["policy/loss"] == pytest.approx(train0["policy/loss"], rel=1e-4, abs=1e-6)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=1e-6)
