"""Benchmark the hi + lo FP8 split of hidden rows on the GPU (kernels/fp8_split.py): µs, GB/s, % of the read ceiling.

What the expert-centric path's FP8 GEMMs run before gate_up (dequant "fp8", T <= 1024 under "auto"): one program per
token row of H = 2048 (Qwen3-30B-A3B) or 4096 (Qwen3-235B-A22B) BF16 values, written as hi and lo E4M3 bytes and one
scale byte. Bytes per row: 2 * H read + 2 * H + 1 written. Each row is timed as CUDA-graph replays over 8 distinct
inputs (a decode step's split is a few KB: the time is the launch and one wave, so the read ceiling is far off at
small T). The ceiling is jobs/bench_moe.py's streaming read, measured in the same run. The first input of every size
is checked bit for bit against fp8_split_reference.

Usage: PYTHONPATH=. python3 jobs/bench_fp8_split.py --out DIR
(prints a table, ends with one JSON line, writes DIR/bench_fp8_split.png and DIR/bench_fp8_split.json)
"""

import argparse
import json
import os

import torch

from jobs.bench_moe import read_ceiling_tbs, time_graph
from kernels.fp8_split import fp8_split_reference, fp8_split_rows

COPIES = 8


def bench(T, H, reps, ceiling):
    gen = torch.Generator(device="cuda").manual_seed(T + H)
    xs = [torch.randn(T, H, device="cuda", generator=gen).bfloat16() for _ in range(COPIES)]
    outs = [fp8_split_rows(x) for x in xs]
    want = fp8_split_reference(xs[0].cpu())
    exact = (torch.equal(outs[0].data.view(torch.uint8).cpu(), want.data.view(torch.uint8))
             and torch.equal(outs[0].scales.cpu(), want.scales))
    us = time_graph(lambda: [fp8_split_rows(x, o) for x, o in zip(xs, outs, strict=True)], reps) / COPIES
    nbytes = T * (4 * H + 1)
    tbs = nbytes / us / 1e6
    return dict(T=T, H=H, us=round(us, 2), mb=round(nbytes / 1e6, 3), tbs=round(tbs, 3),
                pct=round(100 * tbs / ceiling, 1), exact=exact)


def plot(rows, ceiling, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for H in sorted({r["H"] for r in rows}):
        pts = sorted((r["T"], r["pct"]) for r in rows if r["H"] == H)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"H = {H}")
    ax.set(xscale="log", xlabel="T (rows)", ylabel=f"% of the read ceiling ({ceiling:.2f} TB/s)", ylim=(0, 100),
           title="fp8_split_rows: hidden rows to hi + lo E4M3")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_fp8_split.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--tokens", default="1,8,64,512,4096,16384")
    parser.add_argument("--hidden", default="2048,4096")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_split needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s")
    rows = []
    for H in (int(h) for h in args.hidden.split(",")):
        for T in (int(t) for t in args.tokens.split(",")):
            r = bench(T, H, args.reps, ceiling)
            rows.append(r)
            print(f"H={H:5d} T={T:6d} {r['us']:9.2f} us {r['mb']:9.3f} MB {r['tbs']:6.3f} TB/s {r['pct']:5.1f}% "
                  f"bit-exact {r['exact']}", flush=True)
    plot(rows, ceiling, args.out)
    with open(os.path.join(args.out, "bench_fp8_split.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, rows=rows), f, indent=1)
    print(json.dumps(dict(bench="fp8_split", ceiling_tbs=round(ceiling, 3), exact=all(r["exact"] for r in rows),
                          us={f"H{r['H']}_T{r['T']}": r["us"] for r in rows},
                          pct={f"H{r['H']}_T{r['T']}": r["pct"] for r in rows})))


if __name__ == "__main__":
    main()
