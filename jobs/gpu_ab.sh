#!/usr/bin/env bash
# A kernel change judged in one device call: the base revision (`make ab-base REV=<rev>` here; carry .ab_base) against
# the working tree on the same GPU. The GPU tests of the MoE kernel files ($TESTS, default the expert-centric and
# warp-decode ones), jobs/ab_moe.py (both trees' MoE paths side by side, bit-identity reported; AB_ARGS narrows it),
# and bench_decode's steps (kernel=auto, c = 1k) on the base tree, the working tree, and the base again, so that a
# drift of the machine shows. Each stage has its own time limit (TESTS_S, AB_S, DECODE_S seconds; the defaults add
# up to ~8 minutes). Results land in $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
if [ ! -f .ab_base/kernels/__init__.py ]; then
  echo "no .ab_base/kernels: run 'make ab-base REV=<rev>' and carry .ab_base" >&2
  exit 2
fi
root=$PWD
export PYTHONPATH=${PYTHONPATH:-$root}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$out/gpu.txt"
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_expert_centric_moe.py \
  tests/test_fp8_split.py tests/test_warp_decode_moe.py tests/test_warp_decode_kernels.py} 2>&1 | tail -5
timeout "${AB_S:-150}" python3 jobs/ab_moe.py --base .ab_base --out "$out" ${AB_ARGS:-} 2>&1 | tee "$out/ab_moe.log"
decode() {  # $1: label, $2: the tree first on the path
  mkdir -p "$out/decode_$1"
  PYTHONPATH="$2:$PYTHONPATH" timeout "${DECODE_S:-60}" python3 jobs/bench_decode.py --sections steps \
    --contexts 1024 --kernels auto --batches "${BATCHES:-1,8,32,64}" --out "$out/decode_$1" 2>&1 \
    | grep -v -i warn | tee "$out/decode_$1.log"
}
decode base "$root/.ab_base"
decode new "$root"
decode base_again "$root/.ab_base"
