#!/usr/bin/env bash
# The GPU check of issue 14, for a machine with one CUDA GPU, no network, and torch, transformers, peft and
# accelerate installed. Installs the wheels of benchmarks/gpu_wheels.sh (made beforehand on a machine with
# network) into a private folder, then runs benchmarks/gpu_check.py: the precision tests on CUDA, a 1-GPU
# train-rm -> train-ppo -> eval chain on the tiny model, and bf16 throughput of an RM step and a PPO
# iteration of SmolLM2's shape. Writes one JSON; about 5 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh [WHEELS=.whl] [OUT_JSON=${OUT:-.}/gpu_check.json]
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
JSON=${2:-${OUT:-.}/gpu_check.json}
SITE=${GPU_CHECK_SITE:-/tmp/rlhf_gpu_site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout "${GPU_CHECK_TIMEOUT:-330}" python3 benchmarks/gpu_check.py --tokenizer "$WHEELS/tokenizer" --out "$JSON" \
  --work "${GPU_CHECK_WORK:-/tmp/rlhf_gpu_check}" ${GPU_CHECK_ARGS:-}
