"""Multi-turn episodes with an environment (`rollout.env=FILE.py:Class`), on either sampling engine.

    load_environment     the class `rollout.env` names (or its dict of classes by name), checked: a callable `reset`
    Environment          one environment class probed: its tools (docstrings and hints checked), template, encoder
    EnvSettings          the budgets of an episode (`rollout.max_turns`, `max_tool_calls`, `max_episode_tokens`,
                         `max_tool_tokens`, `tool_timeout_s`)
    EnvironmentRunner    an `episodes.EpisodeRunner`: one environment instance per episode, turns until the policy
                         answers without a tool call (and `env_response` gives None), or a budget cuts it
    parse_tool_calls     the Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls in a turn's text
    turn_seed            the seed of a row's turn: a sample depends on (row, sample, turn), never on its batch

The interface is TRL's `environment_factory` (GRPOTrainer), so a TRL environment runs unchanged: `reset(**row)`
receives the data row's columns (those it names, all with `**kwargs`; the built-in task's `answer` too) and may
return a first observation, appended to the last user message; every other public method is a tool, described
to the model through the chat template's `tools=` (transformers' `get_json_schema`: a docstring with an `Args:`
line per argument, and type hints); `get_reward()` (plain or async), when defined, is the episode's score. The
general multi-turn form without tools: `env_response(messages) -> str | None`, the reply the next user message,
None the episode's end. Like TRL's dict `environment_factory`, `rollout.env=FILE.py:ENVS` may name a dict of
classes by name: each data row's `environment` column picks its class (and is not passed to `reset`), and only
that class's tools are shown in its prompt.

The prompt, the first observation included, is rendered with the tools and tokenized as the data's prompts are
(`data.tokenize.Encoder`: user text plain) and cut to `data.max_prompt_length` by the same rule
(`Encoder.fit_prompt`: the oldest turns first, then the last message's content from the left); a template, tools
and system turn that leave no room for a token of it are refused.

A turn of an environment with tools stops once its calls are complete and something else follows (`_past_calls`,
`Sampling.stop`: the `hf` engine stops that row there) and is cut at the calls' end (`_cut`), so the ids kept are
those sampling to the end would keep; a turn whose calls end with the end-of-turn id keeps it.

Token in, token out (STYLE 17): each turn's sampled ids are kept as sampled (action mask 1); only the messages
after them (the end of the assistant turn when a `</tool_call>` cut it, tool results or the environment's reply,
the next assistant header) are rendered and tokenized, as the difference between the chat template's rendering
of the conversation with and without them (TRL's `_get_tool_suffix_ids` does the same), their contents as plain
text (a special-token string in a tool result or a reply stays those characters, as in the data's user text), and
appended with action mask 0. The history is never re-tokenized.

Both engines run it: each turn is one `Generator.generate` call over the episodes still running, their prompts the
episode's ids so far (vLLM's prefix cache holds their shared history). The `vllm` engine ignores `Sampling.stop`
and samples each turn to its EOS or budget; `_cut` keeps the same prefix the `hf` engine's stop gives. The engine's
log-probs of the kept tokens become `Episodes.engine_logprobs` (0 on the environment's tokens).

A template that cannot render `tools=` (SmolLM2's ignores them) is replaced by the shipped ChatML tool template
(`rlhf_cli/templates/chatml_tools.jinja`), said once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_cli import engine
from rlhf_cli.data.chat_tools import choose_tool_template
from rlhf_cli.data.formats import Prompt
from rlhf_cli.data.tokenize import Encoder
from rlhf_cli.errors import ConfigError
from rlhf_cli.rollout.episodes import Conversation, Episodes
from rlhf_cli.rollout.generation import Generator, Sampling

log = logging.getLogger(__name__)

NOT_TOOLS = ("reset", "get_reward", "env_response")
"""The environment's public methods that are not tools (TRL's `reset` and `get_reward`, and `env_response`)."""
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
CALL_END = "</tool_call>"
STOP_WINDOW = 24
"""A turn's last tokens in which `EnvironmentRunner._past_calls` looks for a `</tool_call>` before decoding it all."""


def turn_seed(seed: int, turn: int) -> int:
    """The seed of turn `turn` (0-based) of the episode whose row seed is `seed`: the row seed itself for the first
    turn (so a single-turn episode samples as `SingleTurnRunner` does), a fixed mix of both after it."""
    return int(seed) if turn == 0 else (int(seed) * 1_000_003 + turn * 2_654_435_761) % (2**63 - 1)


@dataclasses.dataclass(frozen=True)
class EnvSettings:
    """An episode's budgets (the `rollout.*` keys of the same names)."""

    max_turns: int = 8
    """Policy turns per episode (>= 1)."""
    max_tool_calls: int = 16
    """Tool calls per episode (>= 0)."""
    max_episode_tokens: int = 1024
    """Tokens after the prompt, sampled and written by tools and the environment (>= 1)."""
    max_tool_tokens: int = 256
    """Tokens of one tool result (>= 1); a longer one is cut there."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run (> 0)."""


def load_environment(spec: str) -> type | dict[str, type]:
    """The environment class `rollout.env=FILE.py:Class` (or `package.module:Class`) names, or the dict of classes
    by name `FILE.py:ENVS` names (TRL's dict `environment_factory`). Raises ConfigError in one line: a missing file
    or name, something that is neither a class nor a non-empty dict of them by string names, a class without a
    callable `reset`."""
    from rlhf_cli.rewards import load_object

    found, name = load_object(spec, "rollout.env"), spec.rpartition(":")[2]
    if not isinstance(found, dict):
        return _checked_class(found, spec, repr(name))
    if not found:
        raise ConfigError(f"rollout.env={spec}: {name} is an empty dict (give it name -> environment class)")
    for key, cls in found.items():
        if not isinstance(key, str):
            raise ConfigError(f"rollout.env={spec}: {name} has the key {key!r}: the names of a dict of environments "
                              f"are strings, those of the data's `environment` column")
        _checked_class(cls, spec, f"{name}[{key!r}]")
    return dict(found)


def _checked_class(cls: Any, spec: str, what: str) -> type:
    if not inspect.isclass(cls):
        raise ConfigError(f"rollout.env={spec}: {what} is not a class (give the environment class, or a dict of them "
                          f"by name; one instance is made per episode)")
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"rollout.env={spec}: {what} has no reset method (TRL's environment interface: "
                          f"def reset(self, **row) -> str | None)")
    return cls


def environment_tools(instance: Any, spec: str) -> tuple[dict[str, Callable[..., Any]], list[dict[str, Any]]]:
    """The tools of an environment instance, by name, and their JSON schemas (transformers' `get_json_schema`):
    every public method but `NOT_TOOLS`. Raises ConfigError naming the method when it has no docstring, no type
    hints or a docstring without an `Args:` line for an argument."""
    from transformers.utils import get_json_schema

    tools, schemas = {}, []
    for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
        if name.startswith("_") or name in NOT_TOOLS:
            continue
        try:
            schemas.append(get_json_schema(method))
        except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
            raise ConfigError(f"rollout.env={spec}: the tool {name!r} cannot be described to the model "
                              f"({type(e).__name__}: {e}): give it a docstring with an Args: line per argument and "
                              f"type hints, or a leading _ to keep it from the model") from None
        tools[name] = method
    return tools, schemas


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]] | str]:
    """The tool calls in a turn's text, in order: (name, arguments) for each well-formed
    `<tool_call>{"name": str, "arguments": {...}}</tool_call>`, an error message (str) for a malformed one (not
    JSON, not an object, no name, arguments not an object, an unclosed `<tool_call>`)."""
    calls: list[tuple[str, dict[str, Any]] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"Error: the tool call is not JSON ({e})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('Error: a tool call is {"name": <tool name>, "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(f"Error: the arguments of {call['name']!r} are not a JSON object")
            continue
        calls.append((call["name"], args))
    if text.count("<tool_call>") > len(TOOL_CALL.findall(text)):
        calls.append("Error: a <tool_call> without its </tool_call>")
    return calls


def _call_tool(fn: Callable[..., Any], args: dict[str, Any]) -> str:
    """Run one tool (a coroutine function on its own event loop, in this worker thread): its result as text."""
    out = fn(**args)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return str(out)


async def _await(x: Any) -> Any:
    return await x


class _ToolCall:
    """One tool call running on a daemon thread of its own, its clock started with it: a tool that never returns
    is left behind (and said so in its error) without holding up the process's exit or any later call."""

    def __init__(self, fn: Callable[..., Any], args: dict[str, Any], timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.value: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name="rlhf-tool")
        self.thread.start()

    def _run(self, fn: Callable[..., Any], args: dict[str, Any]) -> None:
        try:
            self.value = _call_tool(fn, args)
        except BaseException as e:  # noqa: BLE001 - handed to the episode as the model's error message
            self.error = e

    def result(self) -> str:
        """The tool's text. Raises TimeoutError past the deadline, or what the tool raised."""
        self.thread.join(timeout=max(0.0, self.deadline - time.monotonic()))
        if self.thread.is_alive():
            raise TimeoutError
        if self.error is not None:
            raise self.error
        return str(self.value)


class Environment:
    """One environment class of `rollout.env`, probed once at the start: its tools, whether it owns the reward
    (`get_reward`) or replies (`env_response`), the chat template its episodes render with, and the `Encoder` of
    their prompts (the tools' schemas rendered in). name: its key in a dict of environments, None for the one
    class. Raises ConfigError when the class cannot be made or a tool cannot be described (`environment_tools`)."""

    def __init__(self, cls: type, name: str | None, spec: str, tokenizer: Any) -> None:
        self.cls, self.name, self.tokenizer = cls, name, tokenizer
        try:
            probe = cls()
        except Exception as e:  # noqa: BLE001 - the user's class: one line
            raise ConfigError(f"rollout.env={spec}: {cls.__name__}() raised {type(e).__name__}: {e}") from None
        tools, self.schemas = environment_tools(probe, spec)
        self.tool_names = set(tools)
        self.owns_reward = callable(getattr(probe, "get_reward", None))
        self.replies = callable(getattr(probe, "env_response", None))
        self.template, self.why = self._choose_template()
        self.closing = self._closing()
        self.encoder = Encoder(tokenizer, True, tools=self.schemas or None, template=self.template)
        """Renders, tokenizes and cuts its episodes' prompts as the data's are (user text plain)."""

    def describe(self) -> str:
        """The class, its tools and its template, in words (the start table's)."""
        names = f" ({', '.join(sorted(self.tool_names))})" if self.tool_names else ""
        return f"{self.cls.__name__}: {len(self.tool_names)} tool(s){names}, {self.why}"

    def _choose_template(self) -> tuple[str | None, str]:
        """The chat template to render with (None: the tokenizer's own) and why, in words: the tokenizer's own
        when there are no tools, else `chat_tools.choose_tool_template` (the shipped ChatML tool template when the
        model's own cannot render `tools=` or it has none)."""
        if not self.schemas and getattr(self.tokenizer, "chat_template", None):
            return None, "the model's own chat template"
        return choose_tool_template(self.tokenizer, self.schemas)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The conversation as the chat template renders it, with the environment's tools."""
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas or None, chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def _closing(self) -> str:
        """What the template writes after an assistant message's content (ChatML: `<|im_end|>\\n`)."""
        mark = "\x00RLHF-CONTENT\x00"
        text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}], False)
        return text[text.index(mark) + len(mark):]


@dataclasses.dataclass
class _Episode:
    """One episode's state while it runs."""

    kind: Environment
    env: Any
    row: Any
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    n_prompt: int = 0  # the prompt's messages, the first of `messages`
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # an engine's of `ids`, 0 off the mask; hf: unused
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_tokens: int = 0
    ended: str | None = None  # how the last turn ended: "eot", "call" (at </tool_call>) or None (a token budget)
    done: bool = False
    has_eos: bool = False
    pending: list[Any] = dataclasses.field(default_factory=list)  # this turn's parsed calls (`parse_tool_calls`)

    def finish(self, has_eos: bool) -> None:
        self.done, self.has_eos = True, has_eos


class EnvironmentRunner:
    """`rollout.env`: episodes of several turns against one environment instance each (see the module's doc).

    spec: `rollout.env`; tokenizer: the policy's; settings: the budgets; system_prompt: `data.system_prompt` (put
    first in a prompt without a system message, as the data's own rendering does); max_prompt_length:
    `data.max_prompt_length`, the prompt's tokens (None: not cut). Raises ConfigError at construction for a bad
    environment (`load_environment`, `Environment`), a dict of classes of which some own the reward and some do
    not, or a template, tools and system turn that take all of `max_prompt_length`, so a run stops before
    sampling. After each `run`, `stats` holds its `episode/*` statistics (this rank's rows).
    """

    def __init__(self, spec: str, tokenizer: Any, settings: EnvSettings, system_prompt: str | None = None,
                 max_prompt_length: int | None = None) -> None:
        self.spec, self.tokenizer, self.s, self.system_prompt = spec, tokenizer, settings, system_prompt
        self.max_prompt_length = max_prompt_length
        loaded = load_environment(spec)
        self.envs = ({None: Environment(loaded, None, spec, tokenizer)} if not isinstance(loaded, dict)
                     else {name: Environment(cls, name, spec, tokenizer) for name, cls in loaded.items()})
        """The environments by the name a row's `environment` column gives (None: the one class for every row)."""
        owners = {e.owns_reward for e in self.envs.values()}
        if len(owners) > 1:
            mine = [str(k) for k, e in self.envs.items() if e.owns_reward]
            raise ConfigError(f"rollout.env={spec}: {', '.join(mine)} define get_reward and the others do not, but a "
                              f"run's score is the environments' or the reward sources' for every row: give each "
                              f"environment a get_reward, or none")
        self.owns_reward = owners.pop()
        for env in self.envs.values():
            self._check_room(env)
        kinds = [e.describe() if k is None else f"{k} = {e.describe()}" for k, e in self.envs.items()]
        self.summary = ("; ".join(kinds) + "; the score: " + ("its get_reward() (the reward.* sources are not called)"
                        if self.owns_reward else "the run's reward sources, on the tokens the policy sampled"))
        """One line on the environments, their tools, templates and the score (the start table's)."""
        log.info("rollout.env=%s: %s", spec, self.summary)
        # each tool call runs on a daemon thread of its own (`_ToolCall`); an episode's calls run one after another
        # (its environment's state is its own), the episodes' side by side (`episodes_pool`, one job per episode)
        self.episodes_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rlhf-env")
        self.stats: dict[str, float] = {}

    def _check_room(self, env: Environment) -> None:
        """Refuse a template, tools and system turn that leave no token of `max_prompt_length` to a prompt."""
        if self.max_prompt_length is None:
            return
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        n = len(self.encode(env.render([*system, {"role": "user", "content": ""}], True)))
        if n >= self.max_prompt_length:
            raise ConfigError(f"rollout.env={self.spec}: {env.cls.__name__}'s chat template, tools and system turn "
                              f"take {n} tokens before any prompt text, data.max_prompt_length="
                              f"{self.max_prompt_length} leaves none: raise data.max_prompt_length")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def environment_of(self, prompt: dict[str, Any]) -> Environment:
        """The environment of a prompt row: the one class, or the one its `environment` column names. Raises
        ConfigError naming the row and the known names when that column is missing or names none of them."""
        if None in self.envs:
            return self.envs[None]
        name = (prompt.get("columns") or {}).get("environment")
        if isinstance(name, str) and name in self.envs:
            return self.envs[name]
        said = "has no `environment` column" if name is None else f"has environment={name!r}"
        raise ConfigError(f"rollout.env={self.spec}: data row {prompt.get('row')} {said}; with a dict of "
                          f"environments each row's `environment` column names one of: {', '.join(self.envs)}")

    def check_rows(self, prompts: Sequence[dict[str, Any]]) -> None:
        """Refuse, before any sampling, a prompt row whose environment is missing or unknown (`environment_of`)."""
        for prompt in prompts:
            self.environment_of(prompt)

    # -- one episode's start ------------------------------------------------------------------------------------
    def start(self, prompt: dict[str, Any]) -> _Episode:
        """A fresh environment for `prompt` (a prompt row with `messages`), reset with the row's columns (less a
        dict's `environment`); its first observation appended to the last user message; the prompt rendered with
        its tools and cut to `max_prompt_length` (`_prompt_ids`)."""
        if "messages" not in prompt:
            raise ValueError("EnvironmentRunner: a prompt row without `messages` (load_prompt_data gives them)")
        kind = self.environment_of(prompt)
        messages = [dict(m) for m in prompt["messages"]]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        env, row = kind.cls(), prompt.get("row")
        columns = dict(prompt.get("columns") or {})
        if kind.name is not None:
            columns.pop("environment", None)  # it chose the class (TRL's dict form passes it to no reset)
        if prompt.get("answer") is not None:
            columns.setdefault("answer", prompt["answer"])
        try:
            obs = env.reset(**_accepted(env.reset, columns))
        except Exception as e:  # noqa: BLE001 - the user's environment: one line naming the row
            raise ConfigError(f"rollout.env={self.spec}: reset raised {type(e).__name__}: {e} on data row {row} "
                              f"(columns {sorted(columns)})") from None
        if obs is not None:
            if not isinstance(obs, str):
                raise ConfigError(f"rollout.env={self.spec}: reset returned a {type(obs).__name__} on data row "
                                  f"{row}; it must return a string (the first observation) or None")
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + obs}
        return _Episode(kind, env, row, messages, self._prompt_ids(kind, messages, row), len(messages))

    def _prompt_ids(self, kind: Environment, messages: list[dict[str, Any]], row: Any) -> list[int]:
        """The prompt's ids as the data's prompts get theirs (`Encoder.encode_prompts`, with the tools), cut to
        `max_prompt_length` as they are (`Encoder.fit_prompt`). Raises ConfigError naming the row when no token of
        its last message fits (its own system message too long)."""
        prompt = Prompt(messages=messages, text="")
        (ids,) = kind.encoder.encode_prompts([prompt])
        if self.max_prompt_length is None:
            return ids
        cut = kind.encoder.fit_prompt(prompt, ids, self.max_prompt_length)
        if cut is None:
            raise ConfigError(f"rollout.env={self.spec}: data row {row}'s prompt leaves no token of its last message "
                              f"in data.max_prompt_length={self.max_prompt_length} (its template, tools and system "
                              f"turn take it all): raise data.max_prompt_length")
        return cut

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self, prompts: Sequence[dict[str, Any]], seeds: Sequence[int], generator: Generator,
            sampling: Sampling) -> Episodes:
        """One episode per prompt (see `episodes.EpisodeRunner`): each turn one `generator.generate` call over
        the episodes still running, `sampling.max_new_tokens` (`ppo.max_new_tokens`) per turn. A collective: an
        environment that fails on one rank (`reset` raising, a reply that is not a string) stops every rank, with
        its one-line message where it failed.

        Raises:
            ConfigError: the environment failed here or on another rank.
        """
        failure, episodes = None, None
        try:
            episodes = self._run(prompts, seeds, generator, sampling)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            failure = e
        if engine.all_reduce_sum(torch.tensor(float(failure is not None))).item() > 0:
            if failure is None:
                raise ConfigError(f"rollout.env={self.spec}: the environment failed on another rank")
            raise failure
        return episodes

    def _run(self, prompts: Sequence[dict[str, Any]], seeds: Sequence[int], generator: Generator,
             sampling: Sampling) -> Episodes:
        eps = [self.start(p) for p in prompts]
        self._engine_logprobs = True  # until a turn's generation comes without them (the hf engine)
        turn = 0
        while True:
            active = [i for i, e in enumerate(eps) if not e.done]
            if not active:
                break
            self._turn([eps[i] for i in active], [turn_seed(seeds[i], turn) for i in active], generator, sampling)
            jobs = {i: self.episodes_pool.submit(self._run_calls, eps[i], eps[i].pending)
                    for i in active if eps[i].pending}
            for i in active:
                self._answer(eps[i], jobs[i].result() if i in jobs else None)
            turn += 1
        self.stats = self._stats(eps)
        return self._episodes(eps, sampling.pad_id)

    def _turn(self, eps: list[_Episode], seeds: list[int], generator: Generator, sampling: Sampling) -> None:
        """One policy turn of each episode in `eps`: sample (an episode with tools may stop once its calls are
        complete, `_past_calls`), keep the ids as sampled (`_cut`), parse and start its calls."""
        limits = [min(sampling.max_new_tokens, self.s.max_episode_tokens - len(e.ids)) for e in eps]
        tools = [bool(e.kind.tool_names) for e in eps]
        gen = generator.generate([e.prompt_ids + e.ids for e in eps], seeds, dataclasses.replace(
            sampling, max_new_tokens=max(limits), stop=(lambda b, ids: tools[b] and self._past_calls(ids))
            if any(tools) else None))
        eos = set(sampling.eos_ids)
        self._engine_logprobs &= gen.logprobs is not None
        for k, e in enumerate(eps):
            n = min(int(gen.mask[k].sum().item()), limits[k])
            ids = [int(x) for x in gen.responses[k, :n].tolist()]
            ids, e.ended = self._cut(e.kind, ids, eos)
            e.ids += ids
            e.mask += [1] * len(ids)
            if gen.logprobs is not None:
                e.logprobs += [float(x) for x in gen.logprobs[k, :len(ids)].tolist()]
            e.turns += 1
            content = self.tokenizer.decode(ids[:-1] if e.ended == "eot" else ids, skip_special_tokens=False)
            e.messages.append({"role": "assistant", "content": content})
            if e.ended is None:  # a token budget cut the turn: truncated, the environment is not called
                e.finish(False)
                continue
            calls = parse_tool_calls(content) if e.kind.tool_names else []
            if calls and (e.turns >= self.s.max_turns or e.tool_calls + len(calls) > self.s.max_tool_calls):
                e.finish(False)  # a budget: cut, counted in episode/truncated_frac
                continue
            e.pending = calls

    def _cut(self, kind: Environment, ids: list[int], eos: set[int]) -> tuple[list[int], str | None]:
        """A turn's sampled ids cut after its first run of tool calls (`<tool_call>…</tool_call>`, several in a
        row with only whitespace between them: consecutive calls stay one turn) when the environment has tools and
        anything but the end-of-turn id follows (a model writing its own tool results), and how the turn ended:
        "call" (cut there, or at the calls' end without an end-of-turn id), "eot" (an id of the EOS set) or None
        (a token budget). The ids kept are a prefix of those sampled."""
        eot = ids and ids[-1] in eos
        text = self.tokenizer.decode(ids[:-1] if eot else ids, skip_special_tokens=False)
        end = _calls_end(text) if kind.tool_names else None
        if end is None:
            return ids, ("eot" if eot else None)
        if not text[end:].strip():
            return ids, ("eot" if eot else "call")
        for k in range(1, len(ids) + 1):
            if len(self.tokenizer.decode(ids[:k], skip_special_tokens=False)) >= end:
                return ids[:k], "call"
        return ids, "call"  # unreachable: the whole text reaches `end`

    def _past_calls(self, ids: Sequence[int]) -> bool:
        """Whether a turn's sampling may stop at `ids` (`Sampling.stop`): its text holds its first run of tool calls
        and, after it, something that is neither whitespace nor the start of another `<tool_call>` (a trailing
        partial character, U+FFFD, waits for its last byte). `_cut` then cuts the turn at that run's end whatever
        is sampled next, so stopping here keeps exactly the ids it keeps without stopping; stopping later would
        too, never earlier. Asked after every token, it decodes the whole turn only while a `</tool_call>` is among
        its last `STOP_WINDOW` tokens (a turn that writes more whitespace than that after its calls is sampled to
        its end, as without the stop)."""
        if CALL_END not in self.tokenizer.decode(ids[-STOP_WINDOW:], skip_special_tokens=False):
            return False
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        end = _calls_end(text)
        if end is None:
            return False
        rest = text[end:].lstrip().rstrip("\ufffd")
        return bool(rest) and not rest.startswith("<tool_call>") and not "<tool_call>".startswith(rest)

    def _run_calls(self, e: _Episode, calls: list[tuple[str, dict[str, Any]] | str]) -> list[dict[str, Any]]:
        """One episode's calls of a turn, in order (each in the tool pool, bounded by `tool_timeout_s`): their tool
        messages, errors included (`_result`)."""
        out = []
        for call in calls:
            e.tool_calls += 1
            if isinstance(call, str):
                out.append(self._result(e, call))
                continue
            name, args = call
            if name not in e.kind.tool_names:
                out.append(self._result(e, f"Error: no tool named {name!r} (the tools: "
                                           f"{', '.join(sorted(e.kind.tool_names))})"))
                continue
            out.append(self._result(e, (name, _ToolCall(getattr(e.env, name), args, self.s.tool_timeout_s))))
        return out

    def _result(self, e: _Episode, pending: Any) -> dict[str, Any]:
        """The tool message of one call: its result cut at `max_tool_tokens`, or an error the model reads."""
        if isinstance(pending, str):
            e.tool_errors += 1
            return {"role": "tool", "name": "error", "content": pending}
        name, call = pending
        try:
            text = call.result()
        except TimeoutError:  # the call is left running on its daemon thread
            e.tool_errors += 1
            return {"role": "tool", "name": name,
                    "content": f"Error: the tool {name!r} ran past rollout.tool_timeout_s={self.s.tool_timeout_s:g}"}
        except Exception as ex:  # noqa: BLE001 - a tool that raises: the model reads it
            e.tool_errors += 1
            return {"role": "tool", "name": name, "content": f"Error: the tool {name!r} raised {type(ex).__name__}: "
                    f"{str(ex)[:500]}"}
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # plain, as sent
        if len(ids) > self.s.max_tool_tokens:
            text = self.tokenizer.decode(ids[:self.s.max_tool_tokens], skip_special_tokens=False)
        return {"role": "tool", "name": name, "content": text}

    def _answer(self, e: _Episode, results: list[dict[str, Any]] | None) -> None:
        """After a turn: the tool results (`results`, the turn's tool messages), or the environment's reply, or the
        episode's end; the new messages appended as tokens with action mask 0, unless they leave no room for a
        sampled token (truncated)."""
        e.pending = []
        if e.done:
            return
        if results:
            new = results
        elif e.kind.replies:
            reply = e.env.env_response([dict(m) for m in e.messages])
            if reply is None:
                return e.finish(True)
            if not isinstance(reply, str):
                raise ConfigError(f"rollout.env={self.spec}: env_response returned a {type(reply).__name__} on data "
                                  f"row {e.row}; it must return a string (the next user message) or None (the end)")
            if e.turns >= self.s.max_turns:
                return e.finish(False)
            new = [{"role": "user", "content": reply}]
        else:
            return e.finish(True)
        (ids,) = e.kind.encoder.encode_segments([self._suffix(e, new)], bos=False)
        if len(e.ids) + len(ids) >= self.s.max_episode_tokens:
            return e.finish(False)
        e.ids += ids
        e.mask += [0] * len(ids)
        e.logprobs += [0.0] * len(ids)
        e.env_tokens += len(ids)
        e.messages += new

    def _suffix(self, e: _Episode, new: list[dict[str, Any]]) -> list[tuple[str, bool]]:
        """The text after the last sampled token up to the next assistant turn's first, as (text, plain) pieces
        (`Encoder.segments`' form): the rest of the assistant turn's closing (all of it after a `</tool_call>` cut;
        after the end-of-turn id the part past it), then the rendering of `new` and the generation prompt, the
        difference of the template's two renderings. The new messages' contents are plain text
        (`Encoder.continuation_segments`), so a special-token string in a tool result or a reply stays those
        characters, as in the data's user text; a template that edits message text gives one piece."""
        before, after = e.kind.render(e.messages, False), e.kind.render(e.messages + new, True)
        if not after.startswith(before):
            raise ConfigError(f"rollout.env={self.spec}: the chat template does not render a conversation as the "
                              f"start of its continuation, so the new messages cannot be appended as tokens; use a "
                              f"ChatML template (data.chat_template) or the shipped tool template")
        rest = e.kind.closing
        if e.ended == "eot":
            eot = self.tokenizer.decode(e.ids[-1:], skip_special_tokens=False)
            rest = rest[len(eot):] if rest.startswith(eot) else rest
        tail = e.kind.encoder.continuation_segments(e.messages + new, len(e.messages))
        return [(rest, False), *(tail if tail is not None else [(after[len(before):], False)])]

    # -- the batch ----------------------------------------------------------------------------------------------
    def _episodes(self, eps: list[_Episode], pad_id: int) -> Episodes:
        """The episodes as tensors: `[left-padded prompt | right-padded completion]` (see `Episodes`), with the
        engine's log-probs where every turn's generation gave them."""
        from rlhf_cli import engine

        dev = engine.device()
        P, R = max(len(e.prompt_ids) for e in eps), max(max(len(e.ids) for e in eps), 1)
        ids = torch.full((len(eps), P + R), pad_id, dtype=torch.long)
        am = torch.zeros(len(eps), P + R, dtype=torch.long)
        action = torch.zeros(len(eps), R, dtype=torch.float32)
        logprobs = torch.zeros(len(eps), R, dtype=torch.float32) if self._engine_logprobs else None
        for b, e in enumerate(eps):
            ids[b, P - len(e.prompt_ids):P] = torch.tensor(e.prompt_ids)
            am[b, P - len(e.prompt_ids):P + len(e.ids)] = 1
            if e.ids:
                ids[b, P:P + len(e.ids)] = torch.tensor(e.ids)
                action[b, :len(e.ids)] = torch.tensor(e.mask, dtype=torch.float32)
                if logprobs is not None:
                    logprobs[b, :len(e.ids)] = torch.tensor(e.logprobs, dtype=torch.float32)
        score = torch.tensor([self._reward(e) for e in eps], dtype=torch.float32) if self.owns_reward else None
        return Episodes(ids.to(dev), am.to(dev), P, action.to(dev), torch.tensor([e.has_eos for e in eps]).to(dev),
                        None if logprobs is None else logprobs.to(dev), None if score is None else score.to(dev),
                        torch.tensor([e.turns for e in eps]).to(dev), [_conversation(e) for e in eps])

    def _reward(self, e: _Episode) -> float:
        """`get_reward()` of the episode's environment (awaited when async); None or NaN: unscorable (NaN)."""
        try:
            r = e.env.get_reward()
            if inspect.isawaitable(r):
                r = asyncio.run(_await(r))
        except Exception as ex:  # noqa: BLE001 - the user's environment: one line naming the row
            raise ConfigError(f"rollout.env={self.spec}: get_reward raised {type(ex).__name__}: {ex} on data row "
                              f"{e.row}") from None
        if r is None:
            return math.nan
        if not isinstance(r, int | float) or isinstance(r, bool):
            raise ConfigError(f"rollout.env={self.spec}: get_reward returned a {type(r).__name__} on data row "
                              f"{e.row}; it must return a number (or None: unscorable)")
        return float(r)

    def _stats(self, eps: list[_Episode]) -> dict[str, float]:
        """`episode/*` of one batch: means per episode; `tool_errors` the count."""
        n = max(len(eps), 1)
        return {"episode/turns_mean": sum(e.turns for e in eps) / n,
                "episode/tool_calls_mean": sum(e.tool_calls for e in eps) / n,
                "episode/tool_errors": float(sum(e.tool_errors for e in eps)),
                "episode/truncated_frac": sum(not e.has_eos for e in eps) / n,
                "episode/sampled_tokens_mean": sum(sum(e.mask) for e in eps) / n,
                "episode/env_tokens_mean": sum(e.env_tokens for e in eps) / n}


def _calls_end(text: str) -> int | None:
    """Where the first run of tool calls in `text` ends (`<tool_call>…</tool_call>` blocks with only whitespace
    between them are one run), None without a closed call."""
    m = TOOL_CALL.search(text)
    if m is None:
        return None
    end = m.end()
    while (m := TOOL_CALL.match(text, len(text) - len(text[end:].lstrip()))) is not None:
        end = m.end()
    return end


def _conversation(e: _Episode) -> Conversation:
    """The episode as TRL's conversational form (`episodes.Conversation`): its prompt's messages, and the messages
    after them with each assistant turn as TRL's response parser gives it (the text outside its
    `<tool_call>…</tool_call>` blocks as `content`, the well-formed calls in `tool_calls`)."""
    completion = []
    for m in e.messages[e.n_prompt:]:
        m = dict(m)
        if m["role"] == "assistant" and e.kind.tool_names and TOOL_CALL.search(m["content"]):
            calls = [c for c in parse_tool_calls(m["content"]) if not isinstance(c, str)]
            m["content"] = TOOL_CALL.sub("", m["content"]).strip()
            if calls:
                m["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": args}}
                                   for name, args in calls]
        completion.append(m)
    return Conversation([dict(m) for m in e.messages[:e.n_prompt]], completion, e.env)


def _accepted(fn: Callable[..., Any], columns: dict[str, Any]) -> dict[str, Any]:
    """The columns `fn` takes: all of them when it takes `**kwargs`, else those it names."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return columns
    names = {p.name for p in params}
    return {k: v for k, v in columns.items() if k in names}


def environment_runner(cfg: Any, tokenizer: Any, prompts: Sequence[dict[str, Any]] = ()) -> EnvironmentRunner:
    """The runner of `rollout.env` with the run's budgets (`rollout.*`), `data.system_prompt` and
    `data.max_prompt_length`; `prompts` (the run's prompt rows) checked for their environment (`check_rows`)."""
    r = cfg.rollout
    settings = EnvSettings(max_turns=r.max_turns, max_tool_calls=r.max_tool_calls,
                           max_episode_tokens=r.max_episode_tokens, max_tool_tokens=r.max_tool_tokens,
                           tool_timeout_s=r.tool_timeout_s)
    runner = EnvironmentRunner(r.env, tokenizer, settings, system_prompt=cfg.data.system_prompt,
                               max_prompt_length=cfg.data.max_prompt_length)
    runner.check_rows(prompts)
    return runner
