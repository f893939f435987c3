"""bf16 ablation: how far each precision configuration's log-probs and KL are from fp32's, for fixed weights.

One fixed pair of weights: the reference (the base model) and the policy after `--steps` AdamW steps at
`--lr` (betas 0.9/0.95, PPO's) on a policy-gradient loss with random per-sequence advantages, i.e. the
size of PPO's first update. Responses are sampled once from the updated policy in fp32 (per-prompt
seeds), then every configuration computes, on those same tokens, the policy's and the reference's
response log-probs at `--temperature` and reports:

  lp err      mean |log π_cfg − log π_fp32| per response token, nats (the policy's per-token error)
  KL k1       mean over sequences of Σ_t (log π_cfg − log π_ref,cfg): what `objective/kl` reports
  KL exact    mean over sequences of Σ_t Σ_v π_cfg(v) (log π_cfg(v) − log π_ref,cfg(v)), full vocabulary
  x fp32      each KL over the same KL in fp32 (1.00 = the configuration sees the real movement)
  s/pass      seconds for one no-grad pass of both models over the batch on this machine

Configurations (policy and reference always computed the same way):
  fp32                    weights and compute in fp32 (the truth; "trunk in fp32")
  bf16-autocast           fp32 weights, torch.autocast(bf16) over trunk and LM head (today's default)
  bf16-autocast+fp32 head autocast over the trunk, LM head in fp32 (SmolLM2's head is the tied embedding:
                          the fp32 head multiplies by the fp32 embedding matrix)
  bf16 weights            both models cast to bf16 (`precision=bf16`): weights rounded once, shared rounding
                          where the update did not move a weight across a bf16 grid point
  bf16 weights+fp32 head  bf16 trunk, head in fp32 from the (already rounded) bf16 tied embedding
  fp16-autocast           torch.autocast(fp16) over trunk and head, where the device has it

    python benchmarks/bf16_ablation.py                      # SmolLM2-135M, 8 built-in prompts, 32 tokens
    python benchmarks/bf16_ablation.py --model tiny         # seconds: a smoke test of the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="model config group: smollm2 (default) or tiny")
    p.add_argument("--prompts", type=int, default=8, help="built-in-task prompts, one response each")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the policy's update")
    p.add_argument("--steps", type=int, default=1, help="AdamW steps between reference and policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=None,
                   help="comma-separated subset of the configurations (default: all the device supports)")
    p.add_argument("--out", default=None, help="also write the table as JSON here and as markdown beside it")
    return p.parse_args()


# ----------------------------------------------------------------------------------------------
# the configurations: how both models turn (ids, mask) into response logits


def _autocast(dtype: Any | None, device: Any) -> contextlib.AbstractContextManager:
    import torch

    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def response_logits(lm: Any, ids: Any, am: Any, P: int, temperature: float, autocast_dtype: Any | None,
                    head_fp32: bool) -> Any:
    """(B, R, V) float32 logits / temperature of the response positions, as `policy_forward` lays them out."""
    import torch

    trunk = getattr(lm, lm.base_model_prefix)
    position_ids = (am.long().cumsum(-1) - 1).clamp(min=0)
    with _autocast(autocast_dtype, ids.device):
        hidden = trunk(input_ids=ids, attention_mask=am, position_ids=position_ids,
                       use_cache=False).last_hidden_state[:, P - 1:-1]
        if not head_fp32:
            return lm.lm_head(hidden).float() / temperature
    with torch.autocast(device_type=ids.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.float(), lm.lm_head.weight.float()) / temperature


def configurations(device: Any) -> dict[str, tuple[Any | None, str, bool]]:
    """name -> (autocast dtype or None, weight dtype name, head in fp32)."""
    import torch

    out = {
        "fp32": (None, "float32", False),
        "bf16-autocast": (torch.bfloat16, "float32", False),
        "bf16-autocast+fp32 head": (torch.bfloat16, "float32", True),
        "bf16 weights": (None, "bfloat16", False),
        "bf16 weights+fp32 head": (None, "bfloat16", True),
    }
    try:
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        out["fp16-autocast"] = (torch.float16, "float32", False)
    except (RuntimeError, AssertionError):  # pragma: no cover - a device without fp16 autocast
        pass
    return out


# ----------------------------------------------------------------------------------------------
# the measurement


def small_update(policy: Any, ep: Any, temperature: float, lr: float, steps: int, seed: int) -> None:
    """`steps` AdamW steps (PPO's betas) on −Σ A·log π over the sampled tokens of the episodes `ep`
    (`rollout.Episodes`) with A ~ N(0, 1) per sequence: PPO's first update at ratio 1, whose step per weight is
    about `lr` whatever the gradient's scale."""
    import torch

    from rlhf_cli.core import logprobs_from_logits

    ids, am, P, mask = ep.input_ids, ep.attention_mask, ep.P, ep.action_mask
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(ids.shape[0], generator=g)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    policy.train()
    for _ in range(steps):
        logits = response_logits(policy, ids, am, P, temperature, None, False)
        lp = logprobs_from_logits(logits, ids[:, P:])
        loss = -((lp * mask).sum(1) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.eval()


def measure(policy: Any, reference: Any, ep: Any, temperature: float, autocast_dtype: Any | None,
            weight_dtype: str, head_fp32: bool) -> dict[str, Any]:
    """Per-token log-probs of both models (B, R) float32 on the episodes `ep` (`rollout.Episodes`), per-sequence
    k1 and exact KL (B,) over the sampled tokens, seconds."""
    import torch

    from rlhf_cli.core import logprobs_from_logits

    dtype = getattr(torch, weight_dtype)
    pol = policy if dtype is torch.float32 else copy.deepcopy(policy).to(dtype)
    ref = reference if dtype is torch.float32 else copy.deepcopy(reference).to(dtype)
    ids, am, P, mask = ep.input_ids, ep.attention_mask, ep.P, ep.action_mask
    labels = ids[:, P:]
    with torch.no_grad():
        t0 = time.perf_counter()
        pol_logits = response_logits(pol, ids, am, P, temperature, autocast_dtype, head_fp32)
        ref_logits = response_logits(ref, ids, am, P, temperature, autocast_dtype, head_fp32)
        seconds = time.perf_counter() - t0
        lp, ref_lp = logprobs_from_logits(pol_logits, labels), logprobs_from_logits(ref_logits, labels)
        # float64: the difference of two nearly equal distributions over the whole vocabulary
        logp, logq = torch.log_softmax(pol_logits.double(), -1), torch.log_softmax(ref_logits.double(), -1)
        exact = (logp.exp() * (logp - logq)).sum(-1).float()  # (B, R) KL(π_t ‖ π_ref,t) per position
    return {"lp": lp * mask, "k1": ((lp - ref_lp) * mask).sum(1), "exact": (exact * mask).sum(1),
            "seconds": seconds, "mask": mask}


def main() -> None:
    args = parse_args()
    import torch

    from rlhf_cli import engine
    from rlhf_cli.data import load_prompt_data
    from rlhf_cli.models import disable_dropout, load_causal_lm, load_tokenizer
    from rlhf_cli.rollout import HFGenerator, Sampling, SingleTurnRunner
    from rlhf_cli.seeds import derive_seed

    C.quiet()
    cfg = C.compose("train_ppo", [f"model={args.model}", "precision=fp32", f"seed={args.seed}"])
    info = C.machine_info()
    device = engine.device()
    tokenizer = load_tokenizer(cfg.model)
    prompts = load_prompt_data(cfg.data, tokenizer, split="train")[: args.prompts]
    reference = disable_dropout(load_causal_lm(cfg.model, "fp32", cfg.seed, tokenizer=tokenizer)).to(device).eval()
    reference.requires_grad_(False)
    policy = copy.deepcopy(reference).requires_grad_(True)
    sampling = Sampling(eos_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.pad_token_id,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0)

    def sample(lm: Any, seeds: list[int]) -> Any:  # one fp32 episode per prompt (`rollout.Episodes`)
        generator = HFGenerator("fp32")
        generator.update_weights(lm)
        return SingleTurnRunner().run(prompts, seeds, generator, sampling)

    # PPO's first update, on responses of the reference (policy == reference before it)
    ep = sample(reference, [derive_seed(args.seed, 0, k) for k in range(len(prompts))])
    small_update(policy, ep, args.temperature, args.lr, args.steps, args.seed)
    moved = [(p.detach() - q).abs() for p, q in zip(policy.parameters(), reference.parameters())]
    flipped = sum(int((p.detach().bfloat16() != q.bfloat16()).sum()) for p, q in zip(policy.parameters(),
                                                                                      reference.parameters()))
    n_weights = sum(p.numel() for p in policy.parameters())
    # the measured responses: sampled from the updated policy in fp32 (PPO's rollout of iteration 2)
    ep = sample(policy, [derive_seed(args.seed, 1, k) for k in range(len(prompts))])

    configs = configurations(device)
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",")]
        unknown = [c for c in wanted if c not in configs]
        if unknown:
            sys.exit(f"error: unknown --configs {unknown}; choose from {list(configs)}")
        configs = {"fp32": configs["fp32"], **{c: configs[c] for c in wanted}}
    measure(policy, reference, ep, args.temperature, None, "float32", False)  # warm-up, untimed
    results: dict[str, dict[str, Any]] = {}
    for name, (ac, wd, head) in configs.items():
        results[name] = measure(policy, reference, ep, args.temperature, ac, wd, head)
        print(f"  measured {name} ({results[name]['seconds']:.1f} s)", file=sys.stderr)

    truth = results["fp32"]
    n_tok = float(truth["mask"].sum())
    rows: list[dict[str, Any]] = []
    for name, r in results.items():
        k1, exact = float(r["k1"].mean()), float(r["exact"].mean())
        rows.append({"config": name, "lp_err": float((r["lp"] - truth["lp"]).abs().sum()) / n_tok,
                     "kl_k1": k1, "kl_k1_x_fp32": k1 / float(truth["k1"].mean()),
                     "kl_exact": exact, "kl_exact_x_fp32": exact / float(truth["exact"].mean()),
                     "seconds": r["seconds"], "seconds_x_fp32": r["seconds"] / truth["seconds"]})

    bf16 = "native" if info["bf16_native"] else "emulated"
    header = [
        "bf16 ablation: log-prob error and KL of policy vs reference, per precision configuration",
        " | ".join(f"{k} {v}" for k, v in C.versions().items() if k != "trl"),
        f"machine: {info['gpu'] or info['cpu']}, {info['cores']} cores; bf16 {bf16}",
        f"model {C.model_label(cfg.model)}; {len(prompts)} built-in prompts, {int(n_tok)} response tokens "
        f"(max {args.max_new_tokens}, T={args.temperature}); policy = reference + {args.steps} AdamW step(s) at "
        f"lr {args.lr:g}: mean |Δw| {float(torch.cat([m.flatten() for m in moved]).mean()):.2e}, "
        f"{flipped / n_weights:.1%} of weights change their bf16 rounding",
    ]
    cols = [("config", "{}"), ("lp_err", "{:.2e}"), ("kl_k1", "{:.4f}"), ("kl_k1_x_fp32", "{:.2f}"),
            ("kl_exact", "{:.4f}"), ("kl_exact_x_fp32", "{:.2f}"), ("seconds", "{:.2f}"), ("seconds_x_fp32", "{:.2f}")]
    names = ["config", "lp err (nats/token)", "KL k1 (nats/seq)", "k1 x fp32", "KL exact (nats/seq)",
             "exact x fp32", "s/pass", "s x fp32"]
    table = [[fmt.format(row[k]) for k, fmt in cols] for row in rows]
    widths = [max(len(n), *(len(r[i]) for r in table)) for i, n in enumerate(names)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    print("\n".join(header))
    print(line(names))
    for r in table:
        print(line(r))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"header": header, "rows": rows, "machine": info}, indent=2))
        md = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
        md += ["| " + " | ".join(r) + " |" for r in table]
        out.with_suffix(".md").write_text("\n".join([*(f"<!-- {h} -->" for h in header), *md]) + "\n")


if __name__ == "__main__":
    main()
