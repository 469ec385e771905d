"""The decode step's unfiltered sampler on the GPU: kernels/gumbel_sample.py against its torch form, per batch.

Why: sampled eagerly after the decode graph, the torch form (~30 launches, [B, V] int64 hash tensors) cost a
B = 1 step ~0.3 ms and a B = 64 step ~1.4 ms on an H100 (docs/perf.md); the fused sampler now runs inside the
decode graph. Each timing is the median µs per call of CUDA-graph replays of one graph sampling C distinct logits
copies (C * B * V * 4 bytes > 200 MB: every call reads its logits from HBM), so the torch form is timed without its
host launch cost, as in a graph. Bound: B * V * 4 bytes over the streaming-read ceiling measured in the same run.
Every batch's tokens are checked equal to the torch form's (bit-identical noise on the GPU).

Usage: PYTHONPATH=. python3 jobs/bench_sampler.py --out DIR [--batches 1,8,32,64,128] [--vocab 151936]
(prints a table, writes DIR/bench_sampler.json and .png, ends with one JSON line)
"""

import argparse
import json
import math
import os

import torch

from jobs.bench_moe import read_ceiling_tbs, time_graph
from kernels.gumbel_sample import gumbel_sample, gumbel_sample_reference

L2_DEFEAT_BYTES = 200e6


def bench(batches, V, reps, ceiling, gen):
    rows = []
    for B in batches:
        copies = max(2, math.ceil(L2_DEFEAT_BYTES / (B * V * 4)))
        logits = [torch.randn(B, V, device="cuda", generator=gen) * 3 for _ in range(copies)]
        temperature = torch.rand(B, device="cuda", generator=gen) + 0.5
        temperature[::4] = 0.0  # greedy rows too
        seeds = torch.randint(0, 2**62, (B,), device="cuda", generator=gen)
        steps = torch.randint(0, 4096, (B,), device="cuda", generator=gen)
        same = all(torch.equal(gumbel_sample(x, temperature, seeds, steps)[0],
                               gumbel_sample_reference(x, temperature, seeds, steps)[0]) for x in logits[:2])
        bound = B * V * 4 / ceiling / 1e6
        row = dict(B=B, bound_us=round(bound, 2), tokens_match=same)
        for name, fn in (("fused", gumbel_sample), ("torch", gumbel_sample_reference)):
            params = (temperature, seeds, steps)
            us = time_graph(lambda fn=fn, xs=logits, ps=params: [fn(x, *ps) for x in xs], reps) / copies
            row[f"{name}_us"] = round(us, 2)
        row["fraction"] = round(bound / row["fused_us"], 3)
        row["speedup"] = round(row["torch_us"] / row["fused_us"], 1)
        rows.append(row)
        print(f"B={B:<4d} fused {row['fused_us']:8.2f} µs  torch {row['torch_us']:9.2f} µs  ({row['speedup']:5.1f}x)  "
              f"bound {bound:7.2f} µs ({100 * row['fraction']:5.1f}%)  tokens {'match' if same else 'DIFFER'}",
              flush=True)
        del logits
    return rows


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    bs = [r["B"] for r in rows]
    for key, style in (("fused_us", "o-"), ("torch_us", "s--"), ("bound_us", ":")):
        ax.plot(bs, [r[key] for r in rows], style, label=key.removesuffix("_us"))
    ax.set(title="unfiltered sampler, µs per call (V = vocabulary)", xlabel="B", ylabel="µs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_sampler.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s (streaming read, median)", flush=True)
    rows = bench([int(b) for b in args.batches.split(",")], args.vocab, args.reps, ceiling,
                 torch.Generator(device="cuda").manual_seed(0))
    plot(rows, args.out)
    summary = dict(bench="sampler", ceiling_tbs=round(ceiling, 3), vocab=args.vocab, rows=rows)
    with open(os.path.join(args.out, "bench_sampler.json"), "w") as f:
        json.dump(summary, f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
