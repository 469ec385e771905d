#!/usr/bin/env bash
# Issue 8 on a multi-GPU kind (nvidia-h200-x2 or larger) in one device call. Needs ray, hydra and omegaconf carried as
# wheels in .whl (../shared/device/make-wheels.sh). Results land in $OUT (or ./out).
# 1. The rollout job, qwen3_30b_a3b (random init, MXFP8 experts), one worker on one GPU, then one worker per GPU with
#    N times the prompts: aggregate tokens/s against N x one GPU (target >= 0.9 x N).
# 2. Weight sync over NCCL, the trainer (this process) on a GPU of its own and a worker on every other GPU, against a
#    plain NCCL broadcast of the same bucket size on the same group (target >= 70% of it).
# NVLink multicast stays off, as the device README asks.
set -uo pipefail
WHEELS=${WHEELS:-.whl} source "$(dirname "$0")/device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_USAGE_STATS_ENABLED=0
n=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m | tee "$out/topo.txt"
per_gpu=${PROMPTS_PER_GPU:-128}
common=(model=qwen3_30b_a3b rollout=gpu kernel=auto logger=none engine.max_num_seqs=64 engine.max_model_len=1024
        sampling.max_tokens=${MAX_TOKENS:-128} sampling.n=4)
for workers in 1 "$n"; do
  python3 jobs/rollout.py "${common[@]}" rollout.num_workers="$workers" prompts=builtin:random:$((per_gpu * workers / 4)) \
    hydra.run.dir="$out/rollout_$workers" 2>&1 | tail -25 | tee "$out/rollout_$workers.log"
done
python3 jobs/bench_sync.py --out "$out/sync" --workers $((n - 1)) --runs collective:fused:512 collective:fused:2048 \
  2>&1 | tee "$out/bench_sync.log"
