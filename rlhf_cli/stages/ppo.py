"""`rlhf train-ppo`: PPO, or a critic-free estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++), against the run's reward
(a reward model, the built-in checker, a reward function, or a weighted sum) on DeepSpeed; or on-policy
distillation from a teacher's per-token log-probs (`reward.type=teacher`, `ppo.advantage_estimator=distill`).

Each iteration (Ouyang et al. 2022; Ziegler et al. 2019; Schulman et al. 2017); steps 1-3 are
`rollout.ExperienceMaker`, step 4 `PPOTrainer.train_on` (`rollout.PolicyLearner`):
  1. rollout   sample `ppo.rollout_batch_size` prompts, `ppo.n_samples_per_prompt` responses each (KV cache)
  2. score     no-grad passes: old logprobs (policy), ref_logprobs (reference), values (critic, `gae` only),
               the teacher's logprobs (`reward.type=teacher`: a third model, a `FrozenModel` like the reference),
               the sequence score (`reward.*`), all in the training forward's layout; the first micro-batches of
               step 4 (`ppo.carried_forwards`) run their training forwards here instead, whose outputs are their
               rows' old logprobs and values (`rollout.UpdatePlan.carry`)
  3. shape     per-token rewards (−β·kl_t when `ppo.kl_in=reward`) plus the score at the EOS token; advantages
               by `ppo.advantage_estimator` (GAE(γ, λ), or a group baseline); whitening
  4. learn     `ppo.epochs` passes over shuffled minibatches: clipped surrogate, clipped value loss (with a
               critic), entropy bonus, β·KL (`ppo.kl_in=loss`), aggregated over the minibatch's real tokens
  5. adapt     the rollout's KL statistics (`rollout.kl_stats`, after the update in every case: an on-policy
               update's first forward gives the old logprobs), then the KL controller's update with them

Precision: sampling and a separate critic run in `precision`; the policy's and the reference's log-prob
passes (old logprobs, ref_logprobs, the training forward, with a shared critic's values) and the reward
model in the precision `scoring_precision` gives (fp32 under bf16-autocast by default: bf16 rounding of the
moved weights swamps the KL of small updates).

Batch layout: see `rlhf_cli/forwards/__init__.py`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_cli import engine, lineage
from rlhf_cli.commands import by_kind, by_stage
from rlhf_cli.config import ConfigError, PPOConfig, RolloutConfig, reward_sources
from rlhf_cli.core import ESTIMATORS, AdaptiveKLController, FixedKLController
from rlhf_cli.data import load_prompt_data
from rlhf_cli.eos import eos_ids
from rlhf_cli.forwards import FrozenWithoutAdapters
from rlhf_cli.lifecycle import Checkpoints, checkpoint_plan, deferred_interrupts, finish_run
from rlhf_cli.models import (
    PolicyWithValueHead,
    add_lora,
    configure_training,
    count_parameters,
    disable_dropout,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    lora_enabled,
    planned_trained_models,
    read_score_stats,
    save_policy,
)
from rlhf_cli.preflight import resolve_reward_model, resolve_teacher
from rlhf_cli.reward_http import HttpReward
from rlhf_cli.reward_judge import JudgeReward
from rlhf_cli.rollout import (
    EngineDriftGuard,
    ExperienceMaker,
    PolicyLearner,
    PushGuard,
    ScoreMixer,
    describe_engine,
    dtype_setting,
    engine_stats,
    is_correction_stats,
    kl_stats,
    resolve_dtype,
)
from rlhf_cli.runs import MetricsLogger, Progress, abs_path, append_samples, set_status
from rlhf_cli.stages.common import (
    check_same_tokenizer,
    dry_run_exit,
    model_source,
    print_table,
    reference_spec,
    start_run,
    trained_parameters,
)

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry (its name, run-dir kind, pointer)

# what only a critic reads: said once when a critic-free estimator makes them moot
CRITIC_KEYS = ("critic", "critic_init", "critic_lr", "c1", "value_clip", "lam")
PROGRESS_KEYS = ["objective/scores", "objective/kl", "policy/clipfrac", "response/length_mean"]


class PPOTrainer(PolicyLearner):
    """Holds the engines and state of one PPO run; `run()` below walks it step by step:
    `load_data` → `build_models` → per iteration `maker.make_experience` (rollout/maker.py) then `train_on`
    (rollout/learner.py)."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg, self.p, self.run_dir = cfg, cfg.ppo, run_dir
        self.precision = cfg.precision  # sampling, separate critic
        # log-prob passes of policy (old logprobs, training forward) and reference, reward-model scores
        self.score_precision = engine.scoring_precision(cfg.precision, cfg.scoring_precision)
        self.tokenizer = load_tokenizer(cfg.model)
        self.estimator = ESTIMATORS[cfg.ppo.advantage_estimator]  # needs_critic: whether a critic is built
        self.bad_steps = 0  # micro-steps skipped for NaN/inf losses
        # load_data
        self.prompts: list[dict[str, Any]] = []
        # build_models
        self.rm_path: str | None = None
        self.reward_model: engine.FrozenModel | FrozenWithoutAdapters | None = None
        self.score_stats: tuple[float, float] | None = None  # the RM's held-out (mean, std)
        self.reference: engine.FrozenModel | FrozenWithoutAdapters | None = None
        self.reference_spec: dict[str, Any] = {}  # how eval rebuilds the reference
        self.teacher: engine.FrozenModel | None = None  # reward.type=teacher only
        self.teacher_path: str | None = None
        self.teacher_params = 0  # non-embedding, for the start table
        self.actor: engine.TrainEngine | None = None  # the policy (with the value head when ppo.critic=shared)
        self.critic: engine.TrainEngine | None = None  # ppo.critic=separate only
        self.kl_ctl: FixedKLController | AdaptiveKLController | None = None
        self.maker: ExperienceMaker | None = None  # the rollout half: prompts -> Experience
        self.n_params = 0
        self.trained = ""  # the start table's line on the parameters trained (all, or LoRA's share)
        self.critic_base: str | None = None  # where a separate critic's trunk came from (its adapter's base)

    # -- build -----------------------------------------------------------------------------
    def load_data(self) -> None:
        cfg = self.cfg
        self.prompts = load_prompt_data(cfg.data, self.tokenizer, split="train")
        lineage.record(self.run_dir, cfg, COMMAND.kind, self.prompts.summary,
                       {"model": model_source(cfg.model), "reference": cfg.reference.path or model_source(cfg.model),
                        "reward_model": resolve_reward_model(cfg), "teacher": resolve_teacher(cfg)},
                       write=engine.is_main())
        if len(self.prompts) < self.p.rollout_batch_size:
            raise ConfigError(f"only {len(self.prompts)} prompts, fewer than "
                              f"ppo.rollout_batch_size={self.p.rollout_batch_size}: {self.prompts.summary.drops()}")
        missing = sum(x.get("answer") is None for x in self.prompts)
        if "checker" in reward_sources(self.cfg) and missing:
            raise ConfigError(f"the checker reward needs prompts with answers: {missing} of {len(self.prompts)} "
                              f"have none (the built-in task has them; for your data set data.answer_key)")
        if "judge" in reward_sources(self.cfg):  # a template field the rows lack: one line now, not mid-run
            JudgeReward.from_config(cfg.reward.judge, cfg.seed).check_rows(self.prompts, "the train split")
        if "http" in reward_sources(self.cfg):  # a reward.label_key no row has, likewise
            HttpReward.from_config(cfg.reward).check_rows(self.prompts, "the train split")
        p, defaults = self.p, PPOConfig()
        if not self.estimator.needs_critic:
            unused = [f"ppo.{k}={p[k]}" for k in CRITIC_KEYS if p[k] != getattr(defaults, k)]
            if unused:
                log.warning("%s: no effect with ppo.advantage_estimator=%s (critic-free: no critic, value loss or "
                            "GAE)", ", ".join(unused), p.advantage_estimator)
        r, rdefaults = self.cfg.rollout, RolloutConfig()
        if r.is_correction == "none" and (r.is_low != rdefaults.is_low or r.is_high != rdefaults.is_high):
            log.warning("rollout.is_low/rollout.is_high have no effect with rollout.is_correction=none")
        if self.cfg.data.group_by_length:
            log.warning("data.group_by_length=true has no effect in %s: prompts are drawn in a plain shuffled order "
                        "(it groups %s's pairs)", COMMAND.name, by_kind("rm").name)

    def build_policy(self) -> Any:
        """The policy of `model` (dropout off; LoRA adapters when `model.lora.r` > 0, with a word on the keys that
        LoRA makes moot); sets `n_params` (non-embedding, before any adapter) and `trained`. The dry run builds the
        same."""
        cfg, p = self.cfg, self.p
        policy = load_causal_lm(cfg.model, self.precision, cfg.seed, tokenizer=self.tokenizer)
        self.n_params = count_parameters(policy)
        if lora_enabled(cfg.model.lora):
            add_lora(policy, cfg.model.lora, what="policy")
            if p.offload_reference and not cfg.reference.path:
                log.warning("ppo.offload_reference=true: with LoRA the reference is the policy with its adapters off, "
                            "so there is no reference copy to offload (the reward model still is)")
            if cfg.model.lora.dropout:
                log.warning("model.lora.dropout=%g has no effect in %s: every dropout is off, so that the "
                            "rollout's log-probs and the update's forward see the same function",
                            cfg.model.lora.dropout, COMMAND.name)
        self.trained = trained_parameters(policy, cfg.model.lora)
        return disable_dropout(policy)

    def build_models(self) -> None:
        """The run's models and the rollout half: the policy (`build_policy`), the reference (with LoRA and no
        `reference.path`, the policy with its adapters off: no second copy), the reward model
        (`build_reward_model`), the engines of the policy and of a critic (`build_engines`), the KL controller,
        the reward sources and the `ExperienceMaker`."""
        cfg, p = self.cfg, self.p
        lora = lora_enabled(cfg.model.lora)
        policy = self.build_policy()
        # with LoRA (and no reference.path) the reference is the policy with its adapters off: no second copy
        reference = None
        if not lora or cfg.reference.path:
            reference = load_causal_lm(cfg.reference.path or cfg.model, self.precision, cfg.seed,
                                       tokenizer=self.tokenizer)
        # how to rebuild the reference later (eval): a path, or the model config and seed it was built from
        self.reference_spec = ({"name_or_path": abs_path(cfg.reference.path)} if cfg.reference.path else
                               reference_spec(cfg))
        shared_rm_critic = self.build_reward_model(lora)
        self.build_teacher()
        self.reference = (engine.FrozenModel(reference, self.score_precision, offload=p.offload_reference)
                          if reference is not None else FrozenWithoutAdapters(policy, self.score_precision))
        self.build_engines(policy, reference, shared_rm_critic)
        self.kl_ctl = (FixedKLController(p.kl_beta) if p.kl_target is None
                       else AdaptiveKLController(p.kl_beta, p.kl_target, p.kl_horizon))
        score_mixer = ScoreMixer(cfg, self.tokenizer, self.reward_model, self.score_stats, p.micro_batch_size,
                                 self.score_precision, normalize=p.normalize_reward,
                                 eos_ids=eos_ids(self.tokenizer, policy.generation_config))
        self.settle_folds(self.reference)  # what the rollout folds into the update, from the engines as built
        self.maker = ExperienceMaker(cfg, self.tokenizer, self.prompts, self.actor, self.reference, self.critic,
                                     score_mixer, self.kl_ctl, self.score_precision, plan=self.plan,
                                     workdir=self.run_dir, teacher=self.teacher)

    def build_reward_model(self, lora: bool) -> Any:
        """The frozen reward model of the run (`rm_path`, `reward_model`, `score_stats`; none unless a reward
        source is `model`). A LoRA critic grown from the reward model (`ppo.critic=separate`,
        `ppo.critic_init=reward_model`, below ZeRO-3) shares its weights: the reward model is that critic with its
        adapters off, so its weights are held once; returns that critic's model, else None."""
        cfg, p = self.cfg, self.p
        self.rm_path = resolve_reward_model(cfg)
        if self.rm_path is None:
            return None
        shared_rm_critic = None
        check_same_tokenizer(self.tokenizer, self.rm_path, "reward model")
        rm = load_scalar_model(self.rm_path, self.precision, cfg.seed)
        # not under ZeRO-3: there the view's forwards would gather the critic's partitioned weights collectively,
        # and reward scoring runs a number of forwards that differs between ranks (identical rows scored once)
        if (lora and self.estimator.needs_critic and p.critic == "separate" and p.critic_init == "reward_model"
                and cfg.deepspeed.zero_stage < 3):
            shared_rm_critic = disable_dropout(add_lora(rm, cfg.model.lora, heads=("score",), what="critic"))
            self.reward_model = FrozenWithoutAdapters(shared_rm_critic, self.score_precision)
            if p.offload_reference:
                log.warning("ppo.offload_reference=true: the reward model is the LoRA critic with its adapters "
                            "off (ppo.critic_init=reward_model), trained on the device, so it is not offloaded")
        else:
            self.reward_model = engine.FrozenModel(rm, self.score_precision, offload=p.offload_reference)
        self.score_stats = read_score_stats(self.rm_path)
        return shared_rm_critic

    def build_teacher(self) -> None:
        """On-policy distillation's teacher (`teacher`, `teacher_path`, `teacher_params`; none unless a reward source
        is `teacher`): any causal LM with the policy's tokenizer (another is refused: its log-probs of our token ids
        would be meaningless), frozen, dropout off, held like the reference (`engine.FrozenModel` in
        `scoring_precision`, offloaded with `ppo.offload_reference`). Raises ConfigError on another tokenizer."""
        cfg = self.cfg
        self.teacher_path = resolve_teacher(cfg)
        if self.teacher_path is None:
            return
        check_same_tokenizer(self.tokenizer, self.teacher_path, "teacher")
        teacher = disable_dropout(load_causal_lm(self.teacher_path, self.precision, cfg.seed,
                                                 tokenizer=self.tokenizer))
        self.teacher_params = count_parameters(teacher)
        self.teacher = engine.FrozenModel(teacher, self.score_precision, offload=self.p.offload_reference)

    def build_engines(self, policy: Any, reference: Any, shared_rm_critic: Any) -> None:
        """`actor`: the policy's engine (with a value head when `ppo.critic=shared`), in the scoring precision;
        `critic`: a separate critic's engine (`build_critic`), in `precision`, only for `ppo.critic=separate` with
        an estimator that needs one. Both constant-lr AdamW over `ppo.iterations × ppo.epochs × minibatches`."""
        cfg, p = self.cfg, self.p
        completions = p.rollout_batch_size * p.n_samples_per_prompt
        # an upper bound (ppo.filter_groups may take fewer steps); the constant schedule reads no horizon
        total = p.iterations * p.epochs * (completions // p.mini_batch_size)
        common = dict(train_batch_size=p.mini_batch_size, micro_batch_size=p.micro_batch_size, total_steps=total,
                      warmup_steps=p.warmup_steps, scheduler="constant", weight_decay=p.weight_decay,
                      max_grad_norm=p.max_grad_norm)
        if not self.estimator.needs_critic:  # critic-free: the policy alone
            self.actor = engine.TrainEngine(policy, cfg.deepspeed, self.score_precision, lr=p.actor_lr, **common)
        elif p.critic == "shared":
            model = PolicyWithValueHead(policy, cfg.seed)
            self.actor = engine.TrainEngine(model, cfg.deepspeed, self.score_precision, lr=p.actor_lr, **common)
        else:
            critic = self.build_critic(reference, shared_rm_critic)
            self.actor = engine.TrainEngine(policy, cfg.deepspeed, self.score_precision, lr=p.actor_lr, **common)
            self.critic = engine.TrainEngine(critic, cfg.deepspeed, self.precision, lr=p.critic_lr, **common)
        self.critic_base = self.critic_base or model_source(cfg.model)

    def build_critic(self, reference: Any, shared_rm_critic: Any) -> Any:
        """A separate critic (dropout off, trainable): the LoRA reward-model critic `shared_rm_critic` when there is
        one; else a scalar model from the reward model (`ppo.critic_init=reward_model`), from the reference's
        trunk, or (LoRA, the reference being the policy's base) from `model` loaded once more; its own LoRA
        adapters under LoRA. Sets `critic_base`, where its trunk came from."""
        cfg, p = self.cfg, self.p
        if shared_rm_critic is not None:  # LoRA: adapters already on the reward model's own weights
            critic = shared_rm_critic
            self.critic_base = abs_path(self.rm_path)
        elif p.critic_init == "reward_model" and self.reward_model is not None:
            critic = load_scalar_model(self.rm_path, self.precision, cfg.seed)
            self.critic_base = abs_path(self.rm_path)
        elif reference is not None:
            critic = load_scalar_model(None, self.precision, cfg.seed, init_from=reference)
            self.critic_base = abs_path(cfg.reference.path) if cfg.reference.path else model_source(cfg.model)
        else:  # LoRA: the reference is the base model, loaded here once more for the critic's own trunk
            critic = load_scalar_model(cfg.model, self.precision, cfg.seed)
        configure_training(critic, cfg.model.gradient_checkpointing)  # one loaded from a path has it off
        if critic is shared_rm_critic:  # adapters added with the reward model's view above
            pass
        elif lora_enabled(cfg.model.lora):  # its own adapters on its own trunk, the head trained in full
            add_lora(critic, cfg.model.lora, heads=("score",), what="critic")
        else:  # requires_grad: a copy of the (already frozen) reference would train only its head
            critic.requires_grad_(True)
        return disable_dropout(critic)

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the weights, optimizer and RNG states (`lifecycle.Checkpoints`)."""
        return {"kl_ctl": self.kl_ctl.state_dict(), "bad_steps": self.bad_steps}


def describe_reward(cfg: Any, rm_path: str | None) -> str:
    """The run's reward for its start table: `reward model <path>`, or the weighted sources."""
    names = {"model": f"reward model {rm_path}", "checker": "checker", "function": f"function {cfg.reward.function}",
             "http": f"reward server {cfg.reward.url}",
             "judge": f"judge {cfg.reward.judge.model} at {cfg.reward.judge.base_url}",
             "teacher": f"teacher {cfg.reward.teacher.path}"}
    sources = reward_sources(cfg)
    if len(sources) == 1:
        return names[next(iter(sources))]
    return " + ".join(f"{w:g} × {names[k]}" for k, w in sources.items())


def check_max_kl(p: Any, roll_stats: dict[str, float], it: int) -> None:
    """Abort the run (FloatingPointError) when the rollout's KL to the reference exceeds `ppo.max_kl`."""
    if p.max_kl is not None and roll_stats["objective/kl"] > p.max_kl:
        raise FloatingPointError(f"aborting at iteration {it + 1}: KL to the reference is "
                                 f"{roll_stats['objective/kl']:.2f} nats/sequence > ppo.max_kl={p.max_kl}")


def run(cfg: Any, run_dir: Path) -> float | None:
    """`rlhf train-ppo` on the composed config `cfg` (conf/train_ppo.yaml), writing into `run_dir`: prompts → start
    table (the dry run's stops there) → models and engines → resume → iterations (rollout, update, KL
    controller) → `final/` and `latest_policy`. Returns the last iteration's mean score (`objective/scores`),
    None on a dry run.

    Raises:
        ConfigError: a bad key or data, no reward model where one is needed, or an abort (`ppo.max_kl`, a
            non-finite loss past `ppo.max_bad_steps`), in one line.
    """
    engine.init_distributed()
    # unset, the reward model is latest_rm's: start_run resolves it once with every other pointer, and the run
    # records the model it named (`paths.typed` the pointer), so a resume and an eval keep using that one
    if resolve_reward_model(cfg) is not None and cfg.reward_model.path is None:
        cfg.reward_model.path = str(Path(cfg.paths.root) / by_kind("rm").pointer)
    if resolve_teacher(cfg) is not None and cfg.reward.teacher.path is None:  # the same for the teacher: latest_sft
        cfg.reward.teacher.path = str(Path(cfg.paths.root) / by_kind("sft").pointer)
    run_dir = start_run(cfg, run_dir)
    tr = PPOTrainer(cfg, run_dir)
    tr.load_data()
    if cfg.dry_run:
        tr.rm_path = cfg.reward_model.path
        policy = tr.build_policy()  # its LoRA target modules are checked here too
        trained = planned_trained_models(cfg, policy, tr.estimator.needs_critic, tr.rm_path)
        print_table(f"{COMMAND.name} (dry run): {run_dir}", {
            **start_rows(tr, describe_engine(cfg.rollout.engine, policy.config)),
            "checkpoint size": checkpoint_plan(trained, cfg.paths, cfg.deepspeed.zero_stage, run_dir,
                                               cfg.ppo.iterations, cfg.ppo.save_every)})
        dry_run_exit(cfg, run_dir)
        return None
    tr.build_models()
    start_table(tr)
    metrics = MetricsLogger(run_dir, enabled=engine.is_main(), loggers=cfg.logger, tracker=cfg.tracker,
                            config=OmegaConf.to_container(cfg, resolve=True))
    ckpts = Checkpoints(run_dir, {"actor": tr.actor, **({"critic": tr.critic} if tr.critic is not None else {})},
                        cfg.paths.keep_checkpoints, cfg.paths.keep_optimizer)
    start, state = ckpts.resume(cfg.resume, metrics)
    if state:
        tr.kl_ctl.load_state_dict(state["kl_ctl"])
        tr.bad_steps = int(state.get("bad_steps", 0))
    done, record = train_loop(tr, ckpts, metrics, start)
    save(tr, ckpts, metrics, done, record)
    return record.get("objective/scores")


def start_rows(tr: PPOTrainer, sampler: str) -> dict[str, Any]:
    """The rows the start table and the dry run's share: the policy, its size and trained parameters (after
    `build_policy`), the reward, prompts, iterations, batch sizes, estimator, the sampling engine (`sampler`, the
    one `rollout.engine` resolves to; vLLM's with its dtype, `rollout.engine_dtype`) and precision."""
    cfg, p = tr.cfg, tr.p
    if sampler.startswith("vllm"):
        dtype = resolve_dtype(cfg.precision, cfg.rollout.engine_dtype, tr.score_precision)
        sampler = f"{sampler}, {dtype_setting(dtype)} weights"
    return {
        "policy": cfg.model.name, "params (non-embedding)": tr.n_params, "trained policy params": tr.trained,
        "reward": describe_reward(cfg, tr.rm_path), "prompts": len(tr.prompts), "iterations": p.iterations,
        "prompts × samples / mini / micro / world": (f"{p.rollout_batch_size} × {p.n_samples_per_prompt} / "
                                                     f"{p.mini_batch_size} / {p.micro_batch_size} / "
                                                     f"{engine.world_size()}"),
        "advantage estimator": p.advantage_estimator, "sampling engine": sampler,
        "precision": f"{cfg.precision} (scoring passes: {tr.score_precision})",
        "zero stage": cfg.deepspeed.zero_stage}


def start_table(tr: PPOTrainer) -> None:
    """The start table, after `build_models`: `start_rows`, then the reference, reward normalisation, policy
    loss, dynamic sampling, engine correction, critic, coefficients and the checkpoint size plan."""
    cfg, p = tr.cfg, tr.p
    print_table(f"{COMMAND.name}: {tr.run_dir}", {
        **start_rows(tr, tr.maker.engine_name),
        **({"environment": tr.maker.runner.summary} if cfg.rollout.env is not None else {}),
        "reference": ("the policy with its LoRA adapters off" if isinstance(tr.reference, FrozenWithoutAdapters)
                      else cfg.reference.path or cfg.model.name),
        **({"teacher": f"{tr.teacher_path} ({tr.teacher_params:,} params, {tr.score_precision})"}
           if tr.teacher is not None else {}),
        "reward normalisation": tr.score_stats if p.normalize_reward else None,
        "policy loss": (f"{p.policy_loss}, {p.aggregation}"
                        + (f", ε_high {p.clip_high}" if p.clip_high is not None else "")
                        + (f", dual clip {p.dual_clip}" if p.dual_clip is not None else "")),
        "dynamic sampling": (f"drops zero-variance groups, <= {p.filter_groups_max_rounds} extra round(s)"
                             if p.filter_groups else "off"),
        "engine correction": (f"{cfg.rollout.is_correction}, ρ in [{cfg.rollout.is_low}, {cfg.rollout.is_high}]"
                              if cfg.rollout.is_correction != "none" else "none"),
        "critic": (f"{p.critic} ({p.critic_init}"
                   + ("; the reward model is this critic with its LoRA adapters off)"
                      if isinstance(tr.reward_model, FrozenWithoutAdapters) else ")")
                   if tr.estimator.needs_critic else "none (critic-free)"),
        "γ λ ε c1 c2 β": f"{p.gamma} {p.lam} {p.clip} {p.c1} {p.c2} {p.kl_beta} (KL in the {p.kl_in})",
        "checkpoint size": checkpoint_plan([e.module for e in (tr.actor, tr.critic) if e is not None],
                                           cfg.paths, cfg.deepspeed.zero_stage, tr.run_dir, p.iterations,
                                           p.save_every)})


def learn(tr: PPOTrainer, exp: Any, roll_stats: dict[str, float], it: int, drift: EngineDriftGuard
          ) -> dict[str, float]:
    """Iteration `it`'s update and its bookkeeping: `train_on` the experience `exp` (None: `ppo.filter_groups`
    kept no group, nothing trains), then the rollout's KL statistics after the update (which fills an on-policy
    plan's old log-probs), the engine's and the correction's, the `ppo.max_kl` and drift checks, and the KL
    controller's update. Returns the iteration's record.

    Raises:
        FloatingPointError: the KL to the reference over `ppo.max_kl`, or an engine that drifted (an abort).
    """
    p, rollout = tr.p, tr.cfg.rollout
    train_stats: dict[str, float] = {}
    if exp is not None:
        train_stats = tr.train_on(exp, it)
        # an all-reduce: inside the caller's deferred block, so that a Ctrl-C between the two leaves no rank behind
        roll_stats.update(kl_stats(exp, tr.kl_ctl.value))
        roll_stats.update(engine_stats(exp))  # {} unless the engine gives its own log-probs
        roll_stats.update(is_correction_stats(exp, rollout.is_correction, rollout.is_low, rollout.is_high))
        check_max_kl(p, roll_stats, it)  # an abort saves no part of this iteration
        drift.check(roll_stats, it)
        # the episodes trained on: fewer than the rollout's when ppo.filter_groups kept fewer (every rank keeps as
        # many rows)
        tr.kl_ctl.update(roll_stats["objective/kl"], exp.input_ids.shape[0] * engine.world_size())
    return {**roll_stats, **train_stats, "ppo/bad_steps": tr.bad_steps}


def train_loop(tr: PPOTrainer, ckpts: Checkpoints, metrics: MetricsLogger, start: int) -> tuple[int, dict[str, float]]:
    """Iterations `start` (0, or where a resume left off) to `ppo.iterations`: rollout (`maker.make_experience`),
    then `learn`, the record logged and samples kept every `ppo.sample_every`; a checkpoint every
    `ppo.save_every`, and on Ctrl-C (or SIGTERM) between iterations. Returns (iterations done, the last record).

    Raises:
        ConfigError: an abort (`learn`'s FloatingPointError), the run's status `aborted` with the reason.
    """
    p = tr.p
    progress = Progress(p.iterations, COMMAND.name, PROGRESS_KEYS, enabled=engine.is_main(), start=start)
    done = start  # iterations complete: the weights of a checkpoint taken now
    updating = False
    # the greedy probe checks an engine that computes as the scoring passes do (`VLLMGenerator.probes`); else this
    drift = EngineDriftGuard(active=not tr.maker.generator.probes)
    pushes = PushGuard()  # a push that changed nothing after a step stops the run (vllm: `tensors_changed`)
    record: dict[str, float] = {}
    try:
        for it in range(start, p.iterations):
            exp, roll_stats, samples = tr.maker.make_experience(it)
            roll_stats.update(pushes.check(tr.maker.generator.tensors_changed, it))
            bad_steps = tr.bad_steps
            # a checkpoint mid-iteration would hold its weights under the previous step (or half of them): a
            # Ctrl-C/SIGTERM from here to `done` lets the update and its bookkeeping (KL controller, metrics row)
            # finish, then saves step it + 1 (a second one stops at once, without a checkpoint)
            with deferred_interrupts() as pending:
                updating = True
                record = learn(tr, exp, roll_stats, it, drift)
                pushes.stepped(exp is not None and tr.bad_steps == bad_steps and record.get("policy/grad_norm") != 0)
                del exp  # its tensors and packed layouts are not held through the next rollout
                metrics.log(it + 1, record)
                if engine.is_main() and p.sample_every and (it + 1) % p.sample_every == 0:
                    append_samples(tr.run_dir, it + 1, samples)
                progress.update(1, record)
                done = it + 1
                updating = False
            if p.save_every and done % p.save_every == 0 and done < p.iterations:
                ckpts.save(done, tr.state())
            if engine.all_reduce_sum(torch.tensor(float(bool(pending)))).item() > 0:  # every rank stops together
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        progress.close()
        if updating:
            log.warning("stopped in the middle of iteration %d's update: no checkpoint of it (resume=true "
                        "continues from the last one)", done + 1)
            raise
        log.warning("interrupted after %d iterations: saving a checkpoint before exit", done)
        ckpts.save(done, tr.state())
        raise
    except FloatingPointError as e:
        progress.close()
        if engine.is_main():
            set_status(tr.run_dir, "aborted", reason=str(e))
        raise ConfigError(str(e)) from None
    finally:
        tr.maker.generator.close()  # an engine's model dir and memory
    progress.close()
    return done, record


def save(tr: PPOTrainer, ckpts: Checkpoints, metrics: MetricsLogger, done: int, record: dict[str, float]) -> None:
    """The run's end: the last checkpoint (`done` iterations; more than `ppo.iterations` when a longer run is
    resumed with fewer), `final/` (`models.save_policy`: the policy, a separate critic, the reward and reference
    they were trained with), the `latest_policy` pointer and the finish table; then every rank waits and the
    metrics close."""
    cfg, p = tr.cfg, tr.p
    ckpts.save(done, tr.state(), final=True)
    final = tr.run_dir / "final"
    actor_sd = tr.actor.consolidated_state_dict()
    critic_sd = tr.critic.consolidated_state_dict() if tr.critic is not None else None
    if engine.is_main():
        extra = {"rlhf_stage": COMMAND.kind, "rlhf_reference_model": tr.reference_spec,
                 "rlhf_reward_model_path": abs_path(tr.rm_path), "rlhf_reward_type": cfg.reward.type,
                 "rlhf_reward_sources": reward_sources(cfg), "rlhf_reward_function": cfg.reward.function,
                 **({"rlhf_teacher_path": abs_path(tr.teacher_path)} if tr.teacher_path else {}),
                 "rlhf_advantage_estimator": p.advantage_estimator}
        save_policy(final, tr.actor.module, actor_sd, tr.tokenizer, extra,
                    tr.critic.module if tr.critic is not None else None, critic_sd, base=model_source(cfg.model),
                    critic_base=tr.critic_base)
        pointer = finish_run(cfg, tr.run_dir, final, COMMAND.kind, iterations=done)
        summary = ("objective/scores", "objective/kl", "objective/kl_beta", "response/length_mean")
        print_table(f"{COMMAND.name} finished", {k: record.get(k) for k in summary}
                    | {"checkpoint": str(final), "pointer": str(pointer or "not moved (a sweep job)")})
    engine.barrier()
    metrics.close()
