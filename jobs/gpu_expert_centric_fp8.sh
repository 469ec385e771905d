#!/usr/bin/env bash
# The expert-centric MoE's FP8-dot GEMMs (dequant "fp8": kernels/moe_gate_up_fp8.py, kernels/moe_down_fp8.py,
# activations split by kernels/fp8_split.py) on the GPU in one device call (estimated 7-9 minutes on one H200): the
# GPU tests of the split and of tests/test_expert_centric_moe.py; Nsight Compute's warp-stall sampling of both
# GEMMs at T = $NCU_TOKENS (64) with the committed table's tiles, summarized per SASS instruction by
# jobs/ncu_stalls.py; a short tune of the fp8 variant (one num_stages per tile unless FULL=1, no bucket started
# after TUNE_S seconds; TUNE_ARGS adds tuner flags, e.g. "--tma on --num-stages 3,4") into $OUT/tuned, for
# comparison: the table in kernels/configs/ is merged by hand, its crossover_tokens set from bench_moe; then
# jobs/bench_moe.py at decode and prefill sizes with the committed table, warp decode, expert_centric (BF16 dots)
# and kernel=auto beside expert_centric_fp8, and jobs/bench_fp8_split.py (the hidden split alone).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH="${PYTHONPATH:-$PWD}"  # the jobs import kernels/ and jobs/ from the repository root
timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/test_fp8_split.py tests/test_expert_centric_moe.py \
  -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  timeout "${NCU_S:-120}" "$ncu" --clock-control none -k regex:"_(gate_up|down)_fp8_kernel" --launch-skip 2 \
    --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    -o "$out/ncu_fp8" python3 jobs/profile_moe.py --path expert_centric --tokens "${NCU_TOKENS:-64}" \
    > "$out/ncu_fp8.log" 2>&1
  "$ncu" -i "$out/ncu_fp8.ncu-rep" --page details > "$out/ncu_fp8_details.txt" 2>&1
  "$ncu" -i "$out/ncu_fp8.ncu-rep" --page source --print-source sass --csv > "$out/ncu_fp8_sass.csv" 2>&1
  grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$out/ncu_fp8_details.txt"
  python3 jobs/ncu_stalls.py "$out/ncu_fp8_sass.csv" 2>&1 | tee "$out/ncu_fp8_stalls.log"
else
  echo "no ncu on this machine: the stall sampling is skipped"
fi
quick=--quick
[ "${FULL:-0}" = 1 ] && quick=
timeout "${TUNE_TIMEOUT_S:-300}" python3 jobs/tune_expert_centric.py --out "$out/tuned" --dequant fp8 $quick \
  --budget-s "${TUNE_S:-150}" --tokens "${TUNE_TOKENS:-1,4,8,16,32,64,128,256,1024,8192}" ${TUNE_ARGS:-} 2>&1 \
  | tee "$out/tune_expert_centric_fp8.log"
timeout "${BENCH_S:-240}" python3 jobs/bench_moe.py --out "$out" --shapes qwen3-30b-a3b --prefill --no-sweep --reps 10 \
  --paths auto,expert_centric_bf16,expert_centric_fp8,kernel_auto 2>&1 | tee "$out/bench_moe.log"
timeout "${SPLIT_S:-60}" python3 jobs/bench_fp8_split.py --out "$out" 2>&1 | tee "$out/bench_fp8_split.log"
