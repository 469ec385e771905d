# composer-rollout: make install | test | lint | rollout | rl-demo | generate | bench-load | bench-moe | bench-requant |
# bench-sync | bench-attention | bench-skinny | bench-router | bench-sampler | bench-launch-floor | bench-decode | bench-prefill |
# profile-decode | ab-base | ab-moe | gpu-*
PY ?= python3

.PHONY: install test lint rollout generate bench-load bench-moe bench-requant gpu-foundation gpu-warp-decode gpu-rollout \
	rl-demo bench-sync gpu-sync gpu-expert-centric gpu-expert-centric-fp8 bench-attention bench-skinny bench-router bench-sampler bench-launch-floor bench-decode profile-decode \
	gpu-decode gpu-multi bench-prefill gpu-prefill ab-base ab-moe gpu-ab gpu-targets

install:  ## CPU torch from the local wheel, then the package with its test tools
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"

test:  ## the whole suite; Triton kernels run in its interpreter on CPU, `gpu` tests skip there
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check composer_rollout kernels jobs tests

rollout:  ## the main job: the rollout job on a local Ray instance (embedded prompts, tiny preset, 2 CPU workers)
	$(PY) jobs/rollout.py $(ARGS)

rl-demo:  ## GRPO on a toy task: the trainer learns from the pool's rollouts and pushes weights every step (CPU)
	$(PY) jobs/rl_demo.py $(ARGS)

generate:  ## in-process generation, no Ray: generate from the tiny preset and print completions with logprobs
	$(PY) jobs/generate.py $(ARGS)

bench-load:  ## checkpoint load time against tensor count (CPU)
	$(PY) jobs/bench_load.py $(ARGS)

bench-moe:  ## MoE kernel paths at the Qwen3 shapes (GPU)
	$(PY) jobs/bench_moe.py $(ARGS)

REV ?= HEAD
ab-base:  ## export revision REV's kernels/ and composer_rollout/ into .ab_base/ (ignored; carry it to the GPU)
	rm -rf .ab_base && mkdir -p .ab_base && git archive $(REV) kernels composer_rollout | tar -x -C .ab_base

ab-moe:  ## MoE paths of .ab_base's kernels/ against the working tree's, timed side by side in one process (GPU)
	$(PY) jobs/ab_moe.py --base .ab_base $(ARGS)

bench-sync:  ## weight sync of a Qwen3-30B-A3B-sized state into a worker: cuda_ipc and object_store (GPU, ray)
	$(PY) jobs/bench_sync.py $(ARGS)

bench-requant:  ## MXFP8 re-quantization of Qwen3-30B-A3B's expert weights, 1 and 48 layers, against a copy ceiling (GPU)
	$(PY) jobs/bench_requant.py $(ARGS)

bench-attention:  ## the Triton decode and prefill attention kernels at the Qwen3 shapes, against KV-read and matmul bounds (GPU)
	$(PY) jobs/bench_attention.py $(ARGS)

bench-skinny:  ## skinny_linear (a decode step's projections and router gate) against cuBLAS and the read bound (GPU)
	$(PY) jobs/bench_skinny_linear.py $(ARGS)

bench-router:  ## the decode router's forms per T (one launch vs norm + gate GEMM + top-k), sets FUSED_ROUTER_MAX_T (GPU)
	$(PY) jobs/bench_router.py $(ARGS)

bench-launch-floor:  ## a B = 1 decode layer's launches as perfect weight streams: the floor of that launch chain (GPU)
	$(PY) jobs/bench_launch_floor.py $(ARGS)

bench-sampler:  ## the decode step's unfiltered sampler (kernels/gumbel_sample.py) against its torch form, per batch (GPU)
	$(PY) jobs/bench_sampler.py $(ARGS)

profile-decode:  ## where a captured decode step's time goes, kernel by kernel (GPU)
	$(PY) jobs/profile_decode.py $(ARGS)

bench-decode:  ## the engine's decode steps (CUDA graphs) at batch x context x MoE path, a long-tail run, FP32 agreement (GPU)
	$(PY) jobs/bench_decode.py $(ARGS)

bench-prefill:  ## a prefill forward per shape (first call, warm, host, kernels) against its roofline; engine prefill per budget (GPU)
	$(PY) jobs/bench_prefill.py $(ARGS)

gpu-foundation:  ## on the GPU machine: CUDA parity tests and the qwen3_30b_a3b preset generating
	bash jobs/gpu_foundation.sh

gpu-warp-decode:  ## on the GPU machine: warp-decode GPU tests, bench_moe, and the 30B preset on torch vs warp_decode
	bash jobs/gpu_warp_decode.sh

gpu-expert-centric:  ## on the GPU machine: expert-centric GPU tests, its tuner (table in $OUT), bench_moe decode + prefill
	bash jobs/gpu_expert_centric.sh

gpu-expert-centric-fp8:  ## on the GPU machine: the FP8-dot GEMMs' GPU tests, warp stalls (ncu), tuner (table in $OUT), bench_moe
	bash jobs/gpu_expert_centric_fp8.sh

gpu-rollout:  ## on the GPU machine: the rollout job, qwen3_30b_a3b, one GPU worker, 256 prompts
	bash jobs/gpu_rollout.sh

gpu-sync:  ## on the GPU machine: the gpu weight-sync tests and bench_sync (needs ray wheels in .whl)
	bash jobs/gpu_sync.sh

gpu-ab:  ## on the GPU machine, .ab_base carried: MoE GPU tests, ab_moe, bench_decode steps on base / new / base
	bash jobs/gpu_ab.sh

gpu-targets:  ## on the GPU machine: bench_moe (decode T) and bench_decode steps, every open target in <= 5 minutes
	bash jobs/gpu_targets.sh

gpu-decode:  ## on the GPU machine: dense-path and CUDA-graph GPU tests, bench_skinny, bench_attention, profile, bench_decode
	bash jobs/gpu_decode.sh

gpu-prefill:  ## on the GPU machine: bench_prefill, then the rollout job on GRPO-shaped prompts twice (needs ray wheels in .whl)
	bash jobs/gpu_prefill.sh

gpu-multi:  ## on a multi-GPU machine: rollout throughput with a worker per GPU against one, weight sync over NCCL
	bash jobs/gpu_multi.sh
