"""jobs/bench_prefill.py at toy sizes on the CPU (Triton's interpreter): both sections run and the table, the JSON
line and the PNG come out (its numbers mean nothing here; this keeps the GPU benchmark working between device
sessions), and its FLOP count agrees with the model's own weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

from composer_rollout.model import Qwen3MoE, preset

ROOT = Path(__file__).resolve().parents[1]


def test_bench_prefill_runs_both_sections(tmp_path):
    cmd = [sys.executable, "-m", "jobs.bench_prefill", "--device", "cpu", "--preset", "tiny", "--shapes", "2x3",
           "--reps", "1", "--prompts", "3", "--n", "2", "--min-len", "2", "--max-len", "6", "--slots", "4",
           "--budgets", "16", "--out", str(tmp_path)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary["forwards"]) == {"2x3"} and set(summary["engine"]) == {"16/first", "16/second"}
    rows = json.loads((tmp_path / "bench_prefill.json").read_text())
    (fwd,), engine = rows["forward_rows"], rows["engine_rows"]
    assert 0 < fwd["host_ms"] <= fwd["warm_ms"] and 0 < fwd["roofline_ms"] and fwd["bytes_gb"] > 0
    for r in engine:
        assert 3 * 2 <= r["prefill_tokens"] <= 3 * 6  # 3 prompts of 2-6 tokens, each prefilled once
        assert r["prefill_rows"] >= r["prefill_tokens"] and r["forwards"] >= 1 and r["prefill_tok_s"] > 0
    assert engine[0]["prefill_tokens"] == engine[1]["prefill_tokens"]  # the same prompts both runs
    assert (tmp_path / "bench_prefill.png").stat().st_size > 0


def test_bench_prefill_refuses_bad_shapes(tmp_path):
    cmd = [sys.executable, "-m", "jobs.bench_prefill", "--device", "cpu", "--shapes", "4by8", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "--shapes" in proc.stderr


def test_forward_flops_counts_every_weight_a_token_touches():
    from jobs.bench_prefill import forward_flops

    a = preset("tiny")
    model = Qwen3MoE(a, device="meta")
    layer = model.layers[0]
    w13, w2 = model.experts(0)
    per_layer = (layer.self_attn.qkv_weight.numel() + layer.self_attn.o_proj.weight.numel()
                 + layer.mlp.gate.weight.numel() + a.num_experts_per_tok * (w13.numel() + w2.numel()) // a.num_experts)
    B, S = 3, 5
    attention = 4 * a.head_dim * a.num_attention_heads * B * sum(p + 1 for p in range(S))
    expected = a.num_hidden_layers * (2 * B * S * per_layer + attention) + 2 * B * a.hidden_size * a.vocab_size
    assert forward_flops(a, B, S) == expected
