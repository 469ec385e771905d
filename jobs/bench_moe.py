"""Benchmark the warp-decode MoE kernels on the GPU (H200): µs per layer, bytes, TB/s, % of read ceiling, accuracy.

Each path runs as CUDA-graph replays over --layers layers with distinct weights (8 layers of Qwen3-30B-A3B
MXFP8 experts are 5 GB, far over the 60 MB L2), uniform random routing, random inputs (never zeros). The read
ceiling is a streaming read of a 4 GB buffer measured in the same run. Unique bytes per layer = experts touched
x bytes per expert (MXFP8 incl. scales, or BF16) + hidden in and out. Accuracy: relative Frobenius error on
layer 0 against moe_reference in FP32 on the same dequantized weights ("same") and on the original BF16
weights before quantization ("orig"). vLLM fused_moe numbers are quoted from docs (not measured here).

Usage: PYTHONPATH=. python3 jobs/bench_moe.py --out DIR
(prints a table, ends with one JSON line, writes DIR/bench_moe.png and DIR/bench_moe.json)
"""

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from kernels import moe_reference, mxfp8_quantize
from kernels.warp_decode_moe import Tiles, warp_decode_moe

SHAPES = {"qwen3-30b-a3b": dict(H=2048, I=768, E=128, k=8), "qwen3-235b-a22b": dict(H=4096, I=1536, E=128, k=8)}
# Quoted from /work/shared/docs/background.md (vLLM Triton fused_moe, faster of BF16/FP8, H200, 30B shape).
VLLM_QUOTED_US = {1: 29.1, 2: 38.2, 4: 50.9, 8: 92.3, 16: 120.5, 32: 160.4, 64: 188.5, 128: 200.2}
TARGET_US = {1: 17.4, 2: 23.6, 4: 45.3, 8: 80.7, 16: 112.0, 32: 152.0, 64: 171.0}


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < N, other=0), axis=0))


def time_graph(fn, reps):
    """Median µs of one replay of a CUDA graph capturing fn()."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def time_eager(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def read_ceiling_tbs():
    n = 4 * 2**30 // 4
    x = torch.randint(0, 7, (n,), dtype=torch.int32, device="cuda")
    block = 8192
    out = torch.empty(triton.cdiv(n, block), dtype=torch.int32, device="cuda")
    us = time_graph(lambda: _read_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=8), 20)
    return n * 4 / us / 1e6


def make_layers(H, I, E, layers, keep_bf16):
    """MXFP8 weights for every layer; BF16 originals for the first `keep_bf16` layers."""
    mx, bf = [], []
    for layer in range(layers):
        gen = torch.Generator(device="cuda").manual_seed(100 + layer)
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H**-0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * I**-0.5
        mx.append(tuple(quantize_chunked(w) for w in (w13, w2)))
        if layer < keep_bf16:
            bf.append((w13, w2))
        del w13, w2
    return mx, bf


def quantize_chunked(w, chunk=16):
    parts = [mxfp8_quantize(w[i:i + chunk]) for i in range(0, w.shape[0], chunk)]
    return type(parts[0])(torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]))


def make_inputs(T, H, E, k, layers, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = []
    for _ in range(layers):
        hidden = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        probs = torch.softmax(torch.randn(T, E, device="cuda", generator=gen), dim=-1)
        weights, ids = probs.topk(k, dim=-1)
        inputs.append((hidden, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)))
    return inputs


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_shape(name, shape, tokens, layers, reps, paths, sweep):
    H, I, E, k = shape["H"], shape["I"], shape["E"], shape["k"]
    keep_bf16 = layers if name == "qwen3-30b-a3b" else 1
    mx, bf = make_layers(H, I, E, layers, keep_bf16)
    per_expert = {"mxfp8": mx[0][0].nbytes // E + mx[0][1].nbytes // E, "bf16": 3 * H * I * 2}
    rows = []
    for T in tokens:
        inputs = make_inputs(T, H, E, k, layers, seed=T)
        touched = statistics.mean(len(torch.unique(ids)) for _, _, ids in inputs)
        h0, w0, i0 = inputs[0]
        # FP32 hidden in, so the references' outputs are not rounded to BF16.
        ref_same = moe_reference(h0.float(), w0, i0, *mx[0], compute_dtype=torch.float32)
        ref_orig = moe_reference(h0.float(), w0, i0, *bf[0], compute_dtype=torch.float32)
        ref_bf16w = ref_orig
        runs = [(p, "mxfp8", dict(schedule=p)) for p in paths]
        if len(bf) == layers:
            runs.append(("auto", "bf16", dict(schedule="auto")))
        if T in sweep:
            runs += [(f"{p}:{tag}", "mxfp8", dict(schedule=p, tiles=t)) for tag, (p, t) in sweep[T].items()]
        for path, wtype, kw in runs:
            ws = mx if wtype == "mxfp8" else bf
            try:
                def layers_call(ws=ws, kw=kw, inputs=inputs):
                    return [warp_decode_moe(h, w, i, *ws[l], **kw) for l, (h, w, i) in enumerate(inputs)]

                us = time_graph(layers_call, reps) / layers
                out = warp_decode_moe(h0, w0, i0, *ws[0], **kw)
                err_same = rel_err(out, ref_same if wtype == "mxfp8" else ref_bf16w)
                err_orig = rel_err(out, ref_orig)
            except Exception as exc:  # a failing variant is reported, the rest still run
                print(f"FAILED {name} T={T} {path} {wtype}: {exc!r}", flush=True)
                continue
            rows.append(row(name, T, f"warp:{path}", wtype, us, touched, per_expert[wtype], H, err_same, err_orig))
        wtype, ws = ("bf16", bf) if len(bf) == layers else ("mxfp8", mx)
        us = time_eager(lambda ws=ws, inputs=inputs: [moe_reference(h, w, i, *ws[l], compute_dtype=torch.bfloat16)
                                                      for l, (h, w, i) in enumerate(inputs)], max(3, reps // 4))
        us /= layers
        out = moe_reference(h0, w0, i0, *ws[0], compute_dtype=torch.bfloat16)
        rows.append(row(name, T, "torch-ref-bf16(eager)", wtype, us, touched, per_expert[wtype], H,
                        rel_err(out, ref_same if wtype == "mxfp8" else ref_bf16w), rel_err(out, ref_orig)))
        print_rows(rows[-(len(runs) + 1):])
    del mx, bf
    torch.cuda.empty_cache()
    return rows


def row(shape, T, path, wtype, us, touched, per_expert, H, err_same, err_orig):
    nbytes = touched * per_expert + 2 * T * H * 2
    return dict(shape=shape, T=T, path=path, weights=wtype, us=round(us, 2), experts=round(touched, 1),
                mb=round(nbytes / 1e6, 1), tbs=round(nbytes / us / 1e6, 3), err_same=float(f"{err_same:.3g}"),
                err_orig=float(f"{err_orig:.3g}"))


def print_rows(rows):
    for r in rows:
        pct = format(r["pct"], "5.1f") if "pct" in r else "    -"  # the fraction is filled in once all rows ran
        print(f"{r['shape']:16s} T={r['T']:4d} {r['path']:34s} {r['weights']:6s} {r['us']:9.1f} us "
              f"{r['mb']:8.1f} MB {r['tbs']:6.3f} TB/s {pct}% err_same {r['err_same']:.2e} "
              f"err_orig {r['err_orig']:.2e}", flush=True)


def plot(rows, out_dir, ceiling):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for col, shape in enumerate(SHAPES):
        series = {}
        for r in rows:
            if r["shape"] == shape:
                series.setdefault(f"{r['path']} {r['weights']}", []).append((r["T"], r["us"], r["pct"]))
        for label, pts in series.items():
            if ":" in label.split()[0][5:]:
                continue
            pts.sort()
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        if shape == "qwen3-30b-a3b":
            ts = sorted(VLLM_QUOTED_US)
            axes[0][col].plot(ts, [VLLM_QUOTED_US[t] for t in ts], "k--", label="vLLM fused_moe (quoted)")
            axes[0][col].plot(sorted(TARGET_US), [TARGET_US[t] for t in sorted(TARGET_US)], "r:", label="target")
        axes[0][col].set(title=f"{shape}: µs per layer", xscale="log", yscale="log", xlabel="T")
        axes[1][col].set(title=f"% of read ceiling ({ceiling:.2f} TB/s)", xscale="log", xlabel="T", ylim=(0, 100))
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_moe.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--paths", default="auto,pair,expert_gate_up,expert")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s (streaming read, 4 GiB, CUDA graph, median)", flush=True)
    sweep = {} if args.no_sweep else {
        t: {"bn16bk256": ("pair", Tiles(pair_bn=16, pair_bk=256)),
            "bn4bk1024": ("pair", Tiles(pair_bn=4, pair_bk=1024)),
            "down_bk128": ("pair", Tiles(pair_down_bk=128))} for t in (1, 4)}
    sweep.update({t: {"stages2": ("expert", Tiles(expert_stages=2)), "bk64": ("expert", Tiles(expert_bk=64)),
                      "bn64bh32": ("expert", Tiles(expert_bn=64, expert_bh=32))} for t in (16, 64)})
    rows = []
    for name in args.shapes.split(","):
        tokens = [int(t) for t in args.tokens.split(",")]
        small = name == "qwen3-30b-a3b"
        paths = [p for p in args.paths.split(",") if small or p != "expert_gate_up"]
        rows += bench_shape(name, SHAPES[name], tokens, args.layers, args.reps, paths, sweep if small else {})
    for r in rows:
        r["pct"] = round(100 * r["tbs"] / ceiling, 1)
    print("\nshape            T    path                               weights    µs/layer   unique MB   TB/s  %ceil")
    print_rows(rows)
    print("\nvLLM fused_moe (quoted from background.md, not measured here), 30B shape, µs/layer:", VLLM_QUOTED_US)
    plot(rows, args.out, ceiling)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, rows=rows, vllm_quoted_us=VLLM_QUOTED_US), f)
    auto = {r["T"]: r["us"] for r in rows if r["shape"] == "qwen3-30b-a3b" and r["path"] == "warp:auto"
            and r["weights"] == "mxfp8"}
    print(json.dumps(dict(bench="moe", ceiling_tbs=round(ceiling, 3), qwen3_30b_auto_us=auto,
                          targets_met={t: auto[t] <= TARGET_US[t] for t in TARGET_US if t in auto})))


if __name__ == "__main__":
    main()
