#!/usr/bin/env bash
# Prefill on the GPU in one device call. First the rollout job on GRPO-shaped prompts twice (on a fresh machine the
# first run compiles, the second reads Triton's disk cache): 32 prompts of 200-800 random tokens, 8 samples each, 256
# tokens per sample, 128 slots, qwen3_30b_a3b (random init, MXFP8 experts), kernel=auto with CUDA graphs,
# engine.max_prefill_tokens per run: RUNS lists budget/name pairs (default "4096/first 4096/second"). Then, unless
# BENCH=0, jobs/bench_prefill.py: a prefill forward per shape (first call and warm, host and kernel time) against its
# roofline, and the engine's prefill tokens/s per max_prefill_tokens.
# Needs ray, hydra and omegaconf carried as wheels in .whl (../shared/device/make-wheels.sh). Results land in $OUT
# (or ./out).
set -uo pipefail
WHEELS=${WHEELS:-.whl} source "$(dirname "$0")/device_env.sh"
python3 - <<'PY'
import json, random
r = random.Random(0)
with open("/tmp/grpo_prompts.jsonl", "w") as f:
    for i in range(32):
        ids = [r.randrange(3, 150000) for _ in range(r.randint(200, 800))]
        f.write(json.dumps({"id": f"q{i}", "prompt_token_ids": ids}) + "\n")
PY
for pair in ${RUNS:-4096/first 4096/second}; do
  budget=${pair%/*} run=${pair#*/}
  timeout 280 python3 jobs/rollout.py model=qwen3_30b_a3b rollout=gpu kernel=auto logger=none \
    prompts=/tmp/grpo_prompts.jsonl sampling.n=8 sampling.max_tokens=256 engine.max_num_seqs=128 \
    engine.max_model_len=1536 engine.max_prefill_tokens="$budget" hydra.run.dir="/tmp/grpo_$run" \
    2>&1 | grep -v "^rollout: " | tail -22 | tee "$out/grpo_$run.log"
done
[ "${BENCH:-1}" = 0 ] && exit 0
timeout 420 python3 jobs/bench_prefill.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_prefill.log" | tail -60
