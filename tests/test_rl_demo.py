"""jobs/rl_demo.py end to end on the tests' Ray head: a few GRPO steps on the tiny model (CPU workers, MXFP8 experts)
with weights pushed through WeightSync after every step; the mean reward at the end beats the start (fixed seed, so
the run is the same every time), every step logs the rollout/trainer mismatch under RL users' metric names to
stdout and to wandb offline, and every rollout was generated with the version just pushed."""

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

from wandb_reader import history_and_config

ROOT = Path(__file__).resolve().parents[1]
METRICS = ["critic/rewards/mean", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
           "training/rollout_probs_diff_std", "training/rollout_logprobs_abs_diff_mean",
           "training/rollout_logprobs_abs_diff_max", "training/token_mult_prob_error", "timing_s/update_weights",
           "timing_s/gen", "rollout/weight_version"]


def test_rl_demo_learns_and_logs_the_mismatch(tmp_path, ray_head):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "jobs/rl_demo.py", f"hydra.run.dir={tmp_path}", f"ray.address={ray_head}", "steps=6",
            "logger=wandb", "sync=collective"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [float(x) for x in re.findall(r"step +\d+ +reward ([\d.]+)", proc.stdout)]
    assert len(rewards) == 6, proc.stdout
    assert sum(rewards[-2:]) > sum(rewards[:2]) + 0.1, rewards  # it learns (0.006 -> 0.16 in 6 steps, this seed)
    assert "|Δlogprob| mean" in proc.stdout and "probs_diff mean" in proc.stdout
    (wandb_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, _ = history_and_config(Path(wandb_file))
    assert config["sync"]["transport"] == "collective"
    rows = [h for h in history if "critic/rewards/mean" in h]
    assert len(rows) == 6 and all(all(k in h for k in METRICS) for h in rows)
    assert [h["rollout/weight_version"] for h in rows] == [1, 2, 3, 4, 5, 6]  # each step rolled out the newest
    assert all(h["rollout/stale_samples"] == 0 for h in rows)
    assert all(0 <= h["training/rollout_probs_diff_mean"] <= h["training/rollout_probs_diff_max"] < 0.1 for h in rows)
    assert [round(h["critic/rewards/mean"], 3) for h in rows] == [round(r, 3) for r in rewards]
