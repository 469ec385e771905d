#!/usr/bin/env bash
# The rollout job on the GPU in one device call: qwen3_30b_a3b (random init, MXFP8 experts), one GPU worker,
# 256 prompts, kernel=$KERNEL (auto), engine.cuda_graphs=$GRAPHS (true). Needs ray, hydra and omegaconf carried
# as wheels in .whl (../shared/device/make-wheels.sh); wandb is not carried, so logger=none. Results land in $OUT
# (or ./out).
set -uo pipefail
WHEELS=${WHEELS:-.whl} source "$(dirname "$0")/device_env.sh"
python3 jobs/rollout.py model=qwen3_30b_a3b rollout=gpu kernel="${KERNEL:-auto}" engine.cuda_graphs="${GRAPHS:-true}" \
  logger=none \
  prompts=builtin:random:256 engine.max_num_seqs=64 engine.max_model_len=512 sampling.max_tokens=64 \
  hydra.run.dir="$out/rollout" 2>&1 | tee "$out/rollout_30b.log"
wc -l "$out/rollout/rollouts.jsonl" | tee -a "$out/rollout_30b.log"
