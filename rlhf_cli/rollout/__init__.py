"""The rollout library: what a training stage or `rlhf eval` does with models around a batch of responses.

    experience.py   `Experience`, the record a rollout hands to the learner
    plan.py         `UpdatePlan`: the update's micro-batch order, computed once per iteration, and what the rollout
                    folds into it (its first micro-batches' training forwards; an on-policy update's old log-probs)
    forward.py      the training forward of one micro-batch (`Forward`), the update's and the folded rollout's
    maker.py        `ExperienceMaker`: one PPO iteration's prompts -> an `Experience` and its statistics
    learner.py      `PolicyLearner`: the update on one `Experience` (minibatches, losses, backward, steps)
    sampling.py     per-prompt seeds, per-row sampling inside HF `generate`, the cut at the first EOS
    policy.py       response log-probs / entropy / values of a policy (and its shared value head), a separate
                    critic's values, the per-sequence KL of two policies, dropout switched off,
                    a LoRA policy's reference (its adapters off), the trained models' final save
    scoring.py      reward-model scores of sequences and of preference pairs
    packing.py      `data.packing` for rollouts: a group's shared prompt computed once, sequences packed into rows
    rewards.py      `Rewards`: the run's reward, one source or a weighted sum (model, checker, function)
    stats.py        whitening, explained variance and the rollout's KL statistics over all ranks

It sits between the components (`core/` math, `models/`, `data/`, `engine.py`) and the stages: a stage
imports it, it imports no stage.

Batch layout: `[prompt | response]`, prompts left-padded to P columns, responses right-padded to R columns,
the response mask ending at the first EOS (inclusive). logits at column P-1+t predict response token t;
values[:, t] is the critic's head at the same column (see models/scalar.py). With `data.packing` the forwards
run packed (packing.py) and read their outputs back into this layout.
"""

from rlhf_cli.rollout.experience import Experience
from rlhf_cli.rollout.forward import Forward, training_forward
from rlhf_cli.rollout.learner import Losses, PolicyLearner
from rlhf_cli.rollout.maker import ExperienceMaker
from rlhf_cli.rollout.packing import PackedRollout, pack_rollout, use_packing
from rlhf_cli.rollout.plan import UpdatePlan, update_order
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
from rlhf_cli.rollout.sampling import PerRowSampler, response_mask, sample_responses
from rlhf_cli.rollout.scoring import batched_rewards, forward_pairs, pair_collator, pair_metrics, score_pairs
from rlhf_cli.rollout.stats import explained_variance_across_ranks, kl_stats, whiten_across_ranks

__all__ = [
    "Experience",
    "Forward",
    "ExperienceMaker",
    "Losses",
    "PackedRollout",
    "PerRowSampler",
    "PolicyLearner",
    "PolicyWithValueHead",
    "FrozenWithoutAdapters",
    "Rewards",
    "batched_rewards",
    "call_on_every_rank",
    "critic_values",
    "disable_dropout",
    "explained_variance_across_ranks",
    "kl_stats",
    "forward_pairs",
    "pack_rollout",
    "pair_collator",
    "has_value_head",
    "lm_of",
    "pair_metrics",
    "policy_forward",
    "response_hidden",
    "response_mask",
    "sample_responses",
    "save_model",
    "save_policy",
    "score_pairs",
    "sequence_kl",
    "training_forward",
    "unwrap",
    "UpdatePlan",
    "update_order",
    "use_packing",
    "whiten_across_ranks",
]
