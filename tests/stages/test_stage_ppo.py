"""`rlhf train-ppo` on the tiny random model in fp32 (and bf16-autocast), CPU, seconds per test.

What issue 6 asks these tests to prove: one iteration changes policy and critic weights; the ratio
of the first minibatch is 1 (old logprobs come from the training forward at the sampling
temperature); garbage in padded positions changes no loss; with c1 = c2 = β = 0 the policy gradient
of `train_on` equals a hand-built clipped surrogate; the missing-EOS penalty hits only unterminated
responses; resume reproduces the next iteration; `whiten_across_ranks` equals `masked_whiten` on one
rank; a checker run with a shared critic trains its value head.

Most tests build a `PPOTrainer` directly (about a second each) and call `maker.make_experience` /
`train_on`; resume and the shared-critic run go through `run_stage` like the CLI does.
"""

import copy
import shutil

import pytest
import torch
from stage_helpers import compose

from rlhf_cli import engine, models, rollout
from rlhf_cli.config import ConfigError
from rlhf_cli.core import compute_gae, entropy_bonus, kl_penalized_rewards, masked_whiten, policy_loss, value_loss
from rlhf_cli.forwards import critic_values, policy_forward
from rlhf_cli.lifecycle import seed_everything
from rlhf_cli.preflight import VALIDATORS, resolve_reward_model
from rlhf_cli.rollout import Experience, response_mask, whiten_across_ranks
from rlhf_cli.runs import read_metrics, set_status
from rlhf_cli.seeds import derive_seed
from rlhf_cli.stages.ppo import PPOTrainer

# 8 rollouts, minibatches of 4, micro-batches of 2 (two accumulation steps per optimizer step),
# 6 new tokens, a sampling temperature != 1 so a missing `/ T` anywhere shows up.
TINY_PPO = [
    "model=tiny", "precision=fp32", "reward.type=checker",
    "ppo.rollout_batch_size=8", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
    "ppo.max_new_tokens=6", "ppo.temperature=0.7", "ppo.iterations=1", "ppo.epochs=1",
]


def build_trainer(tmp_path, overrides=()):
    """A PPOTrainer with data and models built, as `ppo.run` builds it before its loop."""
    cfg = compose("train_ppo", [*TINY_PPO, f"paths.root={tmp_path / 'runs'}", *overrides])
    VALIDATORS["train_ppo"](cfg)
    engine.init_distributed()
    seed_everything(cfg.seed)
    tr = PPOTrainer(cfg, tmp_path / "run")
    tr.load_data()
    tr.build_models()
    tr.bad_steps = 0
    return tr


def edit_generate(monkeypatch, tr, edit):
    """Pass every `generate` output's response columns (B, max_new_tokens) through `edit` (in place).

    The rest of the sampling (`HFGenerator.generate` and `rollout_batch`: cut at the first EOS, pad after, drop
    all-pad columns) runs as is.
    """
    lm = models.lm_of(tr.actor.module)
    generate = lm.generate

    def edited_generate(*args, **kwargs):
        out = generate(*args, **kwargs).clone()
        edit(out[:, kwargs["input_ids"].shape[1]:])
        return out

    monkeypatch.setattr(lm, "generate", edited_generate)


def force_eos(monkeypatch, tr, eos_at):
    """Make the policy emit EOS at response position `eos_at[row]` (rows of the rollout)."""
    def edit(responses):
        for row, pos in eos_at.items():
            responses[row, pos] = tr.maker.eos_ids[0]

    edit_generate(monkeypatch, tr, edit)


def spy_losses(monkeypatch, tr):
    """Record (logprobs, old_logprobs, loss_mask, stats) of every micro-batch `train_on` computes losses for
    (the `PPOTrainer.losses` seam)."""
    calls = []
    real = tr.losses

    def spy(b, num_tokens, num_seqs=None):
        out = real(b, num_tokens, num_seqs)
        calls.append((out.logprobs.clone(), b.old_logprobs.clone(), b.loss_mask.clone(), out.stats))
        return out

    monkeypatch.setattr(tr, "losses", spy)
    return calls


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before, module):
    after = module.state_dict()
    return sorted(k for k in before if not torch.equal(before[k], after[k]))


# ----------------------------------------------------------------------------------------------
# one iteration


def test_one_iteration_changes_policy_and_critic_weights(tmp_path, monkeypatch):
    tr = build_trainer(tmp_path, ["ppo.actor_lr=1e-4", "ppo.critic_lr=1e-4"])
    force_eos(monkeypatch, tr, {1: 2, 6: 4})
    policy0, critic0, ref0 = snapshot(tr.actor.module), snapshot(tr.critic.module), snapshot(tr.reference.module)

    exp, roll_stats, _ = tr.maker.make_experience(0)
    roll_stats.update(rollout.kl_stats(exp, tr.kl_ctl.value))
    B, R = exp.loss_mask.shape
    assert (B, exp.input_ids.shape[1]) == (8, exp.prompt_len + R) and R == 6
    assert exp.loss_mask[1].tolist() == [1, 1, 1, 0, 0, 0] and exp.loss_mask[6].tolist() == [1, 1, 1, 1, 1, 0]
    assert roll_stats["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before training
    assert roll_stats["response/eos_frac"] == pytest.approx(2 / 8)
    stats = tr.train_on(exp, 0)

    assert tr.actor.global_steps == 2 and tr.critic.global_steps == 2  # 8 rollouts / minibatches of 4
    for k in ("policy/loss", "val/loss", "policy/entropy", "policy/grad_norm"):
        assert torch.isfinite(torch.tensor(stats[k])), k
    assert torch.isfinite(torch.tensor(roll_stats["val/explained_var"]))
    assert stats["policy/grad_norm"] > 0
    policy_changed = changed(policy0, tr.actor.module)
    assert "lm_head.weight" in policy_changed and any(".layers.0." in k for k in policy_changed)
    critic_changed = changed(critic0, tr.critic.module)
    assert "score.weight" in critic_changed and any(".layers.0." in k for k in critic_changed)
    assert changed(ref0, tr.reference.module) == []  # the reference is frozen
    assert tr.bad_steps == 0


# ----------------------------------------------------------------------------------------------
# old logprobs == the training forward's logprobs


@pytest.mark.parametrize("precision,logprobs", [("fp32", "fp32"), ("bf16-autocast", "fp32"),
                                                ("bf16-autocast", "same"), ("bf16", "fp32")])
def test_first_minibatch_ratio_is_exactly_one(tmp_path, monkeypatch, precision, logprobs):
    """Old logprobs come from the same code path as the training forward: distribution, padding, position
    ids and precision, so the ratio of the first minibatch is exactly 1 in every precision.

    Rows of different lengths (two end early) put padding into the micro-batches; the temperature is
    0.7, so old logprobs at T = 1 (or a generate-time log-softmax without / T) would fail this.
    """
    tr = build_trainer(tmp_path, [f"precision={precision}", f"scoring_precision={logprobs}", "ppo.epochs=2"])
    tr.carry = 0  # else the first micro-batch's old log-probs are its training forward's own
    force_eos(monkeypatch, tr, {0: 1, 5: 3})
    exp, _, _ = tr.maker.make_experience(0)
    assert exp.loss_mask.sum(1).tolist().count(6.0) == 6
    calls = spy_losses(monkeypatch, tr)
    tr.train_on(exp, 0)
    assert len(calls) == 8  # 2 epochs x 2 minibatches x 2 micro-batches

    for lp, old, mask, stats in calls[:2]:  # the first minibatch: no optimizer step yet
        m = mask.bool()
        if lp.device.type == "cpu":
            assert torch.equal(lp[m], old[m]), (lp - old)[m].abs().max()
            assert stats["policy/clipfrac"] == 0.0 and stats["policy/approx_kl"] == 0.0
        else:  # GPU kernels may differ between the no-grad and the grad pass (benchmarks/gpu_check reports it)
            assert (lp - old)[m].abs().max() < 1e-5
    # after a step the ratio moves, so the check above is not vacuous
    assert any((torch.exp(lp - old)[mask.bool()] - 1).abs().max() > 0 for lp, old, mask, _ in calls[2:])


@pytest.mark.parametrize("precision,scoring,want", [("bf16-autocast", "fp32", "fp32"),
                                                    ("bf16-autocast", "same", "bf16-autocast"),
                                                    ("fp32", "fp32", "fp32")])
def test_each_model_runs_in_its_precision(tmp_path, precision, scoring, want):
    """Policy (old logprobs and training forward), reference and reward model in the scoring precision; a
    separate critic and sampling in `precision`."""
    from rlhf_cli.models import load_scalar_model, load_tokenizer, save_hf

    cfg = compose("train_ppo", TINY_PPO)
    rm_dir = tmp_path / "rm"
    save_hf(load_scalar_model(cfg.model, "fp32", 1), load_tokenizer(cfg.model), rm_dir)
    tr = build_trainer(tmp_path, [f"precision={precision}", f"scoring_precision={scoring}", "reward.type=model",
                                  f"reward_model.path={rm_dir}"])
    assert tr.score_precision == want
    assert tr.actor.precision == tr.reference.precision == tr.reward_model.precision == want
    assert tr.critic.precision == tr.precision == precision


def fp32_kl(tr, exp):
    """(B,) k1 KL, nats per sequence, of the trainer's policy vs reference on `exp`'s tokens, computed in fp32."""
    with torch.no_grad():
        lp, _, _ = policy_forward(tr.actor.module, exp.input_ids, exp.attention_mask, exp.prompt_len, tr.p.temperature)
        ref, _, _ = policy_forward(tr.reference.module, exp.input_ids, exp.attention_mask, exp.prompt_len,
                                   tr.p.temperature)
    return ((lp - ref) * exp.attention_mask[:, exp.prompt_len:].float()).sum(1)


@pytest.mark.parametrize("logprobs", ["fp32", "same"])
def test_kl_after_one_small_step_is_the_fp32_kl_of_the_same_weights(tmp_path, logprobs):
    """bf16-autocast: after one optimizer step at lr 1e-6 the reported KL is the fp32 KL of the same weights
    and samples (default `scoring_precision=fp32`). With `same` the bf16 log-probs carry the rounding of the
    moved weights, and `objective/kl_fp32` beside `objective/kl_check` shows by how much."""
    tr = build_trainer(tmp_path, ["precision=bf16-autocast", f"scoring_precision={logprobs}", "ppo.actor_lr=1e-6",
                                  "ppo.mini_batch_size=8", "ppo.max_grad_norm=0", "ppo.max_new_tokens=16",
                                  "ppo.kl_check_rows=8"])
    exp, before, _ = tr.maker.make_experience(0)
    before.update(rollout.kl_stats(exp, tr.kl_ctl.value))
    assert before["objective/kl"] == 0.0  # policy == reference, computed alike
    tr.train_on(exp, 0)
    assert tr.actor.global_steps == 1
    exp, stats, _ = tr.maker.make_experience(1)
    stats.update(rollout.kl_stats(exp, tr.kl_ctl.value))
    want = fp32_kl(tr, exp).mean().item()
    assert want != 0.0  # the step moved the policy
    if logprobs == "fp32":
        assert stats["objective/kl"] == pytest.approx(want, abs=1e-6)
        assert "objective/kl_fp32" not in stats  # nothing to check: the reported KL is fp32
    else:
        assert stats["objective/kl_fp32"] == pytest.approx(want, abs=1e-6)  # kl_check_rows = every row
        assert stats["objective/kl_check"] == pytest.approx(stats["objective/kl"], abs=1e-6)
        assert abs(stats["objective/kl"] - want) > 1e-4  # the noise floor the check exists to show


def test_old_logprobs_use_the_sampling_temperature(tmp_path):
    """exp.old_logprobs equal a plain log_softmax(logits / T) of the full model forward on the rollout."""
    tr = build_trainer(tmp_path)
    exp, _, _ = tr.maker.make_experience(0)
    P, T = exp.prompt_len, tr.p.temperature
    lm = models.lm_of(tr.actor.module)
    with torch.no_grad():
        pos = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = lm(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=pos).logits
        lp = torch.log_softmax(logits[:, P - 1:-1].float() / T, -1).gather(-1, exp.input_ids[:, P:, None]).squeeze(-1)
    m = exp.loss_mask.bool()
    torch.testing.assert_close(exp.old_logprobs[m], lp[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(exp.ref_logprobs[m], lp[m], rtol=0, atol=1e-5)  # reference == initial policy


def test_offload_reference_reaches_the_frozen_models(tmp_path):
    """ppo.offload_reference is wired to the reference and reward model (a no-op on a CPU-only machine)."""
    tr = build_trainer(tmp_path, ["ppo.offload_reference=true"])
    assert tr.reference.offload is False  # CPU: nothing to offload to
    with tr.reference.on_device() as m:
        assert m is tr.reference.module
    exp, stats, _ = tr.maker.make_experience(0)
    stats.update(rollout.kl_stats(exp, tr.kl_ctl.value))
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# per-prompt sampling


def test_per_row_sampler_draws_from_softmax_over_temperature_after_top_p():
    """Gumbel-max with per-row streams: frequencies match softmax(logits / T); top-p-filtered tokens never drawn."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n, T = 20000, 0.7
    scores = TemperatureLogitsWarper(T)(None, logits.repeat(n, 1))
    draws = rollout.PerRowSampler(range(n))(None, scores).argmax(-1)
    freq = torch.bincount(draws, minlength=6).float() / n
    want = torch.softmax(logits[0] / T, -1)
    assert (freq - want).abs().max() < 4 * (want * (1 - want) / n).sqrt().max()  # 4 standard errors
    kept = TopPLogitsWarper(0.8)(None, scores)
    draws = rollout.PerRowSampler(range(n))(None, kept).argmax(-1)
    assert set(draws.tolist()) == set(torch.nonzero(torch.isfinite(kept[0])).flatten().tolist())


def test_a_prompts_sample_depends_on_its_seed_not_on_its_batch(tmp_path):
    """The same (prompt, seed) gives the same response alone, in another order, or in another chunk size."""
    tr = build_trainer(tmp_path, ["ppo.max_new_tokens=10"])
    lm = models.lm_of(tr.actor.module)
    prompts = tr.prompts[:6]
    seeds = [derive_seed(42, 0, k) for k in range(6)]

    def sample(rows, chunk):
        ids, am, P, _ = rollout.sample_responses(lm, [prompts[i] for i in rows], tr.maker.pad_id, tr.maker.eos_ids,
                                                 10, 0.7, 1.0, "fp32", chunk=chunk, seeds=[seeds[i] for i in rows])
        return {i: ids[j, P:][am[j, P:].bool()].tolist() for j, i in enumerate(rows)}

    full = sample(range(6), chunk=6)
    assert sample([4, 1, 5], chunk=2) == {i: full[i] for i in (4, 1, 5)}
    assert sample([3], chunk=1) == {3: full[3]}
    assert len({tuple(r) for r in full.values()}) > 1  # different seeds, different samples
    ids, am, P, _ = rollout.sample_responses(lm, prompts, tr.maker.pad_id, tr.maker.eos_ids, 10, 0.7, 1.0, "fp32",
                                             chunk=6, seeds=[s + 1 for s in seeds])
    assert {i: ids[i, P:][am[i, P:].bool()].tolist() for i in range(6)} != full  # the seed decides


def test_derived_seeds_do_not_collide():
    keys = ([(s, i, k) for s in (0, 42) for i in range(20) for k in range(32)]
            + [(s, j) for s in (0, 42) for j in range(640)])
    seeds = {derive_seed(*k) for k in keys}
    assert len(seeds) == len(keys)
    assert (derive_seed(7, 3) != derive_seed(7, 3, 0)
            and derive_seed(2**32, 5) != derive_seed(0, 1, 5))
    assert all(0 <= s < 2**63 for s in seeds)


def test_the_models_own_generation_config_does_not_change_the_samples(tmp_path):
    """A checkpoint's generation_config (repetition penalty, suppressed tokens, beams) must not leak into PPO
    sampling."""
    tr = build_trainer(tmp_path, ["ppo.max_new_tokens=10"])
    lm = models.lm_of(tr.actor.module)
    prompts, seeds = tr.prompts[:4], [derive_seed(1, k) for k in range(4)]

    def sample():
        ids, am, P, _ = rollout.sample_responses(lm, prompts, tr.maker.pad_id, tr.maker.eos_ids, 10, 0.7, 1.0, "fp32",
                                                 seeds=seeds)
        return ids[:, P:].tolist()

    plain = sample()
    lm.generation_config.repetition_penalty = 5.0
    lm.generation_config.suppress_tokens = sorted({t for row in plain for t in row})[:20]
    lm.generation_config.num_beams = 2
    assert sample() == plain
    assert lm.generation_config.repetition_penalty == 5.0  # the model's config is restored afterwards


# ----------------------------------------------------------------------------------------------
# padding


def minibatch_losses(tr, exp, rows):
    """The policy, value and entropy losses of one minibatch, computed the way `train_on` does."""
    p = tr.p
    P, T = exp.prompt_len, p.temperature
    num_tokens = exp.loss_mask[rows].sum().item()
    agg = dict(num_tokens=num_tokens, num_seqs=float(len(rows)), aggregation=p.aggregation)
    out = {"pg": 0.0, "vf": 0.0, "ent": 0.0}
    for m in range(0, len(rows), p.micro_batch_size):
        b = exp.rows(rows[m:m + p.micro_batch_size])
        with torch.no_grad():
            lp, ent, _ = policy_forward(tr.actor.module, b.input_ids, b.attention_mask, P, T, with_entropy=True)
            v = critic_values(tr.critic.module, b.input_ids, b.attention_mask, P)
        out["pg"] += policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, p.clip, **agg)[0].item()
        out["vf"] += value_loss(v, b.values, b.returns, b.loss_mask, p.value_clip, **agg)[0].item()
        out["ent"] += entropy_bonus(None, b.loss_mask, entropy=ent, **agg)[0].item()
    return out


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_garbage_in_padded_positions_changes_no_loss(tmp_path, monkeypatch, aggregation):
    tr = build_trainer(tmp_path, [f"ppo.aggregation={aggregation}"])
    force_eos(monkeypatch, tr, {0: 0, 1: 2, 2: 4, 5: 1})
    exp, _, _ = tr.maker.make_experience(0)
    pad = exp.loss_mask == 0
    assert pad.any() and (exp.attention_mask == 0).any()

    g = torch.Generator().manual_seed(0)
    fills = {"old_logprobs": 1e6, "ref_logprobs": -float("inf"), "values": float("nan"), "advantages": float("inf"),
             "returns": -1e6, "rewards": float("nan")}
    # the tensors, dirtied below (minibatch_losses runs the plain layout, where padding would show)
    dirty = Experience(**{f: getattr(exp, f).clone() for f in exp.__dataclass_fields__
                         if f not in ("layouts", "forwards", "plan") and getattr(exp, f) is not None})
    for name, value in fills.items():
        getattr(dirty, name)[pad] = value
    noise = torch.randint(3, len(tr.tokenizer), exp.input_ids.shape, generator=g)
    dirty.input_ids = torch.where(exp.attention_mask.bool(), exp.input_ids, noise)  # prompt and response padding

    rows = torch.tensor([0, 1, 2, 3])  # three padded rows and a full one
    clean, garbage = minibatch_losses(tr, exp, rows), minibatch_losses(tr, dirty, rows)
    assert all(torch.isfinite(torch.tensor(v)) for v in clean.values())
    assert garbage == pytest.approx(clean, rel=1e-6, abs=1e-7)
    assert clean["pg"] != 0.0 and clean["vf"] != 0.0

    # and the rollout's own shaping ignores padding too
    rewards = kl_penalized_rewards(exp.scores, dirty.old_logprobs, dirty.ref_logprobs, exp.loss_mask, 0.05)
    torch.testing.assert_close(rewards, exp.rewards)
    adv, ret = compute_gae(dirty.rewards, dirty.values, exp.loss_mask, tr.p.gamma, tr.p.lam)
    adv_clean, ret_clean = compute_gae(exp.rewards, exp.values, exp.loss_mask, tr.p.gamma, tr.p.lam)
    torch.testing.assert_close((adv, ret), (adv_clean, ret_clean))


# ----------------------------------------------------------------------------------------------
# the policy gradient


def hand_built_policy_grads(lm, exp, rows, temperature, clip):
    """∇ of −Σ_real min(r·A, clip(r, 1−ε, 1+ε)·A) / num_real_tokens over `rows`, in plain torch."""
    lm.zero_grad(set_to_none=True)
    b = exp.rows(rows)
    P = exp.prompt_len
    position_ids = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = lm(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=position_ids).logits
    logits = logits[:, P - 1:-1].float() / temperature  # (B, R, V): column P-1+t predicts response token t
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, b.input_ids[:, P:, None]).squeeze(-1)  # (B, R)
    ratio = torch.exp(logprobs - b.old_logprobs)
    A = b.advantages
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - clip, 1 + clip) * A)
    loss = -(surrogate * b.loss_mask).sum() / b.loss_mask.sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_policy_gradient_equals_hand_built_surrogate(tmp_path, monkeypatch, critic):
    """c1 = c2 = β = 0: every optimizer step's policy gradient in `train_on` is the plain clipped surrogate's.

    Two epochs at a high learning rate and ε = 0.05 so later minibatches have clipped tokens; the
    gradient is captured at each accumulation boundary, before DeepSpeed clips and applies it.
    """
    tr = build_trainer(tmp_path, [f"ppo.critic={critic}", "ppo.c1=0", "ppo.c2=0", "ppo.kl_beta=0", "ppo.clip=0.05",
                                  "ppo.epochs=2", "ppo.actor_lr=3e-3", "ppo.max_grad_norm=0.5"])
    force_eos(monkeypatch, tr, {2: 3, 7: 1})
    exp, _, _ = tr.maker.make_experience(0)

    micro_rows, steps = [], []
    rows_of = Experience.rows
    monkeypatch.setattr(Experience, "rows", lambda self, idx: (micro_rows.append(idx.clone()), rows_of(self, idx))[1])
    policy = models.lm_of(tr.actor.module)
    real_step = tr.actor.step

    def step():
        if tr.actor.is_boundary():
            grads = {n: p.grad.detach().clone() for n, p in tr.actor.module.named_parameters() if p.grad is not None}
            steps.append((torch.cat(micro_rows[-2:]), copy.deepcopy(policy), grads))
        real_step()

    monkeypatch.setattr(tr.actor, "step", step)
    calls = spy_losses(monkeypatch, tr)
    tr.train_on(exp, 0)

    assert len(steps) == 4
    assert any(stats["policy/clipfrac"] > 0 for *_, stats in calls[4:]), "no clipped token: the clip is untested"
    prefix = "lm." if critic == "shared" else ""
    for rows, weights, grads in steps:
        expected = hand_built_policy_grads(weights, exp, rows, tr.p.temperature, tr.p.clip)
        for name, g in expected.items():
            torch.testing.assert_close(grads[prefix + name], g, rtol=1e-4, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")
        if critic == "shared":  # c1 = 0: the value head gets no gradient
            assert grads["score.weight"].abs().max() == 0


# ----------------------------------------------------------------------------------------------
# EOS handling


def test_response_mask_cuts_at_first_eos():
    eos, pad = 2, 0
    responses = torch.tensor([[5, 2, 7, 2],   # EOS at 1, junk after
                              [2, 9, 9, 9],   # empty: EOS first
                              [4, 5, 6, 7],   # no EOS
                              [3, 4, 2, 2]])  # EOS at 2 and 3
    cleaned, mask, has_eos = response_mask(responses, eos, pad)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert cleaned.tolist() == [[5, 2, 0, 0], [2, 0, 0, 0], [4, 5, 6, 7], [3, 4, 2, 0]]
    assert has_eos.tolist() == [True, True, False, True]
    assert mask.dtype == torch.float32

    # against a plain loop on random rows
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 7), generator=g)
    cleaned, mask, has_eos = response_mask(x, eos, pad)
    for row, c, m, h in zip(x.tolist(), cleaned.tolist(), mask.tolist(), has_eos.tolist()):
        n = row.index(eos) + 1 if eos in row else len(row)
        assert m == [1.0] * n + [0.0] * (len(row) - n)
        assert c == row[:n] + [pad] * (len(row) - n)
        assert h == (eos in row)


@pytest.mark.parametrize("truncated", ["penalize", "mask", "keep"])
def test_missing_eos_penalty_hits_only_unterminated_responses(tmp_path, monkeypatch, truncated):
    tr = build_trainer(tmp_path, [f"ppo.truncated={truncated}", "ppo.missing_eos_penalty=0.75"])
    eos_at = {0: 5, 3: 0, 4: 2}  # rows 0, 3 (empty) and 4 end; the other five are cut by max_new_tokens
    force_eos(monkeypatch, tr, eos_at)
    known = torch.linspace(-1.0, 1.0, 8)  # a known score per row
    monkeypatch.setattr(tr.maker, "score_mixer", lambda ids, am, P, prompts: (known.clone(), known.clone(), {}))
    exp, stats, _ = tr.maker.make_experience(0)

    ended = torch.tensor([i in eos_at for i in range(8)])
    lengths = exp.attention_mask[:, exp.prompt_len:].sum(1)
    assert lengths.tolist() == [eos_at[i] + 1 if i in eos_at else 6 for i in range(8)]
    expected = known - 0.75 * (~ended).float() if truncated == "penalize" else known
    torch.testing.assert_close(exp.scores, expected)
    assert stats["objective/scores"] == pytest.approx(known.mean().item())  # raw, before the penalty
    assert stats["response/eos_frac"] == pytest.approx(3 / 8)
    # the score lands on the last real token: each row's rewards sum to score − β·KL (KL = 0 at the start)
    torch.testing.assert_close(exp.rewards.sum(1), expected, atol=1e-6, rtol=0)
    resp_mask = exp.attention_mask[:, exp.prompt_len:].float()
    if truncated == "mask":  # unterminated rows take no part in the loss
        assert exp.loss_mask[ended].equal(resp_mask[ended]) and exp.loss_mask[~ended].sum() == 0
        assert exp.advantages[~ended].abs().sum() == 0
    else:
        assert exp.loss_mask.equal(resp_mask)


@pytest.mark.parametrize("truncated", ["penalize", "mask", "keep"])
def test_overlong_penalty_ramps_over_the_buffer_and_adds_to_truncated(tmp_path, monkeypatch, truncated):
    """`ppo.overlong_buffer=3` before `ppo.max_new_tokens=6`, `ppo.overlong_penalty=0.5`: lengths 1-3 lose nothing,
    4 loses 0.5/3, 5 loses 1/3, 6 (ended at the last token or unterminated) 0.5, on top of `ppo.truncated`'s."""
    tr = build_trainer(tmp_path, [f"ppo.truncated={truncated}", "ppo.missing_eos_penalty=0.75",
                                  "ppo.overlong_buffer=3", "ppo.overlong_penalty=0.5"])
    eos_at = {0: 5, 1: 3, 3: 0, 4: 2, 5: 4}  # lengths 6, 4, 1, 3, 5; rows 2, 6 and 7 are cut at 6 tokens
    force_eos(monkeypatch, tr, eos_at)
    known = torch.linspace(-1.0, 1.0, 8)
    monkeypatch.setattr(tr.maker, "score_mixer", lambda ids, am, P, prompts: (known.clone(), known.clone(), {}))
    exp, stats, _ = tr.maker.make_experience(0)

    lengths = exp.attention_mask[:, exp.prompt_len:].sum(1)
    assert lengths.tolist() == [6, 4, 6, 1, 3, 5, 6, 6]
    overlong = torch.tensor([-0.5, -0.5 / 3, -0.5, 0.0, 0.0, -1 / 3, -0.5, -0.5])
    ended = torch.tensor([i in eos_at for i in range(8)])
    missing = 0.75 * (~ended).float() if truncated == "penalize" else torch.zeros(8)
    torch.testing.assert_close(exp.scores, known - missing + overlong)
    assert stats["reward/overlong_penalty"] == pytest.approx(overlong.mean().item())
    if truncated == "mask":  # the cut rows leave the loss whatever their penalty
        assert exp.advantages[~ended].abs().sum() == 0


def test_checker_scores_the_decoded_response(tmp_path, monkeypatch):
    """reward.type=checker: 1 for the right final number, 0 otherwise; then the missing-EOS penalty."""
    tr = build_trainer(tmp_path)
    answers = [x["answer"] for x in tr.maker.prompt_batch(0)[0]]
    texts = {0: f"{answers[0]}", 1: f"{answers[1] + 1}", 2: f"answer: {answers[2]}", 3: f"{answers[3]}"}
    eos = tr.maker.eos_ids[0]
    forced = {row: tr.tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for row, t in texts.items()}
    forced[3] = forced[3][:-1]  # right, but cut by max_new_tokens: penalised
    assert all(len(ids) <= 6 for ids in forced.values())

    def edit(responses):
        for row, ids in forced.items():
            responses[row, :len(ids)] = torch.tensor(ids)

    edit_generate(monkeypatch, tr, edit)
    exp, stats, samples = tr.maker.make_experience(0)
    raw = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # rows 4-7: random tokens
    assert stats["objective/scores"] == pytest.approx(raw.mean().item())
    assert samples["scores"] == raw[:3].tolist()
    ended = torch.tensor([True, True, True, False, False, False, False, False])
    torch.testing.assert_close(exp.scores, raw - 1.0 * (~ended).float())


def test_empty_responses_do_not_crash_a_step(tmp_path, monkeypatch):
    """Every response is a bare EOS (R = 1): the step runs, losses are finite, nothing is skipped."""
    tr = build_trainer(tmp_path)
    force_eos(monkeypatch, tr, {i: 0 for i in range(8)})
    exp, roll_stats, samples = tr.maker.make_experience(0)
    assert exp.loss_mask.shape == (8, 1) and exp.loss_mask.sum() == 8
    assert roll_stats["response/length_mean"] == 1.0 and samples["responses"][0] == ""
    stats = tr.train_on(exp, 0)
    assert tr.bad_steps == 0
    assert all(torch.isfinite(torch.tensor(stats[k])) for k in ("policy/loss", "val/loss", "policy/entropy"))


def test_all_rows_masked_out_do_not_crash_a_step_and_say_so(tmp_path, monkeypatch, caplog):
    """truncated=mask and no response ends: an all-zero loss mask gives zero losses, not NaN, and one warning
    line says the iteration trains nothing; with one response ended, no warning."""
    import logging

    tr = build_trainer(tmp_path, ["ppo.truncated=mask"])
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.rollout.maker"):
        exp, _, _ = tr.maker.make_experience(0)
    assert exp.loss_mask.sum() == 0  # the random tiny model never says EOS in 6 tokens
    (line,) = [r.getMessage() for r in caplog.records if "trains nothing" in r.getMessage()]
    assert line == ("iteration 1 trains nothing: every response is masked (ppo.truncated=mask and none ended with "
                    "EOS within ppo.max_new_tokens=6)")
    stats = tr.train_on(exp, 0)
    assert tr.bad_steps == 0
    assert stats["policy/loss"] == 0.0 and stats["val/loss"] == 0.0
    caplog.clear()
    force_eos(monkeypatch, tr, {0: 2})
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.rollout.maker"):
        exp, _, _ = tr.maker.make_experience(1)
    assert exp.loss_mask.sum() > 0 and not [r for r in caplog.records if "trains nothing" in r.getMessage()]


@pytest.mark.parametrize("stats, normalize, warned", [(None, True, True), ((0.5, 2.0), True, False),
                                                      (None, False, False)])
def test_normalize_reward_without_stored_stats_says_it_has_no_effect(tokenizer, caplog, stats, normalize, warned):
    import logging

    from rlhf_cli.rollout import ScoreMixer

    cfg = compose("train_ppo", [*TINY_PPO, "reward.type=model"])
    with caplog.at_level(logging.WARNING, logger="rlhf_cli.rollout.scores"):
        ScoreMixer(cfg, tokenizer, object(), stats, 2, "fp32", normalize=normalize)
    lines = [r.getMessage() for r in caplog.records if "normalize_reward" in r.getMessage()]
    assert lines == (["ppo.normalize_reward=true has no effect: the reward model stored no held-out mean/std (it "
                      "was trained without held-out pairs), so its raw scores are used"] if warned else [])


# ----------------------------------------------------------------------------------------------
# whitening


@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (3.0, 0.5), (1000.0, 0.1)])
def test_whiten_across_ranks_equals_masked_whiten_on_one_rank(offset, scale):
    g = torch.Generator().manual_seed(1)
    x = offset + scale * torch.randn(8, 16, generator=g)
    mask = (torch.rand(8, 16, generator=g) > 0.3).float()
    mask[3] = 0  # an all-padding row
    x_dirty = torch.where(mask.bool(), x, torch.tensor(float("nan")))
    out = whiten_across_ranks(x_dirty, mask)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and (out[mask == 0] == 0).all()
    real = x.double()[mask.bool()]
    reference = torch.zeros(8, 16, dtype=torch.float64)
    reference[mask.bool()] = (real - real.mean()) / real.std()
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5)
    if offset < 10:  # masked_whiten (float32) loses ~1e-3 at mean/std = 1e4
        torch.testing.assert_close(out, masked_whiten(x, mask), rtol=0, atol=1e-5)


def test_explained_variance_across_ranks_on_one_rank_is_the_plain_formula():
    g = torch.Generator().manual_seed(0)
    returns, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.arange(7) < torch.tensor([[7], [3], [1], [5]])).float()
    m = mask.bool()
    want = 1 - (returns - values)[m].var() / returns[m].var()
    assert rollout.explained_variance_across_ranks(values, returns, mask) == pytest.approx(want.item(), rel=1e-6)
    assert rollout.explained_variance_across_ranks(returns, returns, mask) == pytest.approx(1.0)
    assert rollout.explained_variance_across_ranks(values, torch.ones(4, 7), mask) == 0.0


def test_whiten_across_ranks_degenerate_masks():
    x = torch.randn(2, 5)
    one = torch.zeros(2, 5)
    one[1, 2] = 1
    torch.testing.assert_close(whiten_across_ranks(x, one), masked_whiten(x, one))  # one token: 0
    assert whiten_across_ranks(x, torch.zeros(2, 5)).abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# end to end: resume, shared critic, missing reward model


def load_safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


RUN = ["reward.type=checker", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
       "ppo.max_new_tokens=6", "ppo.epochs=1", "ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3"]


def test_resume_reproduces_the_next_iteration(run_stage):
    # adaptive β with a short horizon: a KL controller not restored on resume changes iteration 2
    overrides = [*RUN, "ppo.iterations=2", "ppo.save_every=1", "ppo.kl_target=1.0", "ppo.kl_horizon=100"]
    _, run_dir, _ = run_stage("train_ppo", overrides)
    uninterrupted = read_metrics(run_dir)
    assert [r["step"] for r in uninterrupted] == [1, 2]
    final_weights = {name: load_safetensors(run_dir / "final" / name / "model.safetensors") for name in ("", "critic")}
    assert sorted(p.name for p in (run_dir / "ds").iterdir() if p.is_dir()) == ["step-1", "step-2"]

    # as if the run had died right after iteration 1's checkpoint
    (run_dir / "ds" / "latest").write_text("step-1\n")
    set_status(run_dir, "running")
    shutil.rmtree(run_dir / "final")
    run_stage("train_ppo", [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2]

    keys = ["objective/scores", "objective/kl", "objective/kl_beta", "objective/entropy_sampled",
            "response/length_mean", "policy/loss", "policy/approx_kl", "val/loss", "val/explained_var"]
    before, after = uninterrupted[1], resumed[1]
    assert abs(before["objective/kl"]) > 1e-4  # iteration 1 moved the policy (k1 may be < 0 on 8 samples)
    assert before["objective/kl_beta"] != uninterrupted[0]["objective/kl_beta"]
    for k in keys:
        assert after[k] == pytest.approx(before[k], rel=1e-5, abs=1e-7), k
    for name, weights in final_weights.items():  # policy and critic
        for k, v in load_safetensors(run_dir / "final" / name / "model.safetensors").items():
            torch.testing.assert_close(v, weights[k], rtol=0, atol=1e-6,
                                       msg=lambda m, name=name, k=k: f"{name}/{k}: {m}")


@pytest.mark.parametrize("when", ["mid-update", "after-update"])
def test_interrupt_mid_update_finishes_the_iteration_then_resume_matches(run_stage, monkeypatch, tmp_path, when):
    """Ctrl-C during iteration 1's update, or after it but before its bookkeeping (the KL check, the controller,
    the metrics row) is done: the iteration finishes, `ds/step-1` holds exactly iteration 1's weights, and the
    resumed run's iteration 2 and final weights equal an uninterrupted run's."""
    import os
    import signal

    from rlhf_cli.stages import ppo

    overrides = [*RUN, "ppo.iterations=2", "ppo.kl_target=1.0", "ppo.kl_horizon=100"]
    _, whole, _ = run_stage("train_ppo", overrides)
    real, calls = PPOTrainer.losses, []

    def interrupting(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and when == "mid-update":  # the second of iteration 1's 4 micro-batches
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    real_check = ppo.check_max_kl

    def interrupting_check(*args, **kwargs):  # the update is over; the iteration's bookkeeping is not
        if when == "after-update" and len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(PPOTrainer, "losses", interrupting)
    monkeypatch.setattr(ppo, "check_max_kl", interrupting_check)
    run_dir = tmp_path / "runs" / "ppo" / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        run_stage("train_ppo", overrides, run_dir=run_dir)
    assert len(calls) == 4  # the update ran to its end
    assert (run_dir / "ds" / "latest").read_text().strip() == "step-1"
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    monkeypatch.undo()

    run_stage("train_ppo", [*overrides, f"resume={run_dir}"], run_dir=run_dir)
    a, b = read_metrics(whole), read_metrics(run_dir)
    assert [r["step"] for r in b] == [1, 2]
    for k in ("objective/scores", "objective/kl", "objective/kl_beta", "policy/loss", "val/loss"):
        assert b[1][k] == pytest.approx(a[1][k], rel=1e-5, abs=1e-7), k
    for name in ("", "critic"):
        want = load_safetensors(whole / "final" / name / "model.safetensors")
        for k, v in load_safetensors(run_dir / "final" / name / "model.safetensors").items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=1e-6)


def test_checker_run_with_shared_critic_trains_the_value_head(run_stage):
    from transformers import AutoModelForCausalLM

    from rlhf_cli.models import load_causal_lm

    _, run_dir, cfg = run_stage("train_ppo", [*RUN, "ppo.critic=shared", "ppo.iterations=1", "ppo.c1=1.0"])
    final = run_dir / "final"
    assert not (final / "critic").exists()
    record = read_metrics(run_dir)[-1]
    assert record["step"] == 1 and record["val/loss"] > 0

    initial = load_causal_lm(cfg.model, "fp32", cfg.seed)
    head0 = models.PolicyWithValueHead(initial, cfg.seed).score.weight.detach()
    head = load_safetensors(final / "value_head.safetensors")["score.weight"]
    assert head.shape == head0.shape and not torch.equal(head, head0)
    trained = AutoModelForCausalLM.from_pretrained(final)
    assert trained.config.rlhf_reward_type == "checker"
    assert any(not torch.equal(v, initial.state_dict()[k]) for k, v in trained.state_dict().items())


def test_reward_type_model_without_a_reward_model_is_a_clear_error(tmp_path):
    cfg = compose("train_ppo", [*TINY_PPO, "reward.type=model", f"paths.root={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="latest_rm"):
        resolve_reward_model(cfg)


def test_precision_bf16_says_once_that_the_scoring_passes_stay_bf16(tmp_path, caplog):
    """The trainer resolves `scoring_precision` once and hands it to the experience maker: one warning."""
    import logging

    with caplog.at_level(logging.WARNING, logger="rlhf_cli.engine"):
        tr = build_trainer(tmp_path, ["precision=bf16"])
    warnings = [r for r in caplog.records if "scoring_precision=fp32 does not apply" in r.getMessage()]
    assert len(warnings) == 1
    assert tr.score_precision == tr.maker.score_precision == "bf16"
