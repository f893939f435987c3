"""`rlhf eval`: measure a reward model or a policy, or build the report of a past run.

Three modes, picked in this order:
  run_dir=<run or sweep dir>     report of a past training run / a multirun sweep (no models loaded)
  policy.path=<run or HF dir>    policy vs reference on held-out prompts, judged by the reward model
  reward_model.path=<...>        pairwise accuracy of a reward model on preference pairs
With none of them, `<paths.root>/latest_policy` is evaluated, else `<paths.root>/latest_rm`.
Every mode writes `eval.json` and `report/report.html` into this eval's run dir.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig

from rlhf_cli import engine, lineage
from rlhf_cli.commands import by_kind, by_stage
from rlhf_cli.config import ConfigError, ModelConfig
from rlhf_cli.core import policy_eval_stats, proportion_ci95, sample_std, small_sample_warning
from rlhf_cli.data import last_user_turn, load_preference_data, load_prompt_data, task_checker
from rlhf_cli.eos import eos_ids
from rlhf_cli.forwards import batched_scores, pair_metrics, score_pairs, sequence_kl
from rlhf_cli.lifecycle import command_line_keys, prepare_run_dir, seed_everything, write_config
from rlhf_cli.models import (
    is_scalar_model_dir,
    load_causal_lm,
    load_generation_config,
    load_scalar_model,
    load_tokenizer,
    lora_enabled,
    read_score_stats,
    require_scalar_model_dir,
    resolve_hf_dir,
)
from rlhf_cli.models.loading import looks_like_hub_id
from rlhf_cli.report import (
    RESPONSES_FILE,
    UnreadableFile,
    build_report,
    eval_headline,
    is_eval_dir,
    print_summary,
    summary_table,
)
from rlhf_cli.reward_http import HttpReward, queries
from rlhf_cli.reward_judge import JudgeReward
from rlhf_cli.rewards import load_reward_function
from rlhf_cli.rollout import (
    EngineSettings,
    Episodes,
    Sampling,
    SingleTurnRunner,
    call_on_every_rank,
    describe_engine,
    dtype_setting,
    http_on_every_rank,
    judge_on_every_rank,
    make_generator,
    max_model_len,
    resolve_engine,
)
from rlhf_cli.rollout.environments import environment_runner
from rlhf_cli.runs import atomic_write_json, atomic_write_text, read_pointer, set_status
from rlhf_cli.seeds import derive_seed
from rlhf_cli.stages.common import check_same_tokenizer, console, print_table

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry (its name, run-dir kind, pointer)


def _model_cfg(path: str, base: Any) -> Any:
    """A ModelConfig that loads `path` (a run dir, `final/` dir or hub id) with `base`'s runtime settings."""
    cfg = OmegaConf.merge(base, {"name": Path(str(path)).name, "name_or_path": str(path), "gguf_file": None,
                                 "tokenizer": None, "init": "pretrained"})
    return cfg


# ----------------------------------------------------------------------------------------------
# reward model


def eval_reward_model(cfg: Any, rm_path: str, run_dir: Path) -> dict[str, Any]:
    """Pairwise accuracy (ties not correct), margin and reward distributions on preference data."""
    rm_dir = require_scalar_model_dir(rm_path, "reward model")
    tokenizer = load_tokenizer(_model_cfg(rm_dir, cfg.model))
    eos = eos_ids(tokenizer, load_generation_config(rm_dir))  # train-rm keeps the set in its config.json
    data = load_preference_data(cfg.data, tokenizer, eos_ids=eos)
    lineage.record(run_dir, cfg, COMMAND.kind, data.summary, {"reward_model": rm_dir}, write=engine.is_main())
    pairs = {"eval": data.eval, "train": data.train, "all": list(data.train) + list(data.eval)}[cfg.eval.split]
    if cfg.eval.num_prompts:
        pairs = pairs[: cfg.eval.num_prompts]
    if not pairs:
        raise ConfigError(f"no preference pairs in split eval.split={cfg.eval.split} of data.path={cfg.data.path}")
    model = load_scalar_model(rm_dir, cfg.precision, cfg.seed).to(engine.device())
    chosen, rejected = score_pairs(model, pairs, tokenizer.pad_token_id, cfg.eval.batch_size,
                                   engine.scoring_precision(cfg.precision, cfg.scoring_precision), cfg.data.packing)
    stats = pair_metrics(chosen, rejected)
    _, acc_low, acc_high = proportion_ci95((chosen > rejected).float())
    results = {
        "mode": "reward_model", "reward_model": str(Path(rm_dir).resolve()), "pairs": len(pairs),
        "accuracy": stats["rm/accuracy"], "accuracy_ci95_low": acc_low, "accuracy_ci95_high": acc_high,
        **_small_sample(len(pairs), "pairs"), "ties": int(stats["rm/ties"]),
        "loss": stats["rm/loss"], "margin_mean": stats["rm/margin"],
        "chosen_mean": float(chosen.mean()), "chosen_std": sample_std(chosen.tolist()),
        "rejected_mean": float(rejected.mean()), "rejected_std": sample_std(rejected.tolist()),
        "data": data.summary,
    }
    if engine.is_main():
        atomic_write_json(run_dir / "rewards.json", {"chosen": chosen.tolist(), "rejected": rejected.tolist()})
    return results


# ----------------------------------------------------------------------------------------------
# policy


@torch.no_grad()
def eval_policy(cfg: Any, policy_path: str, run_dir: Path) -> dict[str, Any]:
    """Policy vs reference on held-out prompts with shared per-prompt noise: RM scores and win rate, checker
    accuracy, `reward.function` scores, each side with its interval and as paired gains (`score_gain`,
    `accuracy_gain`, `function_gain`; `core.policy_eval_stats`), the reward-hacking headline, KL, lengths, EOS
    rates. Writes `rewards.json` (with a reward model) and the responses file (rank 0).

    Raises:
        ConfigError: no reference recorded or set, no eval prompts, fewer prompts than processes.
    """
    e = cfg.eval
    src = policy_sources(cfg, policy_path)
    tokenizer = load_tokenizer(_model_cfg(src["policy_dir"], cfg.model))
    runner, src = eval_runner(cfg, tokenizer, src)
    mine = eval_prompts(cfg, tokenizer, run_dir, src)
    if cfg.rollout.env is not None:
        runner.check_rows(mine)
    models = load_eval_models(cfg, src, tokenizer)
    sampled, episode_stats = sample_both(cfg, models, mine, tokenizer, runner, run_dir)
    scores = {}
    if sampled["policy"].score is not None:  # the environment's get_reward: the run's reward sources are not called
        scores = {who: ep.score.float().cpu() for who, ep in sampled.items()}
    elif models["reward_model"] is not None:  # both sides in one pass: a prompt's two samples share its computation
        pad = tokenizer.pad_token_id
        (pol_ids, pol_am), (ref_ids, ref_am) = (sampled[who].sampled_view(pad) for who in ("policy", "reference"))
        scores = side_by_side_scores(models["reward_model"], (pol_ids, pol_am, sampled["policy"].P),
                                     (ref_ids, ref_am, sampled["reference"].P), pad, e.batch_size,
                                     models["score_precision"], cfg.data.packing, models["eos"])
    elif cfg.reward.type == "http":  # the server's scores take the reward model's place: win rate, score_gain, ...
        scores = {who: server_scores(cfg, tokenizer, ep, mine) for who, ep in sampled.items()}
    elif cfg.reward.type == "judge":  # so do the judge's
        scores = {who: judge_scores(cfg, tokenizer, ep, mine) for who, ep in sampled.items()}
    rows = [side_values(cfg, models, tokenizer, mine, who, sampled[who], scores.get(who))
            for who in ("policy", "reference")]
    pol, ref = ({k: v.cpu() if torch.is_tensor(v) else v for k, v in d.items()} for d in rows)
    gathered = engine.all_gather_object((pol, ref, [x.get("prompt_text", "") for x in mine]))
    pol = _merge([g[0] for g in gathered])
    ref = _merge([g[1] for g in gathered])
    prompt_texts = [t for g in gathered for t in g[2]]
    # one sequence, one score: a response both models sampled is a tie (`batched_scores` scores it once)
    results: dict[str, Any] = {
        "mode": "policy", "policy": str(Path(src["policy_dir"]).resolve()), "reference": str(src["ref_path"]),
        "reward_model": str(src["rm_path"]) if src["rm_path"] else None, "prompts": len(prompt_texts),
        "reward_source": score_source(cfg, models, src["rm_path"], sampled["policy"]), "temperature": e.temperature,
        "max_new_tokens": e.max_new_tokens, "seed": cfg.seed, **_small_sample(len(prompt_texts), "prompts"),
    }
    rm_stats = models["rm_stats"]
    results.update(policy_eval_stats(pol, ref, rm_stats[1] if rm_stats is not None else None))
    results.update(episode_results(episode_stats, len(mine), len(prompt_texts)))
    if results.get("reward_hacking", "none") != "none":
        log.warning("%s", results["headline"])
    results["samples"] = write_responses(run_dir, pol, ref, prompt_texts, e.num_samples)
    return results


def eval_runner(cfg: Any, tokenizer: Any, src: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The episode runner of a policy eval, built before any model or engine (a bad environment is one line, with
    nothing to close): `SingleTurnRunner`, or with `rollout.env` its `EnvironmentRunner`; and `src`
    (`policy_sources`) without the reward model where the environment's `get_reward` scores the episodes, so none is
    loaded, used or recorded as this eval's judge (eval.json, lineage)."""
    runner = SingleTurnRunner() if cfg.rollout.env is None else environment_runner(cfg, tokenizer)
    if getattr(runner, "owns_reward", False) and src["rm_path"] is not None:
        if cfg.reward.type == "model" and engine.is_main():
            log.info("rollout.env=%s scores the episodes (get_reward): the reward model %s is not loaded",
                     cfg.rollout.env, src["rm_path"])
        src = {**src, "rm_path": None}
    return runner, src


def episode_results(episode_stats: dict[str, dict[str, float]], mine: int, prompts: int) -> dict[str, float]:
    """`<side>/episode_*` of eval.json over every rank's prompts, from each side's `episode/*` statistics of this
    rank's `mine` prompts (`EnvironmentRunner.stats`; {} without an environment): `tool_errors` the count, the rest
    means per episode over all `prompts`. A collective: every rank calls it with the same sides and keys."""
    out = {}
    for who, stats in episode_stats.items():
        for key, value in stats.items():
            count = key == "episode/tool_errors"
            total = engine.all_reduce_sum(torch.tensor(value * (1 if count else mine), dtype=torch.float64)).item()
            out[f"{who}/{key.replace('/', '_')}"] = total if count else total / prompts  # policy/episode_turns_mean
    return out


def server_scores(cfg: Any, tokenizer: Any, sampled: Episodes, mine: list[dict[str, Any]]) -> torch.Tensor:
    """The reward server's (`reward.type=http`, `reward.url`) scores (N,) float32 on the CPU of one side's
    `Episodes` of this rank's prompts `mine`: the same request as train-ppo's (`rlhf_cli.reward_http`).
    Raises RewardServerError (on every rank) when the server fails."""
    (ids, am), P = sampled.sampled_view(tokenizer.pad_token_id), sampled.P
    texts = tokenizer.batch_decode(ids[:, P:], skip_special_tokens=True)
    return http_on_every_rank(HttpReward.from_config(cfg.reward), queries(tokenizer, ids, am), texts, mine).cpu()


def judge_scores(cfg: Any, tokenizer: Any, sampled: Episodes, mine: list[dict[str, Any]]) -> torch.Tensor:
    """The LLM judge's (`reward.type=judge`, `reward.judge.*`) scores (N,) float32 on the CPU of one side's
    `Episodes` of this rank's prompts `mine`, NaN where its reply held no score: train-ppo's requests
    (`rlhf_cli.reward_judge`). Raises RewardServerError (on every rank) when the endpoint fails."""
    texts = tokenizer.batch_decode(sampled.sampled_view(tokenizer.pad_token_id)[0][:, sampled.P:],
                                   skip_special_tokens=True)
    return judge_on_every_rank(JudgeReward.from_config(cfg.reward.judge, cfg.seed), texts, mine).cpu()


def score_source(cfg: Any, models: dict[str, Any], rm_path: str | None, sampled: Episodes | None = None
                 ) -> str | None:
    """What eval.json's `score` figures (`<side>/score_mean`, `win_rate`, `score_gain`) were scored by:
    `environment <rollout.env>` (its `get_reward`, in `sampled`'s episodes), `reward model <path>`, `reward server
    <url>`, `judge <model> at <base_url>`, or None (no such score)."""
    if sampled is not None and sampled.score is not None:
        return f"environment {cfg.rollout.env}"
    if cfg.reward.type == "http":
        return f"reward server {cfg.reward.url}"
    if cfg.reward.type == "judge":
        return f"judge {cfg.reward.judge.model} at {cfg.reward.judge.base_url}"
    return f"reward model {rm_path}" if models["reward_model"] is not None else None


def policy_sources(cfg: Any, policy_path: str) -> dict[str, Any]:
    """Where a policy eval's models come from: `policy_dir` (the policy's HF dir), `ref_spec` (the reference's
    model section: `reference.path`, or the one the policy's config.json records) and `ref_seed`, `ref_path` (its
    name for eval.json) and `rm_path` (`reward_model.path`, else the reward model the runs compared were trained
    against, `recorded_reward_model`; may be None). Says in one line each which reward model it took from the
    lineage, and which pointer the policy's run started from now names another model (the recorded one is used).

    Raises:
        ConfigError: no reference recorded in the policy's config.json and no `reference.path`.
    """
    policy_dir = resolve_hf_dir(policy_path)
    config_json = Path(policy_dir) / "config.json"
    pconf = json.loads(config_json.read_text()) if config_json.is_file() else {}
    ref_spec = {"name_or_path": cfg.reference.path} if cfg.reference.path else pconf.get("rlhf_reference_model")
    if ref_spec is None:
        raise ConfigError(f"no reference model recorded in {policy_dir}/config.json: set reference.path=...")
    notes = lineage.moved_pointers(policy_dir)
    name = ref_spec.get("name_or_path")
    if not cfg.reference.path and name:  # a record older than resolved paths names a pointer: the run it named then
        then = lineage.recorded_model_dir(policy_dir, ("reference", "model"), str(name))
        now = lineage.resolve_model_path(str(name)) if then is not None else None
        if then is not None and then != now:
            notes.append(f"{name} named {then} when {policy_dir} was trained; it now names {now}")
            ref_spec["name_or_path"] = then
    if notes and engine.is_main():
        log.warning("the policy's run started from pointers that have moved since: %s; this eval uses the models it "
                    "was trained from%s", "; ".join(notes),
                    "" if cfg.reference.path else " (reference.path=... to choose another)")
    ref_seed = ref_spec.pop("seed", cfg.seed)
    ref_path = ref_spec.get("name_or_path") or ref_spec.get("gguf_file") or f"{ref_spec.get('name')} (seed {ref_seed})"
    rm_path = cfg.reward_model.path
    if rm_path is None:
        rm_path, whose = recorded_reward_model(policy_dir, ref_spec.get("name_or_path"))
        if rm_path is not None and cfg.reward.type == "model" and engine.is_main():
            console.print(f"reward model: {rm_path}, the one the {whose} was trained against (reward_model.path=... "
                          f"to choose another)", soft_wrap=True, highlight=False)
    return {"policy_dir": policy_dir, "ref_spec": ref_spec, "ref_seed": ref_seed, "ref_path": ref_path,
            "rm_path": rm_path}


def recorded_reward_model(policy_dir: str, reference: str | None) -> tuple[str | None, str]:
    """(the reward model, whose run) that the compared models' runs were trained against: the policy's (a train-ppo
    run records it in config.json and in its lineage), else the reference's when it is a model of ours (DPO against
    RM -> PPO: the PPO run's). (None, "") when neither records one."""
    for whose, model_dir in (("policy", policy_dir), ("reference", reference)):
        local = lineage.resolve_model_path(str(model_dir)) if model_dir else None
        if local is None or not Path(local).is_dir():
            continue
        rec = lineage.read(local) or {}
        config_json = Path(local) / "config.json"
        recorded = ((json.loads(config_json.read_text()).get("rlhf_reward_model_path") if config_json.is_file()
                     else None) or ((rec.get("parents") or {}).get("reward_model") or {}).get("path"))
        if recorded and (Path(recorded).exists() or looks_like_hub_id(recorded)):
            return recorded, f"{whose} ({rec.get('run_dir') or local})"
    return None, ""


def eval_prompts(cfg: Any, tokenizer: Any, run_dir: Path, src: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's share (every world-size-th) of the first `eval.num_prompts` (0 = all) prompts of the eval split,
    and the eval's lineage record (parents: policy, reference, reward model of `src`, `policy_sources`).

    Raises:
        ConfigError: no prompts, or fewer than processes (each samples a share of its own).
    """
    e = cfg.eval
    prompts = load_prompt_data(cfg.data, tokenizer, split="eval")
    parents = {"policy": src["policy_dir"],
               "reference": src["ref_spec"].get("name_or_path") or src["ref_spec"].get("gguf_file"),
               "reward_model": src["rm_path"]}
    available, ws = len(prompts), engine.world_size()
    n = min(available, e.num_prompts) if e.num_prompts else available
    if n == 0:
        raise ConfigError(f"no prompts in the eval split of data.path={cfg.data.path}")
    if n < ws:  # every process samples a share of its own; none may be empty
        cut = n < available
        data = f"data.path={cfg.data.path}" if cfg.data.path else "the built-in task (data.builtin.ppo_eval)"
        why = f"eval.num_prompts={e.num_prompts}" if cut else f"all the eval split of {data} holds"
        raise ConfigError(f"{n} eval prompt(s) for {ws} processes ({why}): each process needs at least one, so run "
                          f"at most {n}" + (" or raise eval.num_prompts" if cut else ""))
    if cfg.reward.type == "judge":  # a template field the rows lack: one line now, before any model loads
        JudgeReward.from_config(cfg.reward.judge, cfg.seed).check_rows(prompts[:n], "the eval split")
    if cfg.reward.type == "http":  # a reward.label_key no row has, likewise
        HttpReward.from_config(cfg.reward).check_rows(prompts[:n], "the eval split")
    lineage.record(run_dir, cfg, COMMAND.kind, prompts.summary, parents, write=engine.is_main())
    if n < available and engine.is_main():
        console.print(f"prompts: the first {n} of the {available} held-out prompts (eval.num_prompts={e.num_prompts})",
                      soft_wrap=True, highlight=False)
    return prompts[:n][engine.rank()::ws]


def load_eval_models(cfg: Any, src: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The models of a policy eval, on the device in eval mode: `policy`, `reference` (its recorded seed),
    `reward_model` (None without one, or unless `reward.type=model`) with `rm_stats` (its stored held-out
    (mean, std), `models.read_score_stats`), `function` (`reward.function`, or None), `score_precision` (the KL
    and reward passes) and `eos` (the policy's EOS set, which ends both sides' responses)."""
    policy = load_causal_lm(_model_cfg(src["policy_dir"], cfg.model), cfg.precision, cfg.seed, tokenizer=tokenizer)
    ref_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), src["ref_spec"])
    reference = load_causal_lm(ref_cfg, cfg.precision, src["ref_seed"], tokenizer=tokenizer)
    reward_model, rm_stats = None, None
    if any(w is not None for w in cfg.reward.weights.values()):
        log.warning("%s does not sum reward.weights: it reports each source on its own (the reward model, the "
                    "checker where prompts have answers, and reward.function when set)", COMMAND.invocation)
    function = load_reward_function(cfg.reward.function) if cfg.reward.function else None
    if src["rm_path"] is not None and cfg.reward.type == "model":
        rm_dir = require_scalar_model_dir(src["rm_path"], "reward model")
        check_same_tokenizer(tokenizer, rm_dir, "reward model")
        reward_model = load_scalar_model(rm_dir, cfg.precision, cfg.seed)
        rm_stats = read_score_stats(rm_dir)  # (mean, std) of its held-out scores, stored by train-rm
    dev = engine.device()
    policy.to(dev).eval()
    reference.to(dev).eval()
    if reward_model is not None:
        reward_model.to(dev).eval()
    return {"policy": policy, "reference": reference, "reward_model": reward_model, "rm_stats": rm_stats,
            "function": function, "score_precision": engine.scoring_precision(cfg.precision, cfg.scoring_precision),
            "eos": eos_ids(tokenizer, policy.generation_config)}


def sample_both(cfg: Any, models: dict[str, Any], prompts: list[dict[str, Any]], tokenizer: Any, runner: Any,
                run_dir: Path) -> tuple[dict[str, Episodes], dict[str, dict[str, float]]]:
    """Each side's episodes on this rank's prompt rows (`prompts`, with `prompt_ids`) from one generator
    (`rollout.engine`) and one `runner` (`SingleTurnRunner`, or with `rollout.env` the environment's
    `EnvironmentRunner`: the same environment, budgets and per-turn seeds on both sides), with one noise stream
    per prompt shared by policy and reference (common random numbers): the same samples whatever the world size,
    and identical episodes wherever the two models agree. `eval.max_new_tokens` bounds a turn, as
    `ppo.max_new_tokens` does in train-ppo. Returns ({"policy": ..., "reference": ...}, each N `Episodes`; each
    side's `episode/*` statistics of this rank's rows, {} without an environment)."""
    e = cfg.eval
    # prompt j of the eval (this rank's i-th) samples with seed derive_seed(seed, j) on both sides
    seeds = [derive_seed(cfg.seed, engine.rank() + i * engine.world_size()) for i in range(len(prompts))]
    cfg.rollout.engine, why = resolve_engine(cfg.rollout.engine, models["policy"].config,  # eval.json: the one used
                                             models["reference"].config)
    if why != "as set" and engine.is_main():
        log.info("rollout.engine=auto samples with %s (%s)", cfg.rollout.engine, why)
    generator = make_generator(cfg.rollout.engine, EngineSettings(
        precision=cfg.precision, chunk=e.generation_batch_size, workdir=run_dir, kv_cache_gb=cfg.rollout.kv_cache_gb,
        max_model_len=max_model_len(cfg, e.max_new_tokens), engine_dtype=cfg.rollout.engine_dtype,
        verbose=cfg.rollout.engine_verbose, selftest=cfg.rollout.engine_selftest,
        sync_timeout_s=cfg.rollout.sync_timeout_s))
    # no score_precision: nothing trains on eval's samples, so `auto` gives the engine the run's precision, as the
    # hf sampler samples under it
    if cfg.rollout.engine == "vllm":  # eval.json and the results table: the dtype used
        cfg.rollout.engine_dtype = dtype_setting(generator.dtype)
    sampling = Sampling(eos_ids=models["eos"], pad_id=tokenizer.pad_token_id, max_new_tokens=e.max_new_tokens,
                        temperature=e.temperature, top_p=e.top_p)
    sampled, stats = {}, {}
    try:
        for who in ("policy", "reference"):  # one engine, the same seeds on both sides
            generator.update_weights(models[who])
            sampled[who] = runner.run(prompts, seeds, generator, sampling)
            if cfg.rollout.env is not None:
                stats[who] = dict(runner.stats)
    finally:
        generator.close()
    return sampled, stats


def side_values(cfg: Any, models: dict[str, Any], tokenizer: Any, mine: list[dict[str, Any]], who: str,
                sampled: Episodes, score: torch.Tensor | None) -> dict[str, Any]:
    """One side's per-prompt values of this rank's prompts `mine` (`who`: policy or reference; `sampled`: its
    `Episodes`): `text`, `length` (sampled tokens), `eos` (1.0 = ended in EOS), `tokens` (the sampled ids), and
    where measured
    `score` (the reward model's, given), `correct` (the data's checker, when every rank's prompts have answers: 0/1, or
    reasoning-gym's score in [0, 1] with its partial credit), `function`
    (`reward.function`); the policy's KL(policy ‖ reference) `kl_k1`, `kl_k3` (nats per sequence) on its own
    samples, temperature-scaled, the policy's log-probs renormalised over its nucleus under `eval.top_p` < 1. With
    `rollout.env`, the text, the length and every source score the tokens the policy sampled
    (`Episodes.sampled_view`), as train-ppo's sources do, `reward.function` gets the conversation, and
    `conversation` holds each episode's messages after the prompt (TRL's conversational form,
    `episodes.Conversation`); the KL runs over the whole episode, on the sampled tokens."""
    ids, am, P, mask = sampled.input_ids, sampled.attention_mask, sampled.P, sampled.action_mask
    texts = tokenizer.batch_decode(sampled.sampled_view(tokenizer.pad_token_id)[0][:, P:], skip_special_tokens=True)
    out: dict[str, Any] = {"text": texts, "length": mask.sum(1), "eos": sampled.has_eos.float(),
                           "tokens": [tuple(r[m.bool()].tolist()) for r, m in zip(ids[:, P:].cpu(), mask.cpu())]}
    conversations = sampled.conversations
    if conversations is not None:
        out["conversation"] = [c.completion for c in conversations]
    if score is not None:
        out["score"] = score
    unanswered = float(any(x.get("answer") is None for x in mine))
    if engine.all_reduce_sum(torch.tensor(unanswered)).item() == 0:  # every rank's prompts have answers
        out["correct"] = call_on_every_rank({"checker": task_checker(cfg.data)}, texts, mine)["checker"]
    if models["function"] is not None:
        out["function"] = call_on_every_rank({"function": (cfg.reward.function, models["function"])}, texts,
                                             mine, conversations)["function"]
    if who == "policy":  # KL(policy ‖ reference) on the policy's own samples, temperature-scaled
        kl = sequence_kl(models["policy"], models["reference"], ids, am, mask, cfg.eval.temperature,
                         cfg.eval.batch_size, models["score_precision"], ("k1", "k3"), packing=cfg.data.packing,
                         top_p=cfg.eval.top_p)
        out["kl_k1"], out["kl_k3"] = kl["k1"], kl["k3"]
    return out


def write_responses(run_dir: Path, pol: dict[str, Any], ref: dict[str, Any], prompt_texts: list[str],
                    num_samples: int) -> list[dict[str, Any]]:
    """The first `num_samples` prompts' pairs for eval.json's `samples` (returned); rank 0 writes `rewards.json`
    (both sides' scores, with a reward model) and every prompt's pair to the responses file, for the report."""
    samples = [[last_user_turn(prompt_texts[i])[-300:], pol["text"][i], _get(pol, "score", i),
                ref["text"][i], _get(ref, "score", i)] for i in range(min(num_samples, len(prompt_texts)))]
    keys = ["prompt", "policy", "policy_score", "reference", "reference_score"]
    if engine.is_main():
        if "score" in pol:
            atomic_write_json(run_dir / "rewards.json", {  # null: a completion the reward server could not score
                side: [_get(t, "score", i) for i in range(len(t["score"]))] for side, t in (("policy", pol),
                                                                                         ("reference", ref))})
        lines = []
        for i, prompt in enumerate(prompt_texts):  # every prompt's pair, for the report and for the user
            line = {"prompt": last_user_turn(prompt), "policy": pol["text"][i], "reference": ref["text"][i]}
            for side, t in (("policy", pol), ("reference", ref)):
                line[f"{side}_length"] = int(t["length"][i])
                for key in ("score", "correct", "function"):
                    line[f"{side}_{key}"] = _get(t, key, i)
                if "conversation" in t:  # rollout.env: the episode's messages after the prompt
                    line[f"{side}_conversation"] = t["conversation"][i]
            lines.append(json.dumps(line) + "\n")
        atomic_write_text(run_dir / RESPONSES_FILE, "".join(lines))
    return [dict(zip(keys, s)) for s in samples]


def side_by_side_scores(model: Any, policy: tuple[torch.Tensor, torch.Tensor, int],
                        reference: tuple[torch.Tensor, torch.Tensor, int], pad_id: int, batch_size: int,
                        precision: str, packing: bool, eos: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Reward-model scores {"policy": (N,), "reference": (N,)} float32 on the CPU of both models' samples of the
    same N prompts, a prompt's two samples in the same forward (`batched_scores` over rows interleaved policy i,
    reference i, `batch_size` // 2 prompts, at least 1, per forward): packed (`data.packing`), a prompt and the
    first tokens its two samples share are computed once, and a sequence both models sampled is scored once (an
    exact tie).

    policy, reference: (input_ids (N, P+R), attention_mask (N, P+R), P) of their `Episodes`, the
    same prompts in the same order (R may differ: the narrower side is right-padded). `eos`: the EOS set, a
    response's closing id read as its first (`batched_scores`)."""
    (a_ids, a_am, P), (b_ids, b_am, Pb) = policy, reference
    if P != Pb or a_ids.shape[0] != b_ids.shape[0]:
        raise ValueError(f"side_by_side_scores: prompts differ ({a_ids.shape[0]} rows, P={P} against "
                         f"{b_ids.shape[0]} rows, P={Pb})")
    width = max(a_ids.shape[1], b_ids.shape[1])
    widen = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
    ids = torch.stack([widen(a_ids, pad_id), widen(b_ids, pad_id)], 1).flatten(0, 1)
    am = torch.stack([widen(a_am, 0), widen(b_am, 0)], 1).flatten(0, 1)
    k = 2 * max(batch_size // 2, 1)  # rows of whole prompts per forward
    scores = torch.cat([batched_scores(model, ids[i:i + k], am[i:i + k], k, precision, P, packing, eos).cpu()
                       for i in range(0, ids.shape[0], k)])
    return {"policy": scores[0::2], "reference": scores[1::2]}


def _small_sample(n: int, what: str) -> dict[str, str]:
    """{"warning": "too few held-out ..."} (and the warning logged) below `core.paired.SMALL_SAMPLE`, else {}."""
    warning = small_sample_warning(n, what)
    if warning is None:
        return {}
    log.warning("%s", warning)
    return {"warning": warning}


def _get(d: dict[str, Any], key: str, i: int) -> float | None:
    """d[key][i] as a float; None when not measured, or NaN (a completion the reward function could not score)."""
    v = float(d[key][i]) if key in d else math.nan
    return None if math.isnan(v) else v


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        out[k] = torch.cat([v.cpu() for v in vals]) if torch.is_tensor(vals[0]) else [x for v in vals for x in v]
    return out


# ----------------------------------------------------------------------------------------------
# entry point


def default_models(cfg: Any, required: bool = True) -> tuple[str | None, str | None]:
    """(policy path, reward-model path) to evaluate: `policy.path` and `reward_model.path` as set; with neither
    set, the newest model's pointer (`commands.Command.defaults`: `latest_policy`, else `latest_rm`), which
    `prepare_run_dir` resolves and records like a pointer typed on the command line.
    Raises ConfigError when there is nothing to evaluate (`required`; else (None, None))."""
    chosen = {"policy.path": cfg.policy.path, "reward_model.path": cfg.reward_model.path}
    if all(v is None for v in chosen.values()):
        for key, kind in COMMAND.defaults:
            if read_pointer(cfg.paths.root, kind) is not None:
                chosen[key] = str(Path(cfg.paths.root) / str(by_kind(kind).pointer))
                break
        else:
            if not required:
                return None, None
            keys = ", ".join(f"{key}=..." for key, _ in COMMAND.defaults)
            pointers = " / ".join(str(by_kind(kind).pointer) for _, kind in COMMAND.defaults)
            raise ConfigError(f"nothing to evaluate: set {keys} or run_dir=... (no {pointers} under {cfg.paths.root})")
    return chosen["policy.path"], chosen["reward_model.path"]


def run(cfg: Any, run_dir: Path) -> float | None:
    """`rlhf eval` on the composed config `cfg` (conf/eval.yaml), writing into `run_dir`: with `run_dir=` the
    report of a past run (`report_only`); else the model to measure (`default_models`) and the data it was trained
    on, a dry run's table, the policy eval or the reward-model eval, then `eval.json`, the report and the verdict.
    Returns the headline figure (win rate, else the policy's score or accuracy; a reward model's accuracy), None
    for a report or a dry run.

    Raises:
        ConfigError: nothing to evaluate, a reward model given as the policy, an unreadable run dir, in one line.
    """
    engine.init_distributed()
    if cfg.run_dir:  # report of a past run: nothing to train or load
        report_only(cfg, run_dir)
        return None
    cfg.policy.path, cfg.reward_model.path = default_models(cfg, required=False)  # resolved with the others
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    policy_path, rm_path, data_note = eval_setup(cfg, run_dir)
    if cfg.dry_run:
        sampler = {}
        if policy_path is not None:  # `auto` decided on the policy and a reference.path's model (the run: both)
            paths = [str(policy_path)] + ([cfg.reference.path] if cfg.reference.path else [])
            sampler = {"sampling engine": cfg.rollout.engine if cfg.rollout.engine != "auto" else describe_engine(
                "auto", *(AutoConfig.from_pretrained(resolve_hf_dir(p)) for p in paths))}
        print_table(f"{COMMAND.name} (dry run): {run_dir}",
                    {"policy": policy_path, "reward_model": rm_path, "data": data_note, **sampler})
        set_status(run_dir, "dry_run") if engine.is_main() else None
        return None
    if policy_path is not None:
        if is_scalar_model_dir(policy_path):
            raise ConfigError(f"policy.path={policy_path} is a reward model (scalar head), not a policy")
        results = eval_policy(cfg, policy_path, run_dir)
        headline = results.get("win_rate", results.get("policy/score_mean", results.get("policy/accuracy")))
    else:
        results = eval_reward_model(cfg, rm_path, run_dir)
        headline = results["accuracy"]
    if engine.is_main():
        write_results(cfg, run_dir, results)
    engine.barrier()
    return headline


def report_only(cfg: Any, run_dir: Path) -> None:
    """`rlhf eval run_dir=...`: rank 0 builds the report of the past run or sweep `run_dir=` (an eval's page: its
    verdict; a training run: its summary table); Hydra's own dir for this eval, left empty, is dropped.

    Raises:
        ConfigError: no run there, or a file of it unparsable (named), on every rank alike.
    """
    error = None
    if engine.is_main():  # one process writes the page (every rank would race over the same files)
        try:
            path = build_report(cfg.run_dir)
            if is_eval_dir(cfg.run_dir):  # an eval's page, rebuilt: its verdict
                console.print(" ".join(eval_headline(cfg.run_dir)), soft_wrap=True, highlight=False)
            else:
                columns, rows = summary_table(cfg.run_dir)
                print_summary(console, columns, rows, title=f"run summary: {cfg.run_dir}")
            console.print(f"report: {path}", soft_wrap=True, highlight=False)  # one line: copied and pasted
        except (UnreadableFile, FileNotFoundError) as e:  # no run there, or a file of it unparsable: named in e
            error = f"run_dir={cfg.run_dir}: {e}"
    error = engine.broadcast_object(error)  # every rank stops alike, none waits for a rank that failed
    if error is not None:
        raise ConfigError(error)
    _discard_empty_run_dir(run_dir)


def eval_setup(cfg: Any, run_dir: Path) -> tuple[str | None, str | None, str | None]:
    """What an eval measures: (policy path, reward-model path) from `default_models`, and `cfg.data` set to the
    data the evaluated model was trained on (its held-out split) unless the command line chose other data; the
    note saying so (or None) is printed and the config rewritten with that data. Says once that `model.lora.r`
    does nothing here. Returns (policy path, reward-model path, the data note)."""
    if lora_enabled(cfg.model.lora) and engine.is_main():
        log.warning("model.lora.r=%d has no effect in `%s`: a LoRA run's final/ holds merged plain weights, "
                    "evaluated as they are", cfg.model.lora.r, COMMAND.invocation)
    policy_path, rm_path = default_models(cfg)
    # the data the evaluated model was trained on (its held-out split), unless this command chose other data
    cfg.data, data_note = lineage.eval_data(cfg.data, policy_path or rm_path, command_line_keys())
    if data_note and engine.is_main():
        write_config(cfg, run_dir)  # the data this eval reads, as run
        console.print(data_note, soft_wrap=True, highlight=False)
    return policy_path, rm_path, data_note


def write_results(cfg: Any, run_dir: Path, results: dict[str, Any]) -> None:
    """Rank 0's end of an eval: `eval.json` (the results and the config as run), the results table and samples,
    the report page (a page that cannot be drawn fails nothing: said, with the command that tries again), status
    `finished`, and the verdict line."""
    atomic_write_json(run_dir / "eval.json", {"results": results, "config": OmegaConf.to_container(cfg, resolve=True)})
    engine_name = cfg.rollout.engine + (f", {cfg.rollout.engine_dtype} weights" if cfg.rollout.engine == "vllm" else "")
    sampler = {"sampling engine": engine_name} if results["mode"] == "policy" else {}
    print_table(COMMAND.name, {**sampler, **{k: v for k, v in results.items() if k not in ("samples", "data")}})
    if results.get("samples"):
        print_summary(console, ["prompt", "policy", "score", "reference", "score"],
                      [[s["prompt"][-80:], s["policy"][:120], s["policy_score"], s["reference"][:120],
                        s["reference_score"]] for s in results["samples"]], title="samples")
    try:  # the verdict, then the runs the model came from (eval.json, lineage.json and the parents' files)
        report = build_report(run_dir)
    except Exception as e:  # noqa: BLE001 - eval.json is written: a page that cannot be drawn fails nothing
        report = f"not written ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); " \
                 f"`{COMMAND.invocation} run_dir={run_dir}` tries again"
        log.warning("report %s", report)
    set_status(run_dir, "finished")
    if results.get("headline"):
        console.print(results["headline"], soft_wrap=True, highlight=False)
    console.print(f"eval.json: {run_dir / 'eval.json'}", soft_wrap=True, highlight=False)
    console.print(f"report: {report}", soft_wrap=True, highlight=False)  # the last line, whole: copied and pasted


def _discard_empty_run_dir(run_dir: Path) -> None:
    """A report-only eval writes nothing of its own: drop the dir Hydra made for it."""
    if engine.is_main() and run_dir.is_dir() and not (run_dir / "config.yaml").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
