"""The decode projections' launches against cuBLAS at Qwen3's shapes on the GPU: kernels/skinny_linear.py (CUDA-core
FMAs, T <= 16), kernels/skinny_gemm.py (tensor cores, T <= 128) and what the model runs above them (cuBLAS: an
FP32 output through torch.mm's FP32 accumulator, a BF16 one through F.linear).

Shapes (weight N x K): per model the fused qkv projection (BF16 out), o_proj and the router gate (FP32 out, as the
model runs them); T = 1..128 tokens. Each timing is the median µs per call of CUDA-graph replays of one graph that
calls the op on C distinct weight copies in turn (C >= 8 and C * weight bytes > 100 MB, so the 60 MB L2 cannot
serve them: every call streams its weight from HBM), launch gaps included, as in a decode step's graph. Bound:
weight + x + out bytes over the streaming-read ceiling measured in the same run (jobs/bench_moe.read_ceiling_tbs).
Error: max |out - ref| / max |ref| on copy 0, ref = skinny_linear_reference in FP32.
--sweep also times alternative configs per shape and T (skinny_linear: block_n and num_warps halved and doubled,
early loads off; skinny_gemm: a block_n x block_k x split grid) and reports the fastest. --ptxas needs no GPU: it
compiles skinny_linear's configs for sm_90a and prints ptxas registers and spills, the 16-byte global loads, and
how many loads precede the first FMA.

Usage: PYTHONPATH=. python3 jobs/bench_skinny_linear.py --out DIR [--sweep] [--tokens 1,2,4,8,16,32,64,128]
(prints a table, writes DIR/bench_skinny_linear.json and .png, ends with one JSON line)
"""

import argparse
import json
import math
import os
import re
import subprocess
import tempfile
from functools import partial

import torch
import torch.nn.functional as F
import triton

from jobs.bench_moe import read_ceiling_tbs, time_graph
from kernels.skinny_gemm import MAX_T as GEMM_MAX_T
from kernels.skinny_gemm import Config as GemmConfig
from kernels.skinny_gemm import _config as gemm_config
from kernels.skinny_gemm import gemm_counter, skinny_gemm
from kernels.skinny_linear import (
    MAX_T,
    _config,
    _skinny_linear_kernel,
    kernel_constexprs,
    skinny_linear,
    skinny_linear_reference,
)

SHAPES = {
    "qwen3-30b-a3b": {"qkv": (5120, 2048, torch.bfloat16), "o_proj": (2048, 4096, torch.float32),
                      "gate": (128, 2048, torch.float32)},
    "qwen3-235b-a22b": {"qkv": (9216, 4096, torch.bfloat16), "o_proj": (4096, 8192, torch.float32),
                        "gate": (128, 4096, torch.float32)},
}
TARGET_US = {"qkv": 6.5, "o_proj": 5.5, "gate": 2.5}  # the 30B goals at T = 1..8
L2_DEFEAT_BYTES = 100e6


def variants(T, N, K):
    """The launcher's Config first, then its neighbours (one knob changed each)."""
    base = _config(T, N, K)
    alt = [base._replace(block_n=b) for b in (base.block_n // 2, base.block_n * 2) if 1 <= b <= 16]
    alt += [base._replace(num_warps=w) for w in (base.num_warps // 2, base.num_warps * 2) if 1 <= w <= 16]
    return [base, *alt, base._replace(early_loads=False)]


def gemm_variants(T, N, K):
    """skinny_gemm's launch first, then a grid of block_n x block_k x split (4 warps, 4 stages; stages 3 and 8
    warps at the launch's own tile)."""
    base = gemm_config(T, N, K, True)
    grid = [GemmConfig(bn, bk, sp) for bn in (16, 32, 64) for bk in (128, 256) for sp in (1, 2, 4)
            if K // bk >= sp]
    extra = [base._replace(stages=3), base._replace(num_warps=8)]
    return [base, *(c for c in grid + extra if c != base)]


def per_call_us(fn, ws, reps):
    """µs per call of one CUDA graph calling fn on every weight copy in turn."""
    return time_graph(lambda: [fn(w) for w in ws], reps) / len(ws)


def max_rel(out, ref):
    return float((out.float() - ref).abs().max() / ref.abs().max())


# (row key, label, plot style) of each launch the bench times
LAUNCHES = (("us", "skinny_linear", "o-"), ("gemm_us", "skinny_gemm", "^-"), ("cublas_us", "cuBLAS", "s--"))


def cublas(x, w, out_dtype):
    """What the model runs above the Triton launches' token limits (layers.fused_linear): an FP32 output is
    cuBLAS's FP32 accumulator (BF16 x BF16 -> FP32), a BF16 one F.linear."""
    return torch.mm(x, w.t(), out_dtype=torch.float32) if out_dtype == torch.float32 else F.linear(x, w)


def timed_configs(fn_of_config, configs, ws, reps, what):
    timed = []
    for cfg in configs:
        try:
            fn = fn_of_config(cfg)
            timed.append((per_call_us(fn, ws, reps), cfg))
        except Exception as exc:  # a failing variant is reported, the rest still run
            print(f"FAILED {what} {cfg}: {exc!r}", flush=True)
    return timed


def bench_shape(model, proj, N, K, out_dtype, tokens, reps, ceiling, sweep, gen):
    copies = max(8, math.ceil(L2_DEFEAT_BYTES / (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", generator=gen).mul_(K**-0.5).bfloat16() for _ in range(copies)]
    counter = gemm_counter(N, "cuda")
    rows = []
    for T in tokens:
        x = torch.randn(T, K, device="cuda", generator=gen).bfloat16()
        out = torch.empty(T, N, device="cuda", dtype=out_dtype)
        ref = skinny_linear_reference(x, ws[0], torch.float32)
        what = f"{model} {proj} T={T}"
        row = dict(model=model, proj=proj, N=N, K=K, T=T, out=str(out_dtype).removeprefix("torch."), copies=copies)
        if T <= MAX_T:
            timed = timed_configs(lambda c, x=x, out=out: partial(_skinny, x, out_dtype, out, c),
                                  variants(T, N, K) if sweep else [_config(T, N, K)], ws, reps, what)
            best_us, best = min(timed, key=lambda p: p[0])
            err = max_rel(skinny_linear(x, ws[0], out_dtype=out_dtype), ref)
            row.update(us=round(timed[0][0], 2), config=list(timed[0][1]), best_us=round(best_us, 2),
                       best_config=list(best), err=float(f"{err:.3g}"))
        if T <= GEMM_MAX_T:
            timed = timed_configs(lambda c, x=x, out=out: partial(_gemm, x, out_dtype, out, counter, c),
                                  gemm_variants(T, N, K) if sweep else [gemm_config(T, N, K, True)], ws, reps, what)
            best_us, best = min(timed, key=lambda p: p[0])
            err = max_rel(skinny_gemm(x, ws[0], out_dtype=out_dtype, counter=counter), ref)
            row.update(gemm_us=round(timed[0][0], 2), gemm_config=list(timed[0][1]), gemm_best_us=round(best_us, 2),
                       gemm_best_config=list(best), gemm_err=float(f"{err:.3g}"))
        row["cublas_us"] = round(per_call_us(partial(cublas, x, out_dtype=out_dtype), ws, reps), 2)
        row["cublas_err"] = float(f"{max_rel(cublas(x, ws[0], out_dtype), ref):.3g}")
        row["bound_us"] = round((N * K * 2 + T * K * 2 + T * N * out.element_size()) / ceiling / 1e6, 2)
        launches = {key: (label, row[key]) for key, label, _ in LAUNCHES if key in row}
        row["fastest"] = min(launches, key=lambda key: launches[key][1])
        rows.append(row)
        print(f"{model:16s} {proj:7s} {N:5d}x{K:<5d} T={T:<3d} bound {row['bound_us']:6.2f} µs  "
              + "  ".join(f"{label} {v:7.2f} ({100 * row['bound_us'] / v:5.1f}%)" for label, v in launches.values())
              + (f"  best skinny {row['best_us']:.2f} {tuple(row['best_config'])}" if sweep and "us" in row else "")
              + (f"  best gemm {row['gemm_best_us']:.2f} {tuple(row['gemm_best_config'])}"
                 if sweep and "gemm_us" in row else ""), flush=True)
    return rows


def _skinny(x, out_dtype, out, cfg, w):
    return skinny_linear(x, w, out_dtype=out_dtype, out=out, config=cfg)


def _gemm(x, out_dtype, out, counter, cfg, w):
    return skinny_gemm(x, w, out_dtype=out_dtype, out=out, counter=counter, config=cfg)


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in SHAPES if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 9), squeeze=False)
    for col, model in enumerate(models):
        for i, proj in enumerate(SHAPES[model]):
            mine = sorted((r for r in rows if r["model"] == model and r["proj"] == proj), key=lambda r: r["T"])
            for key, label, style in LAUNCHES:
                pts = [(r["T"], r[key], 100 * r["bound_us"] / r[key]) for r in mine if key in r]
                if pts:
                    ts = [p[0] for p in pts]
                    axes[0][col].plot(ts, [p[1] for p in pts], style, color=f"C{i}", label=f"{proj} {label}")
                    axes[1][col].plot(ts, [p[2] for p in pts], style, color=f"C{i}", label=f"{proj} {label}")
        axes[0][col].set(title=f"{model}: µs per call", xlabel="T", ylim=(0, None))
        axes[1][col].set(title="% of the read bound", xlabel="T", ylim=(0, 100))
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_skinny_linear.png"), dpi=110)


def summary(rows, ceiling):
    key = [(f"{r['model']}/{r['proj']}/T{r['T']}", r) for r in rows]
    met = {f"{r['proj']}/T{r['T']}": min(r.get("us", 1e9), r.get("gemm_us", 1e9)) <= TARGET_US[r["proj"]]
           for r in rows if r["model"] == "qwen3-30b-a3b" and r["T"] <= 8}
    errs = [(r["out"], e) for r in rows for e in (r.get("err"), r.get("gemm_err")) if e is not None]
    return dict(bench="skinny_linear", ceiling_tbs=round(ceiling, 3),
                **{name: {k: r[field] for k, r in key if field in r}
                   for field, name in (("us", "us"), ("gemm_us", "gemm_us"), ("gemm_best_us", "gemm_best_us"),
                                       ("cublas_us", "cublas_us"), ("bound_us", "bound_us"), ("fastest", "fastest"))},
                targets_met=met, max_rel_err={d: max(e for o, e in errs if o == d) for d in {o for o, _ in errs}})


def ptxas_report(models, tokens):
    """Offline compile of the launcher's configs (no GPU): ptxas registers/spills, loads, load order."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for model in models:
        for proj, (N, K, out_dtype) in SHAPES[model].items():
            for T in tokens:
                cfg = _config(T, N, K)
                cx = dict(kernel_constexprs(T, K, cfg, out_dtype), INTERPRET=False, PDL=True)
                sig = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32" if out_dtype == torch.float32 else "*bf16",
                           res_ptr="*fp32", nw_ptr="*bf16", res_out_ptr="*fp32", normed_ptr="*bf16", T="i32",
                           N="i32", stride_x="i32", eps="fp32", **{k: "constexpr" for k in cx})
                src = ASTSource(fn=_skinny_linear_kernel, signature=sig, constexprs=cx,
                                attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9)})
                ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                     options=dict(num_warps=cfg.num_warps)).asm["ptx"]
                with tempfile.TemporaryDirectory() as d:
                    with open(os.path.join(d, "k.ptx"), "w") as f:
                        f.write(ptx)
                    info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", f"{d}/k.ptx", "-o",
                                           f"{d}/k.cubin"], capture_output=True, text=True, check=True).stderr
                    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f"{d}/k.cubin"],
                                          capture_output=True, text=True, check=True).stdout
                ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\w+\s+)?([A-Z0-9_.]+)", sass)
                first_fma = next(i for i, op in enumerate(ops) if op.startswith(("FFMA", "FMUL")))
                early = sum(op.startswith("LDG") for op in ops[:first_fma])
                w_loads = cfg.block_n * cfg.block_k // (256 * cfg.num_warps) * math.ceil(K / cfg.block_k)
                regs = re.search(r"Used (\d+) registers", info).group(1)
                spilled = re.search(r"(\d+) bytes spill stores", info).group(1)
                loads, v4 = len(re.findall(r"ld\.global", ptx)), len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))
                print(f"{model:16s} {proj:7s} T={T:<3d} {tuple(cfg)} grid {triton.cdiv(N, cfg.block_n):5d}: "
                      f"{regs} registers, {spilled} B spilled, ld.global {loads} (v4 {v4}), {early} LDG before "
                      f"the first FMA ({w_loads} of the weights)", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--ptxas", action="store_true", help="offline compile report (no GPU), then exit")
    args = p.parse_args()
    models, tokens = args.models.split(","), [int(t) for t in args.tokens.split(",")]
    if args.ptxas:
        ptxas_report(models, tokens)
        return
    os.makedirs(args.out, exist_ok=True)
    ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s (CUDA graphs, median)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in models:
        for proj, (N, K, out_dtype) in SHAPES[model].items():
            rows += bench_shape(model, proj, N, K, out_dtype, tokens, args.reps, ceiling, args.sweep, gen)
            torch.cuda.empty_cache()  # the shape's weight copies
    plot(rows, args.out)
    with open(os.path.join(args.out, "bench_skinny_linear.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, rows=rows), f)
    print(json.dumps(summary(rows, ceiling)))


if __name__ == "__main__":
    main()
