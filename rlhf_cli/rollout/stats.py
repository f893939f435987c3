"""Statistics over the real tokens of a whole rollout, across data-parallel ranks: whitening, the critic's
explained variance, and the rollout's KL statistics (after its update). On one rank whitening equals
`core.masked_whiten` (tested)."""

from __future__ import annotations

import math

import torch

from rlhf_cli import engine
from rlhf_cli.core import engine_is_weights, kl_estimate
from rlhf_cli.rollout.experience import Experience


def _moments_across_ranks(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """(x − mean masked to 0 (float64), n, mean, unbiased var) over the real tokens of ALL ranks.

    Two passes in float64 (the mean, then the squared deviations), so a large mean does not swamp the
    variance; var is 1.0 with a single real token and 0.0 with none.
    """
    m = mask.bool()
    xd = torch.where(m, x.double(), torch.zeros_like(x, dtype=torch.float64))
    n, s = engine.all_reduce_sum(torch.stack([m.double().sum(), xd.sum()])).tolist()
    if n < 1:
        return torch.zeros_like(xd), 0.0, 0.0, 0.0
    mean = s / n
    centred = torch.where(m, xd - mean, torch.zeros_like(xd))
    ss = engine.all_reduce_sum(centred.square().sum()).item()
    return centred, n, mean, (ss / (n - 1) if n > 1 else 1.0)


def scored_means(values: dict[str, torch.Tensor], scored: torch.Tensor) -> dict[str, float]:
    """Each (B,) value's mean over the scored rows (`scored` (B,) bool) of ALL ranks where it is not NaN (a
    weight-0 source's unscored row), keyed as in `values`; a key no rank has such a row for is left out (no number
    rather than a NaN). Each rank's float32 mean weighed by its count, so one rank's figure is its plain mean, bit
    for bit."""
    local: list[float] = []
    for v in values.values():
        keep = v[scored & ~v.isnan()].float()
        local += [keep.mean().item() * keep.numel() if keep.numel() else 0.0, float(keep.numel())]
    sums = engine.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
    return {k: sums[2 * i] / sums[2 * i + 1] for i, k in enumerate(values) if sums[2 * i + 1]}


def whiten_across_ranks(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean)/std over real tokens of ALL ranks (unbiased std), 0 on padding.

    x, mask: (B, T); mask 1 = real token. Returns (B, T) float32. Equals `core.masked_whiten(x, mask)`
    on one rank (tested); with one real token the std is taken as 1, like masked_whiten's documented
    fallback.
    """
    centred, n, _, var = _moments_across_ranks(x, mask)
    if n < 1:
        return centred.float()
    return (centred / math.sqrt(var + eps)).float()


def explained_variance_across_ranks(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[returns − values] / Var[returns] over the real tokens of the whole rollout (all ranks).

    values, returns, mask: (B, T). 1 is a perfect critic, 0 one no better than the mean return, < 0
    worse; 0 when the returns do not vary (as `core.value_loss`). Computed once per rollout on the critic's old
    values, so it does not depend on how the rollout is split into micro-batches or ranks.
    """
    _, n, _, var_r = _moments_across_ranks(returns, mask)
    _, _, _, var_d = _moments_across_ranks(returns - values, mask)
    return 1.0 - var_d / var_r if n > 1 and var_r > 0 else 0.0


def response_kl(exp: Experience) -> torch.Tensor:
    """(B,) float32: the k1 KL of each rollout row to the reference, summed over its response tokens (nats per
    sequence), from `exp.old_logprobs` and `exp.ref_logprobs` (Schulman 2020's k1 = log π − log π_ref), over the
    tokens the policy sampled (`exp.action_mask`)."""
    return (kl_estimate(exp.old_logprobs, exp.ref_logprobs, "k1") * exp.action_mask).sum(1)


def kl_stats(exp: Experience, beta: float) -> dict[str, float]:
    """The rollout's KL statistics, means over all ranks' rows: `objective/kl` (k1, nats/seq), `objective/kl_k3`,
    `objective/rlhf_reward` (score − β·KL, β = `beta`; over the scored rows, `Experience.scored`) and
    `objective/entropy_sampled` (−Σ log π of the sampled tokens, nats/seq), each over the tokens the policy
    sampled (`exp.action_mask`). Run after the update in every case: an on-policy plan's old log-probs come from
    it (`UpdatePlan.on_policy`); otherwise the update leaves them as the rollout computed them."""
    action_mask = exp.action_mask
    kl_seq = response_kl(exp)
    k3 = kl_estimate(exp.old_logprobs, exp.ref_logprobs, "k3")
    scored = exp.scored if exp.scored is not None else torch.ones_like(exp.scores, dtype=torch.bool)
    return {**engine.reduce_stats({
        "objective/kl": kl_seq.mean().item(),
        "objective/kl_k3": (k3 * action_mask).sum(1).mean().item(),
        "objective/entropy_sampled": (-(exp.old_logprobs * action_mask).sum(1)).mean().item(),
    }), **scored_means({"objective/rlhf_reward": exp.scores - beta * kl_seq}, scored)}  # over the scored rows


def engine_stats(exp: Experience) -> dict[str, float]:
    """How far the sampling engine's log-probs are from the trainer's, over all ranks' response tokens:
    `rollout/engine_logprob_diff_mean` and `rollout/engine_logprob_diff_max`, |engine − trainer| in nats per
    sampled token (`Experience.engine_logprobs` against `Experience.old_logprobs`, both after temperature). {} when
    the engine gives no log-probs (`rollout.engine=hf`). Run after the update (an on-policy plan's old log-probs
    come from it). A stale engine (weights not pushed) shows here as a diff that grows with every update."""
    if exp.engine_logprobs is None:
        return {}
    diff = (exp.engine_logprobs - exp.old_logprobs).abs() * exp.action_mask
    sums = engine.all_reduce_sum(torch.stack([diff.sum(), exp.action_mask.sum()]))
    top = max(engine.all_gather_object(float(diff.max()) if diff.numel() else 0.0))
    return {"rollout/engine_logprob_diff_mean": (sums[0] / sums[1].clamp(min=1)).item(),
            "rollout/engine_logprob_diff_max": top}


def is_correction_stats(exp: Experience, mode: str, low: float | None, high: float) -> dict[str, float]:
    """The engine correction's statistics over all ranks (`rollout.is_correction`, `core.engine_is_weights`):
    `rollout/is_ratio_p1`, `rollout/is_ratio_p50`, `rollout/is_ratio_p99` (quantiles of ρ_t = π_old/μ over the
    loss's tokens; of the sequences' geometric-mean ratio for `seq_mask`) and `rollout/is_masked_frac` (the
    fraction of those tokens, or sequences, that the bounds truncate or mask). {} with `mode=none` or without the
    engine's log-probs (`rollout.engine=hf`). Run after the update (an on-policy plan's old log-probs come from
    it): the weights the update used are these."""
    if mode == "none" or exp.engine_logprobs is None:
        return {}
    _, ratio, hit = engine_is_weights(exp.old_logprobs, exp.engine_logprobs, exp.loss_mask, mode, low, high)
    m = exp.loss_mask.bool()
    if mode == "seq_mask":  # one value per sequence with a token in the loss (each of its tokens holds it)
        rows = m.any(1)
        values = ((ratio * m).sum(1) / m.sum(1).clamp(min=1))[rows]
        hits = hit.any(1)[rows]
    else:
        values, hits = ratio[m], hit[m]
    values = torch.cat(engine.all_gather_object(values.double().cpu()))
    sums = engine.all_reduce_sum(torch.tensor([float(hits.sum()), float(hits.numel())], dtype=torch.float64))
    if values.numel() == 0:
        return {"rollout/is_masked_frac": 0.0}
    q = torch.quantile(values, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).tolist()
    return {"rollout/is_ratio_p1": q[0], "rollout/is_ratio_p50": q[1], "rollout/is_ratio_p99": q[2],
            "rollout/is_masked_frac": (sums[0] / sums[1].clamp(min=1)).item()}


class PushGuard:
    """Stops a run whose weight push changed no tensor of the engine after an optimizer step (issue 60), and gives
    the iteration's `rollout/engine_tensors_changed`.

    `check(changed, iteration)` reads the engine's count for the push made before this iteration's rollout
    (`Generator.tensors_changed`: None for an engine that samples from the live module, or after a start without
    the self-test; 0 for the self-test's push of the starting weights, so the first row after a start reports 0).
    Zero after an iteration that stepped raises FloatingPointError (the stage aborts the run in one line): the
    policy did not move (a learning rate of 0) or the push reached nothing. `stepped(trained)` after each update:
    False exempts the next push, for an iteration with nothing to train (`ppo.filter_groups`), with a skipped step
    (`ppo.max_bad_steps`), or whose last step had a zero gradient (every advantage 0: GRPO's flat groups without
    `ppo.filter_groups`; Adam then moves nothing); a start or resume begins exempt."""

    def __init__(self) -> None:
        self.last_stepped = False

    def check(self, changed: int | None, iteration: int) -> dict[str, float]:
        if changed is None:
            return {}
        if changed == 0 and self.last_stepped:
            raise FloatingPointError(
                f"aborting at iteration {iteration + 1}: the weight push before its rollout changed no tensor of the "
                f"engine after iteration {iteration}'s optimizer step: the policy did not move (a learning rate of "
                f"0?) or the push reached nothing (rollout.engine=vllm)")
        return {"rollout/engine_tensors_changed": float(changed)}

    def stepped(self, trained: bool) -> None:
        self.last_stepped = bool(trained)


class EngineDriftGuard:
    """Stops a run whose engine drifted from the trainer in bf16, where the greedy probe cannot judge.

    The first iteration's `rollout/engine_logprob_diff_mean` is the baseline (bf16 rounding of the same weights:
    the engine starts from the trainer's). From then on the median of the last `window` iterations' means (of all
    iterations so far while there are fewer; the lower middle of an even count) is compared with it, and more than
    `factor` times the baseline raises FloatingPointError (the stage aborts the run in one line). `active`: False
    where the engine computes as the scoring passes do and its greedy probe checks each push
    (`VLLMGenerator.probes`: both fp32); then this does nothing. After a resume the baseline is the first
    iteration run.

    The rule, from measurement (SmolLM2, bf16-autocast, docs/results.md "vLLM: log-prob agreement and the bf16
    drift rule"): one iteration's mean is noisy, as a few tokens carry most of it. Pushed runs of `experiment=grpo`
    (2 seeds, 24 iterations each) had single iterations up to 3.7x their first (0.082 after 0.022), a spike the
    former one-iteration 3x rule stopped a healthy run on, while their medians of three stayed within 1.5x (2x
    below the bound). An engine whose pushes were skipped went 0.029 -> 0.070 -> 0.102 -> 0.136 (medians of three
    1.0x, 2.4x, 3.5x): 3x on the median stops it at its fourth iteration. The median cannot fire on the first two
    iterations after a start or a resume (the engine has just been built from the trainer's weights there).

    With `ppo.top_p` < 1 both sides' log-probs are renormalised over the nucleus (the engine's by the sampler, the
    trainer's by `core.nucleus_logits`), so the diff is the same float noise as at `top_p=1`.
    """

    def __init__(self, *, active: bool = True, factor: float = 3.0, window: int = 3) -> None:
        self.active, self.factor, self.window = active, factor, window
        self.baseline: float | None = None
        self.recent: list[float] = []

    def check(self, stats: dict[str, float], iteration: int) -> None:
        diff = stats.get("rollout/engine_logprob_diff_mean")
        if not self.active or diff is None:
            return
        if self.baseline is None:
            self.baseline = diff
        self.recent = [*self.recent, diff][-self.window:]
        median = sorted(self.recent)[(len(self.recent) - 1) // 2]
        if median > self.factor * max(self.baseline, 1e-6):
            raise FloatingPointError(
                f"aborting at iteration {iteration + 1}: the sampling engine's log-probs are {median:.3g} nats/token "
                f"from the trainer's (median of the last {len(self.recent)} iterations), > {self.factor:g}x the "
                f"{self.baseline:.3g} of the first iteration: its weights went stale (rollout.engine=vllm)")
