"""`rlhf train-kto` on the tiny model and the built-in task's checker-labelled replies: the chain train-sft ->
train-kto (from `latest_sft`) -> eval writes `final/` (a plain causal LM recording its reference, the SFT model)
and `latest_kto`, and eval compares against that start; at the first step every log-ratio and the reference point
are 0 and the loss is λ/2 per row; a run cut into other micro-batches, padded instead of packed, with its reference
precomputed gives the same numbers (the reference point is one per optimizer step); a resumed run continues the run
it resumes; the stage's loss, reference point and gradients equal a plain-torch loop over the rows; bad labels, a
file of one label and `kto.batch_size=1` are refused in one line before torch loads."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from stage_helpers import assert_same_gradients, grads, subprocess_env

from rlhf_cli.core import kl_reference_point, kto_loss
from rlhf_cli.data import PackedPairCollator, PairCollator
from rlhf_cli.forwards import completion_logprobs, unpaired_collator
from rlhf_cli.models import disable_dropout, load_causal_lm
from rlhf_cli.stages.kto import Reference, kl_logratio_sum, weight_advice, with_kl_completions

STEPS = 4
SMOKE = ["experiment=smoke", "precision=fp32", "data.builtin.rm_train=32", "data.builtin.rm_eval=6"]
PAD, EOS = 0, 2
KEYS = ("kto/loss", "kto/kl", "kto/rewards_desirable", "kto/rewards_undesirable", "kto/logprobs_desirable",
        "kto/logprobs_undesirable")


def read_metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "kto/loss" in r}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """train-sft (2 steps) -> train-kto from `latest_sft` (checkpoints every 2 steps, held-out figures every 2) ->
    eval of `latest_kto`, all through the CLI. Returns (root, the SFT run, the KTO run, the eval dir, its overrides)."""
    from rlhf_cli import cli

    root = tmp_path_factory.mktemp("kto") / "runs"
    argv = sys.argv
    sys.argv = ["rlhf"]
    try:
        cli.main(["train-sft", *SMOKE, f"paths.root={root}", "sft.max_steps=2", "sft.lr=5e-3"])
        kto = [*SMOKE, "model=hf", f"model.name_or_path={root / 'latest_sft'}", f"kto.max_steps={STEPS}",
               "kto.eval_every=2", "kto.save_every=2", "kto.lr=2e-3"]
        cli.main(["train-kto", *kto, f"paths.root={root}"])
        cli.main(["eval", *SMOKE, f"paths.root={root}", f"policy.path={root / 'latest_kto'}", "reward.type=checker",
                  "eval.num_prompts=4", "eval.max_new_tokens=4"])
    finally:
        sys.argv = argv
    (sft_dir,), (kto_dir,), (eval_dir,) = ((root / k).iterdir() for k in ("sft", "kto", "eval"))
    return root, sft_dir, kto_dir, eval_dir, kto


def test_the_chain_sft_kto_eval_through_latest_sft(chain):
    from transformers import AutoModelForCausalLM

    root, sft_dir, run_dir, eval_dir, _ = chain
    final = run_dir / "final"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (root / "latest_kto").read_text().strip() == str(final.resolve())
    train = train_records(run_dir)
    assert sorted(train) == list(range(1, STEPS + 1))
    first = train[1]  # the policy is its reference: log-ratios 0, z0 0, loss 1/2 per row (both weights 1)
    assert first["kto/loss"] == pytest.approx(0.5, abs=1e-6) and first["kto/kl"] == 0
    for key in ("kto/rewards_desirable", "kto/rewards_undesirable"):
        assert abs(first[key]) <= 1e-6
    assert all(set(KEYS) <= set(r) for r in train.values())
    assert train[STEPS]["kto/loss"] < first["kto/loss"] and any(r["kto/kl"] > 0 for r in train.values())
    evals = [r for r in read_metrics(run_dir) if "eval/kto/loss" in r]
    assert [r["step"] for r in evals] == [2, STEPS] and all(f"eval/{k}" in evals[-1] for k in KEYS)
    assert json.loads((final / "rlhf_eval.json").read_text())["eval"]["eval/kto/loss"] == evals[-1]["eval/kto/loss"]
    model = AutoModelForCausalLM.from_pretrained(final)
    sft_final = str((sft_dir / "final").resolve())
    assert model.config.rlhf_stage == "kto" and model.config.rlhf_reference_model["name_or_path"] == sft_final
    results = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert results["policy"] == str(final.resolve()) and results["reference"] == sft_final  # against the start
    assert results["kl_k3"] > 0


def test_micro_batches_padding_and_a_precomputed_reference_change_no_number(chain, run_stage):
    """The same run cut into micro-batches of 2 instead of 4, padded instead of packed, its reference log-probs
    precomputed (every step's mismatched pairs too) instead of a frozen copy with each step: the same metrics, the
    reference point included (one per optimizer step, not per micro-batch), and the same final weights."""
    _, _, run_dir, _, overrides = chain
    _, other, _ = run_stage("train_kto", [o for o in overrides if not o.startswith("kto.save_every")]
                            + ["kto.micro_batch_size=2", "data.packing=false", "kto.precompute_reference=true"])
    a, b = read_metrics(run_dir), read_metrics(other)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if key.startswith(("kto/", "eval/kto/")) and key not in ("kto/lr", "kto/grad_norm", "kto/epoch"):
                assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (ra["step"], key)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in (run_dir, other))
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=1e-5)


def test_resume_continues_the_run(chain, run_stage, tmp_path):
    root, _, run_dir, _, overrides = chain
    crashed = tmp_path / "runs" / "kto" / "crashed"
    shutil.copytree(run_dir, crashed)
    (crashed / "ds" / "latest").write_text("step-2\n")  # as if it had crashed right after the step-2 checkpoint
    (crashed / "status.json").write_text(json.dumps({"state": "running"}))
    shutil.rmtree(crashed / "final")
    run_stage("train_kto", [*overrides, f"resume={crashed}"], run_dir=crashed)
    original, resumed = train_records(run_dir), train_records(crashed)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):  # the same rows, mismatched pairs and reference after the resume
        for key in KEYS:
            assert resumed[step][key] == pytest.approx(original[step][key], rel=1e-5, abs=1e-6), (step, key)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (run_dir, crashed))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)


def make_rows(vocab, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()  # noqa: E731 (ids 0-2: pad/bos/eos)
    return [{"prompt_ids": rnd(2 + i % 3), "completion_ids": rnd(1 + (i * 3) % 5) + [EOS], "label": i % 3 != 1,
             "row": i + 1} for i in range(n)]


def plain_logprob(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).sum()


@pytest.mark.parametrize("packed", [False, True])
def test_loss_reference_point_and_gradients_equal_a_plain_torch_loop(tiny_model_cfg, tokenizer, packed):
    """The stage's step on 6 rows (the reference point from the cycled mismatched pairs, the reference's log-probs
    of both from one pair forward, the policy's in one forward, `core.kto_loss`) against a loop over the rows
    through the plain models: z0 = max(0, mean_i log π(y_{i-1}|x_i) − log π_ref(y_{i-1}|x_i)), then λ (1 − σ(...))
    averaged. The mismatched completion is cut to fit `max_length` beside its prompt."""
    policy = disable_dropout(load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)).train()
    reference_model = load_causal_lm(tiny_model_cfg, seed=1, tokenizer=tokenizer).eval()
    rows, max_length = make_rows(policy.config.vocab_size, seed=3), 7
    kl_rows = with_kl_completions(rows, max_length)
    assert [r["kl_ids"] for r in kl_rows] == [rows[i - 1]["completion_ids"][:max_length - len(rows[i]["prompt_ids"])]
                                              for i in range(6)]
    reference = Reference(reference_model, "fp32", (PackedPairCollator if packed else PairCollator)(PAD))
    collate = unpaired_collator(policy, PAD, packed)
    logratio, ref_lp = kl_logratio_sum(policy, reference, kl_rows, unpaired_collator(policy, PAD, packed, "kl_ids"),
                                       4, "fp32")
    z0 = kl_reference_point(logratio, len(rows))
    labels = torch.tensor([r["label"] for r in rows])
    loss, _ = kto_loss(completion_logprobs(policy, collate(kl_rows), "fp32"), ref_lp, labels, z0, beta=0.5,
                       desirable_weight=1.3, undesirable_weight=0.8)
    loss.backward()
    ours = grads(policy)
    policy.zero_grad()

    with torch.no_grad():
        mismatched = [plain_logprob(policy, r["prompt_ids"], r["kl_ids"])
                      - plain_logprob(reference_model, r["prompt_ids"], r["kl_ids"]) for r in kl_rows]
        want_z0 = max(0.0, float(torch.stack(mismatched).mean()))
    terms = []
    for r in rows:
        with torch.no_grad():
            ref = plain_logprob(reference_model, r["prompt_ids"], r["completion_ids"])
        ratio = plain_logprob(policy, r["prompt_ids"], r["completion_ids"]) - ref
        terms.append(1.3 * (1 - F.sigmoid(0.5 * (ratio - want_z0))) if r["label"]
                     else 0.8 * (1 - F.sigmoid(0.5 * (want_z0 - ratio))))
    want = torch.stack(terms).mean()
    want.backward()
    assert float(z0) == pytest.approx(want_z0, rel=1e-5, abs=1e-6)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert_same_gradients(ours, grads(policy))


def test_unbalanced_classes_are_advised_as_trl_does():
    assert weight_advice(10, 10, 1.0, 1.0) is None
    assert weight_advice(10, 30, 3.5, 1.0) is None  # λ_D n_D / (λ_U n_U) in [1, 4/3]
    assert "kto.desirable_weight in [3.0, 3.99] or kto.undesirable_weight in [0.25, 0.33]" in weight_advice(
        10, 30, 1.0, 1.0)


@pytest.mark.parametrize("rows,overrides,says", [
    ([{"prompt": "Hi?", "completion": "Hello.", "label": True}, {"prompt": "Hi?", "completion": "Go.", "label": "no"}],
     [], "rows.jsonl row 2, field 'label': the label must be a boolean (true = desirable, false = undesirable), got "
         "'no' (str)"),
    ([{"prompt": "Hi?", "completion": "Hello.", "label": 1}], [], "rows.jsonl row 1, field 'label': the label must "
                                                                  "be a boolean"),
    ([{"prompt": "Hi?", "completion": "Hello.", "ok": True}, {"prompt": "Hi?", "completion": "Go.", "ok": True}],
     ["data.label_key=ok"], "rows.jsonl field 'ok': all 2 valid rows are desirable (true): KTO needs both desirable "
                            "and undesirable completions in a file"),
    ([{"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."}], ["kto.batch_size=1", "kto.micro_batch_size=1"],
     "kto.batch_size must be >= 2 (got 1)"),
])
def test_bad_input_is_refused_in_one_line_before_torch_loads(rows, overrides, says, tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = ("import sys\nfrom rlhf_cli import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
            "    print('exit', e.code, 'imported', heavy, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code, "train-kto", "experiment=smoke", "data.path=rows.jsonl",
                          *overrides], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert says in out.stderr and "exit 2 imported []" in out.stderr, out.stderr
    error_lines = [ln for ln in out.stderr.splitlines() if says[:20] in ln]
    assert len(error_lines) == 1  # one line
    assert not (tmp_path / "runs").exists()
