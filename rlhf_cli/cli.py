"""`rlhf <command> [hydra overrides]`: thin dispatch to one Hydra app per command.

Everything after the command goes to Hydra untouched (`--cfg job`, `--help`, `-m`, overrides).
The DeepSpeed launcher's `--local_rank=N` before the command is accepted and dropped; LOCAL_RANK is
read from the environment.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_cli.commands import COMMANDS, reporter

# Hydra's informational flags: nothing runs, nothing is validated
INFO_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i")
SWEEP_DIRS: set[Path] = set()  # the sweep dirs of this process's training jobs (said at the end)
MALLOC_ENV = "RLHF_MALLOC"  # `reuse`, `compact` or `system` (glibc's defaults); unset: the run's own (`malloc_mode`)
# the glibc mallopt parameters `reuse_freed_memory` sets: name -> (its number in malloc.h, value)
MALLOC_SETTINGS = {"M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, 2**31 - 1)}
MALLOC_MODES: dict[str, tuple[dict[str, tuple[int, int]], tuple[str, ...]]] = {
    "reuse": (MALLOC_SETTINGS, ()),  # freed memory kept for the next tensor (`reuse_freed_memory`)
    "compact": (MALLOC_SETTINGS, ("glibc.malloc.tcache_count=0",)),  # and no per-thread cache of small blocks
    "system": ({}, ()),  # glibc's defaults
}
"""`RLHF_MALLOC` mode -> (mallopt settings `reuse_freed_memory` makes, `GLIBC_TUNABLES` `restart_for_tunables` sets)."""
RESTARTED_ENV = "RLHF_MALLOC_RESTARTED"
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard")  # names in LD_PRELOAD that replace malloc

USAGE = """usage: rlhf <command> [hydra overrides...]

commands:
{commands}

Each command is a Hydra app: `rlhf <command> --help` lists its config groups and keys,
`rlhf <command> --cfg job` prints the composed config, `key=value` overrides any key,
`-m key=a,b` sweeps. Under the DeepSpeed launcher or torchrun the same command runs on every rank.
"""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {c.help}" for name, c in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def command_help(command: str) -> str:
    """`rlhf <command> --help`: the command's groups with their options, and every key it reads
    (`commands.Command.reads`) with its default and the description written under its field in config.py."""
    from rlhf_cli.config import CONFIG_GROUPS, field_docs, first_sentence, leaves

    cmd = COMMANDS[command]
    summary, reads = cmd.help, cmd.reads
    conf = Path(__file__).parent / "conf"
    chosen = dict(_compose(command, [], hydra_config=True).hydra.runtime.choices)  # each group's default option
    lines = [f"rlhf {command}: {summary}", "",
             f"usage: rlhf {command} [group=option ...] [key=value ...]",
             "  -m            sweep: key=a,b runs one job per value", "  --cfg job     print the composed config",
             "  --hydra-help  Hydra's own options", "", "groups (group=option):"]
    for group in (g for g in CONFIG_GROUPS if g in reads):
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        lines.append(f"  {group:<11} " + ", ".join(f"{o} (default)" if o == chosen.get(group) else o for o in options))
    from omegaconf import OmegaConf

    values = leaves(OmegaConf.to_container(_compose(command, []), resolve=True))
    docs = field_docs()
    lines += ["", "keys (key=value; default; description, from rlhf_cli/config.py):"]
    for key, value in values.items():
        if key.split(".")[0] not in reads:
            continue
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        lines.append(f"  {key}={shown}  {' '.join(first_sentence(docs.get(key)).split())}")
    return "\n".join(lines)


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def strip_local_rank(argv: list[str]) -> list[str]:
    """Drop the launcher's `--local_rank=N` / `--local_rank N` (before the command), exporting LOCAL_RANK."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        elif a in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def _override_value(overrides: list[str], key: str) -> str | None:
    for ov in overrides:
        if ov.lstrip("+").startswith(key + "="):
            return ov.split("=", 1)[1]
    return None


def _compose(command: str, overrides: list[str], hydra_config: bool = False) -> Any:
    """The command's config as Hydra composes it from `overrides` (flags, `resume=` and `hydra.*` left out); with
    `hydra_config`, with Hydra's own node (`hydra.runtime.choices`: the option each group took)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_cli.config import register_configs

    register_configs()
    keep = [o for o in overrides
            if not o.lstrip("+").startswith(("resume=", "hydra.", "hydra/")) and not o.startswith("-")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="rlhf_cli.conf", version_base="1.3"):
            return compose(config_name=COMMANDS[command].config_name, overrides=keep, return_hydra_config=hydra_config)
    finally:
        GlobalHydra.instance().clear()


def _composed_paths_root(command: str, overrides: list[str]) -> str:
    """`paths.root` as the command's config composes it (an experiment file may set it)."""
    return str(_compose(command, overrides).paths.root)


def is_multirun(overrides: list[str]) -> bool:
    return "-m" in overrides or "--multirun" in overrides


def check_sweep(command: str, overrides: list[str], composed: list[Any] | None = None) -> int:
    """Before a sweep (`-m`) launches anything: refuse `resume` (each job resumes by its own dir), and expand
    the jobs as Hydra's basic sweeper will and validate every job's config and that its `paths.root` can be
    written; each job's composed config is appended to `composed` when given. Returns the number of jobs.

    Raises:
        ConfigError: `resume` with `-m`, or the first invalid job, named by its number and overrides.
        PermissionError: a job's `paths.root` cannot be created or written.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlhf_cli.config import ConfigError
    from rlhf_cli.overrides import explain_composition_error, ignored_keys
    from rlhf_cli.preflight import VALIDATORS
    from rlhf_cli.runs import check_writable

    if (_override_value(overrides, "resume") or "null").lower() not in ("null", "none", "false", ""):
        raise ConfigError("resume with -m: a sweep is not resumed as a whole; resume each unfinished job in place "
                          f"with `rlhf {command} resume=<sweep dir>/<job number>` (no -m)")
    sweep = [o for o in overrides if not o.startswith("-") and not o.lstrip("+").startswith(("hydra.", "hydra/"))]
    try:
        parsed = OverridesParser.create().parse_overrides(sweep)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:  # noqa: BLE001 - a syntax the basic sweeper cannot expand here: Hydra reports it itself
        return 0
    world = int(os.environ.get("WORLD_SIZE", 1))
    ignored: dict[str, list[str]] = {}  # a key some job's setting ignores -> those jobs' refusals
    for i, job in enumerate(jobs):
        varying = " ".join(o for o in job if not all(o in other for other in jobs))  # what names this job
        try:
            cfg = _compose(command, job)
        except Exception as e:  # noqa: BLE001 - Hydra's composition error (unknown group option, wrong type)
            raise ConfigError(f"sweep job {i} ({varying}): {explain_composition_error(e, job)}; no job was "
                              f"launched") from None
        for key, why in ignored_keys(COMMANDS[command], job, cfg):
            ignored.setdefault(key, []).append(why)
        try:
            VALIDATORS[COMMANDS[command].config_name](cfg, world_size=world)
        except ConfigError as e:
            raise ConfigError(f"sweep job {i} ({varying}): {e}; no job was launched") from None
        check_writable(str(cfg.paths.root))  # each job's `paths.root` (`check_output_root` of one run)
        if composed is not None:
            composed.append(cfg)
    for why in ignored.values():  # a key the sweep makes matter in some of its jobs is no mistake
        if len(why) == len(jobs):
            raise ConfigError(f"every sweep job: {why[0]}; no job was launched")
    return len(jobs)


def check_composes(command: str, overrides: list[str]) -> Any | None:
    """Compose the command's config before Hydra runs it, so that a bad override (a wrong type, a group option
    that does not exist, an unquoted comma, a syntax error) is one line and exit status 2, not Hydra's
    multi-line message. Returns the composed config, which the checks before Hydra's run read (`paths.root`), so
    the command line is composed once before Hydra's own composition; None for Hydra's informational flags and
    sweeps (skipped: `check_sweep` composes each job).

    Raises:
        ConfigError: `overrides.explain_composition_error`'s line.
    """
    from rlhf_cli.config import ConfigError
    from rlhf_cli.overrides import explain_composition_error

    if any(o in INFO_FLAGS for o in overrides) or is_multirun(overrides):
        return None
    try:
        return _compose(command, overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's composition errors
        raise ConfigError(explain_composition_error(e, overrides)) from None


def check_before_setup(command: str, cfg: Any) -> None:
    """The checks of the composed `cfg` that need neither torch nor a model, run before Hydra starts the command so
    that their one-line errors come in about a second: the command's checks (`preflight.VALIDATORS`: ranges,
    choices, batch sizes against `WORLD_SIZE`, the estimator's group size, `reward.function` loadable, every local
    model path holding the right kind of model, from its config.json; a reward model set, or `latest_rm` naming
    one, where train-ppo needs one), that a local data file it names exists
    (`config.check_data_files`) and, for a local JSON file, its format, columns and rows (`data.check_rows`: the
    load's file/row/field line). `main` skips it for a resume: the command line is not its config, which is checked
    once Hydra runs it and `resume_config` has restored the record. Raises ConfigError, DataError."""
    from rlhf_cli.config import check_data_files
    from rlhf_cli.data.datasets import check_rows
    from rlhf_cli.preflight import VALIDATORS, resolve_reward_model

    cmd = COMMANDS[command]
    VALIDATORS[cmd.config_name](cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    needs_rm = any(m.key == "reward_model.path" and m.needs_model_reward for m in cmd.model_paths)
    if needs_rm and cfg.reward_model.path is None:
        resolve_reward_model(cfg)  # unset: `latest_rm` must name a reward model, said before any model loads
    check_data_files(cfg)
    if cmd.rows is not None:  # prompts are read from data.path alone (train-ppo holds no eval split out)
        check_rows(cfg.data, cmd.rows, keys=("path",) if cmd.rows == "prompts" else ("path", "eval_path"))


def resume_overrides(command: str, overrides: list[str], root: str | None = None) -> tuple[list[str], str | None]:
    """For `resume=true|<dir>` point Hydra's run dir at the run being resumed (in place): the overrides, and for
    `resume=true` the line naming the run found, for `main` to print. `root`: `paths.root` of the composed config
    (`check_composes`), composed here when None (an informational flag)."""
    from rlhf_cli.config import ConfigError
    from rlhf_cli.runs import find_resumable, get_status, latest_tag

    value = _override_value(overrides, "resume")
    if value is None or value.lower() in ("null", "none", "false", "") or is_multirun(overrides):
        return overrides, None  # a sweep's resume is refused by check_sweep
    cmd = COMMANDS[command]
    root = root if root is not None else _composed_paths_root(command, overrides)
    if value.lower() == "true":
        run = find_resumable(root, cmd.kind, need_checkpoint=cmd.trains)
        if run is None:
            raise ConfigError(f"resume=true: no unfinished `{command}` run with a checkpoint under "
                              f"{Path(root) / cmd.kind} (failed runs are not resumed)")
        found = f"resume=true: continuing {run}" + (f" from {latest_tag(run)}" if cmd.trains else "")
    else:
        found = None
        run = Path(value)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"resume={value}: not a run dir (no config.yaml there)")
        if cmd.trains and get_status(run).get("state") == "finished" and latest_tag(run) is None:
            raise ConfigError(f"resume={value}: the run finished and its DeepSpeed checkpoint in ds/ is gone (e.g. "
                              f"paths.keep_checkpoints=0): nothing to continue from; its model is {run / 'final'}")
    kept = [o for o in overrides if not o.lstrip("+").startswith("resume=")]
    # every rank's Hydra runs in the run's own dir now: only global rank 0 writes Hydra's files there (`.hydra/`, the
    # log); another rank's lines go to its console, as when it starts a run (lifecycle.prepare_run_dir)
    quiet = [] if os.environ.get("RANK", "0") == "0" else [
        "hydra.output_subdir=null", "~hydra.job_logging.handlers.file", "hydra.job_logging.root.handlers=[console]"]
    return [*kept, f"resume={run}", f"hydra.run.dir={run}", *quiet], found


def check_output_root(root: str | None) -> None:
    """Fail before Hydra makes the run dir when `paths.root` (of the config `check_composes` composed) cannot be
    created or written (one line, PermissionError). Skipped (`root` None) for Hydra's informational flags and
    sweeps: a sweep's jobs are checked by `check_sweep`, and Hydra reports what does not compose itself."""
    from rlhf_cli.runs import check_writable

    if root is not None:
        check_writable(root)


def _task_for(command: str) -> Callable:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="conf", config_name=COMMANDS[command].config_name)
    def app(cfg: DictConfig) -> float | None:
        return run_command(command, cfg)

    return app


def quiet_libraries() -> None:
    """Keep DeepSpeed's op-build chatter and transformers' per-file progress bars off the console."""
    import logging

    for name in ("compilers", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_warning()
    except ImportError:  # pragma: no cover
        pass


def run_command(command: str, cfg) -> float | None:
    """Validate `cfg` and run the command's stage; a user error exits 2 with one line, no traceback."""
    from hydra.core.hydra_config import HydraConfig

    from rlhf_cli import engine
    from rlhf_cli.preflight import VALIDATORS

    cmd = COMMANDS[command]
    quiet_libraries()
    from rlhf_cli.errors import USER_ERRORS as errors  # the user's mistakes: one line, exit status 2
    from rlhf_cli.errors import RewardServerError, SaveError
    from rlhf_cli.lifecycle import command_line_keys, is_sweep_job, mark_failed, resume_config
    from rlhf_cli.runs import close_open_loggers

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if is_sweep_job(run_dir) and cmd.trains:
        SWEEP_DIRS.add(run_dir.parent)
    try:
        if cfg.get("resume"):  # continue the recorded run: its config, not today's defaults
            kept = resume_config(cfg, run_dir, command_line_keys())
            if kept and engine.is_main():
                print(f"resume: continuing {run_dir} with its recorded config ({len(kept)} keys differ from this "
                      f"command's defaults and keep their recorded values: {', '.join(kept[:8])}"
                      f"{', ...' if len(kept) > 8 else ''})", file=sys.stderr)
        VALIDATORS[cmd.config_name](cfg, world_size=engine.world_size())
        module = importlib.import_module(cmd.stage)
        if not hasattr(module, "run"):
            _err(f"`rlhf {command}` is not built yet (config is valid)")
            sys.exit(2)
        signal.signal(signal.SIGTERM, _terminate)  # SIGTERM takes Ctrl-C's path: checkpoint, then exit
        return module.run(cfg, run_dir)
    except errors as e:
        # a failed save, or a reward server failing a training run, leaves the run resumable (its message says
        # so), and so does a failed resume attempt
        server_down = isinstance(e, RewardServerError) and cmd.trains
        if not (isinstance(e, SaveError) or server_down) and not cfg.get("resume"):
            mark_failed(run_dir, str(e))
        close_open_loggers("failed")
        _err(f"{e}; the last checkpoint is kept: continue with resume=true once it is up" if server_down else str(e))
        sys.exit(2)
    except Exception as e:  # a crash in our code; the traceback follows
        if engine.lost_rank(e):  # another node or rank went away: not our fault, the run stays resumable
            close_open_loggers("failed")
            _err(f"rank {engine.rank()}: another rank stopped answering ({str(e).splitlines()[0]}); the last "
                 f"checkpoint is kept: continue with resume=true once every node is up")
            sys.exit(1)
        if not cfg.get("resume"):
            mark_failed(run_dir, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        close_open_loggers("failed")
        raise
    except KeyboardInterrupt:
        close_open_loggers("killed")
        _err("interrupted (training stages checkpoint before exiting: continue with resume=true)")
        sys.exit(130)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def trains_adapters(command: str | None, cfg: Any | None) -> bool:
    """Whether `rlhf <command>` with the composed `cfg` trains LoRA adapters (`model.lora.r` > 0) over a frozen
    model."""
    if cfg is None or command not in COMMANDS or not COMMANDS[command].trains:
        return False
    from omegaconf import OmegaConf

    return int(OmegaConf.select(cfg, "model.lora.r", default=0) or 0) > 0


def run_trains_adapters(command: str, cfg: Any | None, overrides: list[str], jobs: list[Any]) -> bool:
    """`trains_adapters` of what this command line runs: the run it resumes (`resume=<run dir>` in `overrides`,
    after `resume_overrides`: its recorded config.yaml), any job of a sweep (`jobs`, composed by `check_sweep`),
    else the composed `cfg`."""
    if command not in COMMANDS or not COMMANDS[command].trains:
        return False
    if jobs:
        return any(trains_adapters(command, job) for job in jobs)
    run = _override_value(overrides, "resume")
    if run and run.lower() not in ("null", "none", "false", "true", "") and (Path(run) / "config.yaml").is_file():
        from omegaconf import OmegaConf

        from rlhf_cli.config import ConfigError

        try:
            return trains_adapters(command, OmegaConf.load(Path(run) / "config.yaml"))
        except Exception as e:  # noqa: BLE001 - YAML, OmegaConf or a value that is no int
            raise ConfigError(f"resume={run}: its config.yaml does not load ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return trains_adapters(command, cfg)


def malloc_mode(command: str | None = None, adapters: bool = False) -> str:
    """The malloc settings for `rlhf <command>` (`MALLOC_MODES`): `RLHF_MALLOC` where set, else `compact` for a
    run that trains LoRA adapters (`adapters`: `run_trains_adapters`, once the config is composed), else the
    command's own (`Command.malloc`; `reuse` for no or an unknown command); `system` whatever they say when an
    allocator from PRELOADED_ALLOCATORS is preloaded (`LD_PRELOAD`), whose own settings then rule. Raises
    ValueError for any other `RLHF_MALLOC`."""
    default = "compact" if adapters else COMMANDS[command].malloc if command in COMMANDS else "reuse"
    mode = os.environ.get(MALLOC_ENV, "") or default
    if mode not in MALLOC_MODES:
        raise ValueError(f"{MALLOC_ENV}={mode!r}: expected one of {', '.join(MALLOC_MODES)} (unset: each run's "
                         "own)")
    preload = os.environ.get("LD_PRELOAD", "").lower()
    return "system" if any(name in preload for name in PRELOADED_ALLOCATORS) else mode


def _glibc() -> bool:
    """Whether this process runs glibc (whose mallopt and tunables these settings are), not musl or another libc."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or no such name
        return False


def with_tunables(tunables: tuple[str, ...]) -> str:
    """`GLIBC_TUNABLES` with `tunables` ("name=value") added to this environment's: each one whose name it names
    already keeps the user's value; this environment's own value when nothing is added."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    have = [t for t in current.split(":") if t]
    named = {t.split("=", 1)[0] for t in have}
    missing = [t for t in tunables if t.split("=", 1)[0] not in named]
    return ":".join([*have, *missing]) if missing else current


def restart_for_tunables(command: str | None, adapters: bool = False) -> None:
    """Start this process again (`os.execve`, same pid and arguments) with the `GLIBC_TUNABLES` its malloc mode
    needs (`MALLOC_MODES`: `compact`'s `glibc.malloc.tcache_count=0`), which glibc reads only when a process
    starts. Returns at once when nothing is missing: off glibc, when the environment names each of those tunables
    already (a value of the user's own is kept), in the process a restart started (`RLHF_MALLOC_RESTARTED`,
    removed here so that the run's own children decide for themselves), or when `sys.argv` is no longer the
    command line this process started with (a script that called `main` after setting it would run again from
    its top). A failed `execve` says so in one line and the run goes on without. `main` calls it for the command
    line it was started with, after composing its config and before torch is imported.

    Why `compact` turns glibc's per-thread cache off: a LoRA reward model on HH (SmolLM2, 8 pairs of 320 tokens per
    micro-batch) frees ~2 GiB of activations per backward, yet the next forward took new heap for nearly all of
    its ~2.5 GiB: small blocks freed into the per-thread cache stay allocated in the heap's view, scattered among
    the freed activations, so these cannot merge into blocks as large as the next micro-batch's. Full fine-tuning
    is spared most of it: its gradients and moments, made once and large, take up much of the heap. Measured
    (docs/results.md "LoRA: reward model, same steps"): 12 micro-batches peaked at 7.93-7.98 GiB with the cache
    and 6.06 without, in 136-149 s and 119 s; `rlhf train-ppo experiment=grpo model.lora.r=16`, 3 iterations, two
    runs each: 2.0-2.2 GiB without the cache against 2.5-2.6 with it, in the same time. Allocation only: in fp32
    every number is the same (bit for bit); under bf16-autocast some CPU kernels' results depend on where their
    tensors lie, so the same run under another mode may differ in last bits (as between machines), and sampled
    completions with them."""
    if os.environ.pop(RESTARTED_ENV, None):
        return
    tunables = MALLOC_MODES[malloc_mode(command, adapters)][1]
    if not tunables or not _glibc() or sys.argv[1:] != sys.orig_argv[len(sys.orig_argv) - len(sys.argv) + 1:]:
        return
    merged = with_tunables(tunables)
    if merged == os.environ.get("GLIBC_TUNABLES", ""):
        return
    env = {**os.environ, "GLIBC_TUNABLES": merged, RESTARTED_ENV: "1"}
    sys.stdout.flush(), sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:
        print(f"warning: could not start again with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} ({e}); running with "
              "glibc's per-thread cache on", file=sys.stderr)


def reuse_freed_memory(command: str | None = None, adapters: bool = False) -> bool:
    """Keep freed memory in this process for the next tensor (glibc on Linux); returns whether the settings took.

    glibc serves every block above 32 MiB with its own mmap and unmaps it when freed, so each such tensor, made new
    at every step (the 113 MB embedding gradient, the LM head's weight cast, logits), costs a page fault per 4 KiB
    page and the kernel zeroing it. `mallopt(M_MMAP_MAX, 0)` serves large blocks from the heap instead, where freed
    blocks stay mapped for the next one, and `mallopt(M_TRIM_THRESHOLD, 2 GiB)` gives the heap's free top back only
    past 2 GiB; jemalloc and tcmalloc behave alike. Process-wide: `main` calls it first, so a caller of `main` in
    its own process gets it too. Measured on SmolLM2 (fwd + bwd + AdamW, 8 x 85 tokens, bf16-autocast, 2 cores):
    2.5M -> 0.9M page faults, step medians 1.63-1.70 -> 1.34-1.42 s, peak RSS +6 %; `rlhf train-ppo` 0.89x the
    time (docs/results.md). Allocation only: every number is the same. Off for a command whose `malloc` is `system`
    (train-sft) and with `RLHF_MALLOC=system`; on for every command with `RLHF_MALLOC=reuse` or `compact`, and for
    a run training LoRA adapters (`adapters`: `main` calls this again once the config is composed).
    Raises ValueError for an unknown `RLHF_MALLOC`.
    """
    settings = MALLOC_MODES[malloc_mode(command, adapters)][0]
    if not settings or not sys.platform.startswith("linux"):
        return False
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the malloc this process runs
    if mallopt is None:
        return False
    return all(mallopt(number, value) for number, value in settings.values())


def main(argv: list[str] | None = None) -> None:
    argv_given = argv
    argv = strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    try:
        reuse_freed_memory(argv[0] if argv else None)
    except ValueError as e:
        _err(str(e))
        sys.exit(2)
    from rlhf_cli.config import ConfigError, register_configs
    from rlhf_cli.errors import DataError, ModelSourceError
    from rlhf_cli.overrides import check_ignored_keys, check_override_keys

    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        _err(f"unknown command '{command}'")
        print(usage(), file=sys.stderr)
        sys.exit(2)
    if any(a in ("--help", "-h") for a in rest):  # anywhere on the line: the registry's help, never Hydra's
        print(command_help(command))
        sys.exit(0)
    try:
        warnings, jobs, resuming = check_override_keys(COMMANDS[command].config_name, rest), [], None
        try:
            if is_multirun(rest) and not any(o in INFO_FLAGS for o in rest):
                check_sweep(command, rest, jobs)
            cfg = check_composes(command, rest)  # the command line composed once before Hydra runs it
            if cfg is not None and not cfg.get("resume"):  # a resume is checked on its record, once Hydra runs it
                check_ignored_keys(COMMANDS[command], rest, cfg)
                check_before_setup(command, cfg)
            root = str(cfg.paths.root) if cfg is not None else None
            rest, resuming = resume_overrides(command, rest, root)
            adapters = run_trains_adapters(command, cfg, rest, jobs)
            if argv_given is None:  # the command's own process: it may start again with glibc's tunables
                restart_for_tunables(command, adapters)
        finally:  # said once: by the process that runs the command (or fails to compose it)
            for warning in warnings:
                if os.environ.get("RANK", "0") == "0":
                    print(f"warning: {warning}", file=sys.stderr)
        if resuming and os.environ.get("RANK", "0") == "0":  # once, not once per rank
            print(resuming, file=sys.stderr)
        reuse_freed_memory(command, adapters)  # the run's own mode, now that its config says whether it trains LoRA
        check_output_root(root)
    except (ConfigError, DataError, ModelSourceError, PermissionError) as e:
        _err(str(e))
        sys.exit(2)
    register_configs()
    sys.argv = [f"rlhf {command}", *rest]
    _task_for(command)()
    if argv_given is None and "rlhf_cli.engine" in sys.modules:  # the `rlhf` process, about to exit, that reached
        sys.modules["rlhf_cli.engine"].close_distributed()         # the engine (not --help, --cfg)
    if SWEEP_DIRS:  # the jobs moved no pointer: say where they are and how to compare them
        for d in sorted(SWEEP_DIRS):
            print(f"sweep: {d} (latest_* pointers not moved by sweep jobs); compare its jobs with: "
                  f"{reporter().invocation} run_dir={d}", file=sys.stderr)


if __name__ == "__main__":
    main()
