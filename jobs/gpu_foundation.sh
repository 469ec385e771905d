#!/usr/bin/env bash
# The foundation's GPU checks in one device call: CUDA parity tests, then the qwen3_30b_a3b preset
# (random init, MXFP8 experts) loaded and generating. Results land in $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu tests/test_model_parity.py -p no:cacheprovider -s 2>&1 | tee "$out/parity.log"
python3 jobs/generate.py model=qwen3_30b_a3b engine.max_num_seqs=8 engine.max_model_len=1024 \
  sampling.max_tokens=16 sampling.n=2 hydra.run.dir="$out/gen" 2>&1 | tee "$out/generate_30b.log"
