"""Pure-torch RLHF math: per-token ops, KL-shaped rewards, GAE, estimators, PPO/RM losses, direct preference
(DPO/IPO/SLiC) losses, KTO's loss and reference point, KL control, paired statistics of evaluations.

Imports only torch. Shapes: ``B`` batch, ``T`` response length (right-padded), ``V``
vocabulary; ``mask`` ``(B, T)`` is 1 on real response tokens (EOS included), 0 on padding,
and whatever padding holds never reaches an output. Log-probabilities, entropies and KL
are in nats; half-precision inputs are computed in float32.

Paper names map to code (and config) names once, here:

============================  ==========================  ==========================
paper                         argument / config key       usual long name (TRL etc.)
============================  ==========================  ==========================
epsilon (PPO clip)            ``clip`` / ``ppo.clip``     ``clip_range``
epsilon_high (DAPO)           ``clip_high`` / ``ppo.clip_high``  TRL ``epsilon_high``
c (dual clip, Ye et al.)      ``dual_clip`` / ``ppo.dual_clip``  veRL ``clip_ratio_c``
c1 (value-loss coefficient)   ``c1`` / ``ppo.c1``         ``vf_coef``
c2 (entropy coefficient)      ``c2`` / ``ppo.c2``         ``ent_coef``
lambda (GAE)                  ``lam`` / ``ppo.lam``       ``gae_lambda``
gamma (discount)              ``gamma`` / ``ppo.gamma``   ``gamma``
beta (KL penalty)             ``kl_beta`` / ``ppo.kl_beta``  ``kl_coef`` (TRL GRPO ``beta``)
G (samples per prompt)        ``ppo.n_samples_per_prompt``  ``num_generations``
KL target (Ziegler et al.)    ``target`` / ``ppo.kl_target``  ``target_kl``
C (TIS cap, Yao et al.)       ``high`` / ``rollout.is_high``  TRL ``vllm_importance_sampling_cap``
p (nucleus, Holtzman et al.)  ``top_p`` / ``ppo.top_p``   ``top_p``
beta (DPO), tau (IPO)         ``beta`` / ``dpo.beta``     TRL ``beta``
epsilon (cDPO label noise)    ``label_smoothing`` / ``dpo.label_smoothing``  ``label_smoothing`` (TRL < 1)
alpha (RPO's NLL weight)      ``sft_weight`` / ``dpo.sft_weight``  ``rpo_alpha`` (TRL < 1)
beta (KTO)                    ``beta`` / ``kto.beta``     TRL ``beta``
lambda_D, lambda_U (KTO)      ``kto.desirable_weight``, ``kto.undesirable_weight``  TRL ``desirable_weight``
z0 (KTO reference point)      ``kl`` (``kto/kl``)         TRL ``kl``
============================  ==========================  ==========================
"""

from rlhf_cli.core.advantages import (
    add_at_last_token,
    compute_gae,
    compute_gae_vectorized,
    discounted_returns,
    kl_penalized_rewards,
    overlong_penalty,
    teacher_token_rewards,
)
from rlhf_cli.core.correction import IS_CORRECTIONS, engine_is_weights, is_bounds
from rlhf_cli.core.dpo import DPO_LOSSES, dpo_loss, hinge_loss, ipo_loss, sigmoid_loss
from rlhf_cli.core.estimators import ESTIMATORS, AdvantageEstimator, outcome_advantages
from rlhf_cli.core.groups import group_adjusted_scores, group_stats, informative_groups
from rlhf_cli.core.kl_controllers import AdaptiveKLController, FixedKLController
from rlhf_cli.core.kto import kl_completion_index, kl_reference_point, kto_loss
from rlhf_cli.core.losses import (
    KEPT_TOKEN_MEANS,
    KEPT_TOKENS,
    POLICY_LOSSES,
    cispo_loss,
    entropy_bonus,
    gspo_loss,
    kl_loss,
    masked_aggregate,
    pairwise_loss,
    policy_loss,
    value_loss,
)
from rlhf_cli.core.ops import (
    entropy_from_logits,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    nucleus_logits,
)
from rlhf_cli.core.paired import (
    SMALL_SAMPLE,
    mean_ci95,
    policy_eval_stats,
    proportion_ci95,
    reward_hacking,
    sample_std,
    small_sample_warning,
    t_quantile,
    wilson_ci95,
    win_rate,
)

__all__ = [
    "DPO_LOSSES",
    "ESTIMATORS",
    "IS_CORRECTIONS",
    "KEPT_TOKEN_MEANS",
    "KEPT_TOKENS",
    "POLICY_LOSSES",
    "SMALL_SAMPLE",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "add_at_last_token",
    "cispo_loss",
    "compute_gae",
    "compute_gae_vectorized",
    "discounted_returns",
    "engine_is_weights",
    "dpo_loss",
    "kl_completion_index",
    "kl_reference_point",
    "kto_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "group_adjusted_scores",
    "gspo_loss",
    "group_stats",
    "informative_groups",
    "is_bounds",
    "hinge_loss",
    "ipo_loss",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "logprobs_from_logits",
    "masked_aggregate",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "nucleus_logits",
    "policy_eval_stats",
    "mean_ci95",
    "outcome_advantages",
    "overlong_penalty",
    "teacher_token_rewards",
    "pairwise_loss",
    "policy_loss",
    "proportion_ci95",
    "reward_hacking",
    "sample_std",
    "sigmoid_loss",
    "small_sample_warning",
    "t_quantile",
    "value_loss",
    "wilson_ci95",
    "win_rate",
]
