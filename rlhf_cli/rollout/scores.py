"""The run's sequence score (`ScoreMixer`): one source (`reward.type`) or a weighted sum of several
(`reward.weights`), scored on each rank's own rows. A score is one number per sequence; the per-token rewards
the estimators take are built from it later (`shaping.shape`).

    sources   model     the reward model's score (normalised with its held-out mean/std when
                        `ppo.normalize_reward` and the checkpoint stores them)
              checker   the data's checker (`data.task_checker`): the built-in task's, 1.0 for a correct final
                        number, else 0.0; reasoning-gym's tasks' own `score_answer` with `data.reasoning_gym`
              function  the user's `reward.function` (see `rlhf_cli.rewards`)
              http      a reward server at `reward.url`, OpenRLHF's remote protocol (see `rlhf_cli.reward_http`);
                        its scores as they come, NaN where it answered null or NaN
              judge     an LLM judge at `reward.judge.base_url` (see `rlhf_cli.reward_judge`): the number
                        `reward.judge.pattern` reads in its reply, NaN where it reads none
    score     Σ weight × source score; the trainer then subtracts `ppo.missing_eos_penalty` from responses
              without EOS (`ppo.truncated=penalize`)

A source may leave a row unscored (a reward function's None or NaN): that row's score is NaN here, whatever the
other sources say, and the maker turns it into an unscorable row (`ExperienceMaker.sample`).

Reward functions run on every rank, each on that rank's rows. A function that fails on one rank stops every
rank, with its one-line message (`RewardError`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.config import reward_sources
from rlhf_cli.data import task_checker
from rlhf_cli.errors import RewardError, RewardServerError
from rlhf_cli.forwards import batched_scores
from rlhf_cli.reward_http import HttpReward, queries
from rlhf_cli.reward_judge import JudgeReward
from rlhf_cli.rewards import call_reward_function, load_reward_function

log = logging.getLogger(__name__)



class ScoreMixer:
    """Scores completions with the run's reward sources and mixes their scores into one (B,) score per row.

    cfg: the run config (`reward.*`, `ppo.normalize_reward`); reward_model: an `engine.FrozenModel` (None when
    no source is `model`); score_stats: its held-out (mean, std) or None; batch_size: rows per RM forward;
    score_precision: the RM pass's precision; eos_ids: the run's EOS set (`eos.eos_ids`), the tokenizer's first.
    """

    def __init__(self, cfg: Any, tokenizer: Any, reward_model: Any, score_stats: tuple[float, float] | None,
                 batch_size: int, score_precision: str, normalize: bool = True, eos_ids: Sequence[int] = ()) -> None:
        self.weights = reward_sources(cfg)
        self.tokenizer, self.reward_model, self.score_stats = tokenizer, reward_model, score_stats
        self.batch_size, self.score_precision, self.normalize = batch_size, score_precision, normalize
        self.eos_ids = tuple(eos_ids)  # the EOS set: a response's closing id is read as the first (`batched_scores`)
        self.packing = bool(cfg.data.packing)  # the reward model scores packed rows (`batched_scores`)
        self.functions: dict[str, tuple[str, Any]] = {}
        if "checker" in self.weights:  # the data's own: the built-in task's, or reasoning-gym's
            self.functions["checker"] = task_checker(cfg.data)
        if "function" in self.weights:
            self.functions["function"] = (cfg.reward.function, load_reward_function(cfg.reward.function))
        self.http = HttpReward.from_config(cfg.reward) if "http" in self.weights else None
        self.judge = JudgeReward.from_config(cfg.reward.judge, cfg.seed) if "judge" in self.weights else None
        if "model" in self.weights and reward_model is None:
            raise ValueError("the reward source `model` needs a reward model")
        if "model" in self.weights and normalize and score_stats is None and engine.is_main():
            log.warning("ppo.normalize_reward=true has no effect: the reward model stored no held-out mean/std (it "
                        "was trained without held-out pairs), so its raw scores are used")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                 prompts: list[dict[str, Any]], conversations: list[Any] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(raw (B,), score (B,), per-source scores) of this rank's rows `[prompt | response]`, float32.

        conversations: the rows' `episodes.Conversation`s under `rollout.env` (`Episodes.conversations`): the
        user's reward function (`function`) then receives their messages (`call_on_every_rank`); every other
        source scores `[prompt | response]` as without an environment (the response: the tokens the policy
        sampled, `Episodes.sampled_view`).

        raw = Σ weight × raw source score; score = the same with the model's score normalised; NaN in both where a
        source of non-zero weight left the row unscored. The per-source scores are the raw (B,) values keyed
        `reward/<source>`, NaN where that source left a row unscored (the maker logs their means over the scored
        rows of all ranks). A source of weight 0 is scored and logged, and changes no score.

        Raises:
            RewardError: a reward function failed here or on another rank, or the reward model scored NaN (a
                model's NaN is a fault, not an unscorable row: only functions, servers and judges may leave one).
        """
        device = input_ids.device
        sources: dict[str, torch.Tensor] = {}  # raw, by source
        normalised: dict[str, torch.Tensor] = {}  # where it differs from raw: the model's, under normalize
        if "model" in self.weights:
            with self.reward_model.on_device() as rm:
                r = batched_scores(rm, input_ids, attention_mask, self.batch_size, self.score_precision,
                                   prompt_len, self.packing, self.eos_ids)
            bad = engine.all_reduce_sum(r.isnan().sum().float()).item()
            if bad:
                raise RewardError(f"the reward model scored NaN for {int(bad)} completions (an overflow under "
                                  f"scoring_precision={self.score_precision}? try scoring_precision=fp32)")
            sources["reward/model"] = r.float()
            if self.normalize and self.score_stats is not None:
                mean, std = self.score_stats
                normalised["reward/model"] = (r - mean) / (std if std > 1e-6 else 1.0)  # constant RM: only centre
        texts = self.tokenizer.batch_decode(input_ids[:, prompt_len:], skip_special_tokens=True)
        if self.functions:
            sources.update({f"reward/{k}": v.to(device)
                            for k, v in call_on_every_rank(self.functions, texts, prompts, conversations).items()})
        if self.http is not None:
            sources["reward/http"] = http_on_every_rank(self.http, queries(self.tokenizer, input_ids, attention_mask),
                                                        texts, prompts).to(device)
        if self.judge is not None:
            sources["reward/judge"] = judge_on_every_rank(self.judge, texts, prompts).to(device)
        raw = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=device)
        norm = torch.zeros_like(raw)
        for key, values in sources.items():
            w = self.weights[key.removeprefix("reward/")]
            if w != 0:  # a weight-0 source's NaN leaves the row scored
                raw, norm = raw + w * values, norm + w * normalised.get(key, values)
        return raw, norm, sources


def call_on_every_rank(functions: dict[str, tuple[str, Any]], texts: list[str], prompts: list[dict[str, Any]],
                       conversations: list[Any] | None = None) -> dict[str, torch.Tensor]:
    """{source: (B,) float32 scores, NaN where unscorable} of this rank's completions `texts` (of the data rows
    `prompts`) by each `functions[source] = (name, fn)`, called as `rlhf_cli.rewards.call_reward_function` does.
    With `conversations` (B `episodes.Conversation`s, under `rollout.env`), the `function` source receives TRL's
    conversational form instead: each row's prompt and completion messages, and `environments=` its environment
    instance where the function takes it; the `checker` still reads `texts`. A collective: call it on every rank.

    Raises:
        RewardError: on every rank when a function failed on any of them (this rank's own message, or
            "failed on another rank").
    """
    failure, out = None, {}
    try:
        for source, (name, fn) in functions.items():
            shown, said = [x.get("prompt_text", "") for x in prompts], texts
            columns = [x.get("columns") for x in prompts]
            if conversations is not None and source == "function":
                shown, said = [c.prompt for c in conversations], [c.completion for c in conversations]
                columns = [{**(cols or {}), "environments": c.environment} for cols, c in zip(columns, conversations)]
            out[source] = call_reward_function(fn, name, shown, said, [x.get("answer") for x in prompts],
                                               [x.get("row") for x in prompts], columns)
    except RewardError as e:
        failure = e
    if engine.all_reduce_sum(torch.tensor(float(failure is not None))).item() > 0:
        raise failure if failure is not None else RewardError("a reward function failed on another rank")
    return out


def unscored_rows(cfg: Any, iteration: int, raw: torch.Tensor,
                  score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows no reward source could score (a NaN score from `ScoreMixer`, of any weighted source): (raw, score) with
    those rows' values set to 0, and scored (B,) bool, False on them. The maker keeps them out of every group
    baseline, loss and reward statistic (`valid`); a collective: call it on every rank.

    The rule is TRL's for unscorable rows (trl PRs #5749, #5773): a row nobody can score teaches nothing, rather
    than reward 0, which would push the policy away from answers the verifier could not read.

    Raises:
        RewardError: on every rank, when more than `reward.max_unscorable_frac` of this generation round's
            completions over all ranks are unscored (iteration: 0-based, for the message).
    """
    scored = ~(raw.isnan() | score.isnan())
    limit = cfg.reward.max_unscorable_frac
    n_bad, n = engine.all_reduce_sum(torch.tensor([float((~scored).sum()), float(scored.numel())],
                                                  dtype=torch.float64)).tolist()
    if n and n_bad / n > limit:
        raise RewardError(f"iteration {iteration + 1}: {int(n_bad)} of {int(n)} completions ({n_bad / n:.0%}) could "
                          f"not be scored (reward {'+'.join(reward_sources(cfg))} returned None or NaN), more than "
                          f"reward.max_unscorable_frac={limit}: fix the reward source, or raise the limit")
    zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
    return torch.where(scored, raw, zero), torch.where(scored, score, zero), scored


def http_on_every_rank(client: HttpReward, query: list[str], texts: list[str],
                       prompts: list[dict[str, Any]]) -> torch.Tensor:
    """(B,) float32 scores of this rank's rows by the reward server `client` (`HttpReward.score`: `query` the
    rows' full texts, `texts` their completions, `prompts` their data rows), NaN where it could not score a row.
    A collective: call it on every rank.

    Raises:
        RewardServerError: on every rank when the server failed for any of them.
    """
    return _server_on_every_rank(lambda: client.score(query, texts, prompts), f"reward server {client.url}")


def judge_on_every_rank(judge: JudgeReward, texts: list[str], prompts: list[dict[str, Any]]) -> torch.Tensor:
    """(B,) float32 scores of this rank's completions `texts` (of the data rows `prompts`) by the LLM judge
    (`JudgeReward.score`), NaN where its reply held no score. A collective: call it on every rank.

    Raises:
        RewardServerError: on every rank when the judge's endpoint failed for any of them.
    """
    return _server_on_every_rank(lambda: judge.score(texts, prompts), f"judge endpoint {judge.base_url}")


def _server_on_every_rank(score: Any, server: str) -> torch.Tensor:
    """`score()` on this rank; every rank raises RewardServerError when it failed on any (`server` names it)."""
    failure, out = None, None
    try:
        out = score()
    except RewardServerError as e:
        failure = e
    except Exception as e:  # noqa: BLE001 - anything else here must not skip the collective below: one line
        failure = RewardServerError(f"{server}: scoring raised {type(e).__name__}: {e}")
    if engine.all_reduce_sum(torch.tensor(float(failure is not None))).item() > 0:
        raise failure if failure is not None else RewardServerError(
            f"{server} failed for another rank")
    return out
