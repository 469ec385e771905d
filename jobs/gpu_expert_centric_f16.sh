#!/usr/bin/env bash
# The expert-centric MoE's f16_rel dequantization (FP16 dots, kernels/mx_tiles.py) on the GPU in one device call
# (estimated 4-5 minutes on one H200): the GPU tests of tests/test_expert_centric_moe.py (BF16 and f16_rel at the
# 30B shape, CUDA-graph replay); a short tune of the f16_rel variant only (T = 1, 8, 32, 64, 128, 1024, 8192, one
# num_stages per tile, no bucket started after 90 s), whose table lands in $OUT and in this copy's kernels/configs/
# so that the bench runs its tuned tiles; then jobs/bench_moe.py at decode and prefill sizes, expert_centric (BF16
# dots, the tuned table) beside expert_centric_f16. Keep the table: copy $OUT/expert_centric_h200_f16_rel.json to
# kernels/configs/.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH="${PYTHONPATH:-$PWD}"  # the jobs import kernels/ and jobs/ from the repository root
python3 -m pytest -q -m gpu tests/test_expert_centric_moe.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
python3 jobs/tune_expert_centric.py --out kernels/configs --dequant f16_rel --quick --budget-s 90 \
  --tokens 1,8,32,64,128,1024,8192 2>&1 | tee "$out/tune_expert_centric_f16.log"
cp kernels/configs/expert_centric_*_f16_rel.json "$out/"
python3 jobs/bench_moe.py --out "$out" --shapes qwen3-30b-a3b --prefill --no-sweep --reps 10 \
  --paths expert_centric,expert_centric_f16 2>&1 | tee "$out/bench_moe.log"
