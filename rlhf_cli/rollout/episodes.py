"""The episode seam: prompts in, sampled episodes out, in the layout every pass scores and trains on.

    Episodes          one batch of episodes: ids and attention (B, P+R), the action mask (B, R), EOS, the engine's
                      log-probs, an episode's own score, turns, its conversation (`Conversation`)
    EpisodeRunner     the protocol a way of running episodes implements: `run(prompts, seeds, generator, sampling)`
    SingleTurnRunner  one response per prompt, one `Generator.generate` call (train-ppo's and eval's episodes)
    join_episodes     several batches as one (`ppo.filter_groups`' rounds)

Three masks, each built where its tokens are made and never derived from another (STYLE 16): the attention mask
says which positions hold a token at all; the action mask which response positions hold a token the policy
sampled (what the policy loss, the KL, the entropy, the value loss, the advantages and whitening read); the loss
mask (`Experience.loss_mask`) which of those enter the loss. A runner that appends tokens the policy did not
sample (a tool's output, an environment's reply) gives them attention 1 and action 0: they condition the next
turn and are never trained (STYLE 17: the sampled ids are kept exactly as sampled, never re-tokenized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from rlhf_cli.rollout.generation import Generator, Sampling, join_rollout_batches, rollout_batch


class Episodes(NamedTuple):
    """B episodes on one rank, laid out `[left-padded prompt | right-padded completion]`: P prompt columns, R
    completion columns, rows in the order of their prompts.

    input_ids        (B, P+R) long     the prompt's ids, then every token of the episode after it, pad after
    attention_mask   (B, P+R) long     1 = a real token (prompt, sampled, or written by an environment)
    P                int               the prompt columns
    action_mask      (B, R) float32    1 = a token the policy sampled (a response's EOS included), 0 = padding or a
                                       token the policy did not sample
    has_eos          (B,) bool         the episode's last sampled token is an id of `Sampling.eos_ids` (else a
                                       token budget cut it)
    engine_logprobs  (B, R) float32    the sampling engine's log-probs of the sampled tokens (0 elsewhere), on
                     | None            the ids' device; None when the engine gives none (`hf`)
    score            (B,) float32      the episode's own score, where what ran it gives one (an environment's
                     | None            reward: `environments.EnvironmentRunner` with a `get_reward`, which the maker
                                       then uses instead of the reward sources); None: the run's `ScoreMixer`
                                       scores the text (`SingleTurnRunner` gives none)
    turns            (B,) long         the policy's turns in each episode (1 for a single-turn episode)
    conversations    B `Conversation`s  each episode's messages and environment, where what ran it keeps them
                     | None            (`environments.EnvironmentRunner`: `reward.function` then receives them);
                                       None: the reward sources read the sampled tokens' text (`SingleTurnRunner`)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    P: int
    action_mask: torch.Tensor
    has_eos: torch.Tensor
    engine_logprobs: torch.Tensor | None
    score: torch.Tensor | None
    turns: torch.Tensor
    conversations: list[Conversation] | None = None

    def rows(self, idx: torch.Tensor) -> Episodes:
        """The rows `idx` (long indices), in their order, with the same columns."""
        picked = {name: getattr(self, name)[idx] for name in _ROW_FIELDS if getattr(self, name) is not None}
        if self.conversations is not None:
            picked["conversations"] = [self.conversations[i] for i in idx.tolist()]
        return self._replace(**picked)

    def sampled_view(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) of `[prompt | the tokens the policy sampled]`: what the run's reward sources
        score, so that a tool's or the environment's words never earn the policy a reward (a checker reading the
        tool's result as the answer). The sampled tokens of each row keep their order, right-padded with `pad_id`;
        the very tensors of the episode when its responses hold no other token (every single-turn episode)."""
        P, response = self.P, self.attention_mask[:, self.P:]
        keep = self.action_mask.bool()
        if torch.equal(keep, response.bool()):
            return self.input_ids, self.attention_mask
        width = int(keep.sum(1).max()) if keep.numel() else 0
        ids = torch.full((keep.shape[0], width), pad_id, dtype=self.input_ids.dtype, device=self.input_ids.device)
        am = torch.zeros_like(ids, dtype=self.attention_mask.dtype)
        for i in range(keep.shape[0]):
            row = self.input_ids[i, P:][keep[i]]
            ids[i, :len(row)], am[i, :len(row)] = row, 1
        return torch.cat([self.input_ids[:, :P], ids], 1), torch.cat([self.attention_mask[:, :P], am], 1)


class Conversation(NamedTuple):
    """One episode as messages, TRL's conversational form (what `reward.function` receives under `rollout.env`).

    prompt       the messages the episode began with (`data.system_prompt` and `reset`'s observation included)
    completion   the messages after them: assistant turns (`content` without the tool calls, the well-formed calls
                 in `tool_calls`, `[{"type": "function", "function": {"name", "arguments"}}]`), tool results
                 (`{"role": "tool", "name", "content"}`) and the environment's replies (`user`)
    environment  the episode's environment instance (a reward function's `environments=`)
    """

    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    environment: Any


_ROW_FIELDS = ("input_ids", "attention_mask", "action_mask", "has_eos", "engine_logprobs", "score", "turns")


@runtime_checkable
class EpisodeRunner(Protocol):
    """A way of running episodes: `run(prompts, seeds, generator, sampling) -> Episodes`.

    prompts: B prompt rows (dicts with `prompt_ids`, the rendered prompt's ids, and the data set's other columns);
    seeds: one int per row, the row's whole random stream (a row's episode depends on its prompt, its seed, the
    weights and `sampling`, never on the rows beside it); generator: the engine to sample with, already at the
    policy's current weights (`Generator`); sampling: the settings of each of its calls (`Sampling`). Returns the
    B episodes in the prompts' order; the policy's sampled ids are kept exactly as sampled, and only they carry
    action mask 1.
    """

    def run(self, prompts: Sequence[dict[str, Any]], seeds: Sequence[int], generator: Generator,
            sampling: Sampling) -> Episodes:
        ...


class SingleTurnRunner:
    """One response per prompt: one `generator.generate` call, the response cut at the first EOS
    (`generation.rollout_batch`). The action mask is the engine's response mask (`Generation.mask`: every token
    up to and including the first EOS is sampled), one turn each, no score of its own."""

    def run(self, prompts: Sequence[dict[str, Any]], seeds: Sequence[int], generator: Generator,
            sampling: Sampling) -> Episodes:
        prompt_ids = [x["prompt_ids"] for x in prompts]
        generation = generator.generate(prompt_ids, seeds, sampling)
        input_ids, attention_mask, P, has_eos = rollout_batch(prompt_ids, generation, sampling.pad_id)
        R, dev = input_ids.shape[1] - P, input_ids.device
        action_mask = generation.mask[:, :R].float().to(dev)
        engine_logprobs = None
        if generation.logprobs is not None:
            engine_logprobs = generation.logprobs[:, :R].float().to(dev)
        turns = torch.ones(input_ids.shape[0], dtype=torch.long, device=dev)
        return Episodes(input_ids, attention_mask, P, action_mask, has_eos, engine_logprobs, None, turns)


def join_episodes(parts: Sequence[Episodes], pad_id: int) -> Episodes:
    """Batches of episodes as one, rows in order: one `[left-padded prompt | right-padded completion]` layout
    (`generation.join_rollout_batches`, which drops the columns no row uses); the action masks and the engine's
    log-probs padded with 0 to the joined R (the engine's log-probs only when every part has them). Raises
    ValueError when `parts` is empty."""
    input_ids, attention_mask, P = join_rollout_batches([(e.input_ids, e.attention_mask, e.P) for e in parts],
                                                        pad_id)
    R = input_ids.shape[1] - P

    def widen(t: torch.Tensor) -> torch.Tensor:  # (B_i, R_i) -> (B_i, R): pad with 0, drop unused columns
        return torch.nn.functional.pad(t, (0, R))[:, :R]

    engine_logprobs = None
    if all(e.engine_logprobs is not None for e in parts):
        engine_logprobs = torch.cat([widen(e.engine_logprobs) for e in parts])
    score = torch.cat([e.score for e in parts]) if all(e.score is not None for e in parts) else None
    conversations = (sum((e.conversations for e in parts), [])
                     if all(e.conversations is not None for e in parts) else None)
    return Episodes(input_ids, attention_mask, P, torch.cat([widen(e.action_mask) for e in parts]),
                    torch.cat([e.has_eos for e in parts]), engine_logprobs, score,
                    torch.cat([e.turns for e in parts]), conversations)
