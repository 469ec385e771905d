#!/usr/bin/env bash
# The fast decode engine (issue 6) on the GPU in one device call: the attention kernels' whole test files (their
# for-loop paths run only on a GPU), the engine's CUDA-graph and Triton-attention tests, bench_attention, then
# bench_decode (BENCH_DECODE_ARGS narrows it to the device time left). Results land in $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH=${PYTHONPATH:-$PWD}
python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_prefill_attention.py \
  tests/test_rmsnorm.py tests/test_router_topk.py tests/test_qk_norm_rope.py tests/test_chunked_prefill.py \
  tests/test_dense_paths.py 2>&1 | tee "$out/gpu_tests.log"
python3 jobs/bench_attention.py --out "$out" ${BENCH_ATTENTION_ARGS:-} 2>&1 | tee "$out/bench_attention.log"
python3 jobs/bench_decode.py --out "$out" ${BENCH_DECODE_ARGS:-} 2>&1 | tee "$out/bench_decode.log"
