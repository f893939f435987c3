"""The command line: dispatch, Hydra composition, typed config errors, sweeps."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from stage_helpers import REPO, compose

from rlhf_cli.config import ConfigError, reward_sources, validate_reward
from rlhf_cli.preflight import VALIDATORS

ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "0"}


def rlhf(*args, cwd=REPO, timeout=300):
    return subprocess.run([sys.executable, "-m", "rlhf_cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_no_command_lists_subcommands():
    out = rlhf()
    assert out.returncode == 0
    for cmd in ("train-rm", "train-ppo", "eval"):
        assert cmd in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/statm")
def test_cli_keeps_freed_memory_for_reuse_unless_told_not_to():
    """`cli.reuse_freed_memory` (run first by `main`): a freed 113 MB tensor stays in the process for the next one
    (no page faults to get it back), where glibc alone unmaps it; `RLHF_MALLOC=system` leaves glibc as it is."""
    code = ("import os; from rlhf_cli import cli; took = cli.reuse_freed_memory(); import torch\n"
            "def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
            "r0 = rss(); x = torch.ones(49152, 576); r1 = rss(); del x; r2 = rss()\n"
            "print(took, (r1 - r0) >> 20, (r2 - r0) >> 20)")
    clean = {k: v for k, v in ENV.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "RLHF_MALLOC")}

    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        took, touched, kept = out.stdout.split()
        return took, int(touched), int(kept)

    took, touched, kept = run()
    if took == "False":
        pytest.skip("not glibc: nothing to set")
    assert touched >= 100 and kept >= 100  # still resident after the free
    took, touched, kept = run(RLHF_MALLOC="system")
    assert took == "False" and touched >= 100 and kept < 20  # glibc unmapped it


def test_cli_refuses_an_unknown_malloc_mode():
    out = subprocess.run([sys.executable, "-m", "rlhf_cli", "--help"], cwd=REPO, env={**ENV, "RLHF_MALLOC": "glibc"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: RLHF_MALLOC='glibc': expected one of reuse, compact, system (unset: each "
                                  "run's own)")


def test_each_command_has_its_malloc_settings_and_the_environment_overrides_them(monkeypatch):
    """train-sft runs under glibc's defaults (its packed rows change shape every step: kept blocks only grow the
    heap), the other commands keep freed memory; `RLHF_MALLOC` set either way rules for every command."""
    from rlhf_cli import cli
    from rlhf_cli.commands import COMMANDS

    monkeypatch.delenv("RLHF_MALLOC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert {name: cli.malloc_mode(name) for name in COMMANDS} == {
        name: "system" if name == "train-sft" else "reuse" for name in COMMANDS}
    assert cli.malloc_mode(None) == cli.malloc_mode("train-kto") == "reuse"
    if sys.platform.startswith("linux"):
        assert cli.reuse_freed_memory("train-sft") is False
    for mode in ("reuse", "compact", "system"):
        monkeypatch.setenv("RLHF_MALLOC", mode)
        assert cli.malloc_mode("train-sft") == cli.malloc_mode("train-ppo") == mode


def test_a_run_training_lora_adapters_turns_glibcs_per_thread_cache_off(monkeypatch, tmp_path):
    """A training command whose run trains LoRA adapters runs `compact` (freed memory kept, no per-thread cache
    of small blocks: `cli.restart_for_tunables`): decided from the composed config, the recorded config of a run
    it resumes, or any job of a sweep; the same config evaluated, or without LoRA, does not; `RLHF_MALLOC` still
    rules."""
    from omegaconf import OmegaConf

    from rlhf_cli import cli

    monkeypatch.delenv("RLHF_MALLOC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    lora, full = OmegaConf.create({"model": {"lora": {"r": 8}}}), OmegaConf.create({"model": {"lora": {"r": 0}}})
    assert {c: cli.trains_adapters(c, lora) for c in ("train-sft", "train-rm", "train-dpo", "train-ppo", "eval")} == {
        "train-sft": True, "train-rm": True, "train-dpo": True, "train-ppo": True, "eval": False}
    assert not cli.trains_adapters("train-rm", full) and not cli.trains_adapters("train-rm", OmegaConf.create({}))
    assert cli.malloc_mode("train-rm", True) == cli.malloc_mode("train-sft", True) == "compact"
    assert cli.malloc_mode("train-rm", False) == "reuse" and cli.malloc_mode("train-sft", False) == "system"
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(lora, run / "config.yaml")  # a LoRA run resumed with today's defaults composed
    assert cli.run_trains_adapters("train-rm", full, [f"resume={run}"], [])
    assert not cli.run_trains_adapters("eval", full, [f"resume={run}"], [])
    (run / "config.yaml").write_text("model: {lora: {r: abc}}\n")
    with pytest.raises(ConfigError, match="does not load"):
        cli.run_trains_adapters("train-rm", full, [f"resume={run}"], [])
    assert cli.run_trains_adapters("train-rm", None, ["-m"], [full, lora])  # a sweep: any job
    assert not cli.run_trains_adapters("train-rm", None, ["-m"], [full, full])
    monkeypatch.setenv("RLHF_MALLOC", "reuse")
    assert cli.malloc_mode("train-rm", True) == "reuse"


def test_the_restart_for_glibcs_tunables_keeps_the_arguments_and_happens_once(monkeypatch):
    from rlhf_cli import cli

    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda exe, args, env: calls.append((exe, args, env)))
    monkeypatch.setattr(cli.sys, "orig_argv", [sys.executable, "-m", "rlhf_cli", "train-rm", "model.lora.r=8"])
    monkeypatch.setattr(cli.sys, "argv", ["/x/rlhf_cli/__main__.py", "train-rm", "model.lora.r=8"])
    for name in ("RLHF_MALLOC", "LD_PRELOAD", cli.RESTARTED_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    cli.restart_for_tunables("train-rm", False)
    cli.restart_for_tunables("eval", False)
    assert calls == []  # reuse: nothing glibc reads at start
    cli.restart_for_tunables("train-rm", True)
    if not cli._glibc():
        assert calls == []
        return
    (exe, args, env), = calls
    assert exe == sys.executable and args == [sys.executable, "-m", "rlhf_cli", "train-rm", "model.lora.r=8"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
    assert env[cli.RESTARTED_ENV] == "1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=7")  # the user's own value is kept
    cli.restart_for_tunables("train-rm", True)
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    monkeypatch.setenv(cli.RESTARTED_ENV, "1")
    cli.restart_for_tunables("train-rm", True)  # the restarted process: no second restart, the marker removed
    assert cli.RESTARTED_ENV not in cli.os.environ
    monkeypatch.setattr(cli.sys, "argv", ["/x/driver.py", "train-rm", "model.lora.r=8"])
    monkeypatch.setattr(cli.sys, "orig_argv", [sys.executable, "/x/driver.py"])
    cli.restart_for_tunables("train-rm", True)  # sys.argv set by a script: restarting would rerun the script
    assert len(calls) == 1


def test_a_lora_command_restarts_itself_with_the_tunable(tmp_path):
    """End to end: `rlhf train-rm model=tiny model.lora.r=4 dry_run=true`, started as a command (`main()` with
    no arguments), runs its stage in a process started again with the tunable, once."""
    from rlhf_cli import cli

    if not cli._glibc():
        pytest.skip("glibc's tunables")
    code = ("import atexit, os, sys\n"
            "atexit.register(lambda: print('TUNABLES', os.environ.get('GLIBC_TUNABLES'), flush=True))\n"
            "print('START', flush=True)\n"
            "from rlhf_cli.cli import main\n"
            "main()\n")
    env = {k: v for k, v in ENV.items() if k not in ("RLHF_MALLOC", "LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", code, "train-rm", "model=tiny", "model.lora.r=4", "dry_run=true",
                          f"paths.root={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("START") == 2  # once, then once more after the restart
    assert "TUNABLES glibc.malloc.tcache_count=0" in out.stdout


def test_a_preloaded_allocator_keeps_its_own_settings(monkeypatch):
    from rlhf_cli import cli

    monkeypatch.delenv("RLHF_MALLOC", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert cli.malloc_mode() == "system" and cli.reuse_freed_memory() is False
    monkeypatch.setenv("LD_PRELOAD", "")
    assert cli.malloc_mode() == "reuse"


def test_unknown_command_exits_2_with_list():
    out = rlhf("train-orpo")
    assert out.returncode == 2
    assert "unknown command 'train-orpo'" in out.stderr and "train-ppo" in out.stderr


def test_strip_local_rank(monkeypatch):
    from rlhf_cli.cli import strip_local_rank

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank(["--local_rank=3", "train-rm", "seed=1"]) == ["train-rm", "seed=1"]
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_local_rank(["--local_rank", "1", "eval"]) == ["eval"]
    assert os.environ["LOCAL_RANK"] == "1"


REQUIRED_KEYS = {
    "ppo": ["gamma", "lam", "clip", "value_clip", "c1", "c2", "kl_beta", "kl_target", "kl_horizon",
            "kl_estimator", "rollout_batch_size", "mini_batch_size", "micro_batch_size", "epochs",
            "max_new_tokens", "temperature"],
    "data": ["path", "format", "max_length", "max_prompt_length"],
    "paths": ["root"],
}


@pytest.mark.parametrize("command", ["train-rm", "train-ppo", "eval"])
def test_cfg_job_has_every_key_and_launcher_form(command):
    out = rlhf("--local_rank=0", command, "--cfg", "job")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    for section, keys in REQUIRED_KEYS.items():
        for k in keys:
            assert k in cfg[section], f"{section}.{k} missing"
    for k in ("precision", "seed", "model", "deepspeed"):
        assert k in cfg


EXPERIMENTS = sorted(f[:-len(".yaml")] for f in os.listdir(os.path.join(REPO, "rlhf_cli", "conf", "experiment"))
                     if f.endswith(".yaml"))


@pytest.mark.parametrize("command", sorted(VALIDATORS))
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_composes_and_validates(command, experiment, tmp_path):
    VALIDATORS[command](compose(command, [f"experiment={experiment}", f"paths.root={tmp_path}"]))


def test_checker_experiment_sets_what_docs_results_records():
    cfg = compose("train_ppo", ["experiment=checker"])
    assert cfg.reward.type == "checker" and cfg.ppo.lam == 1.0 and cfg.ppo.epochs == 1
    assert (cfg.ppo.rollout_batch_size, cfg.ppo.iterations, cfg.ppo.max_new_tokens) == (32, 10, 48)
    assert compose("eval", ["experiment=checker"]).eval.max_new_tokens == 48


@pytest.mark.parametrize(("overrides", "want"), [
    ([], {"model": 1.0}),
    (["reward.type=checker"], {"checker": 1.0}),
    (["reward.weights={model:1.0,checker:0.5}"], {"model": 1.0, "checker": 0.5}),  # the README's form
    (["reward.weights.function=2", "reward.function=m:f"], {"function": 2.0}),
])
def test_reward_sources_from_the_command_line(overrides, want):
    cfg = compose("train_ppo", overrides)
    validate_reward(cfg)
    assert reward_sources(cfg) == want


def test_grpo_experiment_is_critic_free_and_fits_the_completion_budget():
    cfg = compose("train_ppo", ["experiment=grpo"])
    p = cfg.ppo
    assert cfg.reward.type == "checker" and p.advantage_estimator == "grpo" and p.kl_in == "loss"
    completions = p.iterations * p.rollout_batch_size * p.n_samples_per_prompt
    assert p.n_samples_per_prompt >= 2 and completions <= 1536  # issue 18's budget
    # one optimizer step per iteration on all its completions: the on-policy update (no old log-prob pass)
    assert p.epochs == 1 and p.mini_batch_size == p.rollout_batch_size * p.n_samples_per_prompt
    assert p.max_new_tokens == 48 and compose("eval", ["experiment=grpo"]).eval.max_new_tokens == 48


def test_overrides_land_in_composed_config():
    out = rlhf("train-ppo", "--cfg", "job", "model=tiny", "ppo.clip=0.3", "ppo.kl_beta=0.02",
               "deepspeed=zero2", "precision=fp32", "data.max_length=128")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["ppo"]["clip"] == 0.3 and cfg["ppo"]["kl_beta"] == 0.02
    assert cfg["model"]["init"] == "random" and cfg["deepspeed"]["zero_stage"] == 2
    assert cfg["precision"] == "fp32" and cfg["data"]["max_length"] == 128


def test_misspelt_key_is_rejected_with_suggestion(tmp_path):
    out = rlhf("train-ppo", "ppo.clpi=0.1", f"paths.root={tmp_path}")
    assert out.returncode == 2
    assert "ppo.clpi" in out.stderr and "did you mean 'ppo.clip'" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command, override, line", [
    ("train-ppo", "ppo.clip=abc", "ppo.clip must be a float (got 'abc')"),
    ("train-rm", "rm.lr=abc", "rm.lr must be a float (got 'abc')"),
    ("train-rm", "rm.batch_size=1.5", "rm.batch_size must be an integer (got '1.5')"),
    ("eval", "data.chat_template=maybe", "data.chat_template must be true or false (got 'maybe')"),
    ("train-rm", "rm=x", "rm is a section of keys, not a value (got 'x'): set rm.<key>=<value>"),
    ("train-rm", "model=tinyy", "no model option 'tinyy' (hf, smollm2, tiny)"),
    ("train-ppo", "experiment=nope", "no experiment option 'nope' (checker, distill, grpo, hh_smollm2, smoke, tools)"),
    ("train-rm", "data.system_prompt=Be brief, and kind.",
     "data.system_prompt: the value 'Be brief, and kind.' holds a comma, which Hydra reads as a list or a sweep; "
     "quote it inside the override to keep it as text: \"data.system_prompt='Be brief, and kind.'\""),
    ("train-rm", "rm.lr=[1", "'rm.lr=[1' does not parse as an override (no viable alternative at input '[1'); "
                             "quote a value holding []{}(),=' characters"),
])
def test_hydra_composition_errors_are_one_line_and_exit_2(tmp_path, command, override, line):
    out = rlhf(command, override, f"paths.root={tmp_path}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: {line}"]
    assert not any(tmp_path.iterdir())


def test_help_lists_the_groups_and_the_keys_each_command_reads_with_their_descriptions():
    from rlhf_cli.config import field_docs

    docs = field_docs()
    helps = {c: rlhf(c, "--help") for c in ("train-rm", "train-ppo", "eval")}
    for command, out in helps.items():
        assert out.returncode == 0 and out.stdout.startswith(f"rlhf {command}: ")
        assert "  model       hf, smollm2 (default), tiny" in out.stdout
        assert "  experiment  checker, distill, grpo, hh_smollm2, smoke, tools" in out.stdout
    first = lambda key: docs[key].split(". ")[0].rstrip(".")  # noqa: E731
    ppo = helps["train-ppo"].stdout.splitlines()
    assert f"  ppo.clip=0.2  {first('ppo.clip')}" in ppo
    assert f"  model.name_or_path=null  {first('model.name_or_path')}" in ppo
    assert not any(ln.startswith(("  rm.", "  policy.", "  eval.")) for ln in ppo)
    rm = helps["train-rm"].stdout.splitlines()
    assert any(ln.startswith("  rm.lr=") for ln in rm) and not any(ln.startswith(("  ppo.", "  reward.")) for ln in rm)
    ev = helps["eval"].stdout.splitlines()
    assert any(ln.startswith("  policy.path=null  ") for ln in ev) and not any(ln.startswith("  rm.") for ln in ev)


@pytest.mark.parametrize("command, override, line", [
    ("train-ppo", "policy.path=/some/dir",
     "`rlhf train-ppo` does not read policy.path (an `rlhf eval` key); did you mean model.name_or_path? "
     "(`rlhf train-ppo --help` lists the keys it reads)"),
    ("train-rm", "ppo.clip=0.1", "`rlhf train-rm` does not read ppo.clip (an `rlhf train-ppo` key); did you mean one "
                                 "of the rm.* keys? (`rlhf train-rm --help` lists the keys it reads)"),
    ("train-ppo", "rm.lr=1e-5", "`rlhf train-ppo` does not read rm.lr (an `rlhf train-rm` key); did you mean "
                                "ppo.actor_lr? (`rlhf train-ppo --help` lists the keys it reads)"),
    ("train-rm", "rollout.engine=hf", "`rlhf train-rm` does not read rollout.engine (an `rlhf train-ppo / eval` key) "
                                      "(`rlhf train-rm --help` lists the keys it reads)"),
    ("train-rm", "ppo.max_steps=3", "unknown config key 'ppo.max_steps' for `rlhf train-rm`; did you mean "
                                    "'rm.max_steps'? (`rlhf train-rm --cfg job` lists every key)"),
    ("train-ppo", "tensorboard=true",
     "tensorboard is no longer a key: TensorBoard is one of the loggers, logger=[jsonl,tensorboard] (without "
     "`logger`, metrics go to metrics.jsonl only)"),
])
def test_a_key_the_command_does_not_read_is_refused_naming_what_was_meant(tmp_path, command, override, line):
    out = rlhf(command, "model=tiny", override, f"paths.root={tmp_path}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"error: {line}"]


def test_logging_keys_a_command_ignores_are_a_warning(tmp_path):
    """One override list for train-rm, train-ppo and eval: eval warns about the logging keys and does not refuse
    them (here it then stops for its own reason: nothing to evaluate under an empty paths.root)."""
    out = rlhf("eval", "model=tiny", "logger=[jsonl,tensorboard]", "tracker.project=demo", "dry_run=true",
               f"paths.root={tmp_path}")
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: logger has no effect in `rlhf eval` (it writes no training metrics)",
                        "warning: tracker.project has no effect in `rlhf eval` (it writes no training metrics)"]
    assert not [ln for ln in out.stderr.splitlines() if ln.startswith("error:") and ("logger" in ln or "tracker" in ln)]


def test_an_unknown_logger_is_one_line_naming_the_loggers(tmp_path):
    out = rlhf("train-rm", "model=tiny", "logger=[jsonl,tensorbord]", f"paths.root={tmp_path}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: logger: 'tensorbord' is not one of jsonl, tensorboard, wandb, mlflow, trackio "
        "(e.g. logger=[jsonl,tensorboard])"]


def test_a_quoted_comma_value_is_text():
    assert compose("train_rm", ["data.system_prompt='Be brief, and kind.'"]).data.system_prompt == "Be brief, and kind."


@pytest.mark.parametrize("override,needle", [
    ("ppo.clip=-1", "ppo.clip (ε) must be > 0"),
    ("ppo.gamma=1.5", "ppo.gamma (γ) must be in [0, 1]"),
    ("ppo.mini_batch_size=12", "ppo.rollout_batch_size=16 is not divisible by ppo.mini_batch_size=12"),
    ("precision=fp16", "precision='fp16' is not one of"),
])
def test_out_of_range_value_one_line_error(tmp_path, override, needle):
    out = rlhf("train-ppo", "model=tiny", override, f"paths.root={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1


def test_config_module_rejects_bad_batch_split():
    from omegaconf import OmegaConf

    from rlhf_cli.config import ConfigError, RunConfig, validate_rm

    cfg = OmegaConf.structured(RunConfig)
    cfg.rm.batch_size, cfg.rm.micro_batch_size = 16, 8
    validate_rm(cfg, world_size=2)
    with pytest.raises(ConfigError,
                       match=r"rm.batch_size=16 is not divisible by rm.micro_batch_size × world size = 8 × 4 = 32"):
        validate_rm(cfg, world_size=4)


def test_multirun_dry_run_gives_one_run_dir_per_job(tmp_path):
    out = rlhf("train-rm", "-m", "model=tiny", "dry_run=true", "rm.lr=1e-5,2e-5", f"paths.root={tmp_path}",
               "data.builtin.rm_train=32", "data.builtin.rm_eval=8")
    assert out.returncode == 0, out.stderr[-3000:]
    sweeps = list((tmp_path / "rm").glob("sweep-*"))
    assert len(sweeps) == 1
    jobs = sorted(p for p in sweeps[0].iterdir() if (p / "config.yaml").is_file())
    assert [p.name for p in jobs] == ["0", "1"]
    lrs = sorted(yaml.safe_load((p / "config.yaml").read_text())["rm"]["lr"] for p in jobs)
    assert lrs == [1e-5, 2e-5]


def test_a_sweep_is_validated_whole_before_any_job_launches(tmp_path):
    out = rlhf("train-rm", "-m", "model=tiny", "rm.lr=1e-3,-1", "rm.max_steps=2", f"paths.root={tmp_path}")
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and errors == [
        "error: sweep job 1 (rm.lr=-1): rm.lr must be > 0 (got -1.0); no job was launched"]
    assert not (tmp_path / "rm").exists()
    out = rlhf("train-rm", "-m", "model=tiny", "rm.lr=1e-3,2e-3", "resume=true", f"paths.root={tmp_path}")
    assert out.returncode == 2 and "error: resume with -m: a sweep is not resumed as a whole" in out.stderr
    out = rlhf("train-rm", "-m", "model=tiny,nosuch", "rm.max_steps=2", f"paths.root={tmp_path}")
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert line.startswith("error: sweep job 1 (model=nosuch): ") and line.endswith("; no job was launched")
    assert not (tmp_path / "rm").exists()


@pytest.mark.slow
def test_sweep_jobs_move_no_pointer_and_the_sweep_is_named_at_the_end(tmp_path):
    out = rlhf("train-rm", "-m", "experiment=smoke", "rm.max_steps=2", "rm.lr=1e-3,2e-3",
               f"paths.root={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    (sweep,) = list((tmp_path / "rm").glob("sweep-*"))
    assert all((sweep / job / "final" / "model.safetensors").is_file() for job in ("0", "1"))
    assert not (tmp_path / "latest_rm").exists()  # no job's model silently becomes the next stage's default
    assert f"sweep: {sweep} (latest_* pointers not moved by sweep jobs); compare its jobs with: rlhf eval " \
           f"run_dir={sweep}" in out.stderr


def test_resume_true_continues_the_newest_unfinished_run_in_place(tmp_path):
    common = ["experiment=smoke", f"paths.root={tmp_path}", "rm.save_every=4", "rm.max_steps=8"]
    out = rlhf("train-rm", *common)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "rm").iterdir()]
    # a crash after the step-4 checkpoint: the newest complete checkpoint is step-4, the run is unfinished
    (run / "ds" / "latest").write_text("step-4\n")
    (run / "status.json").write_text('{"state": "running"}')
    # a newer run that stops on a data check is marked failed, and resume=true passes it by
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(3)))
    out = rlhf("train-rm", *common, f"data.path={few}")
    assert out.returncode == 2 and "fewer than rm.batch_size" in out.stderr
    (failed,) = [p for p in (tmp_path / "rm").iterdir() if p != run]
    status = json.loads((failed / "status.json").read_text())
    assert status["state"] == "failed" and "fewer than rm.batch_size" in status["reason"]
    out = rlhf("train-rm", *common, f"data.path={few}", f"resume={run}")  # a resume attempt that fails ...
    assert out.returncode == 2 and json.loads((run / "status.json").read_text())["state"] == "running"  # ... keeps it
    out = rlhf("train-rm", *common, "resume=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resume=true: continuing {run} from step-4" in out.stderr
    assert sorted(p.name for p in (tmp_path / "rm").iterdir()) == sorted([run.name, failed.name])  # in place
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 8]  # each training step once, then the final eval record
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    out = rlhf("train-rm", *common, "resume=true")  # nothing left to resume
    assert out.returncode == 2 and "no unfinished `train-rm` run" in out.stderr


def test_resume_continues_the_recorded_run_and_refuses_changed_data(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "chosen": "yes" if i % 2 == 0 else "no",
                                         "rejected": "no" if i % 2 == 0 else "yes"}) + "\n" for i in range(40)))
    common = ["experiment=smoke", f"paths.root={tmp_path}", "rm.save_every=2"]
    out = rlhf("train-rm", *common, f"data.path={pairs}", "rm.max_steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = list((tmp_path / "rm").iterdir())
    (run / "ds" / "latest").write_text("step-2\n")  # a crash after the step-2 checkpoint
    (run / "status.json").write_text('{"state": "running"}')
    other = tmp_path / "other.jsonl"
    other.write_text(pairs.read_text())
    out = rlhf("train-rm", *common, f"data.path={other}", "rm.max_steps=4", f"resume={run}")
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-2000:]
    assert f"data.path={other} (recorded: {pairs})" in errors[0]
    assert "a resumed run keeps its recorded config" in errors[0]
    # the same command without data.path (and with more steps) continues the recorded run on its own data
    out = rlhf("train-rm", *common, "rm.max_steps=6", "resume=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "with its recorded config" in out.stderr and "data.path" in out.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["path"] == str(pairs)
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[:6] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_ppo_resume_keeps_the_reward_model_it_started_with(tmp_path):
    common = ["experiment=smoke", f"paths.root={tmp_path}"]
    assert rlhf("train-rm", *common, "rm.max_steps=2").returncode == 0
    first_rm = (tmp_path / "latest_rm").read_text().strip()
    out = rlhf("train-ppo", *common, "ppo.iterations=1", "ppo.save_every=1")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = list((tmp_path / "ppo").iterdir())
    assert yaml.safe_load((run / "config.yaml").read_text())["reward_model"]["path"] == first_rm  # recorded
    # a second reward model moves latest_rm while the PPO run waits; resuming it keeps the first one
    assert rlhf("train-rm", *common, "rm.max_steps=2", "seed=7").returncode == 0
    assert (tmp_path / "latest_rm").read_text().strip() != first_rm
    out = rlhf("train-ppo", *common, "ppo.iterations=2", f"resume={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["reward_model"]["path"] == first_rm
    saved = json.loads((run / "final" / "config.json").read_text())
    assert saved["rlhf_reward_model_path"] == first_rm


def test_keep_checkpoints_0_deletes_ds_after_final_and_resume_says_why(tmp_path):
    common = ["experiment=smoke", f"paths.root={tmp_path}", "rm.save_every=2", "rm.max_steps=4",
              "paths.keep_checkpoints=0"]
    out = rlhf("train-rm", *common)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "rm").iterdir()]
    assert (run / "final" / "model.safetensors").is_file() and not (run / "ds").exists()
    out = rlhf("train-rm", *common, f"resume={run}")
    assert out.returncode == 2 and "its DeepSpeed checkpoint in ds/ is gone" in out.stderr
    out = rlhf("train-rm", *common[:-1], "paths.keep_checkpoints=-1")
    assert out.returncode == 2 and "paths.keep_checkpoints must be >= 0" in out.stderr


def test_sigterm_checkpoints_and_resume_finishes(tmp_path):
    import signal
    import time

    common = ["experiment=smoke", f"paths.root={tmp_path}", "rm.max_steps=400",
              "rm.log_every=1"]
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_cli", "train-rm", *common], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    metrics = None
    while time.time() < deadline and proc.poll() is None:
        found = list(tmp_path.glob("rm/*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 3:
            metrics = found[0]
            break
        time.sleep(0.5)
    assert metrics is not None, "the run never logged 3 steps"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    run = metrics.parent
    tag = (run / "ds" / "latest").read_text().strip()
    assert tag.startswith("step-") and (run / "ds" / tag).is_dir()
    assert json.loads((run / "status.json").read_text())["state"] == "running"
    done = int(tag.split("-")[1])
    # finish soon after the checkpoint (a shorter schedule; resume still starts from the checkpoint)
    resumed = [a for a in common if not a.startswith("rm.max_steps=")] + [f"rm.max_steps={done + 2}", "resume=true"]
    out = rlhf("train-rm", *resumed)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


def test_report_of_a_path_that_holds_no_run_is_one_line(tmp_path):
    out = rlhf("eval", f"run_dir={tmp_path / 'nope'}", f"paths.root={tmp_path}")
    assert out.returncode == 2
    nope = tmp_path / "nope"
    assert out.stderr.strip().splitlines()[-1] == f"error: run_dir={nope}: report: '{nope}' does not exist"


def test_the_benchmarks_give_both_tools_the_allocator_of_a_lora_run(monkeypatch):
    """benchmarks/_common.malloc_env: with `--lora-r` both tools' children get the tunable our LoRA run restarts
    with (a user's own GLIBC_TUNABLES kept), so the allocator is not counted as ours."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    monkeypatch.delitem(sys.modules, "_common", raising=False)
    import _common as C

    monkeypatch.setattr(C, "_COMPARED", [])

    for name in ("RLHF_MALLOC", "LD_PRELOAD", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    C.compare_under("train-rm", True)
    assert C.malloc_env() == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
                              "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert C.malloc_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
    C.compare_under("train-rm")
    assert "GLIBC_TUNABLES" not in C.malloc_env()
    C.compare_under("train-sft", True)
    assert C.malloc_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"


@pytest.mark.parametrize("command, key, meant", [
    ("train_ppo", "ppo.clip_rang", "ppo.clip"), ("train_ppo", "ppo.clip_range", "ppo.clip"),
    ("train_ppo", "ppo.cliprange", "ppo.clip"), ("train_ppo", "ppo.vf_coef", "ppo.c1"),
    ("train_ppo", "ppo.ent_coef", "ppo.c2"), ("train_ppo", "ppo.kl_coef", "ppo.kl_beta"),
    ("train_ppo", "ppo.num_generations", "ppo.n_samples_per_prompt"),
    ("train_ppo", "ppo.cliprange_value", "ppo.value_clip"), ("train_ppo", "ppo.learning_rate", "ppo.actor_lr"),
    ("train_rm", "rm.learning_rate", "rm.lr"), ("train_dpo", "learning_rate", "dpo.lr"),
    ("train_ppo", "ppo.gama", "ppo.gamma"), ("train_ppo", "ppo.clpi", "ppo.clip")])
def test_a_misspelt_or_peer_key_is_answered_with_the_key_it_means(command, key, meant):
    from rlhf_cli.config import ConfigError
    from rlhf_cli.overrides import check_override_keys

    with pytest.raises(ConfigError, match=f"did you mean '{re.escape(meant)}'\\?"):
        check_override_keys(command, [f"{key}=0.2"])


@pytest.mark.parametrize("command, overrides, says", [
    ("train-rm", ["data.path=nope.jsonl"], "nope.jsonl: file not found (data.path)"),
    ("train-rm", ["rm.lr=-1"], "rm.lr must be > 0"),
    ("train-rm", ["rm.batch_size=6", "rm.micro_batch_size=4"], "rm.batch_size"),
    ("train-rm", ["model.name_or_path=runs/latest_sft"], "add `model=hf`"),
    ("train-rm", ["rm.lrr=1"], "did you mean 'rm.lr'?"),
    ("train-rm", ["data.path=bad.jsonl"], "bad.jsonl row 2, field 'rejected'"),
    ("train-rm", ["data.path=prompts.jsonl"], "reward-model training needs chosen/rejected pairs"),
    ("train-rm", ["model=hf", "model.name_or_path=./no/such/model"], "model.name_or_path=./no/such/model does not"),
    ("train-ppo", ["reward_model.path=lm_model"], "holds a causal LM (LlamaForCausalLM), not a reward model"),
    ("train-ppo", [], "no reward model: set reward_model.path"),  # no latest_rm under paths.root
    ("train-ppo", ["reward.type=checker", "ppo.advantage_estimator=grpo"], "ppo.n_samples_per_prompt >= 2"),
    ("train-ppo", ["reward.type=function", "reward.function=nope.py:f"], "reward.function=nope.py:f: no file")])
def test_a_bad_path_range_key_or_row_is_refused_before_torch_loads(command, overrides, says, tmp_path):
    """The one-line errors that need no model come before torch, DeepSpeed and transformers are imported (they
    took 9-17 s there, issue 61): counted by what the process imported, not timed."""
    row = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."}
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "rejected": 3}) + "\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Hi?"}) + "\n")
    (tmp_path / "lm_model").mkdir()  # a causal LM where a reward model should be
    (tmp_path / "lm_model" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    code = ("import sys\nfrom rlhf_cli import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
            "    print('exit', e.code, 'imported', heavy, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code, command, "experiment=smoke", *overrides], cwd=tmp_path,
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert says in out.stderr and "exit 2 imported []" in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()
