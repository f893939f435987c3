"""`rlhf serve-rm`: a trained reward model behind HTTP, answering OpenRLHF's remote reward protocol at
`/get_reward`, so that trainers score with it through `reward.type=http` (this toolkit's, or OpenRLHF's
`--remote_rm_url`), several of them sharing one GPU.

    rlhf serve-rm                                    the reward model `<paths.root>/latest_rm` names
    rlhf serve-rm reward_model.path=runs/rm/<run>    a run dir, its final/ dir, or an HF reward-model dir
    POST /get_reward {"query": [text, ...], ...}  -> {"rewards": [score, ...], "scores": [the same]}

Each `query` is a full text (templated prompt, response and its EOS, as `rlhf_cli.reward_http.queries` sends it):
tokenized as it is (no special tokens added) and scored at its last token, as the trainer's in-process reward
model scores its ids. Other request fields are accepted and ignored. Concurrent requests are gathered (`Batcher`:
the first waits up to `serve.max_wait_ms` for others, up to `serve.batch_size` rows) and scored together, one
forward per `serve.batch_size` rows. The server sees text, not ids: where a trainer's sampled ids are not the
tokenizer's own encoding of their text (often so for a random model's samples: 18 of 50 random 8-token replies
did not survive decode-then-encode with SmolLM2's tokenizer; natural text does), a score differs slightly from the
in-process reward model's, as with any text protocol (OpenRLHF's too).

Normalisation: by default the scores are the model's raw scores, the numbers `rlhf eval` reports for the same
texts (`<side>/score_mean`, `rewards.json`). With `serve.normalize=true` they are (score - mean) / std with the
held-out mean and std train-rm stored in the model: what train-ppo's in-process `ppo.normalize_reward=true`
trains on (a trainer using the server does not normalise its scores again). Ctrl-C (or SIGTERM) stops it.
"""

from __future__ import annotations

import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_cli import engine
from rlhf_cli.commands import by_stage
from rlhf_cli.config import ConfigError
from rlhf_cli.data import pad_sequences
from rlhf_cli.eos import eos_ids
from rlhf_cli.forwards import batched_scores
from rlhf_cli.lifecycle import prepare_run_dir
from rlhf_cli.models import load_generation_config, load_scalar_model, load_tokenizer, read_score_stats
from rlhf_cli.preflight import reward_model_dir
from rlhf_cli.runs import set_status
from rlhf_cli.stages.common import print_table

log = logging.getLogger(__name__)
COMMAND = by_stage(__name__)  # this stage's entry in the command registry
PATH = "/get_reward"


class RewardScorer:
    """Texts -> scores of a reward model: `scorer(texts)` is a list of floats, one per text: each text cleaned
    (`clean`), tokenized without added special tokens, right-padded, scored at its last token
    (`forwards.batched_scores`, the EOS set `eos` read as the in-process scorer reads it), `batch_size` rows per
    forward under `precision`; with `stats` (mean, std), normalised as `rollout.ScoreMixer` does."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, precision: str,
                 stats: tuple[float, float] | None = None, eos: tuple[int, ...] = ()) -> None:
        self.model, self.tokenizer, self.batch_size, self.precision, self.stats = (model, tokenizer, batch_size,
                                                                                   precision, stats)
        self.eos = tuple(eos)

    def clean(self, text: str) -> str:
        """A query as OpenRLHF's own serve_rm reads it: the pad text its trainer leaves around a sequence
        (`batch_decode` with special tokens, left pads, trailing pads) removed, and a response that ended (an EOS
        or pads at its end) closed with exactly one EOS text. A query from `rlhf_cli.reward_http` (no pads, one
        EOS where the response ended) is unchanged."""
        pad, eos = self.tokenizer.pad_token, self.tokenizer.eos_token
        ends = [t for t in (pad, eos) if t]
        while pad and text.startswith(pad):
            text = text[len(pad):]
        closed = False
        while any(text.endswith(t) for t in ends):
            t = next(t for t in ends if text.endswith(t))
            text, closed = text[:-len(t)], True
        return text + eos if closed and eos else text

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> list[float]:
        ids = self.tokenizer([self.clean(t) for t in texts], add_special_tokens=False)["input_ids"]
        if any(len(x) == 0 for x in ids):
            raise ValueError("an empty query (no tokens) cannot be scored")
        batch = pad_sequences(ids, self.tokenizer.pad_token_id, side="right")
        dev = engine.device()
        scores = batched_scores(self.model, batch["input_ids"].to(dev), batch["attention_mask"].to(dev),
                                self.batch_size, self.precision, eos_ids=self.eos).cpu()
        if self.stats is not None:
            mean, std = self.stats
            scores = (scores - mean) / (std if std > 1e-6 else 1.0)  # a constant RM has std 0: only centre
        return scores.tolist()


@dataclass
class _Request:
    texts: list[str]
    future: Future = field(default_factory=Future)


class Batcher:
    """Gathers concurrent requests into one scoring call: a worker thread takes the first waiting request, waits up
    to `max_wait_s` for more until `batch_size` rows are gathered, calls `score(all their texts)` once, and hands
    each request its share. `submit(texts)` returns a `concurrent.futures.Future` of the texts' scores (the
    scorer's exception where it raised). `calls` counts the scoring calls."""

    def __init__(self, score: Callable[[list[str]], list[float]], batch_size: int, max_wait_s: float) -> None:
        self.score, self.batch_size, self.max_wait_s = score, batch_size, max_wait_s
        self.calls = 0
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="serve-rm-batcher", daemon=True)
        self._thread.start()

    def submit(self, texts: list[str]) -> Future:
        request = _Request(list(texts))
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _gather(self, first: _Request) -> tuple[list[_Request], bool]:
        items, rows, stop = [first], len(first.texts), False
        deadline = time.monotonic() + self.max_wait_s
        while rows < self.batch_size and not stop:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if item is None:
                stop = True
            else:
                items.append(item)
                rows += len(item.texts)
        return items, stop

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            items, stop = self._gather(first)
            self._score(items)
            if stop:
                return

    def _score(self, items: list[_Request]) -> None:
        """One scoring call for all `items`; when it fails and several requests share it, each is scored again
        on its own, so only a bad request gets the error (the server goes on either way)."""
        self.calls += 1
        try:
            scores = self.score([t for it in items for t in it.texts])
        except Exception as e:  # noqa: BLE001 - a request's error is its own: handed to it, never raised here
            if len(items) > 1:
                for it in items:
                    self._score([it])
                return
            _settle(items[0].future, error=e)
            return
        at = 0
        for it in items:
            _settle(it.future, result=scores[at:at + len(it.texts)])
            at += len(it.texts)


def _settle(future: Future, result: Any = None, error: Exception | None = None) -> None:
    """Hand a request its scores or its error, unless its client has gone (the future cancelled)."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def make_app(batcher: Batcher, source: str) -> Any:
    """The FastAPI app: `POST /get_reward` (OpenRLHF's protocol: `query`, a list of strings; the reply's
    `rewards` and, for OpenRLHF's older clients, `scores`), HTTP 400 with one line for a body without such a
    `query`, 500 where scoring raised; `GET /health` names the model (`source`)."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title=COMMAND.invocation)

    async def get_reward(request: Any) -> JSONResponse:  # a plain route: the request itself, no parsing by FastAPI
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"detail": "the body is not JSON"}, status_code=400)
        texts = body.get("query") if isinstance(body, dict) else None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return JSONResponse({"detail": 'expected {"query": [text, ...]} (OpenRLHF\'s remote reward protocol)'},
                                status_code=400)
        try:
            scores = await asyncio.wrap_future(batcher.submit(texts)) if texts else []
        except Exception as e:  # noqa: BLE001 - the client gets the one line, the server goes on
            return JSONResponse({"detail": f"scoring failed: {type(e).__name__}: {e}"}, status_code=500)
        return JSONResponse({"rewards": scores, "scores": scores})

    async def health(request: Any) -> JSONResponse:
        return JSONResponse({"model": source})

    app.router.add_route(PATH, get_reward, methods=["POST"])
    app.router.add_route("/health", health, methods=["GET"])
    return app


def check_port_free(host: str, port: int) -> None:
    """Raises ConfigError (one line) when `host`:`port` cannot be listened on (another server holds it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"serve.host={host} serve.port={port}: cannot listen there ({e.strerror or e}): "
                              f"choose another serve.port") from None


def load_scorer(cfg: Any, rm_dir: str) -> RewardScorer:
    """The reward model of `rm_dir` on the device with its tokenizer, as a `RewardScorer` of `serve.*`."""
    model_cfg = OmegaConf.merge(cfg.model, {"name": Path(rm_dir).name, "name_or_path": rm_dir, "gguf_file": None,
                                            "tokenizer": None, "init": "pretrained"})
    tokenizer = load_tokenizer(model_cfg)
    model = load_scalar_model(rm_dir, cfg.precision, cfg.seed).to(engine.device()).eval()
    stats = read_score_stats(rm_dir) if cfg.serve.normalize else None
    if cfg.serve.normalize and stats is None:
        log.warning("serve.normalize=true has no effect: %s stored no held-out mean/std, so its raw scores are "
                    "served", rm_dir)
    return RewardScorer(model, tokenizer, cfg.serve.batch_size,
                        engine.scoring_precision(cfg.precision, cfg.scoring_precision), stats,
                        eos_ids(tokenizer, load_generation_config(rm_dir)))  # train-rm keeps the set


def run(cfg: Any, run_dir: Path) -> None:
    """`rlhf serve-rm` on the composed config `cfg` (conf/serve_rm.yaml): load the reward model, then serve it at
    `http://<serve.host>:<serve.port>/get_reward` until interrupted; the run dir records the config and the state.

    Raises:
        ConfigError: no reward model, or the port taken.
    """
    import uvicorn

    engine.init_distributed()
    cfg.reward_model.path = reward_model_dir(cfg, "no reward model to serve")
    run_dir = prepare_run_dir(cfg, run_dir)
    s = cfg.serve
    url = f"http://{s.host}:{s.port}{PATH}"
    if cfg.dry_run:
        print_table(f"{COMMAND.name} (dry run): {run_dir}", {"reward model": cfg.reward_model.path, "url": url})
        set_status(run_dir, "dry_run")
        return None
    check_port_free(s.host, s.port)
    scorer = load_scorer(cfg, cfg.reward_model.path)
    batcher = Batcher(scorer, s.batch_size, s.max_wait_ms / 1000)
    # log_config=None: uvicorn's own dictConfig would close every handler of this process (the run dir's log
    # among them); its loggers go through the run's logging instead
    server = uvicorn.Server(uvicorn.Config(make_app(batcher, cfg.reward_model.path), host=s.host, port=s.port,
                                           log_level="warning", access_log=False, log_config=None))
    print(f"serving {cfg.reward_model.path} at {url} ({'normalised' if scorer.stats else 'raw'} scores; "
          f"reward.url={url} in a trainer; Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down on the signal, then raised it again: a normal stop
        pass
    finally:
        batcher.close()
    set_status(run_dir, "finished")
    return None
