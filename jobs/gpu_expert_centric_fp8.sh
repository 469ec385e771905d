#!/usr/bin/env bash
# The expert-centric MoE's FP8-dot GEMMs (dequant "fp8": kernels/moe_gate_up_fp8.py, kernels/moe_down_fp8.py,
# activations split by kernels/fp8_split.py) on the GPU in one device call (estimated 7-9 minutes on one H200): the
# GPU tests of the split and of tests/test_expert_centric_moe.py; a short tune of the fp8 variant (one num_stages per
# tile unless FULL=1, no bucket started after TUNE_S seconds), whose table lands in $OUT and in this copy's
# kernels/configs/ so that the bench runs its tuned tiles; then jobs/bench_moe.py at decode and prefill sizes, warp
# decode, expert_centric (BF16 dots) and kernel=auto beside expert_centric_fp8, and jobs/bench_fp8_split.py (the
# hidden split alone). Keep the table: copy
# $OUT/expert_centric_h200_fp8.json to kernels/configs/.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH="${PYTHONPATH:-$PWD}"  # the jobs import kernels/ and jobs/ from the repository root
timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/test_fp8_split.py tests/test_expert_centric_moe.py \
  -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
quick=--quick
[ "${FULL:-0}" = 1 ] && quick=
timeout "${TUNE_TIMEOUT_S:-300}" python3 jobs/tune_expert_centric.py --out kernels/configs --dequant fp8 $quick \
  --budget-s "${TUNE_S:-150}" --tokens "${TUNE_TOKENS:-1,4,8,16,32,64,128,256,1024,8192}" 2>&1 \
  | tee "$out/tune_expert_centric_fp8.log"
cp kernels/configs/expert_centric_*_fp8.json "$out/"
timeout "${BENCH_S:-240}" python3 jobs/bench_moe.py --out "$out" --shapes qwen3-30b-a3b --prefill --no-sweep --reps 10 \
  --paths auto,expert_centric_bf16,expert_centric_fp8,kernel_auto 2>&1 | tee "$out/bench_moe.log"
timeout "${SPLIT_S:-60}" python3 jobs/bench_fp8_split.py --out "$out" 2>&1 | tee "$out/bench_fp8_split.log"
