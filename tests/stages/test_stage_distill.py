"""On-policy distillation in `rlhf train-ppo` (`reward.type=teacher`, `ppo.advantage_estimator=distill`; issue 59),
tiny random models in fp32, CPU.

The teacher's per-token rewards equal log π_teacher − log π_student of each sampled token computed by plain
torch, one unpadded row at a time; a teacher equal to the policy gives advantages 0; a teacher with another
tokenizer, a missing teacher and a teacher without the distill estimator are refused in one line; a short run
through `latest_sft` logs finite metrics with `distill/*` among them. Under bf16-autocast the teacher scores in
`scoring_precision`: fp32 by default (the fp32 log-ratio), bf16 with `same` (within the bf16 drift).
"""

import copy
import math

import pytest
import torch
from test_stage_ppo import build_trainer

from rlhf_cli.config import ConfigError
from rlhf_cli.models import load_causal_lm, save_hf
from rlhf_cli.runs import read_metrics, write_pointer

DISTILL = ["reward.type=teacher", "ppo.advantage_estimator=distill", "ppo.kl_beta=0.0", "ppo.truncated=keep"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_model_cfg, tokenizer):
    """{name: dir} of tiny causal LMs with the policy's tokenizer: `same` (the policy's weights: `TINY_PPO`'s seed
    42), `other` (seed 3); and `retokenized` (seed 3, saved with a copy of the tokenizer holding one more token)."""
    root = tmp_path_factory.mktemp("teachers")
    extra = copy.deepcopy(tokenizer)
    extra.add_tokens(["<my_extra_token>"])
    dirs = {}
    for name, seed, tok in (("same", 42, tokenizer), ("other", 3, tokenizer), ("retokenized", 3, extra)):
        dirs[name] = root / name
        save_hf(load_causal_lm(tiny_model_cfg, "fp32", seed, tokenizer=tokenizer), tok, dirs[name])
    return dirs


def plain_logprobs(lm, ids, am, action_mask, P, temperature):
    """log π(a_t|s_t) of each sampled token, one row at a time without its padding: the real tokens alone
    (positions 0..n−1), logits / T, log-softmax, gathered at the next token. (B, R) float64, 0 off the action
    mask."""
    B, R = action_mask.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        real = ids[b][am[b].bool()]  # left-padded prompt, right-padded response: the real tokens, in order
        n_resp = int(action_mask[b].sum())
        with torch.no_grad():
            logits = lm(real[None]).logits[0].double() / temperature
        logp = torch.log_softmax(logits, -1)
        start = real.shape[0] - int(am[b, P:].sum())  # the first response token's index in `real`
        for t in range(n_resp):
            out[b, t] = logp[start + t - 1, real[start + t]]
    return out


def test_teacher_rewards_are_the_plain_torch_log_ratio_of_each_sampled_token(tmp_path, teachers):
    tr = build_trainer(tmp_path, [*DISTILL, f"reward.teacher.path={teachers['other']}"])
    assert not tr.on_policy  # the teacher's reward reads the old log-probs: the rollout runs the policy pass
    exp, stats, _ = tr.maker.make_experience(0)
    P, m = exp.prompt_len, exp.action_mask
    teacher = load_causal_lm(str(teachers["other"]), "fp32").eval()
    want_t = plain_logprobs(teacher, exp.input_ids, exp.attention_mask, m, P, 0.7)
    want_s = plain_logprobs(tr.actor.module, exp.input_ids, exp.attention_mask, m, P, 0.7)
    torch.testing.assert_close(exp.old_logprobs.double(), want_s, rtol=0, atol=1e-5)
    want = (want_t - want_s) * m
    assert exp.rewards.dtype == torch.float32 and exp.advantages.dtype == torch.float32
    torch.testing.assert_close(exp.rewards.double(), want, rtol=0, atol=1e-5)  # β 0, no score: the teacher's alone
    torch.testing.assert_close(exp.advantages.double(), want, rtol=0, atol=1e-5)  # no discount, whitening or group
    n = m.sum()
    assert math.isclose(stats["distill/reverse_kl"], float(-(want * m).sum() / n), abs_tol=1e-5)
    assert math.isclose(stats["distill/teacher_logprob_mean"], float((want_t * m).sum() / n), abs_tol=1e-5)
    assert stats["distill/reverse_kl"] != 0 and "time/scoring_teacher" in stats


def test_a_teacher_equal_to_the_policy_gives_advantages_zero(tmp_path, teachers):
    tr = build_trainer(tmp_path, [*DISTILL, f"reward.teacher.path={teachers['same']}"])
    exp, stats, _ = tr.maker.make_experience(0)
    assert exp.action_mask.sum() > 0
    torch.testing.assert_close(exp.advantages, torch.zeros_like(exp.advantages), rtol=0, atol=1e-6)
    assert abs(stats["distill/reverse_kl"]) < 1e-6


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, teachers):
    with pytest.raises(ConfigError) as e:
        build_trainer(tmp_path, [*DISTILL, f"reward.teacher.path={teachers['retokenized']}"])
    assert "\n" not in str(e.value)
    assert "the teacher at" in str(e.value) and "uses a different tokenizer than the policy" in str(e.value)


@pytest.mark.parametrize("overrides,match", [
    (["ppo.advantage_estimator=distill"], r"reward\.type=teacher\) and ppo\.advantage_estimator=distill go together"),
    (["reward.type=teacher"], r"ppo\.advantage_estimator=gae with the reward sources \['teacher'\]"),
    (DISTILL, r"^no teacher: set reward\.teacher\.path=.* or run `rlhf train-sft` first \(no .*latest_sft\)$"),
    ([*DISTILL, "reward.teacher.path=/no/such/dir"], r"^reward\.teacher\.path=/no/such/dir does not exist"),
    ([*DISTILL, "ppo.filter_groups=true", "ppo.n_samples_per_prompt=2", "ppo.mini_batch_size=16"],
     r"^ppo\.filter_groups=true with ppo\.advantage_estimator=distill: .* set ppo\.filter_groups=false$"),
])
def test_bad_teacher_settings_are_refused_in_one_line(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_trainer(tmp_path, overrides)


def test_a_short_distillation_run_through_latest_sft(run_stage, tmp_path, teachers):
    root = tmp_path / "runs"
    write_pointer(root, "sft", teachers["other"])  # the teacher by default: <paths.root>/latest_sft
    size = ["ppo.iterations=2", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
            "ppo.max_new_tokens=6", "ppo.epochs=1"]
    _, run_dir, cfg = run_stage("train_ppo", ["experiment=distill", *size], root=root)
    assert cfg.reward.teacher.path == str(teachers["other"].resolve())  # the pointer resolved at start
    records = read_metrics(run_dir)
    assert len(records) == 2
    for rec in records:
        assert {"distill/reverse_kl", "distill/teacher_logprob_mean"} <= set(rec)
        bad = {k: v for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    assert records[0]["objective/kl_beta"] == 0.0
    assert (run_dir / "final" / "config.json").is_file()


@pytest.mark.parametrize("scoring,want", [("fp32", "fp32"), ("same", "bf16-autocast")])
def test_under_bf16_autocast_the_teacher_scores_in_scoring_precision(tmp_path, teachers, scoring, want):
    """precision=bf16-autocast samples in bf16; the teacher's pass runs in `scoring_precision`, as the student's
    old log-probs do. fp32 (the default): each token's reward is the fp32 log-ratio of the sampled tokens.
    `same`: both passes under autocast, off the fp32 log-ratio by the bf16 drift (measured: 8e-4 nats per token
    on average, 2.5e-3 at most; `distill/reverse_kl` 1.2e-4 off), and no further."""
    tr = build_trainer(tmp_path, [*DISTILL, "precision=bf16-autocast", f"scoring_precision={scoring}",
                                  f"reward.teacher.path={teachers['other']}"])
    assert tr.teacher.precision == tr.actor.precision == want
    exp, stats, _ = tr.maker.make_experience(0)
    P, m = exp.prompt_len, exp.action_mask
    teacher = load_causal_lm(str(teachers["other"]), "fp32").eval()
    want_r = (plain_logprobs(teacher, exp.input_ids, exp.attention_mask, m, P, 0.7)
              - plain_logprobs(tr.actor.module, exp.input_ids, exp.attention_mask, m, P, 0.7))
    err = (exp.rewards.double() - want_r)[m.bool()].abs()
    rkl_err = abs(stats["distill/reverse_kl"] - float(-(want_r * m).sum() / m.sum()))
    if scoring == "fp32":
        assert err.max() < 1e-5 and rkl_err < 1e-5
    else:
        assert 1e-5 < err.max() < 1e-2 and rkl_err < 1e-3
