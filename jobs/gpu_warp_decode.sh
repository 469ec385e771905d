#!/usr/bin/env bash
# Warp decode on the GPU in one device call: its kernel and GPU tests, jobs/bench_moe.py, and the qwen3_30b_a3b
# preset generating end to end on kernel=torch and kernel=warp_decode. Results land in $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# The kernel-level tests carry no gpu marker: on a GPU machine they run natively, at their irregular shapes.
python3 -m pytest -q tests/test_warp_decode_kernels.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
python3 -m pytest -q -m gpu tests/test_warp_decode_moe.py tests/test_kernel_paths.py -p no:cacheprovider 2>&1 \
  | tee -a "$out/gpu_tests.log"
python3 jobs/bench_moe.py --out "$out" --no-sweep 2>&1 | tee "$out/bench_moe.log"
for kernel in torch warp_decode; do
  python3 jobs/generate.py model=qwen3_30b_a3b kernel=$kernel engine.max_num_seqs=16 engine.max_model_len=512 \
    sampling.max_tokens=32 sampling.n=4 hydra.run.dir="$out/gen_$kernel" 2>&1 | tail -4 | tee "$out/generate_$kernel.log"
done
