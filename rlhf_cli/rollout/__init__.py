"""The rollout library: what an RL stage or `rlhf eval` does with models around a batch of sampled responses.

    episodes.py     the episode seam: `Episodes` (ids, attention, the action mask, EOS, engine log-probs, an
                    episode's own score, turns), the `EpisodeRunner` protocol and its `SingleTurnRunner`
    prompts.py      `PromptSource` (which prompts and seeds each generation round samples), `ppo.filter_groups`'
                    rounds (`filter_groups`, `join_rounds`)
    shaping.py      `shape`: scores and log-probs -> per-token rewards, advantages and returns
    experience.py   `Experience`, the record a rollout hands to the learner
    plan.py         `UpdatePlan`: the update's micro-batch order, computed once per iteration, and what the rollout
                    folds into it (its first micro-batches' training forwards; an on-policy update's old log-probs)
    maker.py        `ExperienceMaker`: one PPO iteration's prompts -> an `Experience` and its statistics (the
                    orchestrator of the pieces above, and the rollout's no-grad scoring passes)
    learner.py      `PolicyLearner`: the update on one `Experience` (minibatches, losses, backward, steps)
    vllm_engine.py  `rollout.engine=vllm`: the vLLM engine behind the seam (the one module importing vllm)
    generation.py   the sampling-engine seam (`Generator`: prompt ids + one seed per prompt + `Sampling` ->
                    `Generation`), its HF engine (`HFGenerator`: per-row sampling inside HF `generate`), the cut
                    at the first EOS, the rollout batch layout
    engines.py      the engines' registry `GENERATORS` (`rollout.engine`), `make_generator`, `resolve_engine`,
                    `max_model_len`
    scores.py       `ScoreMixer`: the run's sequence score, one source or a weighted sum (model, checker, function,
                    http, judge)
    stats.py        whitening, explained variance and the rollout's KL statistics over all ranks

It sits between the forwards (`forwards/`: log-probs, values, scores, packing) with the components below them
(`core/` math, `models/`, `data/`, `engine.py`) and the stages: a stage imports it, it imports no stage.

Batch layout: `[prompt | response]`, prompts left-padded to P columns, responses right-padded to R columns,
the response ending at the first EOS (inclusive); `forwards/__init__.py` says how the forwards read it. The
action mask (B, R) marks the tokens the policy sampled: every loss, KL, advantage and statistic reads it (or the
loss mask built from it), never the attention mask's response columns (`episodes.py`).
"""

from rlhf_cli.rollout.engines import (
    GENERATORS,
    EngineSettings,
    describe_engine,
    make_generator,
    max_model_len,
    resolve_engine,
)
from rlhf_cli.rollout.episodes import EpisodeRunner, Episodes, SingleTurnRunner, join_episodes
from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.generation import (
    Generation,
    Generator,
    HFGenerator,
    PerRowSampler,
    Sampling,
    dtype_setting,
    resolve_dtype,
    response_mask,
    rollout_batch,
    sample_responses,
)
from rlhf_cli.rollout.learner import Losses, PolicyLearner
from rlhf_cli.rollout.maker import ExperienceMaker
from rlhf_cli.rollout.plan import UpdatePlan, update_order
from rlhf_cli.rollout.scores import ScoreMixer, call_on_every_rank, http_on_every_rank, judge_on_every_rank
from rlhf_cli.rollout.stats import (
    EngineDriftGuard,
    PushGuard,
    engine_stats,
    explained_variance_across_ranks,
    is_correction_stats,
    kl_stats,
    whiten_across_ranks,
)

__all__ = [
    "GENERATORS",
    "EngineDriftGuard",
    "PushGuard",
    "EngineSettings",
    "EpisodeRunner",
    "Episodes",
    "Experience",
    "ExperienceMaker",
    "Generation",
    "Generator",
    "HFGenerator",
    "Losses",
    "PerRowSampler",
    "PolicyLearner",
    "Sampling",
    "ScoreMixer",
    "SingleTurnRunner",
    "UpdatePlan",
    "call_on_every_rank",
    "http_on_every_rank",
    "judge_on_every_rank",
    "engine_stats",
    "is_correction_stats",
    "join_episodes",
    "resolve_dtype",
    "dtype_setting",
    "explained_variance_across_ranks",
    "kl_stats",
    "describe_engine",
    "make_generator",
    "max_model_len",
    "resolve_engine",
    "response_mask",
    "rollout_batch",
    "sample_responses",
    "update_order",
    "whiten_across_ranks",
]
