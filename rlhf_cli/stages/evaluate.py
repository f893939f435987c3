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
from rlhf_cli.core import (
    mean_ci95,
    proportion_ci95,
    reward_hacking,
    sample_std,
    small_sample_warning,
    wilson_ci95,
    win_rate,
)
from rlhf_cli.data import check_answers, last_user_turn, load_preference_data, load_prompt_data
from rlhf_cli.eos import eos_ids
from rlhf_cli.forwards import batched_rewards, pair_metrics, score_pairs, sequence_kl
from rlhf_cli.lifecycle import command_line_keys, prepare_run_dir, seed_everything, write_config
from rlhf_cli.models import (
    is_scalar_model_dir,
    load_causal_lm,
    load_generation_config,
    load_scalar_model,
    load_tokenizer,
    lora_enabled,
    read_reward_stats,
    require_scalar_model_dir,
    resolve_hf_dir,
)
from rlhf_cli.report import (
    RESPONSES_FILE,
    UnreadableFile,
    build_report,
    eval_headline,
    is_eval_dir,
    print_summary,
    summary_table,
)
from rlhf_cli.rewards import load_reward_function
from rlhf_cli.rollout import (
    EngineSettings,
    Sampling,
    call_on_every_rank,
    describe_engine,
    make_generator,
    resolve_engine,
    rollout_batch,
)
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
    `accuracy_gain`, `function_gain`), the reward-hacking headline, KL, lengths, EOS rates."""
    e = cfg.eval
    policy_dir = resolve_hf_dir(policy_path)
    config_json = Path(policy_dir) / "config.json"
    pconf = json.loads(config_json.read_text()) if config_json.is_file() else {}
    ref_spec = {"name_or_path": cfg.reference.path} if cfg.reference.path else pconf.get("rlhf_reference_model")
    if ref_spec is None:
        raise ConfigError(f"no reference model recorded in {policy_dir}/config.json: set reference.path=...")
    ref_seed = ref_spec.pop("seed", cfg.seed)
    ref_path = ref_spec.get("name_or_path") or ref_spec.get("gguf_file") or f"{ref_spec.get('name')} (seed {ref_seed})"
    rm_path = cfg.reward_model.path or pconf.get("rlhf_reward_model_path")
    tokenizer = load_tokenizer(_model_cfg(policy_dir, cfg.model))
    pad_id = tokenizer.pad_token_id

    prompts = load_prompt_data(cfg.data, tokenizer, split="eval")
    parents = {"policy": policy_dir, "reference": ref_spec.get("name_or_path") or ref_spec.get("gguf_file"),
               "reward_model": rm_path}
    available, ws = len(prompts), engine.world_size()
    n = min(available, e.num_prompts) if e.num_prompts else available
    if n == 0:
        raise ConfigError(f"no prompts in the eval split of data.path={cfg.data.path}")
    if n < ws:  # every process samples a share of its own; none may be empty
        cut = n < available
        src = f"data.path={cfg.data.path}" if cfg.data.path else "the built-in task (data.builtin.ppo_eval)"
        why = f"eval.num_prompts={e.num_prompts}" if cut else f"all the eval split of {src} holds"
        raise ConfigError(f"{n} eval prompt(s) for {ws} processes ({why}): each process needs at least one, so run "
                          f"at most {n}" + (" or raise eval.num_prompts" if cut else ""))
    lineage.record(run_dir, cfg, COMMAND.kind, prompts.summary, parents, write=engine.is_main())
    prompts = prompts[:n]
    mine = prompts[engine.rank()::ws]

    policy = load_causal_lm(_model_cfg(policy_dir, cfg.model), cfg.precision, cfg.seed, tokenizer=tokenizer)
    ref_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), ref_spec)
    reference = load_causal_lm(ref_cfg, cfg.precision, ref_seed, tokenizer=tokenizer)
    reward_model, rm_stats = None, None
    if any(w is not None for w in cfg.reward.weights.values()):
        log.warning("%s does not sum reward.weights: it reports each source on its own (the reward model, the "
                    "checker where prompts have answers, and reward.function when set)", COMMAND.invocation)
    function = load_reward_function(cfg.reward.function) if cfg.reward.function else None
    if rm_path is not None and cfg.reward.type == "model":
        rm_dir = require_scalar_model_dir(rm_path, "reward model")
        check_same_tokenizer(tokenizer, rm_dir, "reward model")
        reward_model = load_scalar_model(rm_dir, cfg.precision, cfg.seed)
        rm_stats = read_reward_stats(rm_dir)  # (mean, std) of its held-out scores, stored by train-rm
    dev = engine.device()
    policy.to(dev).eval()
    reference.to(dev).eval()
    score_precision = engine.scoring_precision(cfg.precision, cfg.scoring_precision)  # KL and reward passes
    if reward_model is not None:
        reward_model.to(dev).eval()

    rows: list[dict[str, Any]] = []
    # one noise stream per prompt, shared by policy and reference (common random numbers): the same
    # samples whatever the world size, and identical responses wherever the two models agree
    seeds = [derive_seed(cfg.seed, j) for j in range(engine.rank(), len(prompts), engine.world_size())]
    cfg.rollout.engine, why = resolve_engine(cfg.rollout.engine, policy.config)  # eval.json records the one used
    if why != "as set" and engine.is_main():
        log.info("rollout.engine=auto samples with %s (%s)", cfg.rollout.engine, why)
    generator = make_generator(cfg.rollout.engine, EngineSettings(
        precision=cfg.precision, chunk=e.generation_batch_size, workdir=run_dir, kv_cache_gb=cfg.rollout.kv_cache_gb,
        max_model_len=cfg.data.max_prompt_length + e.max_new_tokens))
    eos = eos_ids(tokenizer, policy.generation_config)  # the policy's set ends both sides' responses
    sampling = Sampling(eos_ids=eos, pad_id=pad_id, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                        top_p=e.top_p)
    prompt_ids = [x["prompt_ids"] for x in mine]
    sampled = {}
    try:
        for who, lm in (("policy", policy), ("reference", reference)):  # one engine, the same seeds on both sides
            generator.update_weights(lm)
            sampled[who] = rollout_batch(prompt_ids, generator.generate(prompt_ids, seeds, sampling), pad_id)
    finally:
        generator.close()
    scores = {}
    if reward_model is not None:  # both sides in one pass: a prompt's two samples share its computation
        scores = side_by_side_rewards(reward_model, sampled["policy"][:3], sampled["reference"][:3], pad_id,
                                      e.batch_size, score_precision, cfg.data.packing, eos)
    for who in ("policy", "reference"):
        ids, am, P, has_eos = sampled[who]
        texts = tokenizer.batch_decode(ids[:, P:], skip_special_tokens=True)
        mask = am[:, P:].float()
        out: dict[str, Any] = {"text": texts, "length": mask.sum(1), "eos": has_eos.float(),
                               "tokens": [tuple(r[m.bool()].tolist()) for r, m in zip(ids[:, P:].cpu(), mask.cpu())]}
        if who in scores:
            out["score"] = scores[who]
        if all(x.get("answer") is not None for x in mine):
            out["correct"] = torch.tensor(check_answers(texts, [x["answer"] for x in mine]))
        if function is not None:
            out["function"] = call_on_every_rank({"function": (cfg.reward.function, function)}, texts,
                                                 mine)["function"]
        if who == "policy":  # KL(policy ‖ reference) on the policy's own samples, temperature-scaled
            kl = sequence_kl(policy, reference, ids, am, P, e.temperature, e.batch_size, score_precision, ("k1", "k3"),
                             packing=cfg.data.packing)
            out["kl_k1"], out["kl_k3"] = kl["k1"], kl["k3"]
        rows.append(out)
    pol, ref = ({k: v.cpu() if torch.is_tensor(v) else v for k, v in d.items()} for d in rows)
    gathered = engine.all_gather_object((pol, ref, [x.get("prompt_text", "") for x in mine]))
    pol = _merge([g[0] for g in gathered])
    ref = _merge([g[1] for g in gathered])
    prompt_texts = [t for g in gathered for t in g[2]]
    # one sequence, one score: a response both models sampled is a tie (`batched_rewards` scores it once)

    results: dict[str, Any] = {
        "mode": "policy", "policy": str(Path(policy_dir).resolve()), "reference": str(ref_path),
        "reward_model": str(rm_path) if rm_path else None, "prompts": len(prompt_texts),
        "temperature": e.temperature, "max_new_tokens": e.max_new_tokens, "seed": cfg.seed,
        **_small_sample(len(prompt_texts), "prompts"),
    }
    for name, t in (("policy", pol), ("reference", ref)):
        results[f"{name}/length_mean"] = float(t["length"].mean())
        results[f"{name}/eos_rate"] = float(t["eos"].mean())
        if "score" in t:
            results[f"{name}/score_mean"], results[f"{name}/score_ci95"] = mean_ci95(t["score"])
        if "correct" in t:
            (results[f"{name}/accuracy"], results[f"{name}/accuracy_ci95_low"],
             results[f"{name}/accuracy_ci95_high"]) = proportion_ci95(t["correct"].float())
        if "function" in t:
            results[f"{name}/function_mean"], results[f"{name}/function_ci95"] = mean_ci95(t["function"])
    # paired differences: policy and reference answer the same prompts with the same noise, so the
    # interval of the per-prompt difference leaves out the variance the two sides share (prompt difficulty)
    if "score" in pol:
        results["win_rate"] = win_rate(pol["score"], ref["score"])
        results["win_rate_ci95_low"], results["win_rate_ci95_high"] = wilson_ci95(results["win_rate"],
                                                                                  len(prompt_texts))
        results["score_gain"], results["score_gain_ci95"] = mean_ci95(pol["score"] - ref["score"])
        if rm_stats is not None and rm_stats[1] > 1e-6:  # the gain in units of the RM's held-out score std
            results["score_gain_rm_std"] = results["score_gain"] / rm_stats[1]
            results["score_gain_rm_std_ci95"] = results["score_gain_ci95"] / rm_stats[1]
    if "correct" in pol:
        gain = pol["correct"].float() - ref["correct"].float()
        results["accuracy_gain"], results["accuracy_gain_ci95"] = mean_ci95(gain)
    if "function" in pol:
        results["function_gain"], results["function_gain_ci95"] = mean_ci95(pol["function"] - ref["function"])
    results.update(reward_hacking(results))
    if results.get("reward_hacking", "none") != "none":
        log.warning("%s", results["headline"])
    results["kl_k1"], results["kl_k1_ci95"] = mean_ci95(pol["kl_k1"])
    results["kl_k3"], results["kl_k3_ci95"] = mean_ci95(pol["kl_k3"])

    samples = [[last_user_turn(prompt_texts[i])[-300:], pol["text"][i], _get(pol, "score", i),
                ref["text"][i], _get(ref, "score", i)] for i in range(min(e.num_samples, len(prompt_texts)))]
    keys = ["prompt", "policy", "policy_score", "reference", "reference_score"]
    results["samples"] = [dict(zip(keys, s)) for s in samples]
    if engine.is_main():
        if "score" in pol:
            atomic_write_json(run_dir / "rewards.json", {"policy": pol["score"].tolist(),
                                                         "reference": ref["score"].tolist()})
        lines = []
        for i, prompt in enumerate(prompt_texts):  # every prompt's pair, for the report and for the user
            line = {"prompt": last_user_turn(prompt), "policy": pol["text"][i], "reference": ref["text"][i]}
            for side, t in (("policy", pol), ("reference", ref)):
                line[f"{side}_length"] = int(t["length"][i])
                for key in ("score", "correct", "function"):
                    line[f"{side}_{key}"] = _get(t, key, i)
            lines.append(json.dumps(line) + "\n")
        atomic_write_text(run_dir / RESPONSES_FILE, "".join(lines))
    return results


def side_by_side_rewards(model: Any, policy: tuple[torch.Tensor, torch.Tensor, int],
                         reference: tuple[torch.Tensor, torch.Tensor, int], pad_id: int, batch_size: int,
                         precision: str, packing: bool, eos: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Reward-model scores {"policy": (N,), "reference": (N,)} float32 on the CPU of both models' samples of the
    same N prompts, a prompt's two samples in the same forward (`batched_rewards` over rows interleaved policy i,
    reference i, `batch_size` // 2 prompts, at least 1, per forward): packed (`data.packing`), a prompt and the
    first tokens its two samples share are computed once, and a sequence both models sampled is scored once (an
    exact tie).

    policy, reference: (input_ids (N, P+R), attention_mask (N, P+R), P) as `rollout_batch` returns them, the
    same prompts in the same order (R may differ: the narrower side is right-padded). `eos`: the EOS set, a
    response's closing id read as its first (`batched_rewards`)."""
    (a_ids, a_am, P), (b_ids, b_am, Pb) = policy, reference
    if P != Pb or a_ids.shape[0] != b_ids.shape[0]:
        raise ValueError(f"side_by_side_rewards: prompts differ ({a_ids.shape[0]} rows, P={P} against "
                         f"{b_ids.shape[0]} rows, P={Pb})")
    width = max(a_ids.shape[1], b_ids.shape[1])
    widen = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
    ids = torch.stack([widen(a_ids, pad_id), widen(b_ids, pad_id)], 1).flatten(0, 1)
    am = torch.stack([widen(a_am, 0), widen(b_am, 0)], 1).flatten(0, 1)
    k = 2 * max(batch_size // 2, 1)  # rows of whole prompts per forward
    scores = torch.cat([batched_rewards(model, ids[i:i + k], am[i:i + k], k, precision, P, packing, eos).cpu()
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
    return float(d[key][i]) if key in d else None


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        out[k] = torch.cat([v.cpu() for v in vals]) if torch.is_tensor(vals[0]) else [x for v in vals for x in v]
    return out


# ----------------------------------------------------------------------------------------------
# entry point


def default_models(cfg: Any) -> tuple[str | None, str | None]:
    """(policy path, reward-model path) to evaluate: `policy.path` and `reward_model.path` as set; with neither
    set, the newest model a pointer names (`commands.Command.defaults`: `latest_policy`, else `latest_rm`).
    Raises ConfigError when there is nothing to evaluate."""
    chosen = {"policy.path": cfg.policy.path, "reward_model.path": cfg.reward_model.path}
    if all(v is None for v in chosen.values()):
        for key, kind in COMMAND.defaults:
            target = read_pointer(cfg.paths.root, kind)
            if target is not None:
                chosen[key] = str(target)
                break
        else:
            keys = ", ".join(f"{key}=..." for key, _ in COMMAND.defaults)
            pointers = " / ".join(str(by_kind(kind).pointer) for _, kind in COMMAND.defaults)
            raise ConfigError(f"nothing to evaluate: set {keys} or run_dir=... (no {pointers} under {cfg.paths.root})")
    return chosen["policy.path"], chosen["reward_model.path"]


def run(cfg: Any, run_dir: Path) -> float | None:
    engine.init_distributed()
    if cfg.run_dir:  # report of a past run: nothing to train or load
        error = None
        if engine.is_main():  # one process writes the page (every rank would race over the same files)
            try:
                path = build_report(cfg.run_dir)
                if is_eval_dir(cfg.run_dir):  # an eval's page, rebuilt: its verdict
                    console.print(" ".join(eval_headline(cfg.run_dir)), soft_wrap=True, highlight=False)
                else:
                    columns, rows = summary_table(cfg.run_dir)
                    print_summary(console, columns, rows, title=f"run summary: {cfg.run_dir}")
                console.print(f"report: {path}")
            except (UnreadableFile, FileNotFoundError) as e:  # no run there, or a file of it unparsable: named in e
                error = f"run_dir={cfg.run_dir}: {e}"
        error = engine.broadcast_object(error)  # every rank stops alike, none waits for a rank that failed
        if error is not None:
            raise ConfigError(error)
        _discard_empty_run_dir(run_dir)
        return None
    run_dir = prepare_run_dir(cfg, run_dir)
    seed_everything(cfg.seed)
    if lora_enabled(cfg.model.lora) and engine.is_main():
        log.warning("model.lora.r=%d has no effect in `%s`: a LoRA run's final/ holds merged plain weights, "
                    "evaluated as they are", cfg.model.lora.r, COMMAND.invocation)
    policy_path, rm_path = default_models(cfg)
    # the data the evaluated model was trained on (its held-out split), unless this command chose other data
    cfg.data, data_note = lineage.eval_data(cfg.data, policy_path or rm_path, command_line_keys())
    if data_note and engine.is_main():
        write_config(cfg, run_dir)  # the data this eval reads, as run
        console.print(data_note, soft_wrap=True, highlight=False)
    if cfg.dry_run:
        sampler = {} if policy_path is None else {"sampling engine": describe_engine(
            cfg.rollout.engine, AutoConfig.from_pretrained(resolve_hf_dir(str(policy_path))))}
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
        atomic_write_json(run_dir / "eval.json",
                          {"results": results, "config": OmegaConf.to_container(cfg, resolve=True)})
        sampler = {"sampling engine": cfg.rollout.engine} if results["mode"] == "policy" else {}
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
        console.print(f"eval.json: {run_dir / 'eval.json'}\nreport: {report}")
    engine.barrier()
    return headline


def _discard_empty_run_dir(run_dir: Path) -> None:
    """A report-only eval writes nothing of its own: drop the dir Hydra made for it."""
    if engine.is_main() and run_dir.is_dir() and not (run_dir / "config.yaml").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
