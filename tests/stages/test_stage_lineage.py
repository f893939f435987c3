"""Issue 16: a run records what it came from (data files with hashes and row counts, parent runs), a resume keeps
that data, and `rlhf eval` of a model reads the model's own held-out split unless told otherwise.

One user-file chain (tiny model, fp32) is trained once per module: train-rm on pairs.jsonl (a quarter held out),
then train-ppo on prompts.jsonl against that reward model.
"""

import hashlib
import json
import shutil

import pytest
import torch

from rlhf_cli import lineage
from rlhf_cli.config import ConfigError

N_PAIRS, N_PROMPTS = 40, 32
RM = ["data.format=explicit", "data.test_size=0.25", "data.seed=3", "rm.batch_size=8", "rm.micro_batch_size=4",
      "rm.max_steps=2", "rm.save_every=1", "rm.eval_every=0", "rm.lr=1e-3"]
PPO = ["data.format=prompt", "data.test_size=0.25", "data.seed=5", "reward.type=model", "ppo.iterations=1",
       "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "ppo.max_new_tokens=4"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_rows(n):
    return [{"prompt": f"Row {i}: is the kettle on?", "chosen": f"Yes, it is on ({i}).",
             "rejected": "No." + " no" * (i % 5)} for i in range(n)]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


_CHAIN = {}


@pytest.fixture
def chain(run_stage, tmp_path_factory):
    """{"files": (pairs, prompts), "root", "rm": (result, run_dir, cfg), "ppo": ...}, trained on first use."""
    if not _CHAIN:
        d = tmp_path_factory.mktemp("chain")
        pairs = write_jsonl(d / "pairs.jsonl", pair_rows(N_PAIRS))
        prompts = write_jsonl(d / "prompts.jsonl",
                              [{"prompt": f"Prompt {i}: name a colour."} for i in range(N_PROMPTS)])
        root = d / "runs"
        _CHAIN["files"], _CHAIN["root"] = (pairs, prompts), root
        _CHAIN["rm"] = run_stage("train_rm", [f"data.path={pairs}", *RM], run_dir=root / "rm" / "a", root=root)
        _CHAIN["ppo"] = run_stage("train_ppo", [f"data.path={prompts}", f"reward_model.path={_CHAIN['rm'][1]}", *PPO],
                                  run_dir=root / "ppo" / "a", root=root)
    return _CHAIN


def test_a_run_records_its_data_file_hash_row_counts_and_parents(chain):
    pairs, prompts = chain["files"]
    _, rm_dir, _ = chain["rm"]
    rec = json.loads((rm_dir / "lineage.json").read_text())
    assert rec["stage"] == "rm" and rec["run_dir"] == str(rm_dir.resolve())
    assert rec["data"]["files"] == [{"path": str(pairs.resolve()), "sha256": sha256(pairs),
                                     "bytes": pairs.stat().st_size}]
    summary = rec["data"]["summary"]
    assert summary["rows_read"] == N_PAIRS and summary["kept"] == {"train": 30, "eval": 10}
    assert rec["data"]["config"]["path"] == str(pairs.resolve()) and rec["data"]["config"]["seed"] == 3
    assert rec["parents"] == {}  # model=tiny is a random init: no weights it came from
    assert json.loads((rm_dir / "final" / "rlhf_lineage.json").read_text()) == rec  # the checkpoint carries it

    _, ppo_dir, _ = chain["ppo"]
    rec = json.loads((ppo_dir / "final" / "rlhf_lineage.json").read_text())
    assert rec["stage"] == "ppo" and rec["data"]["files"][0]["sha256"] == sha256(prompts)
    assert rec["data"]["summary"]["rows_read"] == N_PROMPTS and rec["data"]["summary"]["kept"] == {"train": 24}
    parent = rec["parents"]["reward_model"]
    assert parent == {"path": str((rm_dir / "final").resolve()), "stage": "rm", "run_dir": str(rm_dir.resolve()),
                      "typed": str(rm_dir),  # reward_model.path named the run dir: recorded beside its final/
                      "data_files": [{"path": str(pairs.resolve()), "sha256": sha256(pairs),
                                      "bytes": pairs.stat().st_size}]}


def test_eval_of_a_reward_model_reads_its_own_held_out_split(chain, run_stage):
    """No data.* given: the eval scores exactly the pairs the trainer held out (same file, seed and rows), so
    its scores are the trainer's final held-out scores, pair by pair."""
    pairs, _ = chain["files"]
    _, rm_dir, _ = chain["rm"]
    _, eval_dir, cfg = run_stage("eval", [f"reward_model.path={rm_dir}"], root=chain["root"])
    assert cfg.data.path == str(pairs.resolve()) and cfg.data.seed == 3 and cfg.data.format == "explicit"
    out = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert out["pairs"] == 10
    want = json.loads((rm_dir / "rewards.json").read_text())
    got = json.loads((eval_dir / "rewards.json").read_text())
    for side in ("chosen", "rejected"):
        assert torch.allclose(torch.tensor(got[side]), torch.tensor(want[side]), rtol=1e-5, atol=1e-5), side
    rec = json.loads((eval_dir / "lineage.json").read_text())
    assert rec["stage"] == "eval" and rec["parents"]["reward_model"]["run_dir"] == str(rm_dir.resolve())


def test_eval_of_a_policy_samples_the_held_out_prompts_of_its_file(chain, run_stage, tokenizer):
    from rlhf_cli.data import load_prompt_data

    _, prompts = chain["files"]
    _, ppo_dir, ppo_cfg = chain["ppo"]
    _, eval_dir, cfg = run_stage("eval", [f"policy.path={ppo_dir}", "eval.max_new_tokens=4", "eval.batch_size=8"],
                                 root=chain["root"])
    assert cfg.data.path == str(prompts.resolve())
    text = lambda p: f"Prompt {p['row'] - 1}: name a colour."  # noqa: E731 - the file's row (1-based)
    heldout = {text(p) for p in load_prompt_data(ppo_cfg.data, tokenizer, split="eval")}
    trained = {text(p) for p in load_prompt_data(ppo_cfg.data, tokenizer, split="train")}
    assert len(heldout) == N_PROMPTS - 24 and not heldout & trained
    out = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert out["prompts"] == len(heldout)
    assert {s["prompt"] for s in out["samples"]} <= heldout
    rec = json.loads((eval_dir / "lineage.json").read_text())
    assert rec["parents"]["policy"]["run_dir"] == str(ppo_dir.resolve())
    assert rec["parents"]["reward_model"]["stage"] == "rm"


def test_eval_data_rules(chain):
    """Which data an eval reads: the model's recorded data, unless the command chose another source."""
    pairs, prompts = chain["files"]
    _, rm_dir, _ = chain["rm"]
    from stage_helpers import compose

    base = compose("eval", ["model=tiny"]).data  # built-in task: data.path null
    data, note = lineage.eval_data(base, rm_dir, [])
    assert data.path == str(pairs.resolve()) and data.test_size == 0.25 and data.seed == 3
    assert note.startswith(f"data: the model's training data ({pairs.resolve()}, data.seed=3")
    # a key given on the command line goes on top of the record; the source stays the recorded one
    given = compose("eval", ["model=tiny", "data.test_size=0.5"]).data
    data, _ = lineage.eval_data(given, rm_dir, ["data.test_size"])
    assert data.path == str(pairs.resolve()) and data.test_size == 0.5
    # naming the recorded file again is the same source
    same = compose("eval", ["model=tiny", f"data.path={pairs}"]).data
    assert lineage.eval_data(same, rm_dir, ["data.path"])[0].seed == 3
    # another file, or the built-in task asked for by name: that, and the line says it is not the training data
    other = compose("eval", ["model=tiny", f"data.path={prompts}"]).data
    data, note = lineage.eval_data(other, rm_dir, ["data.path"])
    assert data.path == str(prompts) and "not the model's training data" in note
    assert data.eval_path == str(prompts) and "all of it is evaluated" in note  # no training split to hold out
    data, note = lineage.eval_data(base, rm_dir, ["data.path"])
    assert data.path is None and note.startswith("data: the built-in task as set")
    # a model no run of ours wrote: the composed data
    assert lineage.eval_data(base, pairs.parent, []) == (base, None)


def test_a_recorded_data_section_todays_schema_rejects_is_said_not_fatal(chain, tmp_path):
    _, rm_dir, _ = chain["rm"]
    shutil.copytree(rm_dir / "final", tmp_path / "final")
    rec = json.loads((tmp_path / "final" / "rlhf_lineage.json").read_text())
    rec["data"]["config"]["a_key_from_another_version"] = 1
    (tmp_path / "final" / "rlhf_lineage.json").write_text(json.dumps(rec))
    from stage_helpers import compose

    base = compose("eval", ["model=tiny"]).data
    data, note = lineage.eval_data(base, tmp_path / "final", [])
    assert data is base and note.startswith("data: the model's recorded data section is not valid today")


def test_eval_says_when_the_recorded_file_changed(chain, tmp_path):
    """A copy of the run whose data file is then edited: eval still reads it, and the line says it changed."""
    _, rm_dir, _ = chain["rm"]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(N_PAIRS))
    run = tmp_path / "rm"
    shutil.copytree(rm_dir / "final", run / "final")
    rec = json.loads((run / "final" / "rlhf_lineage.json").read_text())
    rec["data"]["config"]["path"] = str(pairs)
    rec["data"]["files"] = [lineage.fingerprint(str(pairs))]
    (run / "final" / "rlhf_lineage.json").write_text(json.dumps(rec))
    from stage_helpers import compose

    base = compose("eval", ["model=tiny"]).data
    assert "changed since" not in lineage.eval_data(base, run, [])[1]
    write_jsonl(pairs, pair_rows(N_PAIRS + 1))
    note = lineage.eval_data(base, run, [])[1]
    assert f"changed since it was trained: {pairs}" in note and "the held-out rows may differ" in note


def test_resume_refuses_a_data_file_changed_since_the_run_started(run_stage, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(N_PAIRS))
    overrides = [f"data.path={pairs}", *RM]
    _, run_dir, _ = run_stage("train_rm", overrides)
    (run_dir / "ds" / "latest").write_text("step-1\n")  # as if it had been stopped after step 1
    (run_dir / "status.json").write_text(json.dumps({"state": "running"}))
    write_jsonl(pairs, pair_rows(N_PAIRS)[:-1])  # one row fewer
    with pytest.raises(ConfigError) as e:
        run_stage("train_rm", [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"resume={run_dir}: the data changed since the run started: "
                                              f"{pairs.resolve()} (sha256 ")
    write_jsonl(pairs, pair_rows(N_PAIRS))  # the same bytes again: the run continues
    result, _, _ = run_stage("train_rm", [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"


def test_a_model_file_is_recorded_by_its_path_and_never_read_as_a_pointer(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\xff\xfe" + bytes(range(256)) * 64)  # binary, larger than a pointer file
    assert lineage.parent(str(gguf)) == {"path": str(gguf.resolve())}
    assert lineage.read(gguf) is None and lineage.recorded_config(gguf) is None
    pointer = tmp_path / "latest_rm"
    pointer.write_text(str(tmp_path / "missing") + "\n")
    assert lineage.read(pointer) is None


def test_eval_data_takes_a_held_out_file_on_top_and_skips_a_relative_record(chain, tmp_path):
    from stage_helpers import compose

    pairs, _ = chain["files"]
    _, rm_dir, _ = chain["rm"]
    heldout = write_jsonl(tmp_path / "heldout.jsonl", pair_rows(6))
    given = compose("eval", ["model=tiny", f"data.eval_path={heldout}"]).data
    data, note = lineage.eval_data(given, rm_dir, ["data.eval_path"])
    assert data.path == str(pairs.resolve()) and data.eval_path == str(heldout) and data.seed == 3
    assert note.startswith("data: the model's training data")
    # an older run dir: no lineage file, a relative data.path in its config
    old = tmp_path / "old_run"
    shutil.copytree(rm_dir / "final", old / "final")
    (old / "final" / "rlhf_lineage.json").unlink()
    cfg = (old / "final" / "rlhf_config.yaml").read_text().replace(str(pairs.resolve()), "data/pairs.jsonl")
    (old / "final" / "rlhf_config.yaml").write_text(cfg)
    base = compose("eval", ["model=tiny"]).data
    data, note = lineage.eval_data(base, old, [])
    assert data is base and note.startswith("data: the model's recorded data.path data/pairs.jsonl is relative")
