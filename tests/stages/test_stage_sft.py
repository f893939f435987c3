"""`rlhf train-sft` end to end on the tiny model and the built-in task's correct solutions: the CLI run writes
`final/` (a plain causal LM) and `latest_sft`, from which train-rm and train-ppo start (then eval); the loss does
not depend on how an optimizer step is cut into micro-batches, packed runs train the model unpacked runs train
(fp32), and a resumed run continues the run it resumes."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

STEPS = 4
SMOKE = ["experiment=smoke", "precision=fp32"]


def read_metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "sft/loss" in r}


def test_cli_run_writes_a_causal_lm_and_latest_sft_that_train_rm_starts_from(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlhf_cli import cli
    from rlhf_cli.lineage import read_run

    root = tmp_path / "runs"
    monkeypatch.setattr("sys.argv", ["rlhf"])
    cli.main(["train-sft", *SMOKE, f"paths.root={root}", f"sft.max_steps={STEPS}", "sft.eval_every=2"])
    (run_dir,) = (root / "sft").iterdir()
    final = run_dir / "final"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (root / "latest_sft").read_text().strip() == str(final.resolve())
    train = train_records(run_dir)
    assert sorted(train) == list(range(1, STEPS + 1))
    assert train[STEPS]["sft/loss"] < train[1]["sft/loss"]
    for r in train.values():
        assert r["sft/perplexity"] == pytest.approx(torch.tensor(r["sft/loss"]).exp().item(), rel=1e-6)
        assert r["sft/response_tokens"] > 0
    evals = [r for r in read_metrics(run_dir) if "eval/sft/loss" in r]
    assert [r["step"] for r in evals] == [2, STEPS]  # every sft.eval_every steps, then the final one
    assert json.loads((final / "rlhf_eval.json").read_text())["eval"]["eval/sft/loss"] == evals[-1]["eval/sft/loss"]

    model = AutoModelForCausalLM.from_pretrained(final)  # a plain causal LM with its tokenizer
    assert type(model).__name__ == "LlamaForCausalLM" and (final / "tokenizer.json").is_file()
    assert model.config.rlhf_stage == "sft"
    saved = load_file(final / "model.safetensors")

    # train-rm from the pointer: its trunk starts from the SFT weights, and its lineage names the SFT run
    cli.main(["train-rm", *SMOKE, "model=hf", f"model.name_or_path={root / 'latest_sft'}", f"paths.root={root}",
              "rm.max_steps=1", "rm.lr=1e-12", "rm.warmup_ratio=0"])
    (rm_dir,) = (root / "rm").iterdir()
    assert json.loads((rm_dir / "status.json").read_text())["state"] == "finished"
    parent = read_run(rm_dir)["parents"]["model"]
    assert parent["stage"] == "sft" and parent["run_dir"] == str(run_dir.resolve())
    rm = load_file(rm_dir / "final" / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(rm[key], saved[key], rtol=0, atol=1e-6)  # one step at lr 1e-12 moves nothing
    # the run dir is accepted as well (checked and loaded, then a dry run)
    cli.main(["train-rm", *SMOKE, "model=hf", f"model.name_or_path={run_dir}", f"paths.root={root}", "dry_run=true"])

    # the chain goes on: train-ppo from latest_sft (its reference: the SFT model) against latest_rm, then eval,
    # whose page shows the SFT run before the RM and PPO runs
    cli.main(["train-ppo", *SMOKE, "model=hf", f"model.name_or_path={root / 'latest_sft'}", f"paths.root={root}",
              "ppo.iterations=1"])
    (ppo_dir,) = (root / "ppo").iterdir()
    assert read_run(ppo_dir)["parents"]["model"]["stage"] == "sft"
    cli.main(["eval", *SMOKE, f"paths.root={root}", "eval.num_prompts=4"])
    (eval_dir,) = (root / "eval").iterdir()
    sections = sorted(p.name.split("_")[1] for p in (eval_dir / "report").iterdir() if p.is_dir())
    assert sections == ["ppo", "rm", "sft"]
    assert (eval_dir / "report" / f"0_sft_{run_dir.name}" / "sft_loss.png").is_file()

    # the SFT policy against its starting model, which its final/ records (no reference.path)
    assert model.config.rlhf_reference_model["name"] == "tiny"
    cli.main(["eval", *SMOKE, f"paths.root={root}", f"policy.path={run_dir}", "reward.type=checker",
              "eval.num_prompts=4", "hydra.run.dir=" + str(tmp_path / "sft_eval")])
    assert json.loads((tmp_path / "sft_eval" / "eval.json").read_text())["results"]["prompts"] == 4


def test_loss_and_update_do_not_depend_on_how_the_step_is_cut_or_packed(run_stage):
    """One optimizer step of 8 demonstrations as one micro-batch of 8 or four of 2, packed or padded: the same
    loss (Σ NLL / the step's response tokens) and the same weights after two steps, to fp32 rounding."""
    runs = {}
    for name, extra in {"8 packed": [], "2 packed": ["sft.micro_batch_size=2"],
                        "8 padded": ["data.packing=false"]}.items():
        _, run_dir, _ = run_stage("train_sft", [*SMOKE, "sft.max_steps=2", "sft.batch_size=8",
                                                "sft.micro_batch_size=8", *extra])
        runs[name] = run_dir
    want = train_records(runs["8 packed"])
    weights = load_file(runs["8 packed"] / "final" / "model.safetensors")
    for name in ("2 packed", "8 padded"):
        got = train_records(runs[name])
        for step in (1, 2):
            assert got[step]["sft/loss"] == pytest.approx(want[step]["sft/loss"], rel=1e-6), (name, step)
            assert got[step]["sft/response_tokens"] == want[step]["sft/response_tokens"]
        other = load_file(runs[name] / "final" / "model.safetensors")
        for key in weights:
            torch.testing.assert_close(other[key], weights[key], rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    packed, padded = train_records(runs["8 packed"])[1], train_records(runs["8 padded"])[1]
    assert packed["throughput/positions_per_token"] <= padded["throughput/positions_per_token"]


def test_resume_continues_the_run(run_stage, tmp_path):
    overrides = [*SMOKE, f"sft.max_steps={STEPS}", "sft.save_every=2"]
    _, run_dir, _ = run_stage("train_sft", overrides)
    crashed = tmp_path / "runs" / "sft" / "crashed"
    shutil.copytree(run_dir, crashed)
    (crashed / "ds" / "latest").write_text("step-2\n")  # as if it had crashed right after the step-2 checkpoint
    (crashed / "status.json").write_text(json.dumps({"state": "running"}))
    shutil.rmtree(crashed / "final")
    run_stage("train_sft", [*overrides, f"resume={crashed}"], run_dir=crashed)
    original, resumed = train_records(run_dir), train_records(crashed)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # steps after the checkpoint logged once
    for step in range(1, STEPS + 1):
        assert resumed[step]["sft/lr"] == pytest.approx(original[step]["sft/lr"], rel=1e-12)
        assert resumed[step]["sft/loss"] == pytest.approx(original[step]["sft/loss"], rel=1e-5), step
    a, b = (load_file(d / "final" / "model.safetensors") for d in (run_dir, crashed))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    assert json.loads((crashed / "status.json").read_text())["state"] == "finished"


def test_lora_under_zero3_saves_a_merged_causal_lm_with_its_adapter(run_stage, tiny_model_cfg, tokenizer):
    """LoRA through the components train-rm uses, under ZeRO-3: `final/` is the base model with the adapters
    merged (its linear layers moved, its embeddings not), the adapter beside it in `final/adapter/`."""
    from rlhf_cli.models import load_causal_lm

    _, run_dir, _ = run_stage("train_sft", [*SMOKE, "sft.max_steps=2", "model.lora.r=4", "deepspeed=zero3"])
    final = run_dir / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()
    merged = load_file(final / "model.safetensors")
    base = load_causal_lm(tiny_model_cfg, "fp32", seed=42, tokenizer=tokenizer).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[key], base[key])
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"], rtol=0, atol=0)


def test_train_sft_on_tool_transcripts_end_to_end(run_stage, tmp_path):
    """`train-sft data.format=messages` on multi-turn tool transcripts (assistant tool calls, `tool` results, a
    `tools` column) trains: the loss falls, and the response tokens it counts are the assistant turns' only."""
    tools = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate an expression.",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}]
    rows = []
    for a in range(10):
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": f"{a} * 7"}}}
        rows.append({"tools": tools, "messages": [
            {"role": "user", "content": f"What is {a} * 7?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": str(a * 7)},
            {"role": "assistant", "content": f"It is {a * 7}."}]})
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, run_dir, _ = run_stage("train_sft", [*SMOKE, "data.format=messages", f"data.path={path}", "sft.max_steps=3"])
    train = train_records(run_dir)
    assert sorted(train) == [1, 2, 3] and train[3]["sft/loss"] < train[1]["sft/loss"]
    # 8 rows a step, each trained on its call turn and its answer with their EOS: 38 or 39 of its 234-236 tokens
    # (the tools block, the question, the tool result and the headers are context)
    assert 8 * 38 <= train[1]["sft/response_tokens"] <= 8 * 39
    assert (run_dir / "final" / "model.safetensors").is_file()
