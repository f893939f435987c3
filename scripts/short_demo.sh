#!/usr/bin/env bash
# The shortened demo (train-rm -> train-ppo -> eval of the policy -> eval of the RM, ~5 minutes on 2 cores) that a
# refactor is checked with: run it before and after the change, then compare the two trees value by value:
#   bash scripts/short_demo.sh /tmp/before fp32    # on the commit before (e.g. in a `git worktree`)
#   bash scripts/short_demo.sh /tmp/after fp32     # on the change
#   python scripts/compare_runs.py /tmp/before /tmp/after --weights
# Runs `python -m rlhf_cli` from the current directory, so a checkout's own code runs (not the installed one).
set -euo pipefail
root=${1:?usage: short_demo.sh ROOT [PRECISION]}; precision=${2:-fp32}
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" TOKENIZERS_PARALLELISM=false
common=("paths.root=$root" "precision=$precision")
python -m rlhf_cli train-rm "${common[@]}" rm.max_steps=12 rm.save_every=6 rm.eval_every=6
python -m rlhf_cli train-ppo "${common[@]}" ppo.iterations=2 ppo.save_every=1 ppo.rollout_batch_size=16 \
  ppo.mini_batch_size=8
python -m rlhf_cli eval "${common[@]}" eval.num_prompts=8 eval.max_new_tokens=16
python -m rlhf_cli eval "${common[@]}" reward_model.path="$root/latest_rm" eval.num_prompts=16
