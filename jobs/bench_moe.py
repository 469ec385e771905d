"""Benchmark the MoE kernel paths on the GPU (H200): µs per layer, bytes, TB/s, TFLOP/s, % of roofline, accuracy.

Paths (--paths, run side by side at each T): warp decode's schedules `auto`, `pair`, `expert_gate_up`, `expert`
(kernels/warp_decode_moe.py, rows "warp:<schedule>"); `expert_centric` (kernels/expert_centric_moe.py, with its
tuned tiles and dequant "auto": FP8 dots for MXFP8 weights up to T = 1024); `expert_centric_bf16` (BF16 dots at
every T); `kernel_auto` (the model's kernel=auto: warp decode up to the measured crossover T, expert-centric
above); `expert_centric_f16` (its dequant "f16_rel": FP16 dots, kernels/mx_tiles.py); `expert_centric_fp8` (its
dequant "fp8": FP8 dots on the MXFP8 weights as stored, activations split hi + lo); `expert_centric_act_mxfp8`
(activations quantized to MXFP8, an accuracy comparison: it syncs with the host, so it is timed eagerly). Each path
runs as CUDA-graph replays over --layers layers with distinct weights (8 layers of Qwen3-30B-A3B MXFP8 experts are 5
GB, far over the 60 MB L2), uniform random routing, random inputs (never zeros). Ceilings measured in the same run:
a streaming read of a 4 GB buffer (TB/s) and a BF16 8192^3 torch.matmul (TFLOP/s). Unique bytes per layer = experts
touched x bytes per expert (MXFP8 incl. scales, or BF16) + hidden in and out; useful FLOPs = 2 x 3 x H x I per
(token, expert) pair; roofline fraction = max(FLOPs / matmul rate, bytes / read ceiling) / time. --prefill adds T =
256 .. 8192 (warp decode's schedules stop at --warp-max-tokens: they are decode kernels). Accuracy: relative
Frobenius error on layer 0 against moe_reference in FP32 on the same dequantized weights ("same") and on the
original BF16 weights before quantization ("orig"). vLLM fused_moe numbers are quoted from docs (not measured here).

Usage: PYTHONPATH=. python3 jobs/bench_moe.py --out DIR [--prefill] [--paths auto,expert_centric,kernel_auto]
(prints a table, ends with one JSON line, writes DIR/bench_moe.png and DIR/bench_moe.json)
"""

import argparse
import json
import os
import statistics
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels import auto_moe, expert_centric_moe, moe_reference, mxfp8_quantize
from kernels.warp_decode_moe import SCHEDULES, Tiles, tiles_for, warp_decode_moe

SHAPES = {"qwen3-30b-a3b": dict(H=2048, I=768, E=128, k=8), "qwen3-235b-a22b": dict(H=4096, I=1536, E=128, k=8)}
# Quoted from /work/shared/docs/background.md (vLLM Triton fused_moe, faster of BF16/FP8, H200, 30B shape).
VLLM_QUOTED_US = {1: 29.1, 2: 38.2, 4: 50.9, 8: 92.3, 16: 120.5, 32: 160.4, 64: 188.5, 128: 200.2}
TARGET_US = {1: 17.4, 2: 23.6, 4: 45.3, 8: 80.7, 16: 112.0, 32: 152.0, 64: 171.0}
PREFILL_TOKENS = (256, 512, 1024, 2048, 4096, 8192)


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


def bf16_matmul_tflops(n=8192):
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return 2 * n**3 / time_graph(lambda: torch.matmul(a, b, out=c), 10) / 1e6


def make_layers(H, I, E, layers, keep_bf16, device="cuda"):
    """MXFP8 weights for every layer; BF16 originals for the first `keep_bf16` layers."""
    mx, bf = [], []
    for layer in range(layers):
        gen = torch.Generator(device=device).manual_seed(100 + layer)
        w13 = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16, generator=gen) * H**-0.5
        w2 = torch.randn(E, H, I, device=device, dtype=torch.bfloat16, generator=gen) * I**-0.5
        mx.append(tuple(quantize_chunked(w) for w in (w13, w2)))
        if layer < keep_bf16:
            bf.append((w13, w2))
        del w13, w2
    return mx, bf


def quantize_chunked(w, chunk=16):
    parts = [mxfp8_quantize(w[i:i + chunk]) for i in range(0, w.shape[0], chunk)]
    return type(parts[0])(torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]))


def make_inputs(T, H, E, k, layers, seed, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = []
    for _ in range(layers):
        hidden = torch.randn(T, H, device=device, generator=gen).bfloat16()
        probs = torch.softmax(torch.randn(T, E, device=device, generator=gen), dim=-1)
        weights, ids = probs.topk(k, dim=-1)
        inputs.append((hidden, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)))
    return inputs


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def path(name, tiles=None):
    """(row label, fn(hidden, topk_weights, topk_ids, w13, w2) -> [T, H], CUDA-graph capturable) for --paths."""
    if name in SCHEDULES:
        kw = dict(schedule=name) if tiles is None else dict(schedule=name, tiles=tiles)
        return f"warp:{name}", lambda *args: warp_decode_moe(*args, **kw), True
    if name == "expert_centric":
        return "expert_centric", expert_centric_moe, True
    if name == "expert_centric_f16":  # FP16 dots on relative operands (kernels/mx_tiles.py), its own tuned table
        return "expert_centric:f16_rel", lambda *args: expert_centric_moe(*args, dequant="f16_rel"), True
    if name == "expert_centric_bf16":  # BF16 dots on dequantized MXFP8 tiles at every T ("auto": FP8 dots to 1024)
        return "expert_centric:bf16", lambda *args: expert_centric_moe(*args, dequant="bf16"), True
    if name == "expert_centric_fp8":  # FP8 dots on MXFP8 weights as stored, split activations (kernels/fp8_split.py)
        return "expert_centric:fp8", lambda *args: expert_centric_moe(*args, dequant="fp8"), True
    if name == "expert_centric_act_mxfp8":
        return "expert_centric:act_mxfp8(eager)", lambda *args: expert_centric_moe(*args, act_dtype="mxfp8"), False
    if name == "kernel_auto":
        return "kernel:auto", auto_moe, True
    raise ValueError(f"unknown path {name!r}: choose from {', '.join(SCHEDULES)}, expert_centric, "
                     "expert_centric_bf16, expert_centric_f16, expert_centric_fp8, expert_centric_act_mxfp8, "
                     "kernel_auto")


def bench_shape(name, shape, tokens, layers, reps, paths, sweep, warp_max_tokens):
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
        names = [p for p in paths if p not in SCHEDULES or T <= warp_max_tokens]
        runs = [(*path(p), "mxfp8", False) for p in names]
        if len(bf) == layers:  # BF16 weights: the same bytes model at 2 bytes per weight
            runs += [(*path(p), "bf16", False) for p in ("auto", "expert_centric") if p in names]
        if T in sweep:
            runs += [(f"warp:{p}:{tag}", *path(p, t)[1:], "mxfp8", True) for tag, (p, t) in sweep[T].items()]
        for label, fn, capturable, wtype, variant in runs:
            ws = mx if wtype == "mxfp8" else bf
            try:
                def layers_call(ws=ws, fn=fn, inputs=inputs):
                    return [fn(h, w, i, *ws[l]) for l, (h, w, i) in enumerate(inputs)]

                timer = time_graph if capturable else time_eager
                us = timer(layers_call, reps if capturable else max(3, reps // 4)) / layers
                out = fn(h0, w0, i0, *ws[0])
                err_same = rel_err(out, ref_same if wtype == "mxfp8" else ref_orig)
                err_orig = rel_err(out, ref_orig)
            except Exception as exc:  # a failing variant is reported, the rest still run
                print(f"FAILED {name} T={T} {label} {wtype}: {exc!r}", flush=True)
                continue
            rows.append(row(name, T, label, wtype, us, touched, per_expert[wtype], shape, err_same, err_orig,
                            variant))
        wtype, ws = ("bf16", bf) if len(bf) == layers else ("mxfp8", mx)
        us = time_eager(lambda ws=ws, inputs=inputs: [moe_reference(h, w, i, *ws[l], compute_dtype=torch.bfloat16)
                                                      for l, (h, w, i) in enumerate(inputs)], max(3, reps // 4))
        us /= layers
        out = moe_reference(h0, w0, i0, *ws[0], compute_dtype=torch.bfloat16)
        rows.append(row(name, T, "torch-ref-bf16(eager)", wtype, us, touched, per_expert[wtype], shape,
                        rel_err(out, ref_same if wtype == "mxfp8" else ref_orig), rel_err(out, ref_orig), False))
        print_rows([r for r in rows if r["shape"] == name and r["T"] == T])
        del inputs
    del mx, bf
    torch.cuda.empty_cache()
    return rows


def row(shape, T, path, wtype, us, touched, per_expert, dims, err_same, err_orig, variant):
    nbytes = touched * per_expert + 2 * T * dims["H"] * 2
    flops = 2 * 3 * dims["H"] * dims["I"] * T * dims["k"]
    return dict(shape=shape, T=T, path=path, weights=wtype, us=round(us, 2), experts=round(touched, 1),
                mb=round(nbytes / 1e6, 1), tbs=round(nbytes / us / 1e6, 3), gflop=round(flops / 1e9, 2),
                tflops=round(flops / us / 1e6, 1), err_same=float(f"{err_same:.3g}"), err_orig=float(f"{err_orig:.3g}"),
                variant=variant)


def print_rows(rows):
    for r in rows:
        # The fractions are filled in once every row ran (they need the ceilings).
        pct = format(r["pct"], "5.1f") if "pct" in r else "    -"
        roof = format(r["roofline_pct"], "5.1f") if "roofline_pct" in r else "    -"
        print(f"{r['shape']:16s} T={r['T']:4d} {r['path']:34s} {r['weights']:6s} {r['us']:9.1f} us "
              f"{r['mb']:8.1f} MB {r['tbs']:6.3f} TB/s {pct}% {r['tflops']:6.1f} TFLOP/s {roof}% roof "
              f"err_same {r['err_same']:.2e} err_orig {r['err_orig']:.2e}", flush=True)


def plot(rows, out_dir, ceiling, tflops):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows}, key=list(SHAPES).index)
    fig, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 9), squeeze=False)
    for col, shape in enumerate(shapes):
        series = {}
        for r in rows:
            if r["shape"] == shape and not r["variant"]:
                series.setdefault(f"{r['path']} {r['weights']}", []).append((r["T"], r["us"], r["roofline_pct"]))
        for label, pts in series.items():
            pts.sort()
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        if shape == "qwen3-30b-a3b":
            ts = sorted(VLLM_QUOTED_US)
            axes[0][col].plot(ts, [VLLM_QUOTED_US[t] for t in ts], "k--", label="vLLM fused_moe (quoted)")
            axes[0][col].plot(sorted(TARGET_US), [TARGET_US[t] for t in sorted(TARGET_US)], "r:", label="target")
        axes[0][col].set(title=f"{shape}: µs per layer", xscale="log", yscale="log", xlabel="T")
        axes[1][col].set(title=f"% of roofline (read {ceiling:.2f} TB/s, BF16 matmul {tflops:.0f} TFLOP/s)",
                         xscale="log", xlabel="T", ylim=(0, 100))
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_moe.png"), dpi=110)


def summary(rows, ceiling, tflops):
    """The one JSON line: per-T µs of the main 30B MXFP8 paths and the issue targets they meet."""
    def us(label):
        return {r["T"]: r["us"] for r in rows if r["shape"] == "qwen3-30b-a3b" and r["path"] == label
                and r["weights"] == "mxfp8"}

    auto, ec, kauto = us("warp:auto"), us("expert_centric"), us("kernel:auto")
    roof = {r["T"]: r["roofline_pct"] for r in rows if r["shape"] == "qwen3-30b-a3b" and r["weights"] == "mxfp8"
            and r["path"] == "expert_centric" and r["T"] >= 1024}
    best = {t: min(x[t] for x in (auto, ec) if t in x) for t in kauto if t in auto or t in ec}
    return dict(bench="moe", ceiling_tbs=round(ceiling, 3), bf16_matmul_tflops=round(tflops, 1),
                qwen3_30b_auto_us=auto, targets_met={t: auto[t] <= TARGET_US[t] for t in TARGET_US if t in auto},
                expert_centric_us=ec, kernel_auto_us=kauto,
                expert_centric_vs_vllm={t: ec[t] <= VLLM_QUOTED_US[t] for t in VLLM_QUOTED_US if t in ec},
                expert_centric_prefill_roofline_pct=roof, prefill_target_met={t: p >= 50 for t, p in roof.items()},
                kernel_auto_within_5pct={t: kauto[t] <= 1.05 * best[t] for t in best})


def sweep_variants() -> dict:
    """{T: {tag: (schedule, Tiles)}}: the tile variants timed beside the shipped ones (--no-sweep skips them)."""
    sweep = {t: {"bn2w2ctas8": ("pair", Tiles(pair_bn=2, pair_warps=2, pair_ctas=8)),
                 "stages2ctas8pdl": ("pair", Tiles(pair_stages=2, pair_ctas=8, pdl=True)),
                 "down_ctas4": ("pair", Tiles(pair_down_ctas=4)),
                 "down_bh16w8": ("pair", Tiles(pair_down_bh=16, pair_down_warps=8, pair_down_stages=2,
                                               pair_down_ctas=2)),
                 # every chunk of an item in flight from the start; then the same on one 16-row program per SM
                 "down_stages4": ("pair", replace(tiles_for(t), pair_down_stages=4)),
                 "down_bh16w8s4c1": ("pair", replace(tiles_for(t), pair_down_bh=16, pair_down_warps=8,
                                                     pair_down_stages=4, pair_down_ctas=1))}
             for t in (1, 2, 4)}
    # T = 8 / 16: 2,048 / 4,096 down items over 3 programs per SM fall 5-6 / 10-11 to a program; 2 or 4 per SM
    # balance them better (docs/perf.md, 2026-12-07)
    for t in (8, 16):
        sweep[t] = {f"down_ctas{c}": ("pair", replace(tiles_for(t), pair_down_ctas=c)) for c in (2, 4)}
    # gate_up's whole-row tile of T >= 3 before chunk_h (BN 4 over all of H, 4 warps, 5 programs per SM: the warps
    # split H; T = 2's old tile is bn2w2ctas8 above) against the shipped rows-per-warp tiles, and two neighbours of
    # those (docs/perf.md, "gate_up's warps own rows"); at T = 1, where the whole-row tile ships, the other way round
    for t in (1, 2, 4, 8, 16):
        base = tiles_for(t)
        sweep.setdefault(t, {}).update({
            "rows_whole": ("pair", replace(base, pair_hc=None, pair_bn=4, pair_warps=4, pair_ctas=5)),
            "hc512bn1w1c16": ("pair", replace(base, pair_hc=512, pair_bn=1, pair_warps=1, pair_ctas=16)),
            "hc512bn2w4c8": ("pair", replace(base, pair_hc=512, pair_bn=2, pair_warps=4, pair_ctas=8))})
    # T = 1 takes the whole-row tile: the chunked ones lost there on an H100 (docs/perf.md), not yet timed on an H200
    sweep[1].update({f"hc512bn1w2c12s{s}": ("pair", replace(tiles_for(1), pair_hc=512, pair_bn=1, pair_warps=2,
                                                            pair_ctas=12, pair_stages=s)) for s in (2, 3)})
    for t in (16, 64):
        sweep.setdefault(t, {}).update({"stages2": ("expert", Tiles(expert_stages=2)),
                                        "bk64": ("expert", Tiles(expert_bk=64)),
                                        "bn64bh32": ("expert", Tiles(expert_bn=64, expert_bh=32))})
    return sweep


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--prefill", action="store_true", help=f"also T = {PREFILL_TOKENS}")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--paths", default="auto,pair,expert_gate_up,expert")
    parser.add_argument("--warp-max-tokens", type=int, default=1024, help="largest T for warp decode's schedules")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for p in args.paths.split(","):
        path(p)  # an unknown name fails here, before the minutes of set-up
    ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s (streaming read, 4 GiB, CUDA graph, median)", flush=True)
    tflops = bf16_matmul_tflops()
    print(f"BF16 matmul {tflops:.1f} TFLOP/s (torch.matmul 8192^3, CUDA graph, median)", flush=True)
    sweep = {} if args.no_sweep else sweep_variants()
    tokens = [int(t) for t in args.tokens.split(",")]
    tokens += [t for t in PREFILL_TOKENS if args.prefill and t not in tokens]
    rows = []
    for name in args.shapes.split(","):
        small = name == "qwen3-30b-a3b"
        paths = [p for p in args.paths.split(",") if small or p != "expert_gate_up"]
        rows += bench_shape(name, SHAPES[name], tokens, args.layers, args.reps, paths, sweep if small else {},
                            args.warp_max_tokens)
    for r in rows:
        r["pct"] = round(100 * r["tbs"] / ceiling, 1)
        bound_us = max(r["gflop"] * 1e3 / tflops, r["mb"] / ceiling)  # GFLOP / (TFLOP/s) = ms; MB / (TB/s) = µs
        r["roofline_pct"] = round(100 * bound_us / r["us"], 1)
    print("\nshape            T    path                               weights    µs/layer   unique MB   TB/s  %ceil"
          "  TFLOP/s  %roofline")
    print_rows(rows)
    print("\nvLLM fused_moe (quoted from background.md, not measured here), 30B shape, µs/layer:", VLLM_QUOTED_US)
    plot(rows, args.out, ceiling, tflops)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, bf16_matmul_tflops=tflops, rows=rows, vllm_quoted_us=VLLM_QUOTED_US), f)
    print(json.dumps(summary(rows, ceiling, tflops)))


if __name__ == "__main__":
    main()
