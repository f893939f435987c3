"""Which prompts a rollout samples, with which seeds, in how many rounds.

    PromptSource    this rank's rows of an iteration's generation round: the seeded walk through epochs of shuffled
                    prompts (round 0), a seeded permutation of its own for `ppo.filter_groups`' extra rounds; one
                    seed per (iteration, sample), the group ids
    Round           one sampled and scored round (`ExperienceMaker.sample`): its `Episodes` and the score rules
    filter_groups   DAPO's dynamic sampling: rounds until every rank holds informative groups, the kept rows
    join_rounds     the kept rows of several rounds as one
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from rlhf_cli import engine
from rlhf_cli.core import informative_groups
from rlhf_cli.data import epoch_order
from rlhf_cli.rollout.episodes import Episodes, join_episodes
from rlhf_cli.seeds import derive_seed

log = logging.getLogger(__name__)


class PromptSource:
    """The prompt rows of a run's rollouts (`prompts`: the tokenized prompt rows), drawn by the run config (`seed`,
    `data.seed`, `ppo.rollout_batch_size`, `ppo.n_samples_per_prompt`)."""

    def __init__(self, cfg: Any, prompts: Sequence[dict[str, Any]]) -> None:
        self.cfg, self.p, self.prompts = cfg, cfg.ppo, prompts
        self._order: list[int] = []  # prompt order of data epoch `_order_epoch` (`walk`)
        self._order_epoch: int | None = None

    def batch(self, iteration: int, round_: int = 0) -> tuple[list[dict[str, Any]], list[int], torch.Tensor]:
        """This rank's rows of an iteration's generation round: their prompts, sampling seeds and group ids.

        Prompts: round 0 (every iteration's, and the only one without `ppo.filter_groups`) takes a seeded walk
        through epochs of shuffled prompts (the same on every rank), `ppo.rollout_batch_size` (M) per iteration; an
        extra round r >= 1 of `ppo.filter_groups` takes M prompts of its own seeded permutation of all prompts,
        (data.seed, seed, iteration, r), those of round 0 last (so they repeat only when fewer than 2M prompts
        exist); the walk is not advanced. Each prompt is repeated `ppo.n_samples_per_prompt` (G) times in a row; a
        rank takes whole groups. The round's k-th prompt is the iteration's (r·M + k)-th: its group id, and the
        seed of its sample j is one per (run seed, iteration, (r·M + k)·G + j), so every sample has its own stream
        and a response is the same whatever the world size.
        """
        M, G = self.p.rollout_batch_size, self.p.n_samples_per_prompt
        idx = self.walk(iteration)
        if round_ > 0:
            first = set(idx)
            perm = epoch_order(len(self.prompts), (self.cfg.data.seed, self.cfg.seed, iteration), round_)
            idx = ([i for i in perm if i not in first] + [i for i in perm if i in first])[:M]
        per_rank, offset = M // engine.world_size(), round_ * M
        ks = range(engine.rank() * per_rank, (engine.rank() + 1) * per_rank)
        prompts = [self.prompts[idx[k]] for k in ks for _ in range(G)]
        seeds = [derive_seed(self.cfg.seed, iteration, (offset + k) * G + j) for k in ks for j in range(G)]
        groups = torch.tensor([offset + k for k in ks for _ in range(G)], dtype=torch.long)
        return prompts, seeds, groups

    def walk(self, iteration: int) -> list[int]:
        """The prompt indices of an iteration's round 0: positions iteration·M ... (iteration + 1)·M − 1 of the
        walk through epochs of shuffled prompts (`data.epoch_order` seeded by (data.seed, seed, epoch)), M =
        `ppo.rollout_batch_size`."""
        n, M = len(self.prompts), self.p.rollout_batch_size
        idx = []
        for k in range(iteration * M, (iteration + 1) * M):
            epoch, pos = divmod(k, n)
            if epoch != self._order_epoch:
                self._order, self._order_epoch = epoch_order(n, (self.cfg.data.seed, self.cfg.seed), epoch), epoch
            idx.append(self._order[pos])
        return idx


class Round(NamedTuple):
    """One generation round on this rank (`ExperienceMaker.sample`), B rows: prompts (B dicts), groups (B,) long,
    the `Episodes`, raw (B,) the raw score, score (B,) the score the advantages see (normalised, penalties,
    overlong shaping), overlong (B,) its overlong part (all three 0 on unscorable rows), valid (B,) bool (the rows
    that count in a group baseline and learn), scored (B,) bool (False: a reward source left the row unscored; such
    a row is never valid), sources (`reward/<source>`: (B,) raw scores, NaN where unscored), gen_seconds and
    reward_seconds."""

    prompts: list[dict[str, Any]]
    groups: torch.Tensor
    episodes: Episodes
    raw: torch.Tensor
    score: torch.Tensor
    overlong: torch.Tensor
    valid: torch.Tensor
    scored: torch.Tensor
    sources: dict[str, torch.Tensor]
    gen_seconds: float
    reward_seconds: float


def filter_groups(p: Any, iteration: int, first: Round, next_round: Callable[[int], Round], pad_id: int,
                  ) -> tuple[Round | None, list[Round], dict[str, float]]:
    """DAPO's dynamic sampling (`ppo.filter_groups`; Yu et al. 2025, sec. 3.2): keep the groups of `first`
    whose scores vary (`core.informative_groups`) and sample further rounds (`next_round(r)`: round r of the
    iteration, `PromptSource.batch(iteration, r)` sampled and scored) while any rank holds fewer than its share
    of `ppo.rollout_batch_size` groups, for at most `ppo.filter_groups_max_rounds` extra rounds (every rank runs
    the same rounds: sampling may be collective). Every rank then keeps its first k kept groups in round order, k
    the fewest any rank has (capped at its share), rounded down to whole minibatches (`ppo.mini_batch_size`
    completions over all ranks: the optimizer steps after a fixed number of micro-batches, so a partial minibatch
    would carry its gradient into the next iteration's step); every rank's update then has the same shape. p: the
    run's `ppo` section; pad_id: the tokenizer's (the joined layout's padding). Returns (the kept rows as one
    round, or None when k = 0; every round sampled; `groups/dropped_frac`, `groups/extra_rounds`,
    `groups/kept_frac`)."""
    G = p.n_samples_per_prompt
    share = p.rollout_batch_size // engine.world_size()
    mini_rows = p.mini_batch_size // engine.world_size()
    unit = mini_rows // math.gcd(G, mini_rows)  # the fewest groups that fill whole minibatches
    rounds, kept = [first], [informative_groups(first.score, first.groups, first.valid)]
    while True:
        n_kept = sum(int(k.sum()) for k in kept) // G  # whole groups are kept or dropped
        short = engine.all_reduce_sum(torch.tensor(float(n_kept < share))).item() > 0
        if not short or len(rounds) > p.filter_groups_max_rounds:
            break
        rounds.append(next_round(len(rounds)))
        kept.append(informative_groups(rounds[-1].score, rounds[-1].groups, rounds[-1].valid))
    fewest = min(engine.all_gather_object(min(n_kept, share)))
    k = fewest - fewest % unit
    sampled = len(rounds) * share
    stats = {"groups/dropped_frac": (sampled - n_kept) / sampled, "groups/extra_rounds": float(len(rounds) - 1),
             "groups/kept_frac": k / share}
    if k == 0:
        if engine.is_main():
            log.warning("iteration %d trains nothing: %s in %d round(s) (ppo.filter_groups=true, "
                        "ppo.filter_groups_max_rounds=%d)", iteration + 1,
                        "every group sampled has equal scores" if fewest == 0 else
                        f"{fewest} group(s) with varied scores kept, fewer than the {unit} × "
                        f"ppo.n_samples_per_prompt={G} completions of a minibatch (ppo.mini_batch_size="
                        f"{p.mini_batch_size})", len(rounds), p.filter_groups_max_rounds)
        return None, rounds, stats
    rows, left = [], k * G  # the first k kept groups, in round order (a group's rows are adjacent)
    for keep in kept:
        idx = keep.nonzero().flatten()[:left]
        rows.append(idx)
        left -= len(idx)
    return join_rounds(rounds, rows, pad_id), rounds, stats


def join_rounds(rounds: Sequence[Round], rows: Sequence[torch.Tensor], pad_id: int) -> Round:
    """The rows `rows[i]` (long indices) of each round `rounds[i]`, in order, as one round (`join_episodes`: one
    [left-padded prompt | right-padded completion] layout). Timings are summed; sources are the first round's."""
    parts = [(r, i.to(r.episodes.input_ids.device)) for r, i in zip(rounds, rows) if len(i)]
    episodes = join_episodes([r.episodes.rows(i) for r, i in parts], pad_id)

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name)[i] for r, i in parts])

    return Round([r.prompts[j] for r, i in parts for j in i.tolist()], cat("groups"), episodes, cat("raw"),
                 cat("score"), cat("overlong"), cat("valid"), cat("scored"), rounds[0].sources,
                 sum(r.gen_seconds for r in rounds), sum(r.reward_seconds for r in rounds))
