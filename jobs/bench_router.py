"""The decode router's forms on the GPU, per token count: where the one-launch router (kernels/router_gate_topk.py)
pays and where the model should route through the gate GEMM and router_topk instead.

Why: the engine's profile at B = 16 (docs/perf.md, "The decode router's one launch") showed router_gate_topk at
39 µs per layer, against 10.5 µs at B = 8 and 7.5 µs for cuBLAS + router_topk at B = 32: the model's rule for the
fused router (composer_rollout/model/moe.py, FUSED_ROUTER_MAX_T) is set from this table.
Forms, per T (Qwen3 router shapes: gate [E, H] BF16, FP32 logits):
- fused+norm: router_gate_topk with the residual add and RMSNorm in its prologue (T <= MAX_T_NORM; the model's
  form from layer 1 on, up to FUSED_ROUTER_MAX_T tokens);
- fused: router_gate_topk alone (the kernel allows it; the model no longer runs it: every layer's router comes
  after the post-attention add + norm);
- skinny+topk: skinny_linear's FP32 logits then router_topk (T <= 8: fused_linear's path there);
- gemm+topk: skinny_gemm's FP32 logits (tensor cores) then router_topk (fused_linear's path from 9 to 128 tokens);
- cublas+topk: torch.mm with an FP32 output then router_topk (fused_linear's path above 128 tokens);
the unfused forms with the norm run rmsnorm's add_norm first (+norm rows), so each fused form has a like-for-like
unfused twin. Each timing: the median µs per call of CUDA-graph replays of one graph calling the form on C distinct
gate copies (C * gate bytes > 100 MB: every call streams its gate from HBM), launch gaps included, as in a decode
step's graph. Bound: gate + hidden bytes over the streaming-read ceiling measured in the same run. Every form's
ids are checked equal to router_gate_topk_reference's and its weights within 1e-5 ("near-tie swap": two experts
at a near tie swapped by a rounding order, the sorted weights still within 1e-5).

Usage: PYTHONPATH=. python3 jobs/bench_router.py --out DIR [--tokens 1,2,4,8,12,16,24,32]
(prints a table, writes DIR/bench_router.json and .png, ends with one JSON line)
"""

import argparse
import json
import math
import os

import torch

from jobs.bench_moe import read_ceiling_tbs, time_graph
from kernels.rmsnorm import rms_norm
from kernels.router_gate_topk import MAX_T_NORM, router_gate_topk, router_gate_topk_reference
from kernels.router_topk import router_topk
from kernels.skinny_gemm import gemm_counter, skinny_gemm
from kernels.skinny_gemm import max_tokens as gemm_max_tokens
from kernels.skinny_linear import MAX_T, skinny_linear

SHAPES = {"qwen3-30b-a3b": dict(E=128, H=2048, k=8), "qwen3-235b-a22b": dict(E=128, H=4096, k=8)}
L2_DEFEAT_BYTES = 100e6
EPS = 1e-6


def forms(T, E):
    """(name, uses the norm) of the forms that run at T."""
    out = [("fused+norm", True)] if T <= MAX_T_NORM else []
    out += [("fused", False), ("skinny+topk+norm", True), ("skinny+topk", False)] if T <= MAX_T else []
    out += [("gemm+topk+norm", True), ("gemm+topk", False)] if T <= gemm_max_tokens(E) else []
    return out + [("cublas+topk+norm", True), ("cublas+topk", False)]


def run_form(name, x, res, norm_w, gate, k, counter, gemm_count):
    """(weights, ids) of one form on one gate copy (counter: the fused router's, gemm_count: skinny_gemm's)."""
    add_norm = (res, norm_w, EPS) if name.endswith("+norm") else None
    if name.startswith("fused"):
        return router_gate_topk(x, gate, k, True, counter, add_norm=add_norm)[:2]
    if add_norm is not None:
        x, _ = rms_norm(x, norm_w, EPS, res)
    if name.startswith("skinny"):
        logits = skinny_linear(x, gate, out_dtype=torch.float32)
    elif name.startswith("gemm"):
        logits = skinny_gemm(x, gate, out_dtype=torch.float32, counter=gemm_count)
    else:
        logits = torch.mm(x, gate.t(), out_dtype=torch.float32)
    return router_topk(logits, k, True)


def bench_shape(model, E, H, k, tokens, reps, ceiling, gen):
    copies = max(8, math.ceil(L2_DEFEAT_BYTES / (E * H * 2)))
    gates = [torch.randn(E, H, device="cuda", generator=gen).mul_(H**-0.5).bfloat16() for _ in range(copies)]
    counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(copies)]
    gemm_count = gemm_counter(E, "cuda")  # left zeroed by every launch: one serves all copies
    norm_w = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).bfloat16()
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=gen)
        res = torch.randn(T, H, device="cuda", generator=gen)
        ref_w, ref_ids = router_gate_topk_reference(x.bfloat16(), gates[0], k, True)[:2]
        ref_nw, ref_nids = router_gate_topk_reference(x, gates[0], k, True, add_norm=(res, norm_w, EPS))[:2]
        nbytes = E * H * 2 + T * H * 2
        for name, norm in forms(T, E):
            xin = x if norm else x.bfloat16()
            w, ids = run_form(name, xin, res, norm_w, gates[0], k, counters[0], gemm_count)
            want_w, want_ids = (ref_nw, ref_nids) if norm else (ref_w, ref_ids)
            # Rounding-order differences (e.g. the normed row's BF16 rounding) may swap two experts at a near tie:
            # then the ids differ but the sorted weights do not.
            same_w = torch.allclose(w.sort(-1).values, want_w.sort(-1).values, atol=1e-5, rtol=0)
            ok = "matches" if torch.equal(ids, want_ids) and same_w else "near-tie swap" if same_w else "DIFFERS"
            us = time_graph(lambda name=name, xin=xin, res=res: [run_form(name, xin, res, norm_w, g, k, c, gemm_count)
                                                                 for g, c in zip(gates, counters, strict=True)],
                            reps) / copies
            bound = (nbytes + (T * H * 4 if norm else 0)) / ceiling / 1e6
            rows.append(dict(model=model, T=T, form=name, us=round(us, 2), bound_us=round(bound, 2),
                             frac=round(bound / us, 3), matches_reference=ok))
            print(f"{model:16s} T={T:<3d} {name:18s} {us:7.2f} µs  bound {bound:5.2f} µs ({100 * bound / us:5.1f}%)"
                  f"  {ok} (reference)", flush=True)
    return rows


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for i, form in enumerate(dict.fromkeys(r["form"] for r in rows)):
            pts = sorted((r["T"], r["us"]) for r in rows if r["model"] == model and r["form"] == form)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "norm" in form else "s--", color=f"C{i}",
                    label=form)
        ax.set(title=f"{model}: router µs per call", xlabel="T", ylim=(0, None))
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_router.png"), dpi=110)


def fastest(rows, norm):
    """{model/T: the fastest form} among the forms with (norm) or without the norm."""
    best = {}
    for r in rows:
        if r["form"].endswith("+norm") == norm:
            key = f"{r['model']}/T{r['T']}"
            if key not in best or r["us"] < best[key][1]:
                best[key] = (r["form"], r["us"])
    return {key: form for key, (form, _) in best.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,2,4,8,12,16,24,32")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.3f} TB/s (CUDA graphs, median)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in args.models.split(","):
        rows += bench_shape(model, **SHAPES[model], tokens=[int(t) for t in args.tokens.split(",")],
                            reps=args.reps, ceiling=ceiling, gen=gen)
    plot(rows, args.out)
    summary = dict(bench="router", ceiling_tbs=round(ceiling, 3), fastest_with_norm=fastest(rows, True),
                   fastest_without_norm=fastest(rows, False),
                   all_match=all(r["matches_reference"] != "DIFFERS" for r in rows),
                   us={f"{r['model']}/T{r['T']}/{r['form']}": r["us"] for r in rows})
    with open(os.path.join(args.out, "bench_router.json"), "w") as f:
        json.dump(dict(summary, rows=rows), f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
