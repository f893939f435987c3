"""What a newcomer hits in the first hour (issue 61). A pointer is read once, when a run starts: the runs record the
model dir it named then (and the pointer as typed beside it), so a later run that moves the pointer changes nothing
an earlier run's eval or resume reads. An eval of a DPO policy against a PPO policy finds the reward model through
the runs' lineage. A typed key the config ignores is refused; a load that keeps too few rows names why."""

import json

import pytest
from omegaconf import OmegaConf

from rlhf_cli import cli, lineage

SMOKE = ["experiment=smoke", "precision=fp32"]
EVAL = [*SMOKE, "eval.num_prompts=4"]


def only(path):
    (one,) = [p for p in path.iterdir() if p.is_dir()]
    return one


def results(eval_dir):
    return json.loads((eval_dir / "eval.json").read_text())["results"]


def test_a_moved_pointer_changes_no_earlier_runs_reference(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    monkeypatch.setattr("sys.argv", ["rlhf"])
    cli.main(["train-sft", *SMOKE, f"paths.root={root}", "sft.max_steps=2"])
    sft_a = only(root / "sft")
    cli.main(["train-ppo", *SMOKE, "model=hf", f"model.name_or_path={root / 'latest_sft'}", f"paths.root={root}",
              "ppo.iterations=1", "reward.type=checker"])
    ppo_dir = only(root / "ppo")
    a_final = str((sft_a / "final").resolve())

    # config.yaml, lineage and final/ record the SFT run the pointer named, the pointer beside it
    cfg = OmegaConf.load(ppo_dir / "config.yaml")
    assert cfg.model.name_or_path == a_final
    assert cfg.paths.typed["model.name_or_path"] == str(root / "latest_sft")
    parent = lineage.read_run(ppo_dir)["parents"]["model"]
    assert parent["path"] == a_final and parent["typed"] == str(root / "latest_sft")
    assert parent["run_dir"] == str(sft_a.resolve())
    spec = json.loads((ppo_dir / "final" / "config.json").read_text())["rlhf_reference_model"]
    assert spec["name_or_path"] == a_final

    def evaluate(name):
        cli.main(["eval", *EVAL, f"paths.root={root}", f"policy.path={ppo_dir}", "reward.type=checker",
                  f"hydra.run.dir={tmp_path / name}"])
        return results(tmp_path / name)

    before = evaluate("eval_before")
    assert before["reference"] == a_final
    cli.main(["train-sft", *SMOKE, f"paths.root={root}", "sft.max_steps=2", "seed=7", "sft.lr=5e-3"])
    sft_b = next(p for p in (root / "sft").iterdir() if p != sft_a)
    assert (root / "latest_sft").read_text().strip() == str((sft_b / "final").resolve())

    after = evaluate("eval_after")  # the same policy, measured against the same reference: the same numbers
    assert after["reference"] == a_final
    assert after["kl_k1"] == before["kl_k1"] and after["kl_k3"] == before["kl_k3"]
    said = (tmp_path / "eval_after" / "eval.log").read_text()
    assert f"{root / 'latest_sft'} named {a_final}" in said and str((sft_b / "final").resolve()) in said

    # a policy recorded before pointers were resolved names the pointer itself: its lineage says what it named
    config_json = ppo_dir / "final" / "config.json"
    old = json.loads(config_json.read_text())
    old["rlhf_reference_model"]["name_or_path"] = str(root / "latest_sft")
    config_json.write_text(json.dumps(old))
    rec = OmegaConf.load(ppo_dir / "final" / "rlhf_config.yaml")
    rec.paths.typed = {}
    rec.model.name_or_path = str(root / "latest_sft")
    (ppo_dir / "final" / "rlhf_config.yaml").write_text(OmegaConf.to_yaml(rec))
    lineage_json = ppo_dir / "final" / lineage.MODEL_FILE
    parents = json.loads(lineage_json.read_text())
    for role in ("model", "reference"):  # as parent() recorded a pointer: its path, the run it named then
        parents["parents"][role] = {**parents["parents"][role], "path": str(root / "latest_sft")}
        parents["parents"][role].pop("typed", None)
    lineage_json.write_text(json.dumps(parents))
    older = evaluate("eval_older")
    assert older["reference"] == a_final and older["kl_k1"] == before["kl_k1"]
    assert f"{root / 'latest_sft'} named {a_final}" in (tmp_path / "eval_older" / "eval.log").read_text()


def test_resolve_model_paths_records_each_pointer_and_keeps_a_resumed_runs_record(tmp_path):
    from stage_helpers import compose

    from rlhf_cli.lifecycle import write_config

    def model_dir(name):
        d = tmp_path / "runs" / "sft" / name / "final"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        return d

    a, b = model_dir("a"), model_dir("b")
    pointer = tmp_path / "runs" / "latest_sft"
    pointer.write_text(f"{a}\n")
    cfg = compose("train_ppo", ["model=hf", f"model.name_or_path={pointer}", f"reference.path={b.parent}",
                                "reward.type=checker", f"paths.root={tmp_path / 'runs'}"])
    found = lineage.resolve_model_paths(cfg)
    assert cfg.model.name_or_path == str(a) and cfg.reference.path == str(b)  # the run dir: its final/
    assert found == dict(cfg.paths.typed) == {"model.name_or_path": str(pointer), "reference.path": str(b.parent)}
    assert lineage.resolve_model_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a hub id

    # a resume keeps the recorded dirs and typed values, even after the pointer moved
    run_dir = tmp_path / "runs" / "ppo" / "r"
    run_dir.mkdir(parents=True)
    write_config(cfg, run_dir)
    pointer.write_text(f"{b}\n")
    resumed = compose("train_ppo", ["model=hf", f"model.name_or_path={a}", "reward.type=checker",
                                    f"resume={run_dir}"])
    lineage.resolve_model_paths(resumed, run_dir)
    assert resumed.model.name_or_path == str(a) and resumed.paths.typed["model.name_or_path"] == str(pointer)

    # an older run recorded the pointer itself: a resume reads what its lineage says it named then
    old = compose("train_ppo", ["model=hf", f"model.name_or_path={pointer}", "reward.type=checker",
                                f"resume={run_dir}"])
    (run_dir / "lineage.json").write_text(json.dumps({"parents": {"model": {
        "path": str(pointer), "run_dir": str(a.parent)}}}))
    lineage.resolve_model_paths(old, run_dir)
    assert old.model.name_or_path == str(a)

    # the first command line again with resume=: the same pointer is the recorded model, though it moved since
    from rlhf_cli.config import ConfigError
    from rlhf_cli.lifecycle import resume_config

    again = compose("train_ppo", ["model=hf", f"model.name_or_path={pointer}", "reward.type=checker",
                                  f"resume={run_dir}"])
    resume_config(again, run_dir, ["model.name_or_path", "reward.type"])
    with pytest.raises(ConfigError, match="model.name_or_path"):  # another model is refused, as any changed key
        resume_config(compose("train_ppo", ["model=hf", f"model.name_or_path={b}", "reward.type=checker"]), run_dir,
                      ["model.name_or_path"])


def test_eval_finds_a_recorded_reward_model_without_lineage_or_on_the_hub(tmp_path):
    from rlhf_cli.stages.evaluate import recorded_reward_model

    policy = tmp_path / "old_policy"  # written before lineage files existed: its config.json alone
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"rlhf_reward_model_path": "OpenAssistant/reward-model"}))
    assert recorded_reward_model(str(policy), None) == ("OpenAssistant/reward-model", f"policy ({policy})")
    assert recorded_reward_model(str(tmp_path / "gone"), None) == (None, "")


def test_dpo_against_ppo_is_judged_by_the_reward_model_of_the_ppo_run(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    monkeypatch.setattr("sys.argv", ["rlhf"])
    cli.main(["train-rm", *SMOKE, f"paths.root={root}", "rm.max_steps=2"])
    cli.main(["train-ppo", *SMOKE, f"paths.root={root}", "ppo.iterations=1"])  # reward.type=model: latest_rm
    cli.main(["train-dpo", *SMOKE, f"paths.root={root}", "dpo.max_steps=2"])
    rm_final = str((only(root / "rm") / "final").resolve())
    capsys.readouterr()
    cli.main(["eval", *EVAL, f"paths.root={root}", f"policy.path={only(root / 'dpo')}",
              f"reference.path={only(root / 'ppo')}", f"hydra.run.dir={tmp_path / 'e'}"])
    got = results(tmp_path / "e")
    assert got["reward_model"] == rm_final
    assert "win_rate" in got and got["win_rate"] is not None
    assert f"reward model: {rm_final}, the one the reference" in capsys.readouterr().out

    # a prompts file that is not the policy's training data is evaluated whole, up to eval.num_prompts (its 10 %
    # held-out split alone held 30 of these 300)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name a colour, {i}."}) + "\n" for i in range(300)))
    cli.main(["eval", *SMOKE, f"paths.root={root}", f"policy.path={only(root / 'ppo')}", f"data.path={prompts}",
              "eval.num_prompts=40", f"hydra.run.dir={tmp_path / 'e300'}"])
    assert results(tmp_path / "e300")["prompts"] == 40
    assert "prompts: the first 40 of the 300 held-out prompts (eval.num_prompts=40)" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, says", [
    (["experiment=smoke", "model.name_or_path=runs/latest_sft"], "add `model=hf`"),
    (["experiment=smoke", "model=hf", "model.gguf_file=x.gguf"], "GGUF file 'x.gguf' does not exist"),  # no ???
    (["model=hf", "model.name_or_path=x", "model.arch.hidden_size=32"], "model.arch.hidden_size=32 does nothing"),
    (["experiment=smoke", "model.lora.alpha=32"], "set `model.lora.r` > 0"),
    (["experiment=smoke", "rm.max_steps=3", "rm.epochs=2"], "rm.epochs=2 does nothing"),
])
def test_a_typed_key_the_config_ignores_is_refused_in_one_line(overrides, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train-rm", *overrides])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists() or "GGUF" in says  # refused before any run dir (the GGUF: at its load)


def test_a_sweep_refuses_only_a_key_every_job_ignores(tmp_path):
    from rlhf_cli.config import ConfigError

    root = f"paths.root={tmp_path}"
    assert cli.check_sweep("train-ppo", ["-m", "ppo.advantage_estimator=gae,grpo", "ppo.n_samples_per_prompt=2",
                                         "ppo.lam=0.9", "reward.type=checker", root]) == 2
    with pytest.raises(ConfigError, match="every sweep job: ppo.lam=0.9 does nothing"):
        cli.check_sweep("train-ppo", ["-m", "ppo.advantage_estimator=grpo,rloo", "ppo.n_samples_per_prompt=2",
                                      "ppo.lam=0.9", "reward.type=checker", root])


def test_the_same_keys_from_a_preset_or_in_their_setting_pass(tmp_path, monkeypatch):
    from stage_helpers import compose

    from rlhf_cli.commands import COMMANDS
    from rlhf_cli.overrides import check_ignored_keys

    ppo = COMMANDS["train-ppo"]
    cfg = compose("train_ppo", ["experiment=grpo"])  # a preset may set what its command leaves unread
    check_ignored_keys(ppo, ["experiment=grpo"], cfg)
    with pytest.raises(Exception, match="ppo.c1=0.3 does nothing .* critic-free"):
        check_ignored_keys(ppo, ["experiment=grpo", "ppo.c1=0.3"], compose("train_ppo", ["experiment=grpo",
                                                                                          "ppo.c1=0.3"]))
    typed = ["model.lora.r=4", "model.lora.alpha=8", "reward.type=checker"]
    check_ignored_keys(ppo, typed, compose("train_ppo", typed))
    with pytest.raises(Exception, match="reward_model.path=x does nothing"):
        check_ignored_keys(ppo, ["reward.type=checker", "reward_model.path=x"],
                           compose("train_ppo", ["reward.type=checker", "reward_model.path=x"]))
    check_ignored_keys(ppo, ["experiment=grpo", "ppo.gamma=0.9"], compose("train_ppo", ["experiment=grpo",
                                                                                       "ppo.gamma=0.9"]))
    with pytest.raises(Exception, match="ppo.gamma=0.9 does nothing .*advantage_estimator=distill"):
        check_ignored_keys(ppo, ["experiment=distill", "ppo.gamma=0.9"],
                           compose("train_ppo", ["experiment=distill", "ppo.gamma=0.9"]))


def test_too_few_rows_names_each_drop_reason_and_the_key_that_keeps_them(tmp_path, monkeypatch, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": "yes " * 80, "rejected": "no " * 80}) + "\n"
                             for i in range(12)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["train-rm", *SMOKE, f"data.path={pairs}", "data.max_length=32", "data.max_prompt_length=16"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "only 0 training pairs" in err and "12 response_too_long (raise data.max_length)" in err


def test_the_engines_own_warnings_go_to_the_log_file_and_are_summed_up_in_one_line(tmp_path):
    import logging

    from rlhf_cli.rollout.vllm_engine import ENGINE_LOG

    root = logging.getLogger()
    log_file, terminal = logging.FileHandler(tmp_path / "train_ppo.log"), logging.StreamHandler()
    shown = []
    terminal.emit = lambda record: shown.append(record.getMessage())
    root.addHandler(log_file), root.addHandler(terminal)
    try:
        ENGINE_LOG.seen.clear()
        engine_log = logging.getLogger("vllm.engine.arg_utils")
        engine_log.warning("This model does not officially support disabling chunked prefill. Disabling this "
                           "manually may cause the engine to crash or produce incorrect outputs.")
        engine_log.warning("libtcmalloc is not found in LD_PRELOAD.")
        engine_log.warning("Something new happened.")
        log_file.flush()
        assert shown == [] and "may cause the engine to crash" in (tmp_path / "train_ppo.log").read_text()
        line = ENGINE_LOG.summary()
        assert line.startswith("vLLM gave 3 warnings (in the run's log file; rollout.engine_verbose=true")
        assert "chunked prefill off on purpose" in line and "speed only (1)" in line
        assert "not known to rlhf, read them: Something new happened." in line
        assert ENGINE_LOG.summary() is None  # said once
        engine_log.error("EngineCore failed")  # errors reach the terminal whatever the setting
        assert shown == ["EngineCore failed"]
        ENGINE_LOG.verbose = True
        engine_log.warning("libiomp is not found in LD_PRELOAD.")
        assert shown[-1] == "libiomp is not found in LD_PRELOAD."
        ENGINE_LOG.verbose = False
        kept, root.handlers = root.handlers, [terminal]  # no log file open: the terminal is all there is
        try:
            engine_log.warning("Triton is not installed.")
            assert shown[-1] == "Triton is not installed." and "(above)" in ENGINE_LOG.summary()
        finally:
            root.handlers = kept
    finally:
        ENGINE_LOG.verbose = False
        ENGINE_LOG.seen.clear()
        root.removeHandler(log_file), root.removeHandler(terminal)
        log_file.close()
