"""The one rule by which a run's random streams are derived from its seeds.

Every stream a run draws from (the data order of an epoch, the minibatch order of a PPO update, the
sampling noise of one prompt) is seeded with `derive_seed(<the seeds it depends on>, <its position>)`,
e.g. `derive_seed(seed, iteration, rank)`. NumPy's SeedSequence hashes the keys, so nearby keys give
unrelated streams and no two key tuples collide in practice (unlike sums or products of keys).
"""

from __future__ import annotations

import numpy as np


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys, e.g. (run seed, iteration, position in the rollout).

    Each key (taken mod 2^64) is encoded as two 32-bit words after a tag and the key count, so (s, j) and
    (s, j, 0), or keys that differ only across a 32-bit boundary, give different seeds. Fits
    `torch.Generator.manual_seed` and `random.Random`.
    """
    words = [0x5EED, len(keys)]
    for k in keys:
        k = int(k) % 2**64
        words += [k & 0xFFFFFFFF, k >> 32]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)
