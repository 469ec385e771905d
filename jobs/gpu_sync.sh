#!/usr/bin/env bash
# Weight sync on the GPU in one device call (under 8 minutes): the gpu-marked sync tests (cuda_ipc and object_store
# into a GPU worker, bit-exact with the Triton re-quantization; NCCL when there are two GPUs), then jobs/bench_sync.py
# (a Qwen3-30B-A3B-sized BF16 state, about 61 GB, into one worker on the same H200 through cuda_ipc and object_store).
# Needs ray, hydra and omegaconf carried as wheels in .whl (../shared/device/make-wheels.sh). Results land in $OUT
# (or ./out): gpu_tests.log, bench_sync.log, bench_sync.json, bench_sync.png.
set -uo pipefail
WHEELS=${WHEELS:-.whl} source "$(dirname "$0")/device_env.sh"
export RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 180 python3 -m pytest -q -m gpu tests/test_weight_sync_gpu.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
timeout 270 python3 jobs/bench_sync.py --out "$out" 2>&1 | tee "$out/bench_sync.log"
