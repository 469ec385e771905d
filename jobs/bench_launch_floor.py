"""What a chain of launches costs when every launch is a perfect weight stream: the floor under a batch-1 decode step.

Why: at B = 1 a Qwen3-30B-A3B layer's seven launches (qkv, attention split and combine, o_proj, router, gate_up,
down) each move 0.3-26 MB, and the step sits ~28 µs per layer above its bytes over the read ceiling on the H200
(docs/perf.md, "What the open targets would take"). This bench says how much of that any kernels would pay with
the same launch structure: it replaces each launch by the streaming read of the same bytes (the read ceiling's
kernel, bench_moe._read_kernel, in programs of 256-8192 int32 so that even the small reads spread over the SMs)
and times chains of them as CUDA-graph replays, every launch on its own buffer so that L2 (50-60 MB) serves none.
Rows:
- one size: LAUNCHES reads of S MB back to back, µs per launch, and the µs above S over the ceiling ("fixed");
- layer: the seven B = 1 launches in order over --layers layers, µs per layer against the bytes over the ceiling,
  and the same bytes as one read per layer (what a one-launch layer could reach).
The layer's sizes come from the model preset (`--preset`, default the 30B shape) at `--context` keys, MXFP8
experts: the qkv and o_proj weights in BF16, the row's K and V in BF16, the split workspace the combine reads (the
splits that hold partials, decode_attention.active_splits), the router gate in BF16, k experts' gate_up and down
with their E8M0 scales.

Usage: PYTHONPATH=. python3 jobs/bench_launch_floor.py --out DIR [--layers 16] [--preset qwen3_30b_a3b] [--context 1024]
(prints a table, writes DIR/bench_launch_floor.json and .png, ends with one JSON line)
"""

import argparse
import json
import os

import torch
import triton

from composer_rollout.model import preset
from jobs.bench_moe import _read_kernel, read_ceiling_tbs, time_graph
from kernels.decode_attention import active_splits, default_num_splits, workspace_shape

MB = 1e6


def layer_launches(args, context: int) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of each launch of a B = 1 decode layer, in order."""
    H, D, hq, hkv = args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads
    I, k = args.moe_intermediate_size, args.num_experts_per_tok
    mx = 33 / 32  # an E4M3 byte per weight plus an E8M0 scale per 32
    # The combine reads the splits that hold partials, of a grid sized for a slot far longer than the row
    ws = workspace_shape(1, hq, D, active_splits(context, default_num_splits(1, hkv, 1 << 20)))
    return (
        ("qkv", H * (hq + 2 * hkv) * D * 2),
        ("attention split", context * hkv * D * 2 * 2),
        ("attention combine", ws[1] * ws[2] * ws[3] * 4),
        ("o_proj", hq * D * H * 2),
        ("router", args.num_experts * H * 2),
        ("gate_up", int(k * 2 * I * H * mx)),
        ("down", int(k * H * I * mx)),
    )


SIZES_MB = (0.25, 0.5, 1, 2, 4, 8, 13, 17, 21, 26, 39, 64)
LAUNCHES = 16


class Read:
    """One streaming read of `nbytes` (rounded to whole int32) from a buffer of its own, as a launch."""

    def __init__(self, nbytes: int, gen: torch.Generator):
        self.n = max(nbytes // 4, 1)
        self.x = torch.randint(1, 7, (self.n,), dtype=torch.int32, device="cuda", generator=gen)
        # At least ~4 programs per SM where the size allows, 32 KB programs (the ceiling's) where it is large.
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.block = 8192
        while self.block > 256 and self.n // self.block < 4 * sms:
            self.block //= 2
        self.out = torch.empty(triton.cdiv(self.n, self.block), dtype=torch.int32, device="cuda")

    def __call__(self):
        _read_kernel[(self.out.numel(),)](self.x, self.out, self.n, BLOCK=self.block, num_warps=8)

    def check(self) -> bool:
        """The read really summed the buffer (so the timed launches moved its bytes)."""
        self()
        return int(self.out.sum()) == int(self.x.sum())


def chain_us(reads, reps):
    return time_graph(lambda: [r() for r in reads], reps)


def bench_sizes(ceiling, reps, gen):
    rows = []
    for s in SIZES_MB:
        reads = [Read(int(s * MB), gen) for _ in range(LAUNCHES)]
        assert all(r.check() for r in reads[:2]), f"read of {s} MB summed wrongly"
        us = chain_us(reads, reps) / LAUNCHES
        byte_us = s * MB / (ceiling * 1e6)
        rows.append(dict(mb=s, us=us, byte_us=byte_us, fixed_us=us - byte_us, pct=100 * byte_us / us))
        del reads
    return rows


def bench_layer(launches, ceiling, layers, reps, gen):
    chain = [[Read(b, gen) for _, b in launches] for _ in range(layers)]
    assert all(r.check() for r in chain[0]), "a layer read summed wrongly"
    per_launch = [chain_us([layer[i] for layer in chain], reps) / layers for i in range(len(launches))]
    layer_us = chain_us([r for layer in chain for r in layer], reps) / layers
    total = sum(b for _, b in launches)
    del chain
    one = [Read(total, gen) for _ in range(layers)]
    one_us = chain_us(one, reps) / layers
    byte_us = total / (ceiling * 1e6)
    return dict(mb=total / MB, byte_us=byte_us, layer_us=layer_us, one_launch_us=one_us,
                launches={name: us for (name, _), us in zip(launches, per_launch, strict=True)})


def plot(rows, ceiling, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["mb"] for r in rows], [r["fixed_us"] for r in rows], marker="o", label="µs above bytes / ceiling")
    ax.plot([r["mb"] for r in rows], [r["us"] for r in rows], marker="s", label="µs per launch")
    ax.set(xscale="log", xlabel="MB read per launch", ylabel="µs", title=f"streaming-read launches in a CUDA graph "
           f"(ceiling {ceiling:.2f} TB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_launch_floor.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--preset", default="qwen3_30b_a3b")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    launches = layer_launches(preset(args.preset), args.context)
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch_floor needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceiling = read_ceiling_tbs()
    print(f"{torch.cuda.get_device_name()}: read ceiling {ceiling:.3f} TB/s")
    rows = bench_sizes(ceiling, args.reps, gen)
    print(f"{'MB':>6} {'µs/launch':>10} {'bytes µs':>9} {'fixed µs':>9} {'% ceiling':>9}")
    for r in rows:
        print(f"{r['mb']:6.2f} {r['us']:10.2f} {r['byte_us']:9.2f} {r['fixed_us']:9.2f} {r['pct']:9.1f}")
    layer = bench_layer(launches, ceiling, args.layers, args.reps, gen)
    print(f"B = 1 layer, {layer['mb']:.1f} MB: {len(launches)} launches {layer['layer_us']:.2f} µs, one launch "
          f"{layer['one_launch_us']:.2f} µs, bytes over the ceiling {layer['byte_us']:.2f} µs")
    for name, us in layer["launches"].items():
        print(f"  {name:18s} {us:7.2f} µs")
    plot(rows, ceiling, args.out)
    with open(os.path.join(args.out, "bench_launch_floor.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), ceiling_tbs=ceiling, sizes=rows, layer=layer), f,
                  indent=1)
    print(json.dumps(dict(bench="launch_floor", device=torch.cuda.get_device_name(), ceiling_tbs=round(ceiling, 3),
                          fixed_us={str(r["mb"]): round(r["fixed_us"], 2) for r in rows},
                          layer_us=round(layer["layer_us"], 2), one_launch_us=round(layer["one_launch_us"], 2),
                          layer_byte_us=round(layer["byte_us"], 2))))


if __name__ == "__main__":
    main()
