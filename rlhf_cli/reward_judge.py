"""An LLM judge (`reward.type=judge`, `reward.judge.*`): scores completions by asking a model behind an
OpenAI-compatible chat endpoint (`vllm serve`, the OpenAI API, ...) through the `openai` client (the `judge` extra),
as `verifiers`' JudgeRubric and veRL's GenRM do.

    judge = JudgeReward.from_config(cfg.reward.judge, seed)    the settings reward.judge.*
    judge.check_rows(rows)                                     ConfigError (one line) when the template names a
                                                               field the data rows lack
    scores = judge.score(completions, rows)                    (B,) float32; NaN where the reply gave no score

Each completion is one chat request: one user message, `reward.judge.prompt` with its fields filled in
(`{completion}`, `{prompt}`: the row's last user turn, `{answer}`, and the data file's columns), temperature 0,
`max_tokens`, the run's `seed`, and vLLM's structured output (`structured_outputs={"regex": ...}` in the body) when
`reward.judge.guided_regex` is set. The reply's text is searched with `reward.judge.pattern`: the first match's
first group, a finite float, is the score; anything else (no match, not a number, an empty reply) leaves the row
unscorable (NaN), for the unscorable-row rule (`reward.max_unscorable_frac`).

Identical judge messages (the same prompt, completion and fields) in one call are sent once: a group of G samples
that agree costs one request. `reward.judge.max_concurrency` requests are in flight at once, each with a timeout
(`reward.judge.timeout_s`); no connection, a timeout or a status of `RETRIED_STATUS` (408, 429, 500, 502-504) is
retried `reward.judge.retries` times with reward_http's exponential backoff (0.5 s, 1 s, 2 s, ... capped at 8 s; the
client's own retries are off), any other answer is not. A request that still fails raises `RewardServerError`
naming the base URL; the run stays resumable.

The API key comes from the environment variable `reward.judge.api_key_env` names (the placeholder `EMPTY` when it is
unset: a local server needs none); it is sent as the bearer token only, never stored or logged.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_cli.config import JUDGE_FIELDS, judge_placeholders
from rlhf_cli.data.tokenize import last_user_turn
from rlhf_cli.errors import ConfigError, RewardServerError
from rlhf_cli.reward_http import RETRIED_STATUS, Retry, check_reachable, scores_tensor, with_retries

if TYPE_CHECKING:  # pragma: no cover
    import torch

NO_KEY = "EMPTY"
"""The API key sent when `reward.judge.api_key_env` is unset (vLLM's convention: a local server checks none)."""


def read_score(pattern: re.Pattern[str], reply: str | None) -> float:
    """The score in a judge's `reply`: the first match of `pattern`, its first group as a float; NaN (an unscorable
    row) when the reply is empty, the pattern does not match, or the group is not a finite number."""
    match = pattern.search(reply or "")
    if match is None or match.group(1) is None:
        return math.nan
    try:
        value = float(match.group(1))
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def row_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The template's fields of one prompt dict (`prompt_text`, `answer`, `columns`) other than `completion`:
    the data file's columns, then `prompt` (the last user turn) and `answer` (the row's answer) over them."""
    fields = dict(row.get("columns") or {})
    fields["prompt"] = last_user_turn(str(row.get("prompt_text", "")))
    if row.get("answer") is not None or "answer" not in fields:
        fields["answer"] = row.get("answer")
    return fields


@dataclass(frozen=True)
class JudgeReward:
    """An LLM judge's client: `reward.judge.*` (see `config.JudgeConfig`) and the run's seed."""

    base_url: str
    model: str
    prompt: str
    pattern: str
    guided_regex: str | None = None
    max_tokens: int = 128
    max_concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 3
    api_key_env: str = "OPENAI_API_KEY"
    seed: int | None = None

    @classmethod
    def from_config(cls, judge_cfg: Any, seed: int | None) -> JudgeReward:
        """The client of the run's `reward.judge.*` settings; `seed`: the run's (`seed`), sent with each request."""
        return cls(base_url=str(judge_cfg.base_url), model=str(judge_cfg.model), prompt=str(judge_cfg.prompt),
                   pattern=str(judge_cfg.pattern), guided_regex=judge_cfg.guided_regex,
                   max_tokens=int(judge_cfg.max_tokens), max_concurrency=int(judge_cfg.max_concurrency),
                   timeout_s=float(judge_cfg.timeout_s), retries=int(judge_cfg.retries),
                   api_key_env=str(judge_cfg.api_key_env), seed=None if seed is None else int(seed))

    def check_reachable(self) -> None:
        """Something accepts TCP connections at `base_url` (before any model loads). Raises ConfigError."""
        check_reachable(self.base_url, self.timeout_s, setting="reward.judge.base_url", what="judge endpoint",
                        hint="start it first (e.g. `vllm serve <model>`, README \"Score with an LLM judge\")")

    def check_rows(self, rows: Sequence[dict[str, Any]], where: str = "the prompts") -> None:
        """Every field `reward.judge.prompt` names exists in every row of `rows` (prompt dicts): `prompt` and
        `completion` always do, `answer` where the rows have answers, others where the data file has that column.

        Raises:
            ConfigError: naming the first missing field, how many rows lack it, and the columns there are.
        """
        for name in judge_placeholders(self.prompt):
            if name in ("prompt", "completion"):
                continue
            lacking = sum(row_fields(r).get(name) is None for r in rows)
            if lacking:
                columns = sorted({k for r in rows for k in (r.get("columns") or {})})
                has = f"its columns are {', '.join(columns)}" if columns else "they have no data-file columns"
                raise ConfigError(f"reward.judge.prompt names {{{name}}}, but {lacking} of {len(rows)} rows of "
                                  f"{where} have no {name!r} ({has}; the template's own fields: "
                                  f"{', '.join('{' + f + '}' for f in JUDGE_FIELDS)})")

    def messages(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
        """The judge's user message of each completion: the template with the row's fields filled in."""
        return [self.prompt.format(**{**row_fields(r), "completion": c}) for c, r in zip(completions, rows)]

    def score(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> torch.Tensor:
        """(B,) float32 scores of B completions (`rows[i]`: completion i's prompt dict), NaN where the judge's
        reply held no score (`read_score`). Each distinct message is sent once; `max_concurrency` at a time.

        Raises:
            RewardServerError: a request failed after its retries, or the endpoint refused it (a 4xx).
        """
        import openai  # here: the preflight checks import this module, and the client only matters once scoring

        texts = self.messages(completions, rows)
        unique = list(dict.fromkeys(texts))  # the per-call cache: identical messages are judged once
        if not unique:
            return scores_tensor([])
        pattern = re.compile(self.pattern)
        client = openai.OpenAI(base_url=self.base_url, api_key=os.environ.get(self.api_key_env) or NO_KEY,
                               timeout=self.timeout_s, max_retries=0)  # retries here: on exactly RETRIED_STATUS
        try:
            with ThreadPoolExecutor(max(1, min(self.max_concurrency, len(unique)))) as pool:
                futures = [pool.submit(self._ask, client, t) for t in unique]
                try:
                    replies = [f.result() for f in futures]
                finally:
                    for f in futures:
                        f.cancel()
        finally:
            client.close()
        by_text = {t: read_score(pattern, r) for t, r in zip(unique, replies)}
        return scores_tensor([by_text[t] for t in texts])

    def request(self, text: str) -> dict[str, Any]:
        """The keyword arguments of one `chat.completions.create` call judging the message `text`."""
        kwargs: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": text}],
                                  "temperature": 0.0, "max_tokens": self.max_tokens}
        if self.seed is not None:
            kwargs["seed"] = self.seed
        if self.guided_regex is not None:  # vLLM >= its structured-outputs API (0.32 reads this field)
            kwargs["extra_body"] = {"structured_outputs": {"regex": self.guided_regex}}
        return kwargs

    def _ask(self, client: Any, text: str) -> str | None:
        """The reply's text to one message (None: an empty reply), after up to `retries` retries."""
        import openai

        def attempt() -> str | None:
            try:
                reply = client.chat.completions.create(**self.request(text))
            except openai.APITimeoutError:
                raise Retry(f"no answer within reward.judge.timeout_s={self.timeout_s:g} s") from None
            except openai.APIConnectionError as e:
                raise Retry(f"{type(e).__name__}: {e}") from None
            except openai.APIStatusError as e:
                if e.status_code in RETRIED_STATUS:
                    raise Retry(f"HTTP {e.status_code} {_body(e)}") from None
                raise RewardServerError(f"judge endpoint {self.base_url} answered HTTP {e.status_code} {_body(e)} "
                                        f"(not retried; reward.judge.model={self.model})") from None
            except openai.APIError as e:  # a 200 whose body is not a chat completion
                raise RewardServerError(f"judge endpoint {self.base_url} answered unusably: {e}") from None
            choices = getattr(reply, "choices", None)
            if not choices:
                raise RewardServerError(f"judge endpoint {self.base_url} answered with no choices: "
                                        f"{str(reply)[:120]!r}")
            return choices[0].message.content

        return with_retries(attempt, self.retries, f"judge endpoint {self.base_url}", "reward.judge.retries")


def _body(e: Any) -> str:
    """An API error's body, shortened, on one line."""
    text = getattr(getattr(e, "response", None), "text", "") or str(e)
    return repr(" ".join(text.split())[:120])
