"""Every family a user brings runs through the chain in-process (issue 41): tiny random GPT-2, OPT, GPT-NeoX, Qwen2,
Qwen3, Gemma 2, Phi-3 and Mistral (`family_helpers`), each loaded as a user's model (`model.name_or_path=<dir>`):
a train-rm step (packed; and one with LoRA, unpacked), whose `final/` plain transformers reads as the run scored
(`rewards.json`), a train-ppo iteration with GAE (a separate critic grown from the reward model), one with GRPO,
and `rlhf eval` of the GRPO policy scored by the reward model.

What can break per family and is checked here: loading (Gemma 2 lacks sdpa: the attention fallback), the scalar
head (`*ForSequenceClassification` of each family), positions under left padding (GPT-2, OPT: absolute
positions), packing (`data.packing`, the default) or its fallback, the final saves, and the numbers being finite.
"""

import copy
import json
import math

import pytest
import torch
from family_helpers import FAMILIES, save_tiny

from rlhf_cli.forwards import batched_scores, packing_probe, policy_forward
from rlhf_cli.models import (
    add_lora,
    custom_mask_support,
    load_causal_lm,
    load_scalar_model,
    merged_state_dict,
    parameter_counts,
)
from rlhf_cli.rollout import Generation, rollout_batch

DATA = ["data.builtin.rm_train=8", "data.builtin.rm_eval=4", "data.builtin.ppo_train=4", "data.builtin.ppo_eval=2"]
PPO = ["ppo.iterations=1", "ppo.rollout_batch_size=2", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
       "ppo.epochs=1", "ppo.max_new_tokens=4", "ppo.n_samples_per_prompt=2"]


def assert_plain_transformers_reproduces(rm_dir, data_cfg):
    """`AutoModelForSequenceClassification` and the tokenizer of a train-rm `final/`, on the run's held-out pairs
    (`data_cfg`: the run's `data` section) padded the saved tokenizer's way, give the run's `rewards.json`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.data import load_preference_data

    want = json.loads((rm_dir / "rewards.json").read_text())
    tok = AutoTokenizer.from_pretrained(rm_dir / "final")
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir / "final").eval()
    heldout = load_preference_data(data_cfg, tok).eval
    for which in ("chosen", "rejected"):
        batch = tok.pad({"input_ids": [ex["prompt_ids"] + ex[f"{which}_ids"] for ex in heldout]}, return_tensors="pt")
        with torch.no_grad():
            got = rm(**batch).logits[:, 0]
        torch.testing.assert_close(got, torch.tensor(want[which]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chain_runs_in_process(family, run_stage, tmp_path, tokenizer):
    path = save_tiny(family, tokenizer, tmp_path / family)
    model = [f"model.name_or_path={path}", "model.init=pretrained", "model.tokenizer=null", f"model.name={family}"]
    root = tmp_path / "runs"
    acc, rm_dir, rm_cfg = run_stage("train_rm", [*model, *DATA, "rm.batch_size=4", "rm.micro_batch_size=2",
                                            "rm.max_steps=1", "rm.eval_batch_size=4"], root=root)
    assert acc is not None and 0 <= acc <= 1
    rewards = json.loads((rm_dir / "rewards.json").read_text())
    assert len(rewards["chosen"]) == 4 and all(map(math.isfinite, rewards["chosen"] + rewards["rejected"]))
    assert_plain_transformers_reproduces(rm_dir, rm_cfg.data)
    lora_acc, lora_dir, lora_cfg = run_stage("train_rm", [*model, *DATA, "rm.batch_size=4", "rm.micro_batch_size=2",
                                                   "rm.max_steps=1", "model.lora.r=4", "data.packing=false"],
                                      root=tmp_path / "lora_runs")
    assert lora_acc is not None and (lora_dir / "final" / "adapter").is_dir()
    assert_plain_transformers_reproduces(lora_dir, lora_cfg.data)
    for estimator in ("gae", "grpo"):
        _, ppo_dir, _ = run_stage("train_ppo", [*model, *DATA, *PPO, f"ppo.advantage_estimator={estimator}",
                                                f"reward_model.path={rm_dir}"], root=root)
        assert (ppo_dir / "final" / "config.json").is_file()
        metrics = [json.loads(line) for line in (ppo_dir / "metrics.jsonl").read_text().splitlines()]
        scores = [m["objective/scores"] for m in metrics if "objective/scores" in m]
        assert scores and all(map(math.isfinite, scores))
    _, eval_dir, _ = run_stage("eval", [*DATA, f"policy.path={ppo_dir}", f"reward_model.path={rm_dir}",
                                        "eval.max_new_tokens=4", "eval.batch_size=4"], root=root)
    result = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert math.isfinite(result["policy/score_mean"]) and math.isfinite(result["reference/score_mean"])


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_and_packing_change_no_number(family, tmp_path, tokenizer):
    """A row's response log-probs and reward are the same alone, batched with longer and shorter rows (left-padded
    prompts, right-padded responses: absolute positions would shift) and packed (`data.packing`, where the model
    takes a custom mask), to float rounding."""
    path = save_tiny(family, tokenizer, tmp_path / family)
    lm = load_causal_lm(str(path), tokenizer=tokenizer).eval()
    rm = load_scalar_model(str(path), seed=1).eval()
    pad = tokenizer.pad_token_id
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    responses = [[20, 21, 2], [22, 23, 24, 25, 2], [26]]

    def batch(rows):
        R = max(len(responses[i]) for i in rows)
        resp = torch.tensor([responses[i] + [pad] * (R - len(responses[i])) for i in rows])
        mask = torch.tensor([[1.0] * len(responses[i]) + [0.0] * (R - len(responses[i])) for i in rows])
        has_eos = torch.tensor([responses[i][-1] == 2 for i in rows])
        return rollout_batch([prompts[i] for i in rows], Generation(resp, mask, has_eos, None), pad)

    if custom_mask_support(lm) is None:  # packed segments stay apart (sliding-window families never pack)
        assert packing_probe(lm) is None and packing_probe(rm) is None
    ids, am, P, _ = batch([0, 1, 2])
    with torch.no_grad():
        lp = {packed: policy_forward(lm, ids, am, P, 1.0, packing=packed)[0] for packed in (False, True)}
        score = {packed: batched_scores(rm, ids, am, 8, "fp32", P, packed) for packed in (False, True)}
        for i in range(3):
            one_ids, one_am, one_P, _ = batch([i])
            alone = policy_forward(lm, one_ids, one_am, one_P, 1.0)[0][0]
            n = len(responses[i])
            for packed in (False, True):
                torch.testing.assert_close(lp[packed][i, :n], alone[:n], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(score[packed][i], batched_scores(rm, one_ids, one_am, 8, "fp32")[0],
                                           atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_default_targets_resolve(family, tmp_path, tokenizer):
    """`model.lora.r > 0` with the default `model.lora.target_modules` puts adapters on each family's trunk, for a
    policy and a reward model, and the merged weights give the adapted model's outputs."""
    from omegaconf import OmegaConf

    from rlhf_cli.config import ModelConfig

    path = save_tiny(family, tokenizer, tmp_path / family)
    lora = OmegaConf.structured(ModelConfig).lora
    lora.r = 4
    for model in (load_causal_lm(str(path), tokenizer=tokenizer), load_scalar_model(str(path), seed=1)):
        add_lora(model, lora, heads=("score",) if hasattr(model, "score") else ())
        assert parameter_counts(model)[0] > 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        ids = torch.tensor([[5, 6, 7, 8, 2]])
        with torch.no_grad():
            want = model(input_ids=ids).logits
        merged = merged_state_dict(model, model.state_dict())
        plain = (load_causal_lm(str(path), tokenizer=tokenizer) if not hasattr(model, "score")
                 else load_scalar_model(str(path), seed=1))
        plain.load_state_dict(merged, strict=False)
        with torch.no_grad():
            torch.testing.assert_close(plain.eval()(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_exported_reward_model_reproduces_the_runs_scores(family, run_stage, tmp_path, tokenizer):
    """Plain transformers reads a train-rm `final/` as the run scored: `AutoModelForSequenceClassification` on the
    held-out pairs padded by the saved tokenizer gives `rewards.json`. The user's tokenizer pads on the left; the
    saved one pads on the right, the side the scores assume (GPT-2's absolute positions move under left padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_cli.data import load_preference_data

    user_tok = copy.deepcopy(tokenizer)
    user_tok.padding_side = user_tok.init_kwargs["padding_side"] = "left"  # saved with the user's model
    path = save_tiny(family, user_tok, tmp_path / family)
    assert AutoTokenizer.from_pretrained(path).padding_side == "left"
    model = [f"model.name_or_path={path}", "model.init=pretrained", "model.tokenizer=null"]
    _, rm_dir, cfg = run_stage("train_rm", [*model, *DATA, "rm.batch_size=4", "rm.micro_batch_size=2",
                                            "rm.max_steps=2", "rm.lr=1e-2", "rm.eval_batch_size=4"])
    want = json.loads((rm_dir / "rewards.json").read_text())
    saved = AutoTokenizer.from_pretrained(rm_dir / "final")
    assert saved.padding_side == "right"
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir / "final").eval()
    heldout = load_preference_data(cfg.data, saved).eval
    scores = {}
    for side in ("right", "left"):
        saved.padding_side = side
        for which in ("chosen", "rejected"):
            batch = saved.pad({"input_ids": [ex["prompt_ids"] + ex[f"{which}_ids"] for ex in heldout]},
                              return_tensors="pt")
            with torch.no_grad():
                scores[side, which] = rm(**batch).logits[:, 0]
    for which in ("chosen", "rejected"):
        torch.testing.assert_close(scores["right", which], torch.tensor(want[which]), atol=1e-4, rtol=1e-4)
    if family == "gpt2":  # what a left-padding default would have given
        lengths = {len(ex["prompt_ids"]) + len(ex["chosen_ids"]) for ex in heldout}
        assert len(lengths) > 1 and not torch.allclose(scores["left", "chosen"], scores["right", "chosen"], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_the_cli_chain_runs(family, tmp_path, tokenizer):
    """The whole chain as a user types it, `model=hf model.name_or_path=<dir>`: train-rm, train-ppo with GAE and
    with GRPO, eval (each finds the last one's output through the pointers). Gemma 2 says once that sdpa fell back
    to eager; no command prints a traceback."""
    import subprocess
    import sys

    from stage_helpers import REPO, subprocess_env

    path = save_tiny(family, tokenizer, tmp_path / family)
    common = ["model=hf", f"model.name_or_path={path}", "precision=fp32", f"paths.root={tmp_path / 'runs'}", *DATA]
    commands = [["train-rm", "rm.batch_size=4", "rm.micro_batch_size=2", "rm.max_steps=1"],
                ["train-ppo", *PPO, "ppo.advantage_estimator=gae"],
                ["train-ppo", *PPO, "ppo.advantage_estimator=grpo"],
                ["eval", "eval.max_new_tokens=4", "eval.batch_size=4"]]
    for command, *args in commands:
        out = subprocess.run([sys.executable, "-m", "rlhf_cli", command, *common, *args], cwd=REPO,
                             env=subprocess_env(HYDRA_FULL_ERROR="0"), capture_output=True, text=True, timeout=600)
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "Traceback" not in text, f"{command}: {text[-3000:]}"
        if family == "gemma2":
            assert "model.attn_implementation=sdpa is not supported" in text, command
    assert (tmp_path / "runs" / "latest_rm").exists() and (tmp_path / "runs" / "latest_policy").exists()
