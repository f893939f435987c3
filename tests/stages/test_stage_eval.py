"""`rlhf eval` on tiny models (fp32, CPU): issue 7's "Done when" items.

Reference numbers are computed here with plain torch / Python on unpadded single sequences,
never with the project's helpers (kl_estimate, pair_metrics, win_rate, sequence_scores).
"""

import json
import math
import re
import statistics

import pytest
import torch

from rlhf_cli.core import wilson_ci95

TEMPERATURE = 0.7
MAX_NEW_TOKENS = 8
T5 = 2.5705818  # t(0.975, 5): the interval of 6 paired prompts
WILSON_1_OF_6 = (0.0300534, 0.5635028)  # Wilson 95 % interval of 1 success in 6

def read_results(eval_dir):
    return json.loads((eval_dir / "eval.json").read_text())["results"]


# ----------------------------------------------------------------------------------------------
# models saved once per module


RM_STD = 0.25  # the score std recorded in the tiny reward model's config.json (as train-rm writes it)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_model_cfg, tokenizer):
    """HF dirs of two different tiny causal LMs (policy seed 1, reference seed 2) and a tiny
    random reward model (seed 3), written with save_hf."""
    from rlhf_cli.models import load_causal_lm, load_scalar_model, save_hf

    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, seed in (("policy", 1), ("reference", 2)):
        dirs[name] = save_hf(load_causal_lm(tiny_model_cfg, "fp32", seed, tokenizer=tokenizer), tokenizer, root / name)
    dirs["rm"] = save_hf(load_scalar_model(tiny_model_cfg, "fp32", 3), tokenizer, root / "rm",
                         extra_config={"rlhf_reward_mean": 0.5, "rlhf_reward_std": RM_STD})
    dirs["rm_no_stats"] = save_hf(load_scalar_model(tiny_model_cfg, "fp32", 3), tokenizer, root / "rm_no_stats")
    return dirs


_PIPELINE = {}

PIPELINE_DATA = ["data.builtin.rm_train=16", "data.builtin.rm_eval=8", "data.builtin.ppo_train=8",
                 "data.builtin.ppo_eval=8"]


@pytest.fixture
def pipeline(run_stage, tmp_path_factory):
    """train-rm → train-ppo → eval (policy from `latest_policy`) on the built-in task, run once per module.

    Returns {"root", "rm": (result, run_dir, cfg), "ppo": ..., "eval": ...}.
    """
    if not _PIPELINE:
        root = tmp_path_factory.mktemp("pipeline")
        out = {"root": root}
        out["rm"] = run_stage("train_rm", [*PIPELINE_DATA, "rm.batch_size=8", "rm.micro_batch_size=4",
                                           "rm.max_steps=2", "rm.lr=1e-3"], run_dir=root / "rm" / "a", root=root)
        out["ppo"] = run_stage("train_ppo", [*PIPELINE_DATA, "ppo.iterations=1", "ppo.rollout_batch_size=8",
                                             "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "ppo.epochs=1",
                                             f"ppo.max_new_tokens={MAX_NEW_TOKENS}"],
                               run_dir=root / "ppo" / "a", root=root)
        out["eval"] = run_stage("eval", [*PIPELINE_DATA, f"eval.max_new_tokens={MAX_NEW_TOKENS}", "eval.batch_size=8"],
                                run_dir=root / "eval" / "a", root=root)
        _PIPELINE.update(out)
    return _PIPELINE


# ----------------------------------------------------------------------------------------------
# reward-model eval


# (chosen score, rejected score): 5 correct, 3 wrong, 2 ties (not correct)
KNOWN_SCORES = [(3.0, 1.0), (2.0, 2.0), (0.5, -1.0), (-2.0, 1.0), (1.5, 1.5),
                (4.0, -4.0), (0.0, 0.25), (1.0, 0.0), (-0.5, -0.75), (2.5, 3.0)]
SCORE_RE = re.compile(r"score=(-?\d+(?:\.\d+)?)")


@pytest.mark.parametrize("packing", [True, False])
def test_reward_model_accuracy_on_known_scores_is_exact(run_stage, tiny_dirs, tokenizer, tmp_path, monkeypatch,
                                                        packing):
    """A hand-made file whose responses carry their score ("score=1.5"); the model's scores are replaced
    by that number, everything else (loading, batching, packing, gathering, metrics, eval.json) is the real code.
    Packed, each score's text is what its position may attend to: the mask itself must hide chosen from rejected."""
    import rlhf_cli.forwards.scoring as scoring

    rows = [{"prompt": f"Question {i}: which reply is better?",
             "chosen": f"Chosen reply number {i}. score={c}", "rejected": f"Another reply {i}. score={r}"}
            for i, (c, r) in enumerate(KNOWN_SCORES)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def known_rewards(model, input_ids, attention_mask):  # (2B, L) right-padded → (B,) the written score
        texts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(input_ids, attention_mask)]
        return torch.tensor([float(SCORE_RE.findall(t)[-1]) for t in texts])

    def known_packed_rewards(model, input_ids, allowed, index, position_ids):  # what each read position sees
        return known_rewards(model, input_ids[index[:, 0]], allowed[index[:, 0], 0, index[:, 1]])

    monkeypatch.setattr(scoring, "sequence_scores", known_rewards)
    monkeypatch.setattr(scoring, "scores_at", known_packed_rewards)
    result, eval_dir, _ = run_stage("eval", [f"reward_model.path={tiny_dirs['rm']}", f"data.path={path}",
                                             f"data.eval_path={path}", "data.format=explicit", "eval.batch_size=3",
                                             f"data.packing={str(packing).lower()}"])

    chosen = [c for c, _ in KNOWN_SCORES]
    rejected = [r for _, r in KNOWN_SCORES]
    n = len(KNOWN_SCORES)
    out = read_results(eval_dir)
    assert out["pairs"] == n
    assert out["accuracy"] == 5 / n == result
    assert out["ties"] == 2
    assert (out["accuracy_ci95_low"], out["accuracy_ci95_high"]) == wilson_ci95(5 / n, n)  # hand-checked below
    assert out["warning"].startswith(f"too few held-out pairs ({n}): ")
    assert out["margin_mean"] == pytest.approx(sum(c - r for c, r in KNOWN_SCORES) / n, abs=1e-6)
    assert out["loss"] == pytest.approx(sum(math.log1p(math.exp(r - c)) for c, r in KNOWN_SCORES) / n, abs=1e-6)
    assert out["chosen_mean"] == pytest.approx(statistics.mean(chosen), abs=1e-6)
    assert out["rejected_mean"] == pytest.approx(statistics.mean(rejected), abs=1e-6)
    assert out["chosen_std"] == pytest.approx(statistics.stdev(chosen), abs=1e-6)
    assert out["rejected_std"] == pytest.approx(statistics.stdev(rejected), abs=1e-6)
    # every chosen score still sits next to its own rejected score after sharding, batching and gathering
    rewards = json.loads((eval_dir / "rewards.json").read_text())
    assert sorted(zip(rewards["chosen"], rewards["rejected"])) == sorted(KNOWN_SCORES)
    html = (eval_dir / "report" / "report.html").read_text()
    assert (eval_dir / "report" / "reward_hist.png").is_file() and "data:image/png;base64," in html
    assert json.loads((eval_dir / "status.json").read_text())["state"] == "finished"


def test_reward_model_scores_do_not_depend_on_padding_side(pipeline):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.data import load_preference_data
    from rlhf_cli.data.collate import pad_sequences
    from rlhf_cli.models import sequence_scores

    _, rm_dir, cfg = pipeline["rm"]
    final = rm_dir / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    pairs = load_preference_data(cfg.data, tokenizer).eval
    seqs = [p["prompt_ids"] + p["chosen_ids"] for p in pairs] + [p["prompt_ids"] + p["rejected_ids"] for p in pairs]
    assert len({len(s) for s in seqs}) > 1, "the pairs should need padding"
    with torch.no_grad():
        plain = torch.tensor([float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs])
        by_side = {}
        for side in ("left", "right"):
            batch = pad_sequences(seqs, tokenizer.pad_token_id, side=side)
            by_side[side] = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(by_side["left"], plain, rtol=0, atol=1e-5)
    assert torch.allclose(by_side["right"], plain, rtol=0, atol=1e-5)
    b = len(pairs)
    for side in ("left", "right"):
        c, r = by_side[side][:b], by_side[side][b:]
        assert ((c > r) == (plain[:b] > plain[b:])).all(), side  # same accuracy and tie count as unpadded


# ----------------------------------------------------------------------------------------------
# policy eval


def test_win_rate_counts_ties_half():
    from rlhf_cli.core import win_rate

    policy = torch.tensor([1.0, 2.0, 3.0, 0.0, -1.0])
    reference = torch.tensor([0.0, 2.0, 4.0, -1.0, -1.0])
    assert win_rate(policy, reference) == (1 + 0.5 + 0 + 1 + 0.5) / 5
    assert math.isnan(win_rate(torch.tensor([]), torch.tensor([])))


def fixed_responses(prompts, tokenizer):
    """Per role, one response per prompt (token ids, EOS included where the response ended).

    Rows 0, 2 and 5 are identical for both roles (RM ties); with 3 untied rows the win rate cannot be
    0.5, so swapping policy and reference changes it. Row 4 of the policy is cut at max_new_tokens
    without EOS. Right answers: row 0 for both, row 1 for the reference only; no other response
    contains a digit.
    """
    eos = tokenizer.eos_token_id

    def enc(text, end=True):
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids + [eos] if end else ids

    a0 = prompts[0]["answer"]
    policy = [enc(f" The answer is {a0}"), enc(" I am not sure"), enc(" no idea"), enc(" Let me think"),
              enc(" well" * MAX_NEW_TOKENS, end=False)[:MAX_NEW_TOKENS], enc(" many")]
    reference = [policy[0], enc(f" It is {prompts[1]['answer']}"), policy[2], enc(" seven"), enc(" ok then"), policy[5]]
    for ids in policy + reference:
        assert 1 <= len(ids) <= MAX_NEW_TOKENS
    return {"policy": policy, "reference": reference}


def fake_sampling(monkeypatch, tiny_dirs, tokenizer):
    """Replace eval's sampling engine (`rollout.engine=hf`) with one answering `fixed_responses`; returns
    {role: (prompt ids, responses)} as filled. The rollout batch is built from its answers as from any engine's."""
    import rlhf_cli.stages.evaluate as evaluate
    from rlhf_cli.rollout import Generation, engines, response_mask

    seen, loaded = {}, []
    load_prompt_data = evaluate.load_prompt_data

    def spy_load_prompt_data(*args, **kwargs):  # the prompts' answers, which `fixed_responses` reads
        loaded.append(load_prompt_data(*args, **kwargs))
        return loaded[-1]

    class FixedGenerator:
        def __init__(self):
            self.lm = None

        def update_weights(self, model):
            self.lm = model

        def close(self):
            self.lm = None

        def generate(self, prompt_ids, seeds, sampling):
            role = "policy" if str(self.lm.name_or_path) == str(tiny_dirs["policy"]) else "reference"
            prompts = list(loaded[-1])[:len(prompt_ids)]
            assert [p["prompt_ids"] for p in prompts] == list(prompt_ids) and len(seeds) == len(prompt_ids)
            responses = fixed_responses(prompts, tokenizer)[role]
            seen[role] = (list(prompt_ids), responses, list(seeds))
            ids = torch.full((len(responses), sampling.max_new_tokens), sampling.pad_id, dtype=torch.long)
            for i, resp in enumerate(responses):
                ids[i, :len(resp)] = torch.tensor(resp)
            return Generation(*response_mask(ids, sampling.eos_ids, sampling.pad_id), None)

    monkeypatch.setattr(evaluate, "load_prompt_data", spy_load_prompt_data)
    monkeypatch.setitem(engines.GENERATORS, "hf", lambda settings: FixedGenerator())
    return seen


def nucleus_logprob(logits: torch.Tensor, token: int, top_p: float) -> torch.Tensor:
    """log π_p(token), one position (V,) of temperature-scaled logits, the plain way: the most probable tokens kept
    while the mass before each is < top_p, the sampled token kept too, renormalised over what is kept."""
    probs = torch.softmax(logits.double(), -1)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    kept = set(order[before < top_p].tolist()) | {token}
    return torch.log(probs[token] / probs[sorted(kept)].sum()).float()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_policy_eval_win_rate_and_kl_match_a_plain_torch_computation(
        run_stage, tiny_dirs, tokenizer, monkeypatch, top_p):
    """eval_policy on fixed "samples" (sampling replaced; scoring, KL, batching and aggregation real). With
    `eval.top_p` < 1 the KL reads the policy's nucleus-renormalised log-probs, as train-ppo's penalty does."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    seen = fake_sampling(monkeypatch, tiny_dirs, tokenizer)
    _, eval_dir, _ = run_stage("eval", [
        f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}",
        f"reward_model.path={tiny_dirs['rm']}", "data.builtin.ppo_eval=6", f"eval.max_new_tokens={MAX_NEW_TOKENS}",
        "eval.batch_size=4", f"eval.temperature={TEMPERATURE}", f"eval.top_p={top_p}"])
    out = read_results(eval_dir)
    assert set(seen) == {"policy", "reference"} and out["prompts"] == 6

    # the same numbers, one unpadded sequence at a time, with plain torch
    policy = AutoModelForCausalLM.from_pretrained(tiny_dirs["policy"], dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_dirs["reference"], dtype=torch.float32).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_dirs["rm"], dtype=torch.float32).eval()
    scores, k1, k3 = {"policy": [], "reference": []}, [], []
    with torch.no_grad():
        for role in ("policy", "reference"):
            for prompt, resp in zip(*seen[role][:2]):
                seq = torch.tensor([prompt + resp])
                scores[role].append(float(rm(input_ids=seq).logits[0, 0]))
                if role != "policy":
                    continue
                targets = torch.tensor(resp)
                start = len(prompt) - 1  # logits at position j predict token j + 1
                scaled = policy(input_ids=seq).logits[0, start:-1].float() / TEMPERATURE
                logq = torch.log_softmax(reference(input_ids=seq).logits[0, start:-1].float() / TEMPERATURE, -1)
                lp = torch.stack([nucleus_logprob(scaled[j], t, top_p) for j, t in enumerate(resp)])
                lq = logq[torch.arange(len(resp)), targets]
                k1.append(float((lp - lq).sum()))
                log_r = lq - lp
                k3.append(float((log_r.exp() - 1 - log_r).sum()))

    pol, ref = seen["policy"][1], seen["reference"][1]
    assert seen["policy"][2] == seen["reference"][2]  # the pairing: both sides draw the same noise per prompt
    same = [p == r for p, r in zip(pol, ref)]
    assert same == [True, False, True, False, False, True]
    for s, p, r in zip(same, scores["policy"], scores["reference"]):
        assert s or abs(p - r) > 1e-4, "non-tied rows must have clearly different scores"
    wins = [0.5 if s else float(p > r) for s, p, r in zip(same, scores["policy"], scores["reference"])]
    assert out["win_rate"] == sum(wins) / len(wins)
    assert out["kl_k1"] == pytest.approx(sum(k1) / len(k1), rel=1e-4, abs=1e-5)
    assert out["kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-4, abs=1e-5)
    assert abs(out["kl_k1"]) > 0.1, "two different random models should be far apart"
    for role in ("policy", "reference"):
        assert out[f"{role}/score_mean"] == pytest.approx(statistics.mean(scores[role]), abs=1e-5)
        lengths = [len(r) for r in seen[role][1]]
        assert out[f"{role}/length_mean"] == pytest.approx(statistics.mean(lengths), rel=1e-6)
        eos = [r[-1] == tokenizer.eos_token_id for r in seen[role][1]]
        assert out[f"{role}/eos_rate"] == pytest.approx(sum(eos) / len(eos), rel=1e-6)
    assert out["policy/accuracy"] == 1 / 6
    assert out["reference/accuracy"] == 2 / 6  # row 0 is shared
    # paired differences, prompt by prompt (the same prompts and noise for both models)
    diffs = [p - r for p, r in zip(scores["policy"], scores["reference"])]
    assert out["score_gain"] == pytest.approx(statistics.mean(diffs), abs=1e-5)
    assert out["score_gain_ci95"] == pytest.approx(T5 * statistics.stdev(diffs) / len(diffs) ** 0.5, rel=1e-3)
    assert out["score_gain_rm_std"] == pytest.approx(out["score_gain"] / RM_STD, rel=1e-6)
    assert out["score_gain_rm_std_ci95"] == pytest.approx(out["score_gain_ci95"] / RM_STD, rel=1e-6)
    correct_diffs = [0, -1, 0, 0, 0, 0]  # only row 1 differs: the reference is right there
    assert out["accuracy_gain"] == pytest.approx(statistics.mean(correct_diffs), abs=1e-12)
    assert out["accuracy_gain_ci95"] == pytest.approx(T5 * statistics.stdev(correct_diffs) / 6 ** 0.5, rel=1e-6)
    # proportions: Wilson intervals, never ±0 (1 of 6 correct)
    assert (out["policy/accuracy_ci95_low"], out["policy/accuracy_ci95_high"]) == pytest.approx(WILSON_1_OF_6, abs=1e-4)
    assert out["warning"].startswith("too few held-out prompts (6)")
    assert out["reference"] == str(tiny_dirs["reference"])
    # the checker fell (row 1) with an interval containing 0: at most "possible" hacking, when the RM score rose
    assert out["reward_hacking"] == ("possible" if out["score_gain"] > 0 else "none")
    assert f"checker accuracy {out['accuracy_gain']:+.3f} ± " in out["headline"]


def test_reward_hacking_verdict_is_read_from_the_intervals():
    from rlhf_cli.core import reward_hacking

    rm_up = {"score_gain": 0.5, "score_gain_ci95": 0.1}  # interval [0.4, 0.6]: a real rise
    assert reward_hacking({"accuracy_gain": -0.1, "accuracy_gain_ci95": 0.05}) == {}  # no RM: nothing to say
    assert reward_hacking(rm_up) == {}  # nothing checkable
    # both moves real and opposite: the warning
    out = reward_hacking({**rm_up, "accuracy_gain": -0.1, "accuracy_gain_ci95": 0.05})
    assert out["reward_hacking"] == "warning"
    assert out["headline"].startswith("reward hacking: the RM score rose while checker accuracy fell (RM score "
                                      "+0.500 ± 0.100; checker accuracy -0.100 ± 0.050;")
    out = reward_hacking({**rm_up, "accuracy_gain": 0.1, "accuracy_gain_ci95": 0.07, "function_gain": -0.2,
                          "function_gain_ci95": 0.1})
    assert out["reward_hacking"] == "warning" and "while reward.function fell" in out["headline"]
    # run B4 of docs/results.md: the checker's interval contains 0, so only the note
    out = reward_hacking({"score_gain": 0.53, "score_gain_ci95": 0.11, "accuracy_gain": -0.04,
                          "accuracy_gain_ci95": 0.07})
    assert out["reward_hacking"] == "possible" and out["headline"].startswith("possible reward hacking")
    # both intervals straddle 0, point estimates apart: the note
    out = reward_hacking({"score_gain": 0.05, "score_gain_ci95": 0.1, "accuracy_gain": -0.02,
                          "accuracy_gain_ci95": 0.05})
    assert out["reward_hacking"] == "possible"
    # the RM interval straddles 0 while the checker really fell: still only the note (the RM rise is not shown)
    out = reward_hacking({"score_gain": 0.05, "score_gain_ci95": 0.1, "accuracy_gain": -0.2,
                          "accuracy_gain_ci95": 0.05})
    assert out["reward_hacking"] == "possible"
    out = reward_hacking({**rm_up, "accuracy_gain": 0.1, "accuracy_gain_ci95": 0.07})
    assert out["reward_hacking"] == "none" and out["headline"].startswith("no reward hacking: the RM score rose")
    out = reward_hacking({"score_gain": -0.5, "score_gain_ci95": 0.1, "accuracy_gain": -0.1, "accuracy_gain_ci95": 0})
    assert out["reward_hacking"] == "none" and out["headline"].startswith("no reward hacking: the RM score did not")


def test_policy_eval_stats_on_hand_values_without_models():
    from rlhf_cli.core import policy_eval_stats

    t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    pol = {"length": t(4, 6, 8, 2, 4, 6), "eos": t(1, 1, 0, 1, 1, 1), "score": t(1, 2, 3, 0, -1, 2),
           "correct": torch.tensor([1, 1, 0, 1, 0, 1]), "kl_k1": t(0.1, 0.2, 0.3, 0.0, 0.1, 0.5),
           "kl_k3": t(0.1, 0.1, 0.2, 0.0, 0.1, 0.3)}
    ref = {"length": t(2, 2, 4, 4, 6, 6), "eos": t(1, 0, 0, 1, 1, 1), "score": t(0, 2, 4, -1, -1, 1),
           "correct": torch.tensor([1, 0, 0, 1, 1, 0])}
    out = policy_eval_stats(pol, ref, rm_std=0.5)
    half = lambda xs: T5 * statistics.stdev(xs) / math.sqrt(len(xs))  # noqa: E731
    diffs, gains = [1, 0, -1, 1, 0, 1], [0, 1, 0, 0, -1, 1]
    assert out["policy/length_mean"] == 5.0 and out["reference/eos_rate"] == pytest.approx(4 / 6)
    assert out["policy/score_mean"] == pytest.approx(7 / 6)
    assert out["policy/score_ci95"] == pytest.approx(half([1, 2, 3, 0, -1, 2]), rel=1e-6)
    assert out["win_rate"] == pytest.approx((1 + 0.5 + 0 + 1 + 0.5 + 1) / 6)
    assert (out["win_rate_ci95_low"], out["win_rate_ci95_high"]) == wilson_ci95(out["win_rate"], 6)
    assert out["score_gain"] == pytest.approx(1 / 3) and out["score_gain_ci95"] == pytest.approx(half(diffs), rel=1e-6)
    assert out["score_gain_rm_std"] == pytest.approx(2 / 3)
    assert out["policy/accuracy"] == pytest.approx(4 / 6)
    assert (out["reference/accuracy_ci95_low"], out["reference/accuracy_ci95_high"]) == pytest.approx(
        wilson_ci95(3 / 6, 6))
    assert out["accuracy_gain"] == pytest.approx(1 / 6) and out["accuracy_gain_ci95"] == pytest.approx(half(gains))
    assert out["reward_hacking"] == "none"  # the checker did not fall
    assert out["kl_k1"] == pytest.approx(0.2) and out["kl_k3_ci95"] == pytest.approx(
        half([0.1, 0.1, 0.2, 0.0, 0.1, 0.3]), rel=1e-6)
    assert "function_gain" not in out and "policy/function_mean" not in out
    # no reward model: no score figures, no win rate, no verdict; a tiny RM std is not divided by
    bare = policy_eval_stats({k: v for k, v in pol.items() if k != "score"},
                             {k: v for k, v in ref.items() if k != "score"})
    assert not {"win_rate", "score_gain", "policy/score_mean", "reward_hacking"} & set(bare)
    assert "score_gain_rm_std" not in policy_eval_stats(pol, ref, rm_std=1e-7)
    with pytest.raises(KeyError):  # the policy's KL is always measured
        policy_eval_stats({k: v for k, v in pol.items() if k != "kl_k1"}, ref)


def test_policy_eval_scores_both_sides_with_the_reward_function(run_stage, tiny_dirs, tokenizer, monkeypatch,
                                                               tmp_path):
    seen = fake_sampling(monkeypatch, tiny_dirs, tokenizer)
    fn = tmp_path / "fn.py"
    fn.write_text("def words(prompts, completions, answer, **kw):\n    return [len(c.split()) for c in completions]\n")
    _, eval_dir, _ = run_stage("eval", [
        f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}", "reward.type=checker",
        f"reward.function={fn}:words", "data.builtin.ppo_eval=6", f"eval.max_new_tokens={MAX_NEW_TOKENS}"])
    out = read_results(eval_dir)
    words = {role: [len(tokenizer.decode(r, skip_special_tokens=True).split()) for r in seen[role][1]]
             for role in ("policy", "reference")}
    for role in ("policy", "reference"):
        assert out[f"{role}/function_mean"] == pytest.approx(statistics.mean(words[role]))
    diffs = [p - r for p, r in zip(words["policy"], words["reference"])]
    assert out["function_gain"] == pytest.approx(statistics.mean(diffs))
    assert out["function_gain_ci95"] == pytest.approx(T5 * statistics.stdev(diffs) / 6 ** 0.5, rel=1e-6)
    assert "reward_hacking" not in out  # no reward model: no RM score to rise


@pytest.mark.parametrize("reward", ["model without stored stats", "checker"])
def test_policy_eval_gains_without_rm_stats_or_without_rm(run_stage, tiny_dirs, tokenizer, monkeypatch, reward):
    """An RM without stored score stats gives no `score_gain_rm_std`; the checker gives no scores at all."""
    fake_sampling(monkeypatch, tiny_dirs, tokenizer)
    rm = [f"reward_model.path={tiny_dirs['rm_no_stats']}"] if reward != "checker" else ["reward.type=checker"]
    headline, eval_dir, _ = run_stage("eval", [
        f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}", *rm,
        "data.builtin.ppo_eval=6", f"eval.max_new_tokens={MAX_NEW_TOKENS}", f"eval.temperature={TEMPERATURE}"])
    out = read_results(eval_dir)
    assert "score_gain_rm_std" not in out and "score_gain_rm_std_ci95" not in out
    assert out["accuracy_gain"] == pytest.approx(-1 / 6) and out["policy/accuracy"] == pytest.approx(1 / 6)
    if reward == "checker":
        assert not any(k.startswith(("score_gain", "win_rate")) or k.endswith("score_mean") for k in out)
        assert headline == out["policy/accuracy"]
    else:
        assert math.isfinite(out["score_gain"]) and out["score_gain_ci95"] > 0
        assert headline == out["win_rate"]


def test_mean_ci95_is_a_t_interval_and_has_none_below_two_values():
    from rlhf_cli.core import mean_ci95

    assert mean_ci95(torch.tensor([2.0]))[0] == 2.0 and math.isnan(mean_ci95(torch.tensor([2.0]))[1])
    assert all(math.isnan(v) for v in mean_ci95(torch.tensor([])))
    mean, half = mean_ci95(torch.tensor([1.0, 3.0]))  # s = √2, n = 2: t(0.975, 1) · √2 / √2
    assert mean == 2.0 and half == pytest.approx(12.7062047, rel=1e-7)


@pytest.mark.parametrize(("df", "want"), [(1, 12.7062047), (2, 4.3026527), (5, T5), (29, 2.0452296),
                                          (120, 1.9799304)])
def test_t_quantile_matches_the_table(df, want):
    from rlhf_cli.core import t_quantile

    assert t_quantile(0.975, df) == pytest.approx(want, rel=1e-7)
    assert t_quantile(0.025, df) == pytest.approx(-want, rel=1e-7)
    assert t_quantile(0.95, 3) == pytest.approx(2.3533634, rel=1e-7)


@pytest.mark.parametrize(("p", "n", "want"), [
    (0.0, 4, (0.0, 0.4898908)),  # 0/n: [0, z²/(n + z²)], not ±0
    (1.0, 4, (0.5101092, 1.0)),  # n/n
    (0.5, 10, (0.2365931, 0.7634069)),
    (1 / 6, 6, WILSON_1_OF_6),
])
def test_wilson_interval_matches_hand_values(p, n, want):
    from rlhf_cli.core import proportion_ci95, wilson_ci95

    assert wilson_ci95(p, n) == pytest.approx(want, abs=1e-6)
    k = round(p * n)
    assert proportion_ci95(torch.tensor([1.0] * k + [0.0] * (n - k)))[1:] == pytest.approx(want, abs=1e-6)
    assert all(math.isnan(v) for v in wilson_ci95(0.5, 0))


def test_small_samples_get_a_warning():
    from rlhf_cli.core import SMALL_SAMPLE, small_sample_warning

    assert small_sample_warning(SMALL_SAMPLE, "pairs") is None
    assert small_sample_warning(4, "pairs").startswith("too few held-out pairs (4): ")


def test_policy_eval_end_to_end_on_the_smoke_pipeline(pipeline):
    _, eval_dir, _ = pipeline["eval"]
    _, ppo_dir, _ = pipeline["ppo"]
    _, rm_dir, _ = pipeline["rm"]
    saved = json.loads((eval_dir / "eval.json").read_text())
    out = saved["results"]
    assert out["mode"] == "policy" and out["prompts"] == 8
    assert out["policy"] == str((ppo_dir / "final").resolve())  # default: <paths.root>/latest_policy
    assert out["reward_model"] == str((rm_dir / "final").resolve())  # recorded in the policy checkpoint
    assert 0.0 <= out["win_rate"] <= 1.0
    assert math.isfinite(out["kl_k1"]) and math.isfinite(out["kl_k3"]) and out["kl_k3"] >= 0
    for role in ("policy", "reference"):
        assert math.isfinite(out[f"{role}/score_mean"])
        assert 0.0 <= out[f"{role}/accuracy"] <= 1.0
        assert 0.0 <= out[f"{role}/eos_rate"] <= 1.0
        assert 1 <= out[f"{role}/length_mean"] <= MAX_NEW_TOKENS
    assert len(out["samples"]) == 8
    assert saved["config"]["eval"]["max_new_tokens"] == MAX_NEW_TOKENS
    assert json.loads((eval_dir / "status.json").read_text())["state"] == "finished"
    # every prompt's pair, as the report reads it
    lines = [json.loads(ln) for ln in (eval_dir / "responses.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and [x["policy_score"] for x in lines] == json.loads(
        (eval_dir / "rewards.json").read_text())["policy"]
    assert all(x["policy_correct"] in (0.0, 1.0) and 1 <= x["reference_length"] <= MAX_NEW_TOKENS for x in lines)
    # the page: the verdict, then the RM and PPO runs found through the recorded parents
    html = (eval_dir / "report" / "report.html").read_text()
    for title in ("<h2>Did RLHF help?</h2>", f"<h2>reward-model training: {rm_dir.resolve()}</h2>",
                  f"<h2>PPO training: {ppo_dir.resolve()}</h2>", "<h2>reward distributions</h2>",
                  "<h2>length vs reward</h2>", "<h2>samples (the first 8 of 8 held-out prompts)</h2>",
                  "<summary>config of the rm run (a)</summary>", "<summary>config of the ppo run (a)</summary>"):
        assert title in html, title
    assert f"wins {out['win_rate']:.0%} of 8 held-out prompts" in html
    assert (eval_dir / "report" / "0_rm_a" / "rm_loss.png").is_file()
    assert (eval_dir / "report" / "1_ppo_a" / "ppo_kl.png").is_file()


def test_report_of_a_past_rm_run(pipeline, run_stage):
    _, rm_dir, _ = pipeline["rm"]
    result, eval_dir, _ = run_stage("eval", [f"run_dir={rm_dir}"])
    assert result is None
    report = rm_dir / "report"
    html = (report / "report.html").read_text()
    pngs = sorted(p.name for p in report.glob("*.png"))
    for name in ("rm_loss.png", "rm_accuracy.png", "lr.png", "reward_hist.png"):
        assert name in pngs
    assert html.count("data:image/png;base64,") == len(pngs)
    assert not eval_dir.exists(), "a report-only eval leaves no run dir of its own"


def test_policy_eval_refuses_fewer_prompts_than_processes(run_stage, tiny_dirs, monkeypatch):
    """Each process samples its own share of the prompts: 3 prompts on 4 processes would leave one empty, so the
    run stops before loading a model, with one line naming both numbers and what cut them (the same on every rank)."""
    from rlhf_cli import engine
    from rlhf_cli.errors import ConfigError

    monkeypatch.setattr(engine, "world_size", lambda: 4)
    models = [f"policy.path={tiny_dirs['policy']}", f"reference.path={tiny_dirs['reference']}", "reward.type=checker"]
    with pytest.raises(ConfigError, match=r"^3 eval prompt\(s\) for 4 processes \(eval.num_prompts=3\): .*at most 3 "
                                          r"or raise eval.num_prompts$"):
        run_stage("eval", [*models, "eval.num_prompts=3", "data.builtin.ppo_eval=8"])
    with pytest.raises(ConfigError, match=r"^2 eval prompt\(s\) for 4 processes \(all the eval split of the built-in "
                                          r"task \(data.builtin.ppo_eval\) holds\): .*at most 2$"):
        run_stage("eval", [*models, "eval.num_prompts=5", "data.builtin.ppo_eval=2"])
