"""Checkpoint load time against the number of tensors: loading must be linear in it.

Writes Hub-layout checkpoints with Qwen3-30B-A3B's tensor count (48 layers x 128 experts x 3
= 18,432 expert tensors) and half and double that, at tiny tensor sizes so that the name handling,
not the bytes, is what is timed; then loads each and reports seconds and microseconds per tensor.
Linear loading keeps the per-tensor cost flat as the count grows.

    python jobs/bench_load.py --out /tmp/bench_load
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from composer_rollout.model import Qwen3MoE, load_checkpoint, preset, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/bench_load")
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48, 96])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers in args.layers:
        shape = preset("tiny", hidden_size=32, moe_intermediate_size=32, num_experts=128, num_experts_per_tok=8,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       vocab_size=64)
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Qwen3MoE(shape, dtype=torch.float32).init_random(0), tmp)
            start = time.perf_counter()
            load_checkpoint(tmp, dtype=torch.float32)
            seconds = time.perf_counter() - start
        tensors = layers * (128 * 3 + 9) + 2
        rows.append({"layers": layers, "tensors": tensors, "load_s": seconds, "us_per_tensor": seconds / tensors * 1e6})
    print(f"{'layers':>6} {'tensors':>8} {'load s':>8} {'us/tensor':>10}")
    for r in rows:
        print(f"{r['layers']:>6} {r['tensors']:>8} {r['load_s']:>8.2f} {r['us_per_tensor']:>10.1f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["tensors"] for r in rows], [r["load_s"] for r in rows], "o-")
    ax.set_xlabel("tensors in checkpoint")
    ax.set_ylabel("load seconds")
    ax.set_title("checkpoint load time (tiny tensors)")
    fig.tight_layout()
    fig.savefig(out / "bench_load.png", dpi=120)
    growth = rows[-1]["us_per_tensor"] / rows[0]["us_per_tensor"]
    print(json.dumps({"bench": "load", "rows": rows, "per_tensor_growth": growth}))


if __name__ == "__main__":
    main()
