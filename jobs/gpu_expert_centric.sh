#!/usr/bin/env bash
# The expert-centric MoE on the GPU in one device call (about 6 minutes on one H200, under 8): its GPU tests and the
# kernel paths' (expert_centric, auto) through the model; the tuner, whose table lands in $OUT and in this copy's
# kernels/configs/ so that the bench runs the tuned tiles and crossover; then jobs/bench_moe.py at decode and
# prefill sizes, warp decode (auto schedule) beside expert_centric, kernel=auto and the MXFP8-activation variant.
# Results land in $OUT (or ./out); copy $OUT/expert_centric_h200.json to kernels/configs/ to keep the table.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH="${PYTHONPATH:-$PWD}"  # the jobs import kernels/ and jobs/ from the repository root
python3 -m pytest -q -m gpu tests/test_expert_centric_moe.py tests/test_kernel_paths.py -p no:cacheprovider 2>&1 \
  | tee "$out/gpu_tests.log"
python3 jobs/tune_expert_centric.py --out kernels/configs 2>&1 | tee "$out/tune_expert_centric.log"
cp kernels/configs/expert_centric_*.json "$out/"
python3 jobs/bench_moe.py --out "$out" --shapes qwen3-30b-a3b --prefill --no-sweep --reps 10 \
  --paths auto,expert_centric,kernel_auto,expert_centric_act_mxfp8 2>&1 | tee "$out/bench_moe.log"
