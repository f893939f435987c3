#!/usr/bin/env bash
# Make the folder benchmarks/gpu_check.sh installs from: every package rlhf_cli's GPU check needs that a GPU
# machine with only torch, transformers, peft and accelerate (and their own dependencies) lacks, as wheels
# for CPython PYVER on manylinux x86-64, plus the SmolLM2 tokenizer (HF files, ~3 MB). No model weights.
#
#   bash benchmarks/gpu_wheels.sh [DIR=.whl] [PYVER=3.12]      # run here, inside the README's virtualenv
#
# Versions are the ones installed in this virtualenv. deepspeed and antlr4-python3-runtime publish source
# only: they are built here into pure-Python wheels. datasets travels without pyarrow and pandas (~55 MB):
# the check reads no data files (the built-in task), and rlhf_cli imports datasets only to read them.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${2:-3.12}
PY=${PYTHON:-python}
rm -rf "$DIR" && mkdir -p "$DIR"
pin() {
  for name in "$@"; do
    "$PY" -c 'import importlib.metadata as m, sys; print(f"{sys.argv[1]}=={m.version(sys.argv[1])}")' "$name" || return 1
  done
}

# versions of this virtualenv (an assignment, so a package missing here stops the script)
built=$(pin deepspeed antlr4-python3-runtime)
published=$(pin hjson msgpack ninja py-cpuinfo einops pydantic pydantic-core annotated-types typing-inspection \
  hydra-core omegaconf rich markdown-it-py mdurl pygments gguf datasets dill multiprocess xxhash \
  matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil \
  pytest pluggy iniconfig hypothesis sortedcontainers)
# source-only packages: built here (pure Python, any interpreter)
"$PY" -m pip wheel -q --no-deps -w "$DIR" $built
# everything else as published wheels for the target interpreter
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" $published
# the tokenizer of the tiny model and of SmolLM2's shape, as the HF files rlhf_cli caches from the GGUF
"$PY" - "$DIR/tokenizer" <<'PY'
import sys
from omegaconf import OmegaConf
from rlhf_cli.config import ModelConfig
from rlhf_cli.models import load_tokenizer
cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load("conf/model/tiny.yaml"))
load_tokenizer(cfg).save_pretrained(sys.argv[1])
PY
du -sh "$DIR"
ls "$DIR" | wc -l
