"""The rollout library: what a training stage or `rlhf eval` does with models around a batch of responses.

    experience.py   `Experience`, the record a rollout hands to the learner
    maker.py        `ExperienceMaker`: one PPO iteration's prompts -> an `Experience` and its statistics
    learner.py      `PolicyLearner`: the update on one `Experience` (minibatches, losses, backward, steps)
    generation.py   the sampling-engine seam (`Generator`: prompt ids + one seed per prompt + `Sampling` ->
                    `Generation`), its HF engine (`HFGenerator`: per-row sampling inside HF `generate`), the
                    registry `GENERATORS` (`rollout.engine`), the cut at the first EOS, the rollout batch layout
    policy.py       response log-probs / entropy / values of a policy (and its shared value head), a separate
                    critic's values, the per-sequence KL of two policies, dropout switched off,
                    a LoRA policy's reference (its adapters off), the trained models' final save
    scoring.py      reward-model scores of sequences and of preference pairs
    packing.py      `data.packing` for rollouts: a group's shared prompt computed once, sequences packed into rows
    rewards.py      `Rewards`: the run's reward, one source or a weighted sum (model, checker, function)
    stats.py        whitening and explained variance over the real tokens of all ranks

It sits between the components (`core/` math, `models/`, `data/`, `engine.py`) and the stages: a stage
imports it, it imports no stage.

Batch layout: `[prompt | response]`, prompts left-padded to P columns, responses right-padded to R columns,
the response mask ending at the first EOS (inclusive). logits at column P-1+t predict response token t;
values[:, t] is the critic's head at the same column (see models/scalar.py). With `data.packing` the forwards
run packed (packing.py) and read their outputs back into this layout.
"""

from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.generation import (
    GENERATORS,
    Generation,
    Generator,
    HFGenerator,
    PerRowSampler,
    Sampling,
    make_generator,
    response_mask,
    rollout_batch,
    sample_responses,
)
from rlhf_cli.rollout.learner import Losses, PolicyLearner
from rlhf_cli.rollout.maker import ExperienceMaker
from rlhf_cli.rollout.packing import PackedRollout, pack_rollout, use_packing
from rlhf_cli.rollout.policy import (
    FrozenWithoutAdapters,
    PolicyWithValueHead,
    critic_values,
    disable_dropout,
    has_value_head,
    lm_of,
    policy_forward,
    response_hidden,
    save_model,
    save_policy,
    sequence_kl,
    unwrap,
)
from rlhf_cli.rollout.rewards import Rewards, call_on_every_rank
from rlhf_cli.rollout.scoring import batched_rewards, forward_pairs, pair_collator, pair_metrics, score_pairs
from rlhf_cli.rollout.stats import explained_variance_across_ranks, whiten_across_ranks

__all__ = [
    "GENERATORS",
    "Experience",
    "ExperienceMaker",
    "Generation",
    "Generator",
    "HFGenerator",
    "Losses",
    "PackedRollout",
    "PerRowSampler",
    "PolicyLearner",
    "PolicyWithValueHead",
    "FrozenWithoutAdapters",
    "Rewards",
    "Sampling",
    "batched_rewards",
    "call_on_every_rank",
    "critic_values",
    "disable_dropout",
    "explained_variance_across_ranks",
    "forward_pairs",
    "pack_rollout",
    "pair_collator",
    "has_value_head",
    "lm_of",
    "make_generator",
    "pair_metrics",
    "policy_forward",
    "response_hidden",
    "response_mask",
    "rollout_batch",
    "sample_responses",
    "save_model",
    "save_policy",
    "score_pairs",
    "sequence_kl",
    "unwrap",
    "use_packing",
    "whiten_across_ranks",
]
