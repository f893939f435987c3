"""The model forwards every stage uses: a policy's response log-probs, values and KL, reward-model scores, and the
forwards over preference pairs, padded or packed.

    policy.py    response log-probs / entropy / values of a policy (and its shared value head), a separate
                 critic's values, the per-sequence KL of two policies; a LoRA policy's reference (its adapters off)
    scoring.py   reward-model scores of sequences and of preference pairs, the pair collator for a model, pair metrics
    pairs.py     a causal LM's summed response log-probs of each pair's chosen and rejected (DPO and its kin)
    sft.py       a causal LM's log-probs of demonstrations' response tokens (train-sft), padded or packed
    unpaired.py  a causal LM's summed completion log-probs of unpaired rows (train-kto), padded or packed
    training.py  the training forward of one micro-batch (`Forward`, with its graph): PPO's update, and the rollout's
                 forwards of the update's first micro-batches
    packing.py   `data.packing` for rollouts: a group's shared prompt computed once, sequences packed into rows; the
                 start-up probe that packed segments stay apart on a model (`packing_probe`)

It sits between the components (`core/` math, `models/`, `data/`, `engine.py`) and what uses the forwards
(`rollout/`, the stages): it imports neither. The models the forwards read (`PolicyWithValueHead`, `lm_of`,
`disable_dropout`) and the trained models' final save are `models/`'s.

Rollout batch layout: `[prompt | response]`, prompts left-padded to P columns, responses right-padded to R columns,
the response ending at the first EOS (inclusive); which response tokens count is the caller's action mask (B, R)
(`rollout.Episodes.action_mask`), never sliced out of the attention mask. logits at column P-1+t predict
response token t; values[:, t] is the critic's head at the same column (see models/scalar.py). With
`data.packing` the forwards run packed (packing.py) and read their outputs back into this layout. Pair batches
are `data.PairCollator`'s and `data.PackedPairCollator`'s (`pair_collator` picks one for a model).
"""

from rlhf_cli.forwards.packing import PackedRollout, pack_rollout, packing_probe, use_packing
from rlhf_cli.forwards.pairs import pair_logprobs
from rlhf_cli.forwards.policy import (
    FrozenWithoutAdapters,
    critic_values,
    policy_forward,
    response_hidden,
    sequence_kl,
)
from rlhf_cli.forwards.scoring import batched_scores, forward_pairs, pair_collator, pair_metrics, score_pairs
from rlhf_cli.forwards.sft import response_logprobs, sft_collator
from rlhf_cli.forwards.training import Forward, training_forward
from rlhf_cli.forwards.unpaired import completion_logprobs, unpaired_collator

__all__ = [
    "Forward",
    "FrozenWithoutAdapters",
    "PackedRollout",
    "batched_scores",
    "completion_logprobs",
    "critic_values",
    "forward_pairs",
    "pack_rollout",
    "pair_collator",
    "pair_logprobs",
    "pair_metrics",
    "policy_forward",
    "response_hidden",
    "response_logprobs",
    "score_pairs",
    "sequence_kl",
    "sft_collator",
    "training_forward",
    "unpaired_collator",
    "use_packing",
    "packing_probe",
]
