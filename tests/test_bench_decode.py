"""jobs/bench_decode.py end to end at toy sizes on the CPU (Triton's interpreter, no CUDA graphs): every section
runs and the table, the JSON line and the PNG come out. Its numbers are meaningless here; this keeps the GPU
benchmark from rotting between device sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_runs_every_section(tmp_path):
    cmd = [sys.executable, "-m", "jobs.bench_decode", "--device", "cpu", "--preset", "tiny", "--batches", "1,2",
           "--contexts", "9", "--kernels", "warp_decode,expert_centric", "--reps", "1", "--longtail-slots", "2",
           "--longtail-requests", "3", "--longtail-max", "4", "--longtail-prompt-len", "3", "--engine-tokens", "4",
           "--accuracy-prompts", "1", "--accuracy-tokens", "3", "--accuracy-prompt-len", "4", "--out", str(tmp_path)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary["roofline_frac"]) == {f"{k}/B{b}/c9" for k in ("warp_decode", "expert_centric")
                                              for b in (1, 2)}
    assert set(summary["warp_vs_expert_centric"]) == {"B1/c9"}
    assert set(summary["engine"]) == {"B1/c9", "B2/c9"} and all(v > 0 for v in summary["engine"].values())
    assert summary["longtail"]["requests"] == 3 and 0 < summary["longtail"]["occupancy"] <= 1
    assert 0 < summary["longtail"]["occupancy_bound_fifo"] <= 1
    assert summary["accuracy"]["mean_abs_dlogprob"] < 0.05  # BF16 + MXFP8 engine against its FP32 twin
    assert (tmp_path / "bench_decode.png").stat().st_size > 0
    rows = json.loads((tmp_path / "bench_decode.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["step_ms"] > 0 and 0 < r["roofline_ms"] < r["step_ms"] for r in rows)


def test_fifo_occupancy_bound():
    from jobs.bench_decode import fifo_occupancy

    assert fifo_occupancy([5] * 6, 3) == 1.0  # equal lengths, whole rounds
    # Slots 0/1 take 8 and 2; the 2-slot frees at 2 and takes 4 (ends 6), then 3 at 6 (ends 9): 17 tokens / (2 x 9).
    assert fifo_occupancy([8, 2, 4, 3], 2) == 17 / 18
    assert fifo_occupancy([], 4) == 0.0


def test_accuracy_attribution_runs_and_every_point_moves_the_logprobs(tmp_path):
    """jobs/accuracy_attribution.py at toy sizes: every emulated rounding reaches the logprobs (a hook that never
    fired would score exactly 0), and the table, JSON line and PNG come out."""
    from jobs.accuracy_attribution import FAST_POINTS, POINTS

    cmd = [sys.executable, "-m", "jobs.accuracy_attribution", "--device", "cpu", "--preset", "tiny", "--prompts", "2",
           "--tokens", "4", "--prompt-len", "5", "--leave-one-out", "--out", str(tmp_path)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    means = json.loads(proc.stdout.strip().splitlines()[-1])["mean_abs_dlogprob"]
    assert set(means) == {"fast", "all", *POINTS, *(f"all_but:{p}" for p in FAST_POINTS)}
    assert all(v > 0 for v in means.values()), means
    assert (tmp_path / "accuracy_attribution.png").stat().st_size > 0


def test_accuracy_attribution_refuses_an_unknown_point():
    import pytest
    import torch

    from composer_rollout.model import Qwen3MoE, preset
    from jobs.accuracy_attribution import rounded

    ref = Qwen3MoE(preset("tiny"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"rounding points \['o_proj'\] are unknown"):
        with rounded(ref, {"o_proj", "lm_in"}):
            pass
    assert not ref.norm._forward_hooks  # nothing left hooked
