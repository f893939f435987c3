"""GAE: reverse loop over T (compute_gae) vs doubling scan (compute_gae_vectorized).

    python benchmarks/gae_bench.py [--batch 64] [--lengths 128 512 1024 2048] [--device cpu]

Prints one row per response length: median wall time of each over --repeats runs, the
speed-up, and the largest absolute difference between the two (advantages and returns).
Inputs look like an RLHF rollout: values ~ N(0, 1), a small per-token KL penalty, a score
on the last real token, ragged right-padded lengths, gamma = 1, lambda = 0.95.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from rlhf_cli.core import compute_gae, compute_gae_vectorized


def rollout(batch: int, length: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = torch.arange(length) < lengths[:, None]  # (B, T)
    rewards = -0.05 * torch.rand(batch, length, generator=gen)  # -beta * KL_t
    rewards[torch.arange(batch), lengths - 1] += torch.randn(batch, generator=gen)  # score at EOS
    values = torch.randn(batch, length, generator=gen)
    return rewards.to(device), values.to(device), mask.to(device)


def median_ms(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids contention noise)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"GAE, B={args.batch}, gamma={args.gamma}, lam={args.lam}, device={args.device}, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}")  # fmt: skip
    header = f"{'T':>6} | {'loop ms':>9} | {'vectorised ms':>13} | {'speed-up':>8} | {'max |diff|':>10}"
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        inputs = (*rollout(args.batch, length, args.device), args.gamma, args.lam)
        loop = functools.partial(compute_gae, *inputs)
        vec = functools.partial(compute_gae_vectorized, *inputs)
        diff = max((a - b).abs().max().item() for a, b in zip(loop(), vec()))
        loop_ms, vec_ms = median_ms(loop, args.repeats, args.device), median_ms(vec, args.repeats, args.device)
        print(f"{length:>6} | {loop_ms:>9.2f} | {vec_ms:>13.2f} | {loop_ms / vec_ms:>7.1f}x | {diff:>10.2e}")


if __name__ == "__main__":
    main()
