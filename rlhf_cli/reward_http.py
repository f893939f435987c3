"""A reward server (`reward.type=http`, `reward.url`): scores completions over HTTP with OpenRLHF's remote reward
protocol, so that its `serve_rm` (and `rlhf serve-rm`, and any server written for OpenRLHF's `--remote_rm_url`)
works unchanged.

    client = HttpReward.from_config(cfg.reward)       the settings reward.url, http_batch_size, ...
    check_reachable(url, timeout_s)                    ConfigError (one line) when nothing listens at the URL
    scores = client.score(queries, completions, rows)  (B,) float32; NaN where the server could not score a row

The request, one `POST` of at most `reward.http_batch_size` rows, with up to `reward.max_concurrency` in flight::

    {"query": [...],        each row's full text: the templated prompt and the response, pad stripped, special
                            tokens kept (the response's one closing EOS among them, when it ended with one)
     "prompts": [...],      the templated prompts
     "labels": [...],       the column `reward.label_key` of each data row (null: the row's answer, `data.answer_key`)
     "completions": [...],  the responses alone, special tokens skipped (what a reward function gets)
     "<column>": [...]}     each other column of the data rows (a JSON file's), null where a row has none

and the reply `{"rewards": [...]}` (OpenRLHF's older `{"scores": [...]}` too): one number per row, `null` or NaN
for a row the server cannot score (NaN in the scores). Each request has a timeout (`reward.timeout_s`); a
connection error, a timeout, a 429 or a 5xx is retried `reward.retries` times with exponential backoff (0.5 s,
1 s, 2 s, ... capped at 8 s), any other answer is not. A request that still fails, or a reply that is not one
number (or null) per row, raises `RewardServerError` naming the URL and what came back.
"""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from rlhf_cli.commands import by_kind
from rlhf_cli.errors import ConfigError, RewardServerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

PROTOCOL_FIELDS = ("query", "prompts", "labels", "completions")
"""The request's own fields; a data column of the same name is not sent."""
REPLY_KEYS = ("rewards", "scores")
"""Where the reply's scores are read, in order: OpenRLHF's current key, then its older one."""
BACKOFF_S = 0.5
"""The first retry's wait (seconds); each further retry waits twice the one before, at most `BACKOFF_MAX_S`."""
BACKOFF_MAX_S = 8.0
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try: a busy or failing server. Any other non-2xx is final."""


def _host_port(url: str) -> tuple[str, int]:
    """(host, port) of a URL `config.validate_reward` checked."""
    parts = urlsplit(url)
    return str(parts.hostname), parts.port or (443 if parts.scheme == "https" else 80)


def check_reachable(url: str, timeout_s: float, setting: str = "reward.url", what: str = "reward server",
                    hint: str | None = None) -> None:
    """Something accepts TCP connections at `url`'s host and port (a reward server answers POST only, so no
    request is sent). Called before any model loads. `setting`, `what` and `hint` word the error for the setting
    that holds the URL (the judge's: `reward.judge.base_url`).

    Raises:
        ConfigError: the connection is refused or times out (`timeout_s`, at most 10 s).
    """
    host, port = _host_port(url)
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 10.0)):
            pass
    except OSError as e:
        if hint is None:
            hint = (f"start it first (`{by_kind('serve').invocation}`, README \"Score with a reward server\")")
        raise ConfigError(f"{setting}={url}: no {what} answers at {host}:{port} ({e.strerror or e}): {hint}") from None


def backoff(attempt: int) -> None:
    """Wait before retry `attempt` (1, 2, ...): `BACKOFF_S`, then twice the wait before, at most `BACKOFF_MAX_S`."""
    time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), BACKOFF_MAX_S))


T = TypeVar("T")


class Retry(Exception):
    """A failed attempt worth another (no connection, a timeout, a `RETRIED_STATUS`); its message says what went
    wrong, for the final line of `with_retries`."""


def with_retries(attempt: Callable[[], T], retries: int, who: str, setting: str, scope: str = "") -> T:
    """`attempt()`, tried up to `retries` more times with `backoff` while it raises `Retry`; what it returns or
    raises otherwise passes through. The reward server's and the judge's requests share it.

    Raises:
        RewardServerError: "<who> failed <n> times<scope> (last: <why>; <setting>=<retries>)" when every try
            raised `Retry`.
    """
    why = ""
    for k in range(retries + 1):
        if k:
            backoff(k)
        try:
            return attempt()
        except Retry as e:
            why = str(e)
    tries = f"{retries + 1} times" if retries else "once"
    raise RewardServerError(f"{who} failed {tries}{scope} (last: {why}; {setting}={retries})")


def parse_rewards(reply: Any, n: int, url: str) -> list[float]:
    """The n scores of a server's decoded JSON `reply`: its `rewards` (else `scores`) list, each a finite number,
    or null / NaN for a row the server could not score (NaN here).

    Raises:
        RewardServerError: no such list, a count other than n, or an entry that is not a number, null or NaN
            (a string, a bool, an infinity), naming `url` and what came back.
    """
    got = next((reply[k] for k in REPLY_KEYS if isinstance(reply, dict) and k in reply), None)
    shown = json.dumps(reply, default=str)[:160]
    if not isinstance(got, list):
        raise RewardServerError(f"reward server {url} answered {shown} (expected {{\"rewards\": [one number per "
                                f"row]}} for {n} rows)")
    if len(got) != n:
        raise RewardServerError(f"reward server {url} answered {len(got)} rewards for {n} rows: {shown}")
    out = []
    for i, v in enumerate(got):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and _finite_or_nan(v):
            out.append(float(v))
        else:
            raise RewardServerError(f"reward server {url} answered {v!r} for row {i + 1} of {n}, not a number "
                                    f"(null or NaN: unscorable): {shown}")
    return out


def _finite_or_nan(v: int | float) -> bool:
    """A JSON number that fits a float and is not ±inf (an integer too large for a float is not)."""
    try:
        return not math.isinf(float(v))
    except OverflowError:
        return False


def queries(tokenizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    """The protocol's `query` of each row of a `[prompt | response]` batch (B, L) long: the row's real tokens
    (`attention_mask` 1: no pad on either side) decoded with their special tokens, so the templated prompt
    and a response that ended with EOS keep exactly their one EOS text at the end."""
    return [tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=False)
            for row, m in zip(input_ids.cpu(), attention_mask.cpu())]


def scores_tensor(values: Sequence[float]) -> torch.Tensor:
    """(B,) float32 of `parse_rewards`' values, NaN kept (an unscorable row)."""
    import torch  # here, not at the top: the preflight checks import this module before torch

    return torch.tensor(list(values), dtype=torch.float32)


@dataclass(frozen=True)
class HttpReward:
    """A reward server's client: `reward.url` and how it is called (`reward.http_batch_size`,
    `reward.max_concurrency`, `reward.timeout_s`, `reward.retries`, `reward.label_key`)."""

    url: str
    batch_size: int = 64
    max_concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 3
    label_key: str | None = None

    @classmethod
    def from_config(cls, reward_cfg: Any) -> HttpReward:
        """The client of the run's `reward.*` settings."""
        return cls(url=str(reward_cfg.url), batch_size=int(reward_cfg.http_batch_size),
                   max_concurrency=int(reward_cfg.max_concurrency), timeout_s=float(reward_cfg.timeout_s),
                   retries=int(reward_cfg.retries), label_key=reward_cfg.label_key)

    def check_rows(self, rows: Sequence[dict[str, Any]], where: str = "the prompts") -> None:
        """`reward.label_key`, when set, names a column some row of `rows` (prompt dicts) has: a typo would send
        `labels: [null, ...]` on every request.

        Raises:
            ConfigError: no row has the column; names the key, `where` and the columns there are.
        """
        if self.label_key and not any(self.label_key in (r.get("columns") or {}) for r in rows):
            columns = sorted({k for r in rows for k in (r.get("columns") or {})})
            has = f"its columns are {', '.join(columns)}" if columns else "it has no data-file columns"
            raise ConfigError(f"reward.label_key={self.label_key}: no row of {where} has that column ({has})")

    def payload(self, queries: Sequence[str], completions: Sequence[str],
                rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
        """The request body of these rows (see the module's docstring). `rows[i]`: completion i's prompt dict
        (`prompt_text`, `answer`, `columns`: the data row's columns, when the data has them)."""
        columns = [r.get("columns") or {} for r in rows]
        labels = [c.get(self.label_key) for c in columns] if self.label_key else [r.get("answer") for r in rows]
        body: dict[str, list[Any]] = {"query": list(queries), "prompts": [r.get("prompt_text", "") for r in rows],
                                      "labels": labels, "completions": list(completions)}
        for name in dict.fromkeys(k for c in columns for k in c):
            if name not in PROTOCOL_FIELDS:
                body[name] = [c.get(name) for c in columns]
        return body

    def score(self, queries: Sequence[str], completions: Sequence[str],
              rows: Sequence[dict[str, Any]]) -> torch.Tensor:
        """(B,) float32 scores of B rows, NaN where the server answered null or NaN; requests of at most
        `batch_size` rows, `max_concurrency` at a time, the scores in the rows' order whatever the batching.

        Raises:
            RewardServerError: a request failed after its retries, or its reply was unusable (`parse_rewards`).
        """
        import httpx  # here: the preflight checks import this module, and httpx only matters once scoring

        n = len(queries)
        if n == 0:
            return scores_tensor([])
        spans = [(i, min(i + self.batch_size, n)) for i in range(0, n, self.batch_size)]
        workers = max(1, min(self.max_concurrency, len(spans)))
        with httpx.Client(timeout=self.timeout_s) as client, ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(self._post, client, self.payload(queries[a:b], completions[a:b], rows[a:b]), b - a)
                       for a, b in spans]
            try:
                values = [v for f in futures for v in f.result()]
            finally:
                for f in futures:
                    f.cancel()
        return scores_tensor(values)

    def _post(self, client: Any, body: dict[str, list[Any]], n: int) -> list[float]:
        import httpx

        data = json.dumps(body, default=str)  # a column's value JSON cannot hold (a date) is sent as its text

        def attempt() -> list[float]:
            try:
                resp = client.post(self.url, content=data, headers={"Content-Type": "application/json"})
            except httpx.TimeoutException:
                raise Retry(f"no answer within reward.timeout_s={self.timeout_s:g} s") from None
            except httpx.HTTPError as e:
                raise Retry(f"{type(e).__name__}: {e}") from None
            if resp.status_code in RETRIED_STATUS:
                raise Retry(f"HTTP {resp.status_code} {resp.text[:120]!r}")
            if not resp.is_success:
                raise RewardServerError(f"reward server {self.url} answered HTTP {resp.status_code} "
                                        f"{resp.text[:120]!r} to {n} rows (not retried)")
            try:
                reply = resp.json()
            except ValueError:
                raise RewardServerError(f"reward server {self.url} answered {resp.text[:120]!r}, not JSON") from None
            return parse_rewards(reply, n, self.url)

        return with_retries(attempt, self.retries, f"reward server {self.url}", "reward.retries", f" for {n} rows")
