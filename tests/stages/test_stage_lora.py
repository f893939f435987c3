"""LoRA in every stage (`model.lora.r` > 0) on the tiny model: a LoRA reward model's merged `final/` scores as the
run did and feeds PPO; in LoRA PPO the reference is the base model before and after an update; only adapters and
heads get optimizer state; resume reproduces the uninterrupted run; bf16 runs."""

import json

import pytest
import torch
from stage_helpers import compose
from test_stage_ppo import RUN, build_trainer, load_safetensors

from rlhf_cli.data import load_preference_data
from rlhf_cli.forwards import FrozenWithoutAdapters, policy_forward, score_pairs
from rlhf_cli.models import ADAPTER_DIR, load_causal_lm, load_scalar_model, load_tokenizer
from rlhf_cli.runs import read_metrics, set_status

LORA = ["model.lora.r=4", "model.lora.alpha=8"]
RM_RUN = [*LORA, "rm.batch_size=8", "rm.micro_batch_size=4", "rm.max_steps=3", "rm.lr=5e-3",
          "data.builtin.rm_train=32", "data.builtin.rm_eval=8"]


def optimizer_params(eng):
    """Names of the parameters a TrainEngine's optimizer holds."""
    held = {id(p) for group in eng.optimizer.param_groups for p in group["params"]}
    return {n for n, p in eng.module.named_parameters() if id(p) in held}


def is_adapter_or_head(name):
    return "lora_A" in name or "lora_B" in name or name.startswith("score") or ".score." in name


@pytest.fixture(scope="module")
def lora_rm(tmp_path_factory):
    """A LoRA reward model trained for 3 steps: (run_dir, cfg)."""
    from rlhf_cli.stages import rm

    root = tmp_path_factory.mktemp("lora_rm")
    cfg = compose("train_rm", ["model=tiny", "precision=fp32", f"paths.root={root}", *RM_RUN])
    rm.run(cfg, root / "rm" / "run")
    return root / "rm" / "run", cfg


def test_lora_reward_model_final_reloads_as_a_plain_model_with_the_runs_scores(lora_rm):
    from transformers import AutoModelForSequenceClassification

    run_dir, cfg = lora_rm
    final = run_dir / "final"
    loaded = AutoModelForSequenceClassification.from_pretrained(final).eval()
    assert not any("lora" in k or "modules_to_save" in k for k in loaded.state_dict())
    tokenizer = load_tokenizer(cfg.model)
    heldout = load_preference_data(cfg.data, tokenizer).eval
    chosen, rejected = score_pairs(loaded, heldout, tokenizer.pad_token_id, 8, "fp32", packing=False)
    want = json.loads((run_dir / "rewards.json").read_text())  # the live LoRA model's scores (packed)
    torch.testing.assert_close(chosen, torch.tensor(want["chosen"]), rtol=0, atol=1e-5)
    torch.testing.assert_close(rejected, torch.tensor(want["rejected"]), rtol=0, atol=1e-5)
    # the run trained the head and the adapters: the merged weights differ from the base model's
    base = load_scalar_model(cfg.model, "fp32", cfg.seed).state_dict()
    merged = loaded.state_dict()
    assert not torch.equal(merged["score.weight"], base["score.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted
    adapter = json.loads((final / ADAPTER_DIR / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and adapter["modules_to_save"] == ["score"]


def test_lora_checkpoints_leave_out_the_frozen_base_weights(lora_rm):
    run_dir, _ = lora_rm
    ckpt = sum(f.stat().st_size for f in (run_dir / "ds").rglob("*") if f.is_file())
    weights = (run_dir / "final" / "model.safetensors").stat().st_size
    assert ckpt < weights / 4, (ckpt, weights)  # adapters, head and their Adam moments only


def test_lora_reward_model_feeds_ppo(lora_rm, run_stage):
    run_dir, _ = lora_rm
    _, ppo_dir, _ = run_stage("train_ppo", [*RUN, "reward.type=model", f"reward_model.path={run_dir}",
                                            "ppo.iterations=1"])
    record = read_metrics(ppo_dir)[-1]
    assert record["step"] == 1 and record["objective/scores"] == record["objective/scores"]  # not NaN


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_reference_is_the_base_model_before_and_after_an_update(tmp_path, critic):
    tr = build_trainer(tmp_path, [*LORA, "ppo.actor_lr=1e-2", "ppo.critic_lr=1e-2", f"ppo.critic={critic}"])
    assert isinstance(tr.reference, FrozenWithoutAdapters)
    base = load_causal_lm(tr.cfg.model, "fp32", tr.cfg.seed, tokenizer=tr.tokenizer).eval()
    P = None
    for it in range(2):
        exp, _, _ = tr.maker.make_experience(it)
        P = exp.prompt_len
        want, _, _ = policy_forward(base, exp.input_ids, exp.attention_mask, P, tr.p.temperature)
        mask = exp.attention_mask[:, P:].bool()
        torch.testing.assert_close(exp.ref_logprobs[mask], want[mask], rtol=0, atol=1e-6)
        tr.train_on(exp, it)
    policy, _, _ = policy_forward(tr.actor.module, exp.input_ids, exp.attention_mask, P, tr.p.temperature)
    assert (policy - want)[mask].abs().max() > 1e-4  # the adapters moved the policy, not the reference

    for eng in (tr.actor, tr.critic):
        if eng is None:
            continue
        held = optimizer_params(eng)
        trainable = {n for n, p in eng.module.named_parameters() if p.requires_grad}
        assert held == trainable and all(is_adapter_or_head(n) for n in held), sorted(held - trainable)
    assert (tr.critic is None) == (critic == "shared")


def test_resume_reproduces_the_uninterrupted_lora_run(run_stage):
    overrides = [*RUN, *LORA, "ppo.iterations=2", "ppo.save_every=1", "ppo.actor_lr=1e-2", "ppo.critic_lr=1e-2"]
    _, run_dir, _ = run_stage("train_ppo", overrides)
    uninterrupted = read_metrics(run_dir)
    files = ("model.safetensors", f"{ADAPTER_DIR}/adapter_model.safetensors",
             "critic/model.safetensors", f"critic/{ADAPTER_DIR}/adapter_model.safetensors")
    final_weights = {name: load_safetensors(run_dir / "final" / name) for name in files}

    # the checkpoints hold adapters, heads and their optimizer state: not the frozen base, nor the embedding
    # matrix tied to the LM head (DeepSpeed names a tied tensor once)
    ckpt = sum(f.stat().st_size for f in (run_dir / "ds" / "step-1").rglob("*") if f.is_file())
    assert ckpt < (run_dir / "final" / "model.safetensors").stat().st_size / 4, ckpt

    (run_dir / "ds" / "latest").write_text("step-1\n")
    set_status(run_dir, "running")
    run_stage("train_ppo", [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2]
    assert abs(uninterrupted[1]["objective/kl"]) > 1e-5  # iteration 1 moved the policy
    for k in ("objective/scores", "objective/kl", "policy/loss", "policy/approx_kl", "val/loss"):
        assert resumed[1][k] == pytest.approx(uninterrupted[1][k], rel=1e-5, abs=1e-7), k
    for name, weights in final_weights.items():
        got = load_safetensors(run_dir / "final" / name)
        assert got.keys() == weights.keys()
        for k, v in got.items():
            torch.testing.assert_close(v, weights[k], rtol=0, atol=1e-6, msg=lambda m, n=name, k=k: f"{n}/{k}: {m}")


@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_lora_trains_under_bf16(run_stage, precision):
    from transformers import AutoModelForCausalLM

    _, run_dir, cfg = run_stage("train_ppo", [*RUN, *LORA, "ppo.iterations=1", "ppo.actor_lr=1e-2",
                                              f"precision={precision}"])
    record = read_metrics(run_dir)[-1]
    assert record["policy/loss"] == record["policy/loss"]  # finite
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    base = load_causal_lm(cfg.model, cfg.precision, cfg.seed).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert trained[q].dtype == base[q].dtype
    assert not torch.equal(trained[q], base[q])  # the update survived the merge and the cast


def test_resume_onto_other_base_weights_is_refused(tmp_path):
    """A LoRA checkpoint leaves the frozen base out; resuming it onto other base weights (the model path now
    names another model) stops with one line instead of merging the adapters onto the wrong base."""
    from rlhf_cli.config import ConfigError

    tr = build_trainer(tmp_path / "a", LORA)
    tr.actor.save(str(tmp_path / "ds"), "step-1", {"step": 1})
    assert tr.actor.load(str(tmp_path / "ds"), "step-1")["step"] == 1  # the same base: fine
    other = build_trainer(tmp_path / "b", [*LORA, "seed=1"])  # the tiny model's weights come from the seed
    with pytest.raises(ConfigError, match="frozen base weights this run rebuilt differ") as e:
        other.actor.load(str(tmp_path / "ds"), "step-1")
    assert "\n" not in str(e.value)


def test_lora_settings_are_checked_in_one_line(tmp_path):
    from rlhf_cli.config import ConfigError
    from rlhf_cli.preflight import VALIDATORS

    for bad, words in (("model.lora.r=-1", "model.lora.r must be >= 0"),
                       ("model.lora.dropout=1.5", "model.lora.dropout"),
                       ("model.lora.target_modules=[]", "model.lora.target_modules")):
        cfg = compose("train_ppo", ["model=tiny", bad])
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            VALIDATORS["train_ppo"](cfg)
    with pytest.raises(ConfigError, match="matches no module of the policy"):
        build_trainer(tmp_path, ["model.lora.r=4", "model.lora.target_modules=[nope]"])


def test_a_lora_critic_grown_from_the_reward_model_holds_its_weights_once(lora_rm, tmp_path):
    """`ppo.critic_init=reward_model` with LoRA: the critic's adapters go on the reward model's own weights, and the
    reward model is that critic with its adapters off (its head the original peft keeps): the same scores as the
    reward model loaded on its own, before and after the critic's updates."""
    from rlhf_cli.forwards import batched_scores
    from rlhf_cli.models import sequence_scores, token_values

    run_dir, _ = lora_rm
    tr = build_trainer(tmp_path, [*LORA, "reward.type=model", f"reward_model.path={run_dir}", "ppo.critic=separate",
                                  "ppo.critic_init=reward_model", "ppo.critic_lr=1e-2"])
    assert isinstance(tr.reward_model, FrozenWithoutAdapters)
    critic_weights = {p.data_ptr() for p in tr.critic.module.parameters()}
    assert all(p.data_ptr() in critic_weights for p in tr.reward_model.module.parameters())  # one copy
    rm = load_scalar_model(str(run_dir / "final"), "fp32", tr.cfg.seed).eval()
    for it in range(2):
        exp, _, _ = tr.maker.make_experience(it)
        ids, am, P = exp.input_ids, exp.attention_mask, exp.prompt_len
        with torch.no_grad():
            want = sequence_scores(rm, ids, am)
        got = batched_scores(tr.reward_model.module, ids, am, 4, "fp32", P, False)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        tr.train_on(exp, it)
    with torch.no_grad():  # the critic itself moved: its adapters and its head's trained copy
        moved = (token_values(tr.critic.module, ids, am) - token_values(rm, ids, am))[am.bool()].abs().max()
    assert moved > 1e-4
    held = optimizer_params(tr.critic)
    assert held and all(is_adapter_or_head(n) for n in held)
    assert tr.critic_base == str((run_dir / "final").resolve()) or tr.critic_base.endswith("final")


def test_the_critic_takes_gradient_checkpointing_and_zero3_keeps_a_separate_reward_model(lora_rm, tmp_path):
    """A critic loaded from the reward model's path takes `model.gradient_checkpointing`; under ZeRO-3 the reward
    model stays its own frozen copy (a view's forwards would gather the partitioned critic collectively, and
    reward scoring runs a number of forwards that differs between ranks)."""
    from rlhf_cli import engine

    run_dir, _ = lora_rm
    common = [*LORA, "reward.type=model", f"reward_model.path={run_dir}", "ppo.critic=separate",
              "ppo.critic_init=reward_model", "model.gradient_checkpointing=true"]
    tr = build_trainer(tmp_path / "z0", common)
    assert isinstance(tr.reward_model, FrozenWithoutAdapters)
    assert tr.critic.module.is_gradient_checkpointing and tr.actor.module.is_gradient_checkpointing
    tr = build_trainer(tmp_path / "z3", [*common, "deepspeed=zero3"])
    assert isinstance(tr.reward_model, engine.FrozenModel)
