"""`rlhf train-dpo` on the tiny model and the built-in task's preference pairs: the CLI run writes `final/` (a plain
causal LM recording its reference) and `latest_dpo`; at the first step the loss is log 2 and every margin 0 (the
policy is its reference); the held-out statistics after training read the reference of the starting weights (a
frozen copy, the log-probs precomputed once, or under LoRA the policy with its adapters off), equal to a fresh load;
the reference's log-probs are taken in eval mode, the same twice and on either padding side; the loss and its
gradients equal a plain-torch loop over the pairs; a resumed run continues the run it resumes."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from stage_helpers import assert_same_gradients, grads

from rlhf_cli.core import DPO_LOSSES, dpo_loss
from rlhf_cli.data import PackedPairCollator, PairCollator, pad_sequences
from rlhf_cli.forwards import pair_logprobs
from rlhf_cli.models import disable_dropout, load_causal_lm
from rlhf_cli.stages.dpo import Reference, reference_logprobs, token_counts

STEPS = 4
SMOKE = ["experiment=smoke", "precision=fp32"]
PAD, EOS = 0, 2
LOG2 = math.log(2)
STAT_KEYS = ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy", "dpo/logprobs_chosen",
             "dpo/logprobs_rejected")


def read_metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "dpo/loss" in r}


def eval_records(run_dir):
    return [r for r in read_metrics(run_dir) if "eval/dpo/loss" in r]


def assert_first_step_is_the_reference(record):
    assert record["dpo/loss"] == pytest.approx(LOG2, abs=1e-6)
    for key in ("dpo/margin", "dpo/rewards_chosen", "dpo/rewards_rejected"):
        assert abs(record[key]) <= 1e-6, key
    assert record["dpo/accuracy"] == 0 and record["dpo/logprobs_chosen"] < 0 and record["dpo/logprobs_rejected"] < 0


def test_cli_run_writes_a_causal_lm_and_latest_dpo(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlhf_cli import cli

    root = tmp_path / "runs"
    monkeypatch.setattr("sys.argv", ["rlhf"])
    cli.main(["train-dpo", *SMOKE, f"paths.root={root}", f"dpo.max_steps={STEPS}", "dpo.eval_every=2"])
    (run_dir,) = (root / "dpo").iterdir()
    final = run_dir / "final"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (root / "latest_dpo").read_text().strip() == str(final.resolve())
    train = train_records(run_dir)
    assert sorted(train) == list(range(1, STEPS + 1))  # dpo/loss at every step
    assert_first_step_is_the_reference(train[1])
    assert train[STEPS]["dpo/loss"] < train[1]["dpo/loss"] and train[STEPS]["dpo/margin"] > 0
    for r in train.values():
        assert r["dpo/margin"] == pytest.approx(r["dpo/rewards_chosen"] - r["dpo/rewards_rejected"], abs=1e-6)
        assert r["dpo/loss"] == r["dpo/pair_loss"]  # no sft_weight: no NLL term
    evals = eval_records(run_dir)
    assert [r["step"] for r in evals] == [2, STEPS]  # every dpo.eval_every steps, then the final one
    assert set(k for k in evals[-1] if k.startswith("eval/")) >= {f"eval/{k}" for k in STAT_KEYS}
    assert json.loads((final / "rlhf_eval.json").read_text())["eval"]["eval/dpo/margin"] == evals[-1]["eval/dpo/margin"]

    model = AutoModelForCausalLM.from_pretrained(final)  # a plain causal LM with its tokenizer
    assert type(model).__name__ == "LlamaForCausalLM" and (final / "tokenizer.json").is_file()
    assert model.config.rlhf_stage == "dpo"
    assert model.config.rlhf_reference_model["name"] == "tiny" and model.config.rlhf_reference_model["seed"] == 42


def heldout_from_fresh_loads(cfg, final):
    """The held-out statistics recomputed from scratch: the trained model read from `final/`, the reference a
    fresh load of the starting weights; each pair on its own, padded."""
    from transformers import AutoModelForCausalLM

    from rlhf_cli.data import load_preference_data
    from rlhf_cli.eos import eos_ids
    from rlhf_cli.models import load_generation_config, load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    heldout = load_preference_data(cfg.data, tokenizer, eos_ids=eos_ids(tokenizer, load_generation_config(
        cfg.model))).eval
    trained = AutoModelForCausalLM.from_pretrained(final).eval()
    start = load_causal_lm(cfg.model, "fp32", cfg.seed, tokenizer=tokenizer).eval()
    collate = PairCollator(tokenizer.pad_token_id)
    with torch.no_grad():
        pol, ref = (torch.cat([torch.stack(pair_logprobs(m, collate([ex]), "fp32"), -1) for ex in heldout])
                    for m in (trained, start))
    _, stats = dpo_loss(pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], beta=cfg.dpo.beta)
    return stats


@pytest.mark.parametrize("mode", ["frozen copy", "precomputed", "lora"])
def test_heldout_statistics_read_the_reference_of_the_starting_weights(run_stage, mode):
    """trl PR #6443: after training, the held-out margins must be measured against the starting weights, not the
    trained ones. Here they equal a recomputation from a fresh load of the starting model (<= 1e-5), under each
    kind of reference; the first step is log 2 under each."""
    extra = {"frozen copy": [], "precomputed": ["dpo.precompute_reference=true"],
             "lora": ["model.lora.r=4", "dpo.lr=2e-2"]}[mode]
    _, run_dir, cfg = run_stage("train_dpo", [*SMOKE, "dpo.max_steps=3", "dpo.lr=3e-3", *extra])
    train = train_records(run_dir)
    assert_first_step_is_the_reference(train[1])
    logged = eval_records(run_dir)[-1]
    want = heldout_from_fresh_loads(cfg, run_dir / "final")
    for key in STAT_KEYS:  # the log-probs are sums of ~100 nats: float32 rounding of two layouts, relative
        assert logged[f"eval/{key}"] == pytest.approx(want[key], rel=1e-6, abs=1e-5), key
    assert abs(logged["eval/dpo/margin"]) > 1e-3  # trained: against the trained weights it would be 0
    if mode == "lora":
        assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()


def test_precomputed_reference_gives_the_per_micro_batch_numbers(run_stage):
    """dpo.precompute_reference=true (once, before the first step, `dpo.eval_batch_size` pairs per forward, from the
    policy itself) and false (a frozen copy with each micro-batch): the same metrics and final weights."""
    runs = {}
    for flag in ("false", "true"):
        _, runs[flag], _ = run_stage("train_dpo", [*SMOKE, "dpo.max_steps=2", "dpo.eval_every=1",
                                                   f"dpo.precompute_reference={flag}", "dpo.eval_batch_size=5"])
    a, b = read_metrics(runs["false"]), read_metrics(runs["true"])
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if key.startswith(("dpo/", "eval/dpo/")):
                assert rb[key] == pytest.approx(value, abs=1e-5), (ra["step"], key)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in runs.values())
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=1e-5)


def make_pairs(vocab, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()  # noqa: E731 (ids 0-2: pad/bos/eos)
    return [{"prompt_ids": rnd(2 + i), "chosen_ids": rnd(1 + (i * 3) % 5) + [EOS],
             "rejected_ids": rnd(1 + (i * 2) % 4) + [EOS], "row": i + 1} for i in range(n)]


def left_padded(pairs):
    batch = PairCollator(PAD)(pairs)
    rows = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    batch.update(pad_sequences(rows, PAD, side="left"))
    return batch


def test_reference_logprobs_are_eval_mode_the_same_twice_and_on_either_padding_side(tiny_model_cfg, tokenizer):
    """trl PR #5542: a reference computed in train mode has dropout on. A model with attention dropout 0.5 left in
    train mode gives the eval-mode log-probs, bit-identical twice in a row, and its mode back; left padding, right
    padding and packed rows agree to float rounding."""
    lm = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    lm.config._attn_implementation = "eager"  # eager applies attention dropout in train mode
    for layer in lm.model.layers:
        layer.self_attn.attention_dropout = 0.5
    lm.train()
    pairs = make_pairs(lm.config.vocab_size)
    right = PairCollator(PAD)
    first = reference_logprobs(lm, pairs, right, 4, "fp32")
    again = reference_logprobs(lm, pairs, right, 4, "fp32")
    assert lm.training and torch.equal(first, again) and first.shape == (len(pairs), 2)
    with torch.no_grad():
        lm.eval()
        want = torch.stack(pair_logprobs(lm, right(pairs), "fp32"), -1)
        lm.train()
        noisy = torch.stack(pair_logprobs(lm, right(pairs), "fp32"), -1)
    assert torch.equal(first, want) and (noisy - want).abs().max() > 1e-3  # dropout would have moved them
    for collate in (left_padded, PackedPairCollator(PAD), PairCollator(PAD)):
        got = reference_logprobs(lm, pairs, collate, 3, "fp32")
        torch.testing.assert_close(got, first, rtol=0, atol=1e-5)
    # the precomputed table gives back the same rows for any subset, in the subset's order
    ref = Reference(lm, "fp32")
    ref.precompute(pairs, right, 4)
    c, r = ref(pairs[::-2], right(pairs[::-2]))
    assert torch.equal(torch.stack([c, r], -1), first.flip(0)[::2])


def plain_pair_logprob(model, prompt, response):
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).sum()


@pytest.mark.parametrize("loss_type", list(DPO_LOSSES))
@pytest.mark.parametrize("packed", [False, True])
def test_loss_and_gradients_equal_a_plain_torch_loop(tiny_model_cfg, tokenizer, loss_type, packed):
    """The stage's micro-batch (one forward over the pairs, the reference's log-probs, `core.dpo_loss` with RPO's
    term) against a loop over the pairs through the plain model: -log σ(β h) (or IPO's per token, SLiC's) averaged, plus
    α × the chosen NLL per chosen token."""
    policy = disable_dropout(load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)).train()
    reference = load_causal_lm(tiny_model_cfg, seed=1, tokenizer=tokenizer).eval()  # apart from the policy
    pairs = make_pairs(policy.config.vocab_size, seed=3)
    beta, ls, alpha = 0.3, (0.1 if loss_type == "sigmoid" else 0.0), 0.5
    batch = (PackedPairCollator(PAD) if packed else PairCollator(PAD))(pairs)
    chosen, rejected = pair_logprobs(policy, batch, "fp32")
    loss, _ = dpo_loss(chosen, rejected, *Reference(reference, "fp32")(pairs, batch), beta=beta, loss=loss_type,
                       label_smoothing=ls, sft_weight=alpha, **token_counts(pairs))
    loss.backward()
    ours = grads(policy)
    policy.zero_grad()

    terms, nll, n_tokens = [], 0.0, 0
    for ex in pairs:
        pc, pr = (plain_pair_logprob(policy, ex["prompt_ids"], ex[k]) for k in ("chosen_ids", "rejected_ids"))
        with torch.no_grad():
            rc, rr = (plain_pair_logprob(reference, ex["prompt_ids"], ex[k]) for k in ("chosen_ids", "rejected_ids"))
        h = (pc - rc) - (pr - rr)
        if loss_type == "sigmoid":
            terms.append(-(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h))
        elif loss_type == "ipo":  # per-token log-ratios
            gap = (pc - rc) / len(ex["chosen_ids"]) - (pr - rr) / len(ex["rejected_ids"])
            terms.append((gap - 1 / (2 * beta)) ** 2)
        else:
            terms.append(torch.relu(1 - beta * h))
        nll, n_tokens = nll - pc, n_tokens + len(ex["chosen_ids"])
    want = torch.stack(terms).mean() + alpha * nll / n_tokens
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert_same_gradients(ours, grads(policy))


def test_resume_continues_the_run(run_stage, tmp_path):
    overrides = [*SMOKE, f"dpo.max_steps={STEPS}", "dpo.save_every=2"]
    _, run_dir, _ = run_stage("train_dpo", overrides)
    crashed = tmp_path / "runs" / "dpo" / "crashed"
    shutil.copytree(run_dir, crashed)
    (crashed / "ds" / "latest").write_text("step-2\n")  # as if it had crashed right after the step-2 checkpoint
    (crashed / "status.json").write_text(json.dumps({"state": "running"}))
    shutil.rmtree(crashed / "final")
    run_stage("train_dpo", [*overrides, f"resume={crashed}"], run_dir=crashed)
    original, resumed = train_records(run_dir), train_records(crashed)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # steps after the checkpoint logged once
    for step in range(1, STEPS + 1):
        assert resumed[step]["dpo/lr"] == pytest.approx(original[step]["dpo/lr"], rel=1e-12)
        for key in ("dpo/loss", "dpo/margin"):  # the reference is still the starting weights after the resume
            assert resumed[step][key] == pytest.approx(original[step][key], rel=1e-5, abs=1e-6), (step, key)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (run_dir, crashed))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    assert json.loads((crashed / "status.json").read_text())["state"] == "finished"


@pytest.mark.parametrize("override,match", [
    ("dpo.loss=kto", "dpo.loss"),
    ("dpo.beta=0", "dpo.beta must be > 0"),
    ("dpo.label_smoothing=0.5", r"dpo.label_smoothing must be in \[0, 0.5\)"),
    ("dpo.sft_weight=-1", "dpo.sft_weight must be >= 0"),
])
def test_bad_dpo_keys_are_refused_in_one_line(override, match):
    from stage_helpers import compose

    from rlhf_cli.config import validate_dpo
    from rlhf_cli.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        validate_dpo(compose("train_dpo", [*SMOKE, override]))
    with pytest.raises(ConfigError, match="applies to dpo.loss=sigmoid only"):
        validate_dpo(compose("train_dpo", [*SMOKE, "dpo.loss=ipo", "dpo.label_smoothing=0.1"]))



def test_eval_compares_the_dpo_policy_with_a_ppo_policy_and_names_both_sides(tmp_path, monkeypatch):
    """The README's recipe on the tiny model: train-rm, train-ppo and train-dpo, then `rlhf eval policy.path=<dpo run>
    reference.path=<ppo run> reward_model.path=<rm>`: the paired statistics and the hacking line, and a page that
    names both sides with the command and run each came from."""
    from rlhf_cli import cli

    root = tmp_path / "runs"
    monkeypatch.setattr("sys.argv", ["rlhf"])
    cli.main(["train-rm", *SMOKE, f"paths.root={root}", "rm.max_steps=2"])
    cli.main(["train-ppo", *SMOKE, f"paths.root={root}", "ppo.iterations=1"])
    cli.main(["train-dpo", *SMOKE, f"paths.root={root}", "dpo.max_steps=2"])
    (dpo_dir,), (ppo_dir,), (rm_dir,) = ((root / k).iterdir() for k in ("dpo", "ppo", "rm"))
    cli.main(["eval", *SMOKE, f"paths.root={root}", f"policy.path={dpo_dir}", f"reference.path={ppo_dir}",
              f"reward_model.path={root / 'latest_rm'}", "eval.num_prompts=8"])
    (eval_dir,) = (root / "eval").iterdir()
    results = json.loads((eval_dir / "eval.json").read_text())["results"]
    # both sides as the run dirs they named when the eval started (their final/; issue 61: resolved once)
    assert results["policy"] == str((dpo_dir / "final").resolve())
    assert results["reference"] == str((ppo_dir / "final").resolve())
    for key in ("win_rate", "score_gain", "score_gain_ci95", "accuracy_gain", "kl_k3", "reward_hacking", "headline"):
        assert results.get(key) is not None, key
    html = (eval_dir / "report" / "report.html").read_text()
    sides = html[html.index("<h2>policy and reference</h2>"):]
    sides = sides[:sides.index("</section>")]
    assert "policy (measured)" in sides and f"rlhf train-dpo: {dpo_dir.resolve()}" in sides
    assert "reference (compared with)" in sides and f"rlhf train-ppo: {ppo_dir.resolve()}" in sides
    assert f"rlhf train-rm: {rm_dir.resolve()}" in sides
    for title in (f"<h2>direct preference optimisation: {dpo_dir.resolve()}</h2>",
                  f"<h2>PPO training: {ppo_dir.resolve()}</h2>"):
        assert title in html, title
    assert (eval_dir / "report" / f"1_dpo_{dpo_dir.name}" / "dpo_loss.png").is_file()
