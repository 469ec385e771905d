#!/usr/bin/env bash
# The fast decode engine (issue 6) on the GPU in one device call: the dense-path kernels' and the engine's GPU tests
# (PYTEST_ARGS="" runs their whole files, ~4 minutes: the for-loop and PDL paths run only on a GPU), then
# bench_skinny_linear, bench_router (30B shape), bench_sampler, bench_attention, profile_decode (where a step's time goes) and
# bench_decode. Each stage has its own time limit (TESTS_S, SKINNY_S, ROUTER_S, SAMPLER_S, ATTENTION_S, PROFILE_S, DECODE_S
# seconds) so that one slow stage cannot cost the others' results; the defaults add up to ~9.8 minutes, inside one
# 10-minute device call, and the *_ARGS variables narrow each stage (the run of 2026-12-03: docs/perf.md). Results
# land in $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$out/gpu.txt"
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS--m gpu} tests/test_skinny_linear.py \
  tests/test_decode_attention.py tests/test_rmsnorm.py tests/test_qk_norm_rope.py tests/test_router_topk.py \
  tests/test_lm_head.py tests/test_dense_paths.py tests/test_chunked_prefill.py tests/test_prefill_attention.py \
  tests/test_router_gate_topk.py tests/test_gumbel_sample.py tests/test_skinny_gemm.py 2>&1 | tee "$out/gpu_tests.log" | tail -30
timeout "${SKINNY_S:-50}" python3 jobs/bench_skinny_linear.py --out "$out" ${BENCH_SKINNY_ARGS:-} 2>&1 \
  | tee "$out/bench_skinny_linear.log"
timeout "${ROUTER_S:-30}" python3 jobs/bench_router.py --out "$out" ${BENCH_ROUTER_ARGS:---models qwen3-30b-a3b} 2>&1 \
  | tee "$out/bench_router.log"
timeout "${SAMPLER_S:-30}" python3 jobs/bench_sampler.py --out "$out" 2>&1 | tee "$out/bench_sampler.log"
timeout "${ATTENTION_S:-50}" python3 jobs/bench_attention.py --out "$out" ${BENCH_ATTENTION_ARGS:-} 2>&1 \
  | tee "$out/bench_attention.log"
timeout "${PROFILE_S:-70}" python3 jobs/profile_decode.py --out "$out" ${PROFILE_ARGS:-} 2>&1 \
  | grep -v -i warn | tee "$out/profile_decode.log"
timeout "${DECODE_S:-210}" python3 jobs/bench_decode.py --out "$out" ${BENCH_DECODE_ARGS:-} 2>&1 \
  | tee "$out/bench_decode.log"
