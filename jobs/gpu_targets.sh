#!/usr/bin/env bash
# Where every open performance target stands, on the shipped code, in one short device call (<= 5 minutes): bench_moe
# at the decode T for warp decode's auto schedule, expert_centric and kernel=auto (issue 3's µs per layer, issue 5's
# against vLLM's quoted times; MOE_ARGS="--prefill" adds issue 5's prefill T, ~2 minutes more), then bench_decode's
# steps at c = 1k for the three kernel paths (issue 6's roofline % and warp decode over expert-centric). For the
# sessions whose device time goes mostly to refused starts: the smallest call that still measures every target.
# Each stage has its own time limit (MOE_S, DECODE_S seconds). Results land in $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$out/gpu.txt"
timeout "${MOE_S:-100}" python3 jobs/bench_moe.py --out "$out/moe" --shapes qwen3-30b-a3b --tokens 1,2,4,8,16,32,64 \
  --paths auto,expert_centric,kernel_auto --no-sweep ${MOE_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/bench_moe.log" \
  | tail -30
timeout "${DECODE_S:-200}" python3 jobs/bench_decode.py --sections steps --contexts 1024 --batches 1,8,32,64 \
  --out "$out/decode" ${DECODE_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/bench_decode.log" | tail -16
