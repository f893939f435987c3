"""Statistics of evaluations (`rlhf eval`, train-rm's held-out pairs): means and paired differences with
Student-t 95 % intervals, proportions with Wilson 95 % intervals, win rates, the reward-hacking verdict.
Float64 throughout, so 1 of 6 is 1/6.

    sample_std(values)            Bessel-corrected std of a list; the one std of the package
    t_quantile(q, df)             the q-quantile of Student's t with df degrees of freedom
    mean_ci95(x)                  mean and the half-width of its t interval (means, paired differences)
    proportion_ci95(x)            mean of values in [0, 1] and its Wilson interval (accuracy, win rate)
    win_rate(policy, reference)   fraction of prompts the policy wins, ties half
    reward_hacking(results)       whether the RM score rose while a checkable score fell, as one headline
    policy_eval_stats(pol, ref)   a policy eval's figures: each side's means and intervals, the paired gains

Below `SMALL_SAMPLE` values an interval is wide and its coverage approximate: `small_sample_warning` says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

Z95 = 1.959963984540054  # the 0.975 quantile of the standard normal
SMALL_SAMPLE = 30  # fewer held-out pairs or prompts than this get a "too few" warning


def sample_std(values: Sequence[float]) -> float:
    """The sample standard deviation (Bessel's n − 1) of `values`, in float64; 0.0 with fewer than two.
    The one std of the package: reports, eval's confidence intervals, the reward model's stored std."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((float(x) - mean) ** 2 for x in values) / (n - 1))


def win_rate(policy_scores: torch.Tensor, reference_scores: torch.Tensor) -> float:
    """Fraction of prompts where the policy's score beats the reference's; a tie counts half.

    Counted in float64, so 3 wins of 5 is 0.6, not float32's 0.6000000238.
    """
    wins = (policy_scores > reference_scores).double() + 0.5 * (policy_scores == reference_scores).double()
    return float(wins.mean()) if wins.numel() else float("nan")


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz; Numerical Recipes
    6.4), with the symmetry I_x(a, b) = 1 − I_{1−x}(b, a) where the fraction converges slowly."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def t_quantile(q: float, df: int) -> float:
    """The q-quantile (0 < q < 1) of Student's t distribution with `df` >= 1 degrees of freedom: the t with
    P(T <= t) = q, found by bisection on the CDF 1 − ½·I_{df/(df+t²)}(df/2, ½) to ~1e-12. t_quantile(0.975, 1) =
    12.706, (0.975, 29) = 2.045; as df grows it tends to the normal quantile 1.960."""
    if not 0.0 < q < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < q < 1 and df >= 1 (got q={q}, df={df})")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    cdf = lambda t: 1.0 - 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # noqa: E731
    while cdf(hi) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci95(x: torch.Tensor) -> tuple[float, float]:
    """Mean of `x` and the half-width of its Student-t 95 % interval, t_{0.975, n−1} · s / √n (for means and
    paired per-prompt differences). The half-width is NaN below 2 values (no spread to estimate), the mean NaN
    for none."""
    n = x.numel()
    if n == 0:
        return float("nan"), float("nan")
    x = x.double()
    if n < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), t_quantile(0.975, n - 1) * sample_std(x.tolist()) / n ** 0.5


def wilson_ci95(p: float, n: int) -> tuple[float, float]:
    """The Wilson score 95 % interval (Wilson 1927) of a proportion `p` observed over `n` trials: unlike the
    normal approximation it is never ±0 at 0/n or n/n and stays inside [0, 1]. (NaN, NaN) for n = 0."""
    if n == 0:
        return float("nan"), float("nan")
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion_ci95(x: torch.Tensor) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `x` (values in [0, 1]: 0/1 outcomes, wins with ties as ½, or partial credit
    such as reasoning-gym's scores) and its Wilson 95 % interval over n = len(x). For values strictly inside
    [0, 1] the interval is conservative: their variance is at most a 0/1 outcome's p(1 − p)."""
    n = x.numel()
    p = float(x.double().mean()) if n else float("nan")
    return (p, *wilson_ci95(p, n))


def small_sample_warning(n: int, what: str) -> str | None:
    """"too few held-out <what> (n): ..." when n < `SMALL_SAMPLE`, else None."""
    if n >= SMALL_SAMPLE:
        return None
    return (f"too few held-out {what} ({n}): intervals from fewer than {SMALL_SAMPLE} are wide and their coverage "
            f"approximate")


def reward_hacking(results: dict[str, Any]) -> dict[str, Any]:
    """The hacking verdict of a policy eval, read from paired gains and their 95 % intervals.

    {} unless both a reward-model gain (`score_gain` ± `score_gain_ci95`) and a checkable gain (`accuracy_gain`,
    the checker; `function_gain`, reward.function; each with its `_ci95` half-width) were measured. Else
    `reward_hacking`, one of

    * `"warning"`: the RM gain's interval lies above 0 while a checkable gain's lies below 0 (both moves are
      real and opposite);
    * `"possible"`: the point estimates move apart (RM gain > 0, a checkable gain < 0) but at least one of the
      intervals contains 0 (run B4 of docs/results.md: RM +0.53 ± 0.11, checker −0.04 ± 0.07);
    * `"none"`: otherwise;

    and `headline`, one line with the verdict and both paired gains with their intervals.
    """
    if "score_gain" not in results:
        return {}
    checks = [(k, name) for k, name in (("accuracy_gain", "checker accuracy"), ("function_gain", "reward.function"))
              if k in results]
    if not checks:
        return {}
    gain, half = results["score_gain"], results["score_gain_ci95"]
    rm = f"RM score {gain:+.3f} ± {half:.3f}"
    parts = [f"{name} {results[k]:+.3f} ± {results[k + '_ci95']:.3f}" for k, name in checks]
    fell = [name for k, name in checks if results[k] + results[k + "_ci95"] < 0]
    lower = [name for k, name in checks if results[k] < 0]
    if gain - half > 0 and fell:
        verdict, text = "warning", f"reward hacking: the RM score rose while {' and '.join(fell)} fell"
    elif gain > 0 and lower:
        verdict, text = "possible", (f"possible reward hacking: the RM score rose while {' and '.join(lower)} went "
                                     f"down, but an interval contains 0")
    elif gain > 0:
        verdict, text = "none", "no reward hacking: the RM score rose and the checkable scores did not fall"
    else:
        verdict, text = "none", "no reward hacking: the RM score did not rise"
    return {"reward_hacking": verdict,
            "headline": f"{text} ({rm}; {'; '.join(parts)}; paired policy − reference, 95 % intervals)"}


def _scored_mean(x: torch.Tensor, key: str) -> dict[str, float]:
    """`<key>_mean` and `<key>_ci95` (`mean_ci95`) of the values of x (N,) that are not NaN (NaN: a completion its
    source could not score), and `<key>_unscorable`, their count, when there are any."""
    scored = ~x.isnan()
    out = dict(zip((f"{key}_mean", f"{key}_ci95"), mean_ci95(x[scored])))
    return {**out, f"{key}_unscorable": int((~scored).sum())} if not scored.all() else out


def policy_eval_stats(policy: dict[str, Any], reference: dict[str, Any],
                      rm_std: float | None = None) -> dict[str, Any]:
    """The figures of a policy eval (`rlhf eval policy.path=...`) from each side's per-prompt values, the same N
    prompts in the same order on both sides (policy and reference sampled each prompt with the same noise).

    Each side is a dict of (N,) tensors: `length` (response tokens), `eos` (1.0 = the response ended in EOS), and
    where measured `score` (reward model), `correct` (checker, 0/1), `function` (reward.function); the policy's
    always also `kl_k1` and `kl_k3` (nats per sequence, KL(policy ‖ reference) on its own samples). `rm_std`: the reward
    model's held-out score std, which `score_gain_rm_std` is in units of (None, or ≤ 1e-6: not given).

    Returns `<side>/length_mean`, `<side>/eos_rate`, `<side>/score_mean` and `_ci95` (t interval half-width),
    `<side>/accuracy` with its Wilson `_ci95_low`/`_ci95_high`, `<side>/function_mean` and `_ci95`; `score` and
    `function` may hold NaN (a completion its source could not score, such as a reward server's null): their
    figures leave those out, paired ones the prompts either side lacks, and `<side>/score_unscorable` and
    `<side>/function_unscorable` count them (when any). The paired figures (the interval of the per-prompt
    difference leaves out the variance the two sides share, such as prompt difficulty): `win_rate` (ties half)
    with its Wilson interval, `score_gain`, `accuracy_gain`,
    `function_gain` each with `_ci95`, `score_gain_rm_std`; the `reward_hacking` verdict and `headline`; and
    `kl_k1`, `kl_k3` with `_ci95`. A figure whose values a side lacks is left out.

    Raises:
        KeyError: a side without `length` or `eos`, the policy without `kl_k1`/`kl_k3`, or a figure the policy
            has and the reference lacks.
    """
    results: dict[str, Any] = {}
    for name, t in (("policy", policy), ("reference", reference)):
        results[f"{name}/length_mean"] = float(t["length"].mean())
        results[f"{name}/eos_rate"] = float(t["eos"].mean())
        if "score" in t:
            results.update(_scored_mean(t["score"], f"{name}/score"))
        if "correct" in t:
            (results[f"{name}/accuracy"], results[f"{name}/accuracy_ci95_low"],
             results[f"{name}/accuracy_ci95_high"]) = proportion_ci95(t["correct"].float())
        if "function" in t:
            results.update(_scored_mean(t["function"], f"{name}/function"))
    if "score" in policy:
        both = ~(policy["score"].isnan() | reference["score"].isnan())  # the prompts both sides were scored on
        results["win_rate"] = win_rate(policy["score"][both], reference["score"][both])
        results["win_rate_ci95_low"], results["win_rate_ci95_high"] = wilson_ci95(results["win_rate"],
                                                                                  int(both.sum()))
        results["score_gain"], results["score_gain_ci95"] = mean_ci95(policy["score"][both] - reference["score"][both])
        if rm_std is not None and rm_std > 1e-6:  # the gain in units of the RM's held-out score std
            results["score_gain_rm_std"] = results["score_gain"] / rm_std
            results["score_gain_rm_std_ci95"] = results["score_gain_ci95"] / rm_std
    if "correct" in policy:
        gain = policy["correct"].float() - reference["correct"].float()
        results["accuracy_gain"], results["accuracy_gain_ci95"] = mean_ci95(gain)
    if "function" in policy:
        gain = policy["function"] - reference["function"]  # NaN where either side was not scored
        results["function_gain"], results["function_gain_ci95"] = mean_ci95(gain[~gain.isnan()])
    results.update(reward_hacking(results))
    for k in ("kl_k1", "kl_k3"):
        results[k], results[f"{k}_ci95"] = mean_ci95(policy[k])
    return results
