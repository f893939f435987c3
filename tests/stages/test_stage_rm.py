"""`rlhf train-rm` end to end on the tiny random model (fp32, CPU): issue 5's "Done when" items.

One toy run (a separable preference set, 8 optimizer steps) is trained once per module and shared:
the tests read its metrics, checkpoints and `final/`, or copy it before changing anything.
"""

import json
import math
import random
import shutil

import pytest
import torch

TOY_TRAIN, TOY_EVAL = 32, 8
STEPS_PER_EPOCH = 4  # 32 pairs / batch 8
TOY_STEPS = 2 * STEPS_PER_EPOCH  # rm.epochs=2
TOY_SAVE_EVERY = 4  # ds/step-4 survives pruning (keep=2) next to the final ds/step-8
TOPICS = ["cats", "rain", "tea", "maps", "jazz", "bread", "stars", "chess", "boats", "snow", "glass", "paper"]


def toy_rows(n, seed):
    """Pairs that differ only in their last words: chosen ends "no no no", rejected "yes yes yes".

    The seed-42 tiny model prefers the "yes" ending before training (accuracy 0), so reaching 1.0
    means the model learnt the difference, not that it started there. At rm.lr=5e-4 the loss falls
    smoothly (0.72 at step 1, ~0.08 at step 5, ~0.01 at step 8), so step N+1 of the resume test
    still has a loss worth comparing.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topics = rng.sample(TOPICS, rng.randint(1, 4))  # rows of different lengths: batches hold padding
        body = f"I think {' and '.join(topics)} are fine."
        rows.append({"prompt": f"Do you like {topics[0]}? ({seed}-{i})", "chosen": body + " no no no",
                     "rejected": body + " yes yes yes"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy_data")
    return write_jsonl(d / "train.jsonl", toy_rows(TOY_TRAIN, 0)), write_jsonl(d / "eval.jsonl", toy_rows(TOY_EVAL, 1))


@pytest.fixture(scope="module")
def toy_overrides(toy_files):
    train, heldout = toy_files
    return [f"data.path={train}", f"data.eval_path={heldout}", "data.format=explicit",
            "rm.lr=5e-4", "rm.epochs=2", "rm.batch_size=8", "rm.micro_batch_size=4", "rm.eval_batch_size=16",
            f"rm.eval_every={TOY_SAVE_EVERY}", f"rm.save_every={TOY_SAVE_EVERY}"]


_TOY = {}


@pytest.fixture
def toy_run(run_stage, toy_overrides, tmp_path_factory):
    """(result, run_dir, cfg) of the shared toy run, trained on first use (root: its own tmp dir)."""
    if "run" not in _TOY:
        root = tmp_path_factory.mktemp("toy_root")
        _TOY["run"] = run_stage("train_rm", toy_overrides, run_dir=root / "rm" / "toy", root=root)
    return _TOY["run"]


def read_metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_records(records):
    return {r["step"]: r for r in records if "rm/loss" in r}


def test_loss_decreases_and_accuracy_reaches_one_on_separable_pairs(toy_run):
    result, run_dir, _ = toy_run
    records = read_metrics(run_dir)
    train = train_records(records)
    assert sorted(train) == list(range(1, TOY_STEPS + 1))
    first, last = train[1], train[TOY_STEPS]
    assert first["rm/accuracy"] < 0.5, "the untrained model should prefer the rejected ending"
    assert first["rm/loss"] > 0.5
    assert last["rm/loss"] < 0.05 * first["rm/loss"]
    k = STEPS_PER_EPOCH
    epoch_means = [sum(train[s]["rm/loss"] for s in range(e * k + 1, (e + 1) * k + 1)) / k for e in range(2)]
    assert epoch_means[1] < 0.25 * epoch_means[0]
    assert last["rm/accuracy"] == 1.0
    for key in ("rm/margin", "rm/chosen_mean", "rm/rejected_mean", "rm/lr", "rm/grad_norm",
                "throughput/pairs_per_s", "throughput/tokens_per_s"):
        assert math.isfinite(last[key]), key

    evals = [r for r in records if "eval/rm/accuracy" in r]
    assert [r["step"] for r in evals] == [TOY_SAVE_EVERY, TOY_STEPS]  # every N steps, then the final eval
    assert evals[-1]["eval/rm/accuracy"] == 1.0
    assert evals[-1]["eval/rm/count"] == TOY_EVAL
    assert evals[-1]["eval/rm/loss"] < evals[0]["eval/rm/loss"]
    assert result == 1.0
    saved = json.loads((run_dir / "final" / "rlhf_eval.json").read_text())
    assert saved["eval"]["rm/accuracy"] == 1.0 and saved["steps"] == TOY_STEPS


def crashed_copy(run_dir, dest, tag):
    """A copy of a finished run made to look as if it had crashed right after checkpoint `tag`
    (None: before its first checkpoint). Its metrics.jsonl still holds the later steps, as after a crash."""
    shutil.copytree(run_dir, dest)
    if tag is None:
        shutil.rmtree(dest / "ds")
    else:
        assert (dest / "ds" / tag).is_dir()
        (dest / "ds" / "latest").write_text(tag + "\n")
    (dest / "status.json").write_text(json.dumps({"state": "running"}))
    shutil.rmtree(dest / "final")
    (dest / "rewards.json").unlink()
    return dest


def test_resume_from_step_n_reproduces_the_uninterrupted_run(toy_run, run_stage, toy_overrides, tmp_path):
    _, run_dir, _ = toy_run
    n = TOY_SAVE_EVERY
    assert n == STEPS_PER_EPOCH  # resume exactly at the epoch boundary: epoch 2's order must be drawn afresh
    crashed = crashed_copy(run_dir, tmp_path / "runs" / "rm" / "crashed", f"step-{n}")
    result, _, cfg = run_stage("train_rm", [*toy_overrides, f"resume={crashed}"], run_dir=crashed)
    assert cfg.resume == str(crashed)

    original, resumed = train_records(read_metrics(run_dir)), train_records(read_metrics(crashed))
    assert sorted(resumed) == list(range(1, TOY_STEPS + 1))  # steps <= N kept, steps > N logged once
    for step in range(1, n + 1):  # untouched by the resume
        assert resumed[step]["rm/loss"] == original[step]["rm/loss"]
    assert original[n + 1]["rm/loss"] > 1e-3, "step N+1 must still have a loss worth comparing"
    assert resumed[n + 1]["rm/loss"] == pytest.approx(original[n + 1]["rm/loss"], abs=1e-5, rel=0)
    for step in range(n + 1, TOY_STEPS + 1):  # same data order, optimizer state and LR schedule after that
        assert resumed[step]["rm/lr"] == pytest.approx(original[step]["rm/lr"], rel=1e-12, abs=0)
        assert resumed[step]["rm/loss"] == pytest.approx(original[step]["rm/loss"], rel=1e-4, abs=1e-5)
        assert resumed[step]["rm/margin"] == pytest.approx(original[step]["rm/margin"], rel=1e-4, abs=1e-5)
    want = json.loads((run_dir / "rewards.json").read_text())
    got = json.loads((crashed / "rewards.json").read_text())
    for side in ("chosen", "rejected"):
        assert torch.allclose(torch.tensor(got[side]), torch.tensor(want[side]), rtol=1e-5, atol=1e-4), side
    assert result == 1.0
    assert json.loads((crashed / "status.json").read_text())["state"] == "finished"
    assert (crashed / "config.prev.yaml").is_file()


def test_final_checkpoint_reloads_with_plain_transformers(toy_run):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.data import PairCollator, load_preference_data
    from rlhf_cli.models import sequence_scores

    _, run_dir, cfg = toy_run
    final = run_dir / "final"
    root = run_dir.parent.parent
    assert (root / "latest_rm").read_text().strip() == str(final.resolve())

    assert (final / "model.safetensors").is_file()
    assert (final / "rlhf_config.yaml").is_file() and (final / "rlhf_eval.json").is_file()
    assert not list(final.glob("*.bin"))
    config = AutoConfig.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert config.num_labels == 1
    assert config.pad_token_id == tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.chat_template
    trainer_rewards = json.loads((run_dir / "rewards.json").read_text())
    both = torch.tensor(trainer_rewards["chosen"] + trainer_rewards["rejected"])
    assert config.rlhf_reward_mean == pytest.approx(float(both.mean()), abs=1e-6)
    assert config.rlhf_reward_std == pytest.approx(float(both.std()), abs=1e-6)
    assert config.rlhf_eval_accuracy == 1.0

    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    pairs = load_preference_data(cfg.data, tokenizer).eval
    assert len(pairs) == TOY_EVAL
    batch = PairCollator(tokenizer.pad_token_id)(pairs)  # right-padded, chosen rows then rejected rows
    assert (batch["attention_mask"] == 0).any(), "the batch should hold padding"
    with torch.no_grad():
        hf_scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        ours = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(hf_scores, ours, rtol=0, atol=1e-5)
    trained = torch.tensor(trainer_rewards["chosen"] + trainer_rewards["rejected"])
    assert torch.allclose(hf_scores, trained, rtol=1e-5, atol=1e-5)


def test_eval_on_the_run_eval_split_gives_the_trainer_accuracy(toy_run, run_stage, toy_files):
    _, run_dir, _ = toy_run
    train, heldout = toy_files
    result, eval_dir, _ = run_stage("eval", [f"reward_model.path={run_dir}", f"data.path={train}",
                                             f"data.eval_path={heldout}", "data.format=explicit",
                                             "eval.batch_size=3"])
    trainer = json.loads((run_dir / "final" / "rlhf_eval.json").read_text())["eval"]
    last_eval = [r for r in read_metrics(run_dir) if "eval/rm/accuracy" in r][-1]
    out = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert out["mode"] == "reward_model" and out["pairs"] == TOY_EVAL
    assert out["accuracy"] == trainer["rm/accuracy"] == last_eval["eval/rm/accuracy"]
    assert result == out["accuracy"]
    assert out["ties"] == trainer["rm/ties"]
    assert out["loss"] == pytest.approx(trainer["rm/loss"], abs=1e-5)
    assert out["margin_mean"] == pytest.approx(trainer["rm/margin"], rel=1e-5, abs=1e-5)
    # pair by pair: the fresh load of final/ scores every held-out pair as the trainer did
    want = json.loads((run_dir / "rewards.json").read_text())
    got = json.loads((eval_dir / "rewards.json").read_text())
    for side in ("chosen", "rejected"):
        assert torch.allclose(torch.tensor(got[side]), torch.tensor(want[side]), rtol=1e-5, atol=1e-5), side


def test_the_readmes_plain_transformers_lines_reproduce_the_runs_scores(toy_run, tokenizer):
    """The README's snippet, run as written on the run's held-out pairs (fp32): the score of each chosen and
    rejected reply equals the run's own `rewards.json` to 1e-4 (the exported chat template ends at the EOS)."""
    import re
    from pathlib import Path

    from rlhf_cli.data import load_preference_data

    _, run_dir, cfg = toy_run
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(from transformers import AutoModelForSequenceClassification.*?)```", readme,
                            re.S)
    assert 'final = "runs/rm/<run-id>/final"' in snippet and "chat = [" in snippet
    rows = toy_rows(TOY_EVAL, 1)
    want = json.loads((run_dir / "rewards.json").read_text())
    for i, ex in enumerate(load_preference_data(cfg.data, tokenizer).eval):
        row = rows[ex["row"] - 1]
        for side in ("chosen", "rejected"):
            chat = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row[side]}]
            code = (snippet.replace('"runs/rm/<run-id>/final"', repr(str(run_dir / "final")))
                    .replace(snippet[snippet.index("chat = ["):].split("\n")[0], f"chat = {chat!r}"))
            scope = {}
            exec(code, scope)  # noqa: S102 - the README's own lines
            assert scope["score"] == pytest.approx(want[side][i], abs=1e-4), (i, side)


def test_dry_run_writes_config_and_no_checkpoint(run_stage, toy_overrides):
    result, run_dir, _ = run_stage("train_rm", [*toy_overrides, "dry_run=true", "rm.lr=7e-4"])
    assert result is None
    config = (run_dir / "config.yaml").read_text()
    assert "lr: 0.0007" in config and "dry_run: true" in config
    assert json.loads((run_dir / "status.json").read_text())["state"] == "dry_run"
    assert not (run_dir / "final").exists()
    assert not (run_dir / "ds").exists()
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir.parent.parent / "latest_rm").exists()


def test_resume_before_the_first_checkpoint_starts_over_without_duplicate_records(
        toy_run, run_stage, toy_overrides, tmp_path):
    _, run_dir, _ = toy_run
    crashed = crashed_copy(run_dir, tmp_path / "runs" / "rm" / "crashed", None)
    run_stage("train_rm", [*toy_overrides, f"resume={crashed}"], run_dir=crashed)
    original, resumed = read_metrics(run_dir), read_metrics(crashed)
    assert [r["step"] for r in resumed] == [r["step"] for r in original]
    for want, got in zip(original, resumed):
        for key in ("rm/loss", "eval/rm/loss"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (want["step"], key)


def test_without_held_out_pairs_no_reward_stats_are_stored(run_stage):
    """No held-out pairs: nothing was measured, so `final/config.json` carries no reward mean/std
    (PPO then uses raw scores, eval reports no gain in RM-std units) rather than a 0/1 stand-in."""
    from rlhf_cli.models import read_score_stats

    _, run_dir, _ = run_stage("train_rm", ["data.builtin.rm_eval=0", "rm.max_steps=1", "rm.eval_every=0"])
    config = json.loads((run_dir / "final" / "config.json").read_text())
    assert "rlhf_reward_mean" not in config and "rlhf_reward_std" not in config
    assert config["rlhf_stage"] == "rm" and config["rlhf_eval_accuracy"] is None
    assert read_score_stats(run_dir / "final") is None


@pytest.mark.parametrize("scoring", ["fp32", "same"])
def test_bf16_autocast_run_scores_held_out_pairs_in_fp32(run_stage, toy_overrides, scoring):
    """Under bf16-autocast the held-out scores (accuracy, reward statistics) come from an fp32 pass by
    default (`scoring_precision=fp32`): exactly what the saved model scores in fp32 with plain transformers.
    `scoring_precision=same` scores with the bf16 trunk, which moves every score."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.data import PairCollator, load_preference_data

    _, run_dir, cfg = run_stage("train_rm", [*toy_overrides, "precision=bf16-autocast", f"scoring_precision={scoring}",
                                             "rm.max_steps=2", "rm.eval_every=0", "rm.save_every=0"])
    final = run_dir / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    batch = PairCollator(tokenizer.pad_token_id)(load_preference_data(cfg.data, tokenizer).eval)
    with torch.no_grad():
        fp32 = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    rewards = json.loads((run_dir / "rewards.json").read_text())
    got = torch.tensor(rewards["chosen"] + rewards["rejected"])
    if scoring == "fp32":
        assert torch.allclose(got, fp32, rtol=0, atol=1e-5)
    else:
        assert (got - fp32).abs().max() > 1e-4


def test_the_dropped_partial_batch_is_counted(run_stage, caplog):
    import logging

    overrides = ["data.builtin.rm_train=36", "data.builtin.rm_eval=8", "rm.batch_size=8", "rm.micro_batch_size=4",
                 "dry_run=true"]
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.stages.rm"):
        run_stage("train_rm", overrides)
    (line,) = [r.getMessage() for r in caplog.records if "partial batch" in r.getMessage()]
    assert line.startswith("each epoch trains on 32 of 36 pairs: the last partial batch of 4 is dropped")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.stages.rm"):
        run_stage("train_rm", [*overrides[:2], "rm.batch_size=4", "rm.micro_batch_size=4", "dry_run=true"])
    assert not [r for r in caplog.records if "partial batch" in r.getMessage()]  # 36 = 9 × 4: nothing dropped


def test_packed_and_plain_runs_train_the_same_model(toy_run, run_stage, toy_overrides):
    """`data.packing` (the default) against `data.packing=false`: the same loss at every step, the same held-out
    scores and weights, to fp32 rounding accumulated over 8 Adam steps; the packed run computes fewer positions."""
    from safetensors.torch import load_file

    _, packed_dir, _ = toy_run
    _, plain_dir, _ = run_stage("train_rm", [*toy_overrides, "data.packing=false"])
    packed, plain = train_records(read_metrics(packed_dir)), train_records(read_metrics(plain_dir))
    assert packed.keys() == plain.keys() == set(range(1, TOY_STEPS + 1))
    for step in packed:
        assert packed[step]["rm/loss"] == pytest.approx(plain[step]["rm/loss"], rel=1e-4, abs=1e-5), step
        assert packed[step]["throughput/tokens_per_s"] > 0
        # the same pair tokens counted; the packed run computes each prompt once and pads only row tails
        assert packed[step]["throughput/positions_per_token"] < 1 <= plain[step]["throughput/positions_per_token"]
        assert 0 <= packed[step]["throughput/padding_fraction"] < 0.5
    a, b = (json.loads((d / "rewards.json").read_text()) for d in (packed_dir, plain_dir))
    torch.testing.assert_close(torch.tensor(a["chosen"] + a["rejected"]), torch.tensor(b["chosen"] + b["rejected"]),
                               rtol=0, atol=1e-4)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in (packed_dir, plain_dir))
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("command", ["train_rm", "train_sft", "train_dpo"])
def test_a_ctrl_c_mid_step_finishes_the_step_and_saves_it_then_resume_matches(run_stage, monkeypatch, tmp_path,
                                                                            command):
    """Ctrl-C (SIGINT) during step 2's optimizer step (after its update, before its record) in the supervised loop of
    train-rm, train-sft and train-dpo: the step and its metrics row finish, `ds/step-2` holds exactly step 2's
    weights, and the resumed run's later steps and final weights equal an uninterrupted run's."""
    import os
    import signal

    from safetensors.torch import load_file

    from rlhf_cli.stages import common

    section = command.removeprefix("train_")
    overrides = ["experiment=smoke", f"{section}.max_steps=4", f"{section}.batch_size=4",
                 f"{section}.micro_batch_size=2", f"{section}.eval_every=0", f"{section}.log_every=1"]
    _, whole, _ = run_stage(command, overrides, run_dir=tmp_path / "whole")
    real_log = common.MetricsLogger.log

    def interrupting_log(self, step, record):  # step 2's update is done, its record not yet written
        if step == 2 and not getattr(self, "_interrupted", False):
            self._interrupted = True
            os.kill(os.getpid(), signal.SIGINT)
        return real_log(self, step, record)

    monkeypatch.setattr(common.MetricsLogger, "log", interrupting_log)
    run_dir = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        run_stage(command, overrides, run_dir=run_dir)
    monkeypatch.undo()
    assert (run_dir / "ds" / "latest").read_text().strip() == "step-2"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    run_stage(command, [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    a, b = read_metrics(whole), read_metrics(run_dir)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    key = f"{section}/loss"
    for ra, rb in zip(a, b):
        if key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), ra["step"]
    want, got = load_file(whole / "final" / "model.safetensors"), load_file(run_dir / "final" / "model.safetensors")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)
