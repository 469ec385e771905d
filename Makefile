# composer-rollout: make install | test | lint | rollout | generate | bench-load | bench-moe | gpu-foundation
PY ?= python3

.PHONY: install test lint rollout generate bench-load bench-moe gpu-foundation

install:  ## CPU torch from the local wheel, then the package with its test tools
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"

test:  ## the whole suite; Triton kernels run in its interpreter on CPU, `gpu` tests skip there
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check composer_rollout kernels jobs tests

rollout:  ## the main job: the rollout job on a local Ray instance (embedded prompts, tiny preset, 2 CPU workers)
	$(PY) jobs/rollout.py $(ARGS)

generate:  ## in-process generation, no Ray: generate from the tiny preset and print completions with logprobs
	$(PY) jobs/generate.py $(ARGS)

bench-load:  ## checkpoint load time against tensor count (CPU)
	$(PY) jobs/bench_load.py $(ARGS)

bench-moe:  ## MoE kernel paths at the Qwen3 shapes (GPU)
	$(PY) jobs/bench_moe.py $(ARGS)

gpu-foundation:  ## on the GPU machine: CUDA parity tests and the qwen3_30b_a3b preset generating
	bash jobs/gpu_foundation.sh
