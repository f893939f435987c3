#!/usr/bin/env bash
# The demo: train-rm -> train-ppo -> eval on the defaults (SmolLM2-135M-Instruct, built-in task).
# Pass extra Hydra overrides through DEMO_ARGS, e.g. DEMO_ARGS="paths.root=/tmp/runs". They go to all three
# commands, so give only keys every command reads (paths.*, seed, precision, model=..., data.*): a command
# refuses a key it does not read (rm.* in train-ppo, ppo.* in train-rm).
set -euo pipefail
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" TOKENIZERS_PARALLELISM=false
args=(${DEMO_ARGS:-})
start=$(date +%s)
rlhf train-rm "${args[@]}"
rlhf train-ppo "${args[@]}"
# 64 held-out prompts and the training response length keep the demo within ~15 minutes on 2 cores
rlhf eval eval.num_prompts=64 eval.max_new_tokens=32 "${args[@]}"  # its last line: the report's path
echo "demo finished in $(( $(date +%s) - start )) s"
