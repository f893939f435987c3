"""Two processes under torchrun (gloo, CPU) train the same models as one process on the same global batch.

Reward model: ZeRO-2 and ZeRO-3 on two ranks, with packed pairs (`data.packing`, the default), match one
rank with plain padded pairs (`data.packing=false`) step for step: packing is exact under ZeRO-3 too. PPO and GRPO
(packed on two ranks under ZeRO-2, plain on one):
rollouts are seeded per prompt position, so two ranks sample the same responses as one, and ZeRO-2 training
on two ranks matches one rank; a ZeRO-3 chain (reward model trained under ZeRO-3, loaded as the PPO critic,
generation from partitioned weights) matches one rank and writes loadable checkpoints. LoRA: the reward model under
ZeRO-3 and PPO under ZeRO-2 on two ranks match one rank; LoRA PPO runs under ZeRO-3. On-policy distillation's
teacher rewards and statistics on two ranks match one rank.

Every rank accumulates two micro-batches per optimizer step (train-rm, train-sft, and PPO's two epochs), under
ZeRO-3 too: ZeRO-3 once kept only the last micro-batch's gradient (`engine.TrainEngine._backward`), and ZeRO-3 on
two ranks now matches one rank within 1e-5.

PPO runs here use one minibatch per epoch (`ppo.mini_batch_size == ppo.rollout_batch_size`): each rank
shuffles its own rows, so with smaller minibatches their composition (not their statistics) depends on
the world size.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import tokenizer_override

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
COMMON = ["experiment=smoke"]
RM_ARGS = ["train-rm", *COMMON, "rm.max_steps=6", "rm.micro_batch_size=2"]  # 2 micro-batches per rank
PPO_ARGS = ["train-ppo", *COMMON, "ppo.iterations=2", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
            "ppo.micro_batch_size=2", "ppo.epochs=2", "ppo.max_new_tokens=8", "ppo.kl_target=1.0", "ppo.kl_horizon=100"]
PPO_KEYS = ("objective/scores", "objective/kl", "objective/kl_beta", "objective/entropy_sampled",
            "response/length_mean", "response/eos_frac", "policy/loss", "policy/approx_kl", "policy/clipfrac",
            "val/loss", "val/explained_var")
RM_KEYS = ("rm/loss", "rm/accuracy", "rm/grad_norm", "eval/rm/loss", "eval/rm/accuracy")


def launch(args, root, ranks=1):
    cmd = [sys.executable, "-m", "rlhf_cli"]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}",
               "-m", "rlhf_cli"]
    out = subprocess.run([*cmd, *args, f"paths.root={root}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def metrics(root, stage):
    (path,) = list(root.glob(f"{stage}/*/metrics.jsonl"))
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def assert_same_metrics(a, b, keys, tol=1e-4):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for key in keys:  # a renamed metric must not pass by being absent
        assert any(r.get(key) is not None for r in a), key
    for ra, rb in zip(a, b):
        for key in keys:
            if ra.get(key) is not None:
                assert rb[key] == pytest.approx(ra[key], abs=tol, rel=tol), (ra["step"], key)


def assert_same_weights(dir_a, dir_b):
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=lambda m, k=k: f"{dir_b}/{k}: {m}")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """One-process reference runs: the reward model (ZeRO-0) and PPO against it."""
    root = tmp_path_factory.mktemp("one")
    launch([*RM_ARGS, "deepspeed=zero0", "data.packing=false"], root)
    launch([*PPO_ARGS, "deepspeed=zero0", "data.packing=false"], root)
    return root


def final_dir(root, stage):
    (run,) = list((root / stage).iterdir())
    return run / "final"


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_ranks_reward_model_matches_one_rank(one_rank, tmp_path, zero):
    launch([*RM_ARGS, f"deepspeed={zero}"], tmp_path, ranks=2)
    assert len(list((tmp_path / "rm").iterdir())) == 1  # one run dir for both ranks
    assert_same_metrics(metrics(one_rank, "rm"), metrics(tmp_path, "rm"), RM_KEYS, tol=1e-5)
    # ZeRO-3: gathered on save. Weights to 1e-4: AdamW (lr 1e-3) turns the float noise of a near-zero gradient (another
    # summation order: packing, two ranks) into up to ~lr a step, measured 4e-5 on one embedding element under ZeRO-2
    assert_same_weights(final_dir(one_rank, "rm"), final_dir(tmp_path, "rm"))
    assert (tmp_path / "latest_rm").is_file()


@pytest.fixture(scope="module")
def ppo_two_ranks(one_rank, tmp_path_factory):
    """PPO against `one_rank`'s reward model on one launcher of two ranks (ZeRO-2, packed): compared with one rank
    here and with two nodes (test_two_nodes.py's layout) below."""
    root = tmp_path_factory.mktemp("ppo_two_ranks")
    # both micro-batches of each rank's first minibatch run their training forward in the rollout, graphs held
    # through ZeRO-2's gradient reduction (`ppo.carried_forwards`)
    launch(ppo_two_ranks_args(one_rank), root, ranks=2)
    return root


def ppo_two_ranks_args(one_rank):
    return [*PPO_ARGS, "deepspeed=zero2", "ppo.carried_forwards=2", f"reward_model.path={final_dir(one_rank, 'rm')}"]


@pytest.mark.slow
def test_two_ranks_ppo_matches_one_rank_zero2(one_rank, ppo_two_ranks):
    a, b = metrics(one_rank, "ppo"), metrics(ppo_two_ranks, "ppo")
    assert a[-1]["objective/kl"] != 0  # the policy moved: iteration 2 compares a trained policy
    assert all(r["time/scoring_policy"] == r["time/scoring_critic"] == 0 for r in b)  # no no-grad pass left
    assert all(r["time/scoring_policy"] > 0 for r in a)
    assert_same_metrics(a, b, PPO_KEYS)
    for name in ("", "critic"):
        assert_same_weights(final_dir(one_rank, "ppo") / name, final_dir(ppo_two_ranks, "ppo") / name)


@pytest.mark.slow
def test_two_nodes_ppo_equal_one_node_and_only_global_rank_0_writes(one_rank, ppo_two_ranks, tmp_path):
    """PPO on two nodes, simulated (test_two_nodes.py): each node's one rank is LOCAL_RANK 0, and the run equals
    the one-node, two-rank run within 1e-5 (fp32), metrics and both final models, with only global rank 0 writing
    the run's files."""
    from test_two_nodes import assert_only_rank0_writes
    from test_two_nodes import assert_same_weights as assert_same_to_1e5
    from test_two_nodes import launch as launch_nodes

    launch_nodes(ppo_two_ranks_args(one_rank), tmp_path, nodes=2)
    a, b = metrics(ppo_two_ranks, "ppo"), metrics(tmp_path, "ppo")
    assert len(a) == 2 and a[-1]["objective/kl"] != 0
    assert_same_metrics(a, b, PPO_KEYS, tol=1e-5)
    for name in ("", "critic"):
        assert_same_to_1e5(final_dir(ppo_two_ranks, "ppo") / name, final_dir(tmp_path, "ppo") / name)
    assert_only_rank0_writes(tmp_path, "ppo")


@pytest.mark.slow
def test_zero3_chain_reward_model_into_ppo_critic(tmp_path):
    """train-rm under ZeRO-3 (2 ranks) -> train-ppo under ZeRO-3 (2 ranks), critic initialised from that RM. PPO's
    two epochs of two micro-batches per rank match one rank under ZeRO-0 on the same reward model within 1e-5
    (they missed it by 6e-4 in iteration 1's policy loss while ZeRO-3 kept only the last micro-batch's gradient)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    launch([*RM_ARGS, "deepspeed=zero3"], tmp_path, ranks=2)
    launch([*PPO_ARGS, "deepspeed=zero3", "ppo.critic_init=reward_model"], tmp_path, ranks=2)
    one = tmp_path / "one"
    launch([*PPO_ARGS, "deepspeed=zero0", "data.packing=false", "ppo.critic_init=reward_model",
            f"reward_model.path={final_dir(tmp_path, 'rm')}"], one)
    policy = final_dir(tmp_path, "ppo")
    a, b = metrics(one, "ppo"), metrics(tmp_path, "ppo")
    assert len(b) == 2 and a[-1]["objective/kl"] != 0
    assert_same_metrics(a, b, (*PPO_KEYS, "policy/grad_norm"), tol=1e-5)
    for name in ("", "critic"):
        assert_same_weights(final_dir(one, "ppo") / name, policy / name)
    AutoModelForCausalLM.from_pretrained(policy)
    critic = AutoModelForSequenceClassification.from_pretrained(policy / "critic")
    rm = load_file(final_dir(tmp_path, "rm") / "model.safetensors")
    # the critic started from the reward model (trunk and head): 4 PPO steps at lr 1e-5 move it < 1e-3,
    # while a critic from the policy would carry a fresh random head
    got = critic.state_dict()
    assert got.keys() >= rm.keys()
    for k, v in rm.items():
        assert (got[k] - v).abs().max() < 1e-3, k
    assert (tmp_path / "latest_policy").is_file()


@pytest.mark.slow
def test_lora_two_ranks_match_one_rank(tmp_path):
    """LoRA (`model.lora.r=4`): the reward model under ZeRO-3 and PPO (its reference: the policy with its adapters
    off) under ZeRO-2 on two ranks match one rank under ZeRO-0, DeepSpeed handling the frozen base weights."""
    lora = ["model.lora.r=4", "model.lora.alpha=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    launch([*RM_ARGS, *lora, "deepspeed=zero0", "rm.lr=5e-3"], one)
    launch([*RM_ARGS, *lora, "deepspeed=zero3", "rm.lr=5e-3"], two, ranks=2)
    assert_same_metrics(metrics(one, "rm"), metrics(two, "rm"), RM_KEYS)
    assert_same_weights(final_dir(one, "rm"), final_dir(two, "rm"))  # merged after the ZeRO-3 gather
    ppo = [*PPO_ARGS, *lora, "ppo.actor_lr=1e-2", "ppo.critic_lr=1e-2"]
    launch([*ppo, "deepspeed=zero0", f"reward_model.path={final_dir(one, 'rm')}"], one)
    launch([*ppo, "deepspeed=zero2", f"reward_model.path={final_dir(one, 'rm')}"], two, ranks=2)
    a, b = metrics(one, "ppo"), metrics(two, "ppo")
    assert a[-1]["objective/kl"] != 0
    assert_same_metrics(a, b, PPO_KEYS)
    for name in ("", "critic"):
        assert_same_weights(final_dir(one, "ppo") / name, final_dir(two, "ppo") / name)
        assert (final_dir(two, "ppo") / name / "adapter" / "adapter_model.safetensors").is_file()
    # ZeRO-3: the reference view reads the partitioned policy; the merged final/ is gathered first
    three = tmp_path / "three"
    launch([*ppo, "deepspeed=zero3", "ppo.epochs=1", f"reward_model.path={final_dir(one, 'rm')}"], three, ranks=2)
    c = metrics(three, "ppo")
    assert len(c) == 2 and abs(c[0]["objective/kl"]) < 1e-6  # iteration 1 samples the base model itself
    merged = load_file(final_dir(three, "ppo") / "model.safetensors")
    assert merged.keys() == load_file(final_dir(one, "ppo") / "model.safetensors").keys()  # plain names
    assert (final_dir(three, "ppo") / "critic" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("loss", [[], ["ppo.policy_loss=gspo", "ppo.aggregation=seq-mean-token-mean",
                                       "ppo.clip_high=0.28"]], ids=["ppo-token-mean", "gspo-seq-mean-token-mean"])
def test_two_ranks_group_advantages_match_one_rank(tmp_path, loss):
    """GRPO with 4 samples per prompt: each rank holds whole groups, so 2 ranks compute the advantages, and then
    the update, of 1 rank (one minibatch per epoch, see the module docstring). The 2 ranks run packed (one epoch:
    the policy, reference and training passes too), the 1 rank plain (`data.packing=false`). With GSPO and
    `seq-mean-token-mean` each rank divides by the minibatch's response count over both ranks (issue 42's
    invariance on two ranks; tests/stages/test_update_invariance.py cuts one rank's minibatch)."""
    fn = tmp_path / "rewards.py"  # the tiny model's checker score is 0 everywhere: a reward that varies
    fn.write_text("def length(prompts, completions, answer, **kw):\n    return [len(c) / 10 for c in completions]\n")
    args = ["train-ppo", *COMMON, "reward.type=function", f"reward.function={fn}:length",
            "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4",
            "ppo.rollout_batch_size=4", "ppo.mini_batch_size=16", "ppo.micro_batch_size=4", "ppo.iterations=2",
            "ppo.max_new_tokens=8", "ppo.truncated=penalize", "ppo.missing_eos_penalty=1.0", "ppo.kl_in=loss",
            "ppo.kl_estimator=k3", "ppo.epochs=1", "deepspeed=zero2", *loss]
    launch([*args, "data.packing=false"], tmp_path / "one")
    launch(args, tmp_path / "two", ranks=2)  # packed (ppo.epochs=1): each group's prompt computed once
    a, b = metrics(tmp_path / "one", "ppo"), metrics(tmp_path / "two", "ppo")
    assert any(r["advantages/abs_mean"] > 0 for r in a)  # some group had a signal to compare
    assert_same_metrics(a, b, ("advantages/mean", "advantages/abs_mean", "groups/score_mean", "groups/score_std",
                               "groups/zero_var_frac", "objective/scores", "objective/kl", "policy/loss"))
    assert_same_weights(final_dir(tmp_path / "one", "ppo"), final_dir(tmp_path / "two", "ppo"))


@pytest.mark.slow
def test_two_ranks_distillation_matches_one_rank(tmp_path, tiny_model_cfg, tokenizer):
    """On-policy distillation (`reward.type=teacher`): the teacher's per-token rewards of two ranks (packed) are one
    rank's (plain), and `distill/*` are means over every rank's sampled tokens, so they match too."""
    from rlhf_cli.models import load_causal_lm, save_hf

    teacher = tmp_path / "teacher"
    save_hf(load_causal_lm(tiny_model_cfg, "fp32", 3, tokenizer=tokenizer), tokenizer, teacher)
    args = tokenizer_override([  # the teacher was saved with the session's tokenizer: the runs take the same
        "train-ppo", *COMMON, "reward.type=teacher", f"reward.teacher.path={teacher}",
        "ppo.advantage_estimator=distill", "ppo.kl_beta=0.0", "ppo.truncated=keep", "ppo.iterations=2",
        "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8", "ppo.micro_batch_size=2", "ppo.epochs=1",
        "ppo.max_new_tokens=8", "deepspeed=zero2"])
    launch([*args, "data.packing=false"], tmp_path / "one")
    launch(args, tmp_path / "two", ranks=2)
    a, b = metrics(tmp_path / "one", "ppo"), metrics(tmp_path / "two", "ppo")
    assert all(r["distill/reverse_kl"] != 0 for r in a)
    assert_same_metrics(a, b, ("distill/reverse_kl", "distill/teacher_logprob_mean", "advantages/mean",
                               "advantages/abs_mean", "policy/loss", "objective/kl"), tol=1e-5)
    assert_same_weights(final_dir(tmp_path / "one", "ppo"), final_dir(tmp_path / "two", "ppo"))


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_ranks_filter_groups_keep_the_same_shape(tmp_path, zero):
    """`ppo.filter_groups` on two ranks whose shares drop different numbers of groups: every rank runs the same
    generation rounds (sampling and scoring are collective) and trains the same number of groups (the fewest any
    rank kept, in whole minibatches), so the run neither hangs nor fails. Which groups are kept depends on the
    world size (each rank refills its own share), so this is not compared with one rank. Under ZeRO-3 every
    round's sampling gathers the partitioned weights on both ranks."""
    fn = tmp_path / "rewards.py"  # flat for prompts with an even answer, varied by length for the others
    fn.write_text("def f(prompts, completions, answer, **kw):\n"
                  "    return [0.0 if (a or 0) % 2 == 0 else len(c) / 10 for c, a in zip(completions, answer)]\n")
    args = ["train-ppo", *COMMON, "reward.type=function", f"reward.function={fn}:f", "ppo.advantage_estimator=grpo",
            "ppo.n_samples_per_prompt=2", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=4",
            "ppo.micro_batch_size=2", "ppo.iterations=3", "ppo.max_new_tokens=8", "ppo.kl_in=loss",
            "ppo.kl_estimator=k3", "ppo.filter_groups=true", "ppo.filter_groups_max_rounds=1", f"deepspeed={zero}"]
    launch(args, tmp_path / "two", ranks=2)
    rows = metrics(tmp_path / "two", "ppo")
    assert len(rows) == 3 and all(r["groups/extra_rounds"] in (0.0, 1.0) for r in rows)
    assert any(r["groups/dropped_frac"] > 0 for r in rows) and any("policy/loss" in r for r in rows)


SFT_ARGS = ["train-sft", *COMMON, "sft.max_steps=3", "sft.batch_size=8", "sft.micro_batch_size=2"]
SFT_KEYS = ("sft/loss", "sft/response_tokens", "sft/grad_norm", "eval/sft/loss")


@pytest.fixture(scope="module")
def sft_two_ranks(tmp_path_factory):
    """train-sft on one launcher of two ranks (ZeRO-2, packed, a checkpoint at step 2): compared with one rank
    here and with two nodes, one of them killed after step 2, below."""
    root = tmp_path_factory.mktemp("sft_two_ranks")
    launch(SFT_TWO_RANKS, root, ranks=2)
    return root


SFT_TWO_RANKS = [*SFT_ARGS, "sft.save_every=2", "deepspeed=zero2"]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_two_ranks_sft_matches_one_rank(tmp_path, lora, request):
    """train-sft on two ranks (ZeRO-2; LoRA under ZeRO-3; two micro-batches per rank and step), packed, against
    one rank, padded: each rank's micro-batch NLL sums are divided by the step's response tokens over both ranks,
    so the loss and the update are one rank's."""
    extra = ["model.lora.r=4", "sft.lr=1e-2"] if lora else []
    launch([*SFT_ARGS, *extra, "deepspeed=zero0", "data.packing=false"], tmp_path / "one")
    if lora:
        two = tmp_path / "two"
        launch([*SFT_ARGS, *extra, "deepspeed=zero3"], two, ranks=2)
    else:
        two = request.getfixturevalue("sft_two_ranks")
    one, two_rows = metrics(tmp_path / "one", "sft"), metrics(two, "sft")
    assert_same_metrics(one, two_rows, SFT_KEYS, tol=1e-5)
    assert_same_weights(final_dir(tmp_path / "one", "sft"), final_dir(two, "sft"))


@pytest.mark.slow
def test_two_nodes_sft_stop_when_one_is_killed_and_resume_to_the_one_node_run(sft_two_ranks, tmp_path):
    """train-sft on two nodes (test_two_nodes.py): node 1 is killed after its step-2 checkpoint, while node 0's
    rank waits for it in step 3's collectives; node 0 stops, and the two nodes resume the run to the one-node run's
    metrics (steps 1-2 from the first attempt, 3 from the resumed one) and final weights, global rank 1 writing
    nothing but its DeepSpeed files in both attempts (a resumed rank's Hydra runs in the run's own dir:
    `cli.resume_overrides`)."""
    from test_two_nodes import assert_only_rank0_writes, kill_node, start
    from test_two_nodes import assert_same_weights as assert_same_to_1e5
    from test_two_nodes import launch as launch_nodes

    node0, node1 = start(SFT_TWO_RANKS, tmp_path, tmp_path / "audit", nodes=2, pause_at="step-2")
    t0 = time.monotonic()
    while not (tmp_path / "audit" / "paused").exists():
        assert node0.poll() is None and node1.poll() is None and time.monotonic() - t0 < 300
        time.sleep(0.2)
    kill_node(node1)
    t1 = time.monotonic()
    out = node0.communicate(timeout=120)[0]
    stopped = time.monotonic() - t1
    node1.wait(timeout=10)
    assert node0.returncode != 0, out[-3000:]
    assert "error: rank 0: another rank stopped answering ([" in out, out[-3000:]  # gloo's closed connection
    assert "continue with resume=true once every node is up" in out and "Error executing job" not in out  # no crash
    assert stopped < 60, stopped
    (run,) = list((tmp_path / "sft").iterdir())
    assert (run / "ds" / "latest").read_text().strip() == "step-2"
    assert not (run / "final").exists() and not (tmp_path / "latest_sft").exists()
    assert json.loads((run / "status.json").read_text())["state"] == "running"  # resume=true finds it

    launch_nodes([*SFT_TWO_RANKS, "resume=true"], tmp_path, nodes=2)
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert_only_rank0_writes(tmp_path, "sft")  # both attempts
    assert_same_metrics(metrics(sft_two_ranks, "sft"), metrics(tmp_path, "sft"), SFT_KEYS, tol=1e-5)
    assert_same_to_1e5(final_dir(sft_two_ranks, "sft"), run / "final")


DPO_ARGS = ["train-dpo", *COMMON, "dpo.max_steps=3", "dpo.batch_size=8", "dpo.micro_batch_size=4", "dpo.eval_every=2"]
DPO_KEYS = ("dpo/loss", "dpo/margin", "dpo/accuracy", "dpo/logprobs_chosen", "dpo/grad_norm", "eval/dpo/loss",
            "eval/dpo/margin")


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["frozen copy", "lora, precomputed", "lora, each micro-batch"])
def test_two_ranks_dpo_under_zero3_match_one_rank(tmp_path, reference):
    """train-dpo on two ZeRO-3 ranks, packed, against one rank, padded (two micro-batches): each rank's pair sums are
    divided by the step's pair count, so the loss and the update are one rank's; the reference (a frozen copy, or the
    LoRA policy with its adapters off, precomputed from the partitioned weights or run with each micro-batch) is the
    same. One micro-batch per rank and step, except the LoRA reference run with each micro-batch: two per rank and
    step, so the adapters-off forward of the partitioned module runs between one micro-batch's backward and the
    next one's policy forward under gradient accumulation."""
    extra = {"frozen copy": [], "lora, precomputed": ["model.lora.r=4", "dpo.lr=1e-2", "dpo.precompute_reference=true"],
             "lora, each micro-batch": ["model.lora.r=4", "dpo.lr=1e-2", "dpo.micro_batch_size=2"]}[reference]
    launch([*DPO_ARGS, *extra, "deepspeed=zero0", "data.packing=false"], tmp_path / "one")
    launch([*DPO_ARGS, *extra, "deepspeed=zero3"], tmp_path / "two", ranks=2)
    one, two = metrics(tmp_path / "one", "dpo"), metrics(tmp_path / "two", "dpo")
    assert one[0]["dpo/loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert_same_metrics(one, two, DPO_KEYS)
    (a,), (b,) = (list((tmp_path / d).glob("dpo/*/final")) for d in ("one", "two"))
    assert_same_weights(a, b)


KTO_ARGS = ["train-kto", *COMMON, "kto.max_steps=3", "kto.batch_size=8", "kto.micro_batch_size=2", "kto.eval_every=2"]
KTO_KEYS = ("kto/loss", "kto/kl", "kto/rewards_desirable", "kto/rewards_undesirable", "kto/logprobs_desirable",
            "kto/grad_norm", "eval/kto/loss", "eval/kto/kl")


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["frozen copy", "lora, precomputed"])
def test_two_ranks_kto_under_zero3_match_one_rank(tmp_path, reference):
    """train-kto on two ZeRO-3 ranks, packed, against one rank, padded (two micro-batches per rank and step): the
    reference point pairs the prompts of the step's whole batch with the previous row's completion, across the two
    ranks' shares, and sums its log-ratios over both, so it is one rank's; each rank's loss sums are divided by the
    step's row count, so the loss and the update are one rank's too."""
    extra = {"frozen copy": [], "lora, precomputed": ["model.lora.r=4", "kto.lr=1e-2", "kto.precompute_reference=true"]
             }[reference]
    launch([*KTO_ARGS, *extra, "deepspeed=zero0", "data.packing=false"], tmp_path / "one")
    launch([*KTO_ARGS, *extra, "deepspeed=zero3"], tmp_path / "two", ranks=2)
    one, two = metrics(tmp_path / "one", "kto"), metrics(tmp_path / "two", "kto")
    assert one[0]["kto/loss"] == pytest.approx(0.5, abs=1e-6) and one[0]["kto/kl"] == 0
    assert any(r.get("kto/kl", 0) > 0 for r in one)
    assert_same_metrics(one, two, KTO_KEYS)
    (a,), (b,) = (list((tmp_path / d).glob("kto/*/final")) for d in ("one", "two"))
    assert_same_weights(a, b)
