"""The command registry: one entry per `rlhf` command, naming every piece of it.

The CLI (dispatch, `--help`, key checks, resume), the run dirs and pointers (`runs`), the report (sweep tables,
an eval's chain of training runs) and the preflight checks read this table; no other module of the package
names a command (a test checks it). A new command is one `Command` here, one stage module (`stages/<name>.py`
with `run(cfg, run_dir)`) and one schema (its section in `config.RunConfig`, its validator in `config.py`, its
primary YAML in `conf/`).

    COMMANDS                  {name as typed ("train-rm"): Command}, in help order
    by_config(config_name)    the Command of a primary config ("train_rm")
    by_kind(kind)             the Command whose run dirs are `<paths.root>/<kind>/` ("rm")
    by_stage(module)          the Command a stage module runs (a stage reads its own entry: `by_stage(__name__)`)
    reporter()                the Command that builds a past run's or a sweep's report (`run_dir=`)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_cli import config

# the sections every command reads (the shared composition gives every command every section, so that one
# experiment file serves all of them; a key given on the command line must be one its command reads)
_COMMON = ("model", "data", "paths", "precision", "scoring_precision", "seed", "dry_run", "resume", "experiment")


@dataclass(frozen=True)
class ModelPath:
    """A model path a command loads, checked before anything loads (`preflight.check_model_paths`)."""

    key: str
    """The config key holding the path (`reward_model.path`)."""
    kind: str | None
    """`reward` (a scalar-head model), `lm` (a causal LM) or None (either)."""
    hint: str
    """What to set instead, for the error; `{root}` is `paths.root`, `{<kind>}` (`{rm}`) the command of that
    run-dir kind as typed (`rlhf train-rm`)."""
    needs_model_reward: bool = False
    """Checked only when a reward source is `model` (`config.reward_sources`)."""


@dataclass(frozen=True)
class Command:
    """One `rlhf` command: every module that treats commands differently reads it from here."""

    name: str
    """As typed: `rlhf <name>`."""
    config_name: str
    """Its primary config, `conf/<config_name>.yaml` (also the key of `preflight.VALIDATORS`)."""
    stage: str
    """The module whose `run(cfg, run_dir)` it runs; loaded by name only when the command runs."""
    help: str
    """One line for `rlhf --help` and `rlhf <name> --help`."""
    kind: str
    """Its run-dir kind: runs go to `<paths.root>/<kind>/<run-id>/`, and lineage records name it."""
    reads: tuple[str, ...]
    """The top-level config sections it reads; a key of another section on its command line is refused."""
    validator: Callable[..., None]
    """The config's own checks (`config.validate_*`); `preflight.VALIDATORS` adds the model paths."""
    pointer: str | None = None
    """The file under `paths.root` that names its newest `final/` model (`latest_rm`), or None."""
    trains: bool = False
    """Whether it trains: checkpoints in `ds/` (a resume needs one), sweep jobs listed at the end, its own
    hyper-parameter section (`section`) left out of other runs' report tables."""
    section: str | None = None
    """The config section of its own hyper-parameters (`rm`), if any."""
    rows: str | None = None
    """What its `data.path` holds, as the data loaders name it: `pairs`, `prompts`, `demos` or `unpaired`; a local
    JSON file is parsed row by row before anything heavy loads (`data.check_rows`). None: not checked early (eval
    reads the evaluated model's own data unless told otherwise)."""
    model_paths: tuple[ModelPath, ...] = ()
    """The model paths it loads besides `model.name_or_path`, checked before anything loads."""
    reward_function_always: bool = False
    """It loads `reward.function` whenever set (eval reports it beside the other sources), not only when a
    reward source is `function`."""
    meant: dict[str, str] = field(default_factory=dict)
    """A key or section it does not read -> what a user of another toolkit (or command) most likely meant."""
    headline: tuple[tuple[str, str, int], ...] = ()
    """(metric, short column label, direction) for a sweep's table: +1 higher is better, -1 lower, 0 neither."""
    metric_prefixes: tuple[str, ...] = ()
    """Metric-name prefixes that tell its runs apart when a run dir is not where it was written."""
    report: tuple[str, tuple[str, ...]] | None = None
    """(section title, `report.plots.PANELS` names) of its runs in an eval's page, or None."""
    renamed_metrics: dict[str, str] = field(default_factory=dict)
    """Old metric name -> today's, for the metrics of its runs written before a rename: the one map through which
    the report (`report.read.load_records`, so `rlhf eval run_dir=`) reads an old run under today's names."""
    defaults: tuple[tuple[str, str], ...] = ()
    """(key, run-dir kind): with none of these keys set, the first kind whose pointer exists under `paths.root`
    gives its key the model that pointer names (eval: the newest policy, else the newest reward model)."""
    malloc: str = "reuse"
    """glibc's malloc settings its process runs under unless `RLHF_MALLOC` says otherwise (`cli.malloc_mode`):
    `reuse` (freed memory kept for the next tensor, `cli.reuse_freed_memory`: `rlhf train-ppo` 0.89x the time) or
    `system` (glibc's defaults: train-sft, whose packed rows change shape every step, so the kept blocks fit no
    later tensor and the heap only grows: peak RSS 4.34 -> 3.99 GiB, no slower; docs/results.md). A run training
    LoRA adapters runs `compact` whatever this says (`cli.restart_for_tunables`)."""

    @property
    def invocation(self) -> str:
        """`rlhf <name>`, as a message quotes it."""
        return f"rlhf {self.name}"


_FROM_RUN = "run dir, its final/ dir"

_ALL = (
    Command(
        name="train-sft", config_name="train_sft", stage="rlhf_cli.stages.sft", kind="sft", pointer="latest_sft",
        help="fine-tune a causal LM on demonstrations (next-token loss on response tokens only)",
        reads=(*_COMMON, "deepspeed", "sft", "logger", "tracker"), validator=config.validate_sft,
        trains=True, section="sft", rows="demos",
        meant={"policy.path": "model.name_or_path", "rm": "sft", "ppo": "sft"},
        headline=(("eval/sft/loss", "held-out loss", -1), ("sft/loss", "loss", -1)),
        metric_prefixes=("sft/", "eval/sft/"),
        renamed_metrics={"lr": "sft/lr", "grad_norm": "sft/grad_norm", "epoch": "sft/epoch"},  # before issue 39
        report=("supervised fine-tuning", ("sft_loss", "sft_perplexity")),
        malloc="system",
    ),
    Command(
        name="train-rm", config_name="train_rm", stage="rlhf_cli.stages.rm", kind="rm", pointer="latest_rm",
        help="train a reward model (LM + scalar head, Bradley-Terry loss) on preference pairs",
        reads=(*_COMMON, "deepspeed", "rm", "logger", "tracker"), validator=config.validate_rm,
        trains=True, section="rm", rows="pairs",
        meant={"policy.path": "model.name_or_path", "reward_model.path": "model.name_or_path", "ppo": "rm"},
        headline=(("eval/rm/accuracy", "held-out acc", 1), ("rm/accuracy", "train acc", 1), ("rm/loss", "loss", -1)),
        metric_prefixes=("rm/", "eval/rm/"),
        renamed_metrics={"lr": "rm/lr", "grad_norm": "rm/grad_norm", "epoch": "rm/epoch"},  # before issue 39
        report=("reward-model training", ("rm_loss", "rm_accuracy", "rm_margin")),
    ),
    Command(
        name="train-dpo", config_name="train_dpo", stage="rlhf_cli.stages.dpo", kind="dpo", pointer="latest_dpo",
        help="optimise a policy directly on preference pairs against its frozen starting weights (DPO, IPO, SLiC)",
        reads=(*_COMMON, "deepspeed", "dpo", "logger", "tracker"), validator=config.validate_dpo,
        trains=True, section="dpo", rows="pairs",
        meant={"policy.path": "model.name_or_path", "reference.path": "model.name_or_path (the reference is the "
               "starting policy)", "rm": "dpo", "ppo": "dpo", "ppo.kl_beta": "dpo.beta"},
        headline=(("eval/dpo/accuracy", "held-out acc", 1), ("eval/dpo/margin", "held-out margin", 1),
                  ("dpo/loss", "loss", -1)),
        metric_prefixes=("dpo/", "eval/dpo/"),
        renamed_metrics={"lr": "dpo/lr", "grad_norm": "dpo/grad_norm", "epoch": "dpo/epoch"},  # before issue 39
        report=("direct preference optimisation", ("dpo_loss", "dpo_rewards", "dpo_margin", "dpo_accuracy",
                                                   "dpo_logprobs")),
    ),
    Command(
        name="train-kto", config_name="train_kto", stage="rlhf_cli.stages.kto", kind="kto", pointer="latest_kto",
        help="optimise a policy on unpaired completions labelled desirable or not against its frozen starting "
             "weights (KTO)",
        reads=(*_COMMON, "deepspeed", "kto", "logger", "tracker"), validator=config.validate_kto,
        trains=True, section="kto", rows="unpaired",
        meant={"policy.path": "model.name_or_path", "reference.path": "model.name_or_path (the reference is the "
               "starting policy)", "rm": "kto", "ppo": "kto", "dpo": "kto", "ppo.kl_beta": "kto.beta",
               "dpo.beta": "kto.beta"},
        headline=(("eval/kto/loss", "held-out loss", -1), ("eval/kto/rewards_desirable", "held-out reward +", 1),
                  ("eval/kto/rewards_undesirable", "held-out reward -", -1), ("kto/loss", "loss", -1)),
        metric_prefixes=("kto/", "eval/kto/"),
        report=("Kahneman-Tversky optimisation", ("kto_loss", "kto_kl", "kto_rewards", "kto_logprobs")),
    ),
    Command(
        name="train-ppo", config_name="train_ppo", stage="rlhf_cli.stages.ppo", kind="ppo", pointer="latest_policy",
        help="optimise a policy against a reward with PPO (KL penalty, GAE, clipped surrogate) or a critic-free "
             "estimator (GRPO, RLOO, REINFORCE++)",
        reads=(*_COMMON, "deepspeed", "ppo", "rollout", "reward", "reward_model", "reference", "logger",
               "tracker"),
        validator=config.validate_ppo, trains=True, section="ppo", rows="prompts",
        model_paths=(
            ModelPath("reward_model.path", "reward", f"set it to a `{{rm}}` {_FROM_RUN} or an HF reward-model dir, "
                                                     "or leave it unset for {root}/latest_rm", needs_model_reward=True),
            ModelPath("reference.path", "lm", f"set it to a causal LM (a {_FROM_RUN} or an HF dir), or leave it unset "
                                              "for the policy's initial weights"),
        ),
        meant={"policy.path": "model.name_or_path", "rm": "ppo", "rm.lr": "ppo.actor_lr"},
        headline=(("objective/rlhf_reward", "reward", 1), ("objective/scores", "RM score", 1),
                  ("objective/kl", "KL", 0), ("response/length_mean", "length", 0)),
        metric_prefixes=("objective/",),
        report=("PPO training", ("ppo_score", "ppo_kl", "ppo_kl_beta", "ppo_entropy", "ppo_length", "ppo_eos",
                                 "ppo_clipfrac", "ppo_loss", "ppo_explained_var")),
    ),
    Command(
        name="eval", config_name="eval", stage="rlhf_cli.stages.evaluate", kind="eval",
        help="measure a reward model or a policy, and build run reports",
        reads=(*_COMMON, "eval", "rollout", "reward", "reward_model", "reference", "policy", "run_dir"),
        validator=config.validate_eval, section="eval", reward_function_always=True,
        model_paths=(
            ModelPath("policy.path", "lm", f"set it to a `{{ppo}}` {_FROM_RUN} or an HF causal-LM dir, or leave it "
                                           "unset for {root}/latest_policy"),
            ModelPath("reward_model.path", "reward", f"set it to a `{{rm}}` {_FROM_RUN} or an HF reward-model dir, "
                                                     "or leave it unset for the one the policy recorded"),
            ModelPath("reference.path", "lm", f"set it to a causal LM (a {_FROM_RUN} or an HF dir), or leave it unset "
                                              "for the one the policy recorded"),
        ),
        meant={"model.name_or_path": "policy.path", "rm": "eval", "ppo": "eval"},
        defaults=(("policy.path", "ppo"), ("reward_model.path", "rm")),
    ),
    Command(
        name="serve-rm", config_name="serve_rm", stage="rlhf_cli.stages.serve_rm", kind="serve",
        help="serve a trained reward model over HTTP (OpenRLHF's remote reward protocol, for reward.type=http)",
        reads=("model", "paths", "precision", "scoring_precision", "seed", "dry_run", "experiment", "serve",
               "reward_model"),
        validator=config.validate_serve, section="serve",
        model_paths=(
            ModelPath("reward_model.path", "reward", f"set it to a `{{rm}}` {_FROM_RUN} or an HF reward-model dir, "
                                                     "or leave it unset for {root}/latest_rm"),
        ),
        meant={"model.name_or_path": "reward_model.path", "reward.url": "serve.host and serve.port",
               "eval.batch_size": "serve.batch_size", "resume": "nothing: a server has nothing to resume"},
    ),
)
COMMANDS: dict[str, Command] = {c.name: c for c in _ALL}
"""{name as typed: Command}, in help order."""


def _one(what: str, value: str, found: list[Command]) -> Command:
    if not found:
        raise KeyError(f"no command has {what} {value!r}")
    return found[0]


def by_config(config_name: str) -> Command:
    """The command whose primary config is `config_name`. Raises KeyError."""
    return _one("config", config_name, [c for c in COMMANDS.values() if c.config_name == config_name])


def by_kind(kind: str) -> Command:
    """The command whose run dirs are `<paths.root>/<kind>/`. Raises KeyError."""
    return _one("run-dir kind", kind, [c for c in COMMANDS.values() if c.kind == kind])


def by_stage(module: str) -> Command:
    """The command that runs the stage module `module` (a stage passes its `__name__`). Raises KeyError."""
    return _one("stage", module, [c for c in COMMANDS.values() if c.stage == module])


def reporter() -> Command:
    """The command that builds the report of a past run or sweep (the one that reads `run_dir`)."""
    return _one("key", "run_dir", [c for c in COMMANDS.values() if "run_dir" in c.reads])


def kinds() -> tuple[str, ...]:
    """Every run-dir kind, in registry order."""
    return tuple(c.kind for c in COMMANDS.values())


def quote(text: str, **extra: Any) -> str:
    """`text` with `{<kind>}` replaced by that command as typed (`{rm}` -> `rlhf train-rm`) and `extra`'s fields."""
    return text.format(**{c.kind: c.invocation for c in COMMANDS.values()}, **extra)
