"""The attention kernels over the slot KV cache at the Qwen3 shapes on the GPU, against ceilings measured in the
same run.

- decode (kernels/decode_attention.py): B rows, each at context c, one query token; the bound is the K and V bytes
  of B * c positions over the streaming-read bandwidth. Baseline: the engine's torch backend (math SDPA over the
  whole slot, masked), the path the kernel replaces, where it fits in memory.
- prefill (kernels/prefill_attention.py): one row of S new tokens after a cached prefix of `start`; the bound is
  the causal FLOPs (2 * Hq * D * (keys seen, summed over queries) for QK^T and for PV) over the measured BF16
  matmul rate. Baseline: torch's flash SDPA (causal, K/V already expanded to Hq heads, outside the timing) on the
  same q, k, v: the library call the issue asks us to match.

--sweep also times decode's (num_splits, num_stages) variants beside the shipped choice at each (B, c), each
against the shipped time (rows "decode_variant", the JSON line's best_variant), for retuning default_num_splits and
the key loop's pipeline depth.

Every timing is the median of CUDA-graph replays on random data (decode: per call, of a graph of up to 8 calls on
distinct caches). Prints a table, writes bench_attention.png and .json under --out, ends with one JSON line.
"""

import argparse
import json
import os
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jobs.bench_moe import bf16_matmul_tflops, read_ceiling_tbs, time_graph
from kernels import cache_attention_reference, decode_attention, prefill_attention
from kernels.decode_attention import default_num_splits, default_num_stages

SHAPES = {"qwen3-30b-a3b": dict(Hq=32, Hkv=4, D=128), "qwen3-235b-a22b": dict(Hq=64, Hkv=4, D=128)}


def rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def torch_backend(q, k_cache, v_cache, slots, positions):
    """The engine's torch attention (composer_rollout/model/layers.py), on the same cache."""
    keys, values = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)
    mask = (torch.arange(k_cache.shape[1], device=q.device)[None, None, :] <= positions[:, :, None])[:, None]
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)


def every_layer(caches, q, slots, positions, out, **tuning):
    for k_cache, v_cache in caches:
        decode_attention(q, k_cache, v_cache, slots, positions, out=out, **tuning)


def sweep_variants(b, c, Hkv):
    """(num_splits, num_stages) pairs beside the shipped choice: fewer and more splits, deeper pipelines."""
    ns = default_num_splits(b, Hkv, c)
    shipped = (ns, default_num_stages(b, Hkv, ns))
    splits = sorted({ns, max(1, ns // 2), 2 * ns, 4 * ns, 1, 2, 3} & set(range(1, c // 64 + 1)))
    return [(s, st) for s in splits for st in (2, 3, 4, 5) if (s, st) != shipped]


def bench_decode(shape, batches, contexts, reps, ceiling, gen, sweep=False):
    rows, (Hq, Hkv, D) = [], (shape["Hq"], shape["Hkv"], shape["D"])
    for c in contexts:
        for b in batches:
            kv_bytes = 2 * b * c * Hkv * D * 2
            if 2 * kv_bytes > torch.cuda.mem_get_info()[0] * 0.8:
                print(f"skip decode B={b} c={c}: {kv_bytes / 1e9:.0f} GB of KV")
                continue
            # One graph runs `layers` calls on distinct caches, as a model's layers do: a graph launch (~5 µs) is
            # not charged to a call, and L2 (60 MB) cannot serve a call's KV from the one before.
            layers = min(8, max(1, (256 << 20) // kv_bytes))
            caches = [(torch.randn(b + 1, c, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen),
                       torch.randn(b + 1, c, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen))
                      for _ in range(layers)]
            k_cache, v_cache = caches[0]
            q = torch.randn(b, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            slots = torch.randperm(b, device="cuda", generator=gen)
            positions = torch.full((b, 1), c - 1, device="cuda")
            out = decode_attention(q, k_cache, v_cache, slots, positions)
            sub = slice(0, min(b, 4))  # the FP32 reference materialises [B, Hq, c] scores: a few rows suffice
            ref = cache_attention_reference(q[sub], k_cache, v_cache, slots[sub], positions[sub])
            err = rel_err(out[sub], ref)
            us = time_graph(partial(every_layer, caches, q, slots, positions, out), reps) / layers
            base_us = None
            if b * Hq * c * (c + D) * 4 < 8e9:  # math SDPA's FP32 intermediates must fit
                base_us = time_graph(partial(torch_backend, q, k_cache, v_cache, slots, positions), reps)
            bound_us = kv_bytes / ceiling / 1e6
            rows.append(dict(kind="decode", B=b, S=1, context=c, us=round(us, 2), bound_us=round(bound_us, 2),
                             frac=round(bound_us / us, 3), torch_us=base_us and round(base_us, 2), rel_err=err))
            print(f"decode  B={b:<4} c={c:<6} {us:9.2f} µs  bound {bound_us:8.2f} µs ({100 * bound_us / us:5.1f}%)  "
                  f"torch {base_us or float('nan'):9.2f} µs  err {err:.2e}", flush=True)
            for splits, stages in sweep_variants(b, c, Hkv) if sweep else ():
                tuning = dict(num_splits=splits, num_stages=stages)
                v_out = decode_attention(q, k_cache, v_cache, slots, positions, **tuning)
                v_err = rel_err(v_out[sub], ref)
                v_us = time_graph(partial(every_layer, caches, q, slots, positions, v_out, **tuning), reps) / layers
                rows.append(dict(kind="decode_variant", B=b, S=1, context=c, splits=splits, stages=stages,
                                 us=round(v_us, 2), bound_us=round(bound_us, 2), frac=round(bound_us / v_us, 3),
                                 vs_shipped=round(v_us / us, 3), rel_err=v_err))
                print(f"  variant splits={splits:<4} stages={stages} {v_us:9.2f} µs ({100 * bound_us / v_us:5.1f}%)  "
                      f"x{v_us / us:.3f} of shipped  err {v_err:.2e}", flush=True)
    return rows


def bench_prefill(shape, lengths, start, reps, tflops, gen):
    rows, (Hq, Hkv, D) = [], (shape["Hq"], shape["Hkv"], shape["D"])
    for s in lengths:
        L = start + s
        k_cache = torch.randn(2, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(1, s, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        slots = torch.zeros(1, dtype=torch.long, device="cuda")
        positions = torch.arange(start, L, device="cuda")[None]
        out = prefill_attention(q, k_cache, v_cache, slots, positions)
        sub = slice(max(0, s - 64), s)  # the last queries see every key: the hardest rows
        err = rel_err(out[:, sub], cache_attention_reference(q[:, sub].contiguous(), k_cache, v_cache, slots,
                                                             positions[:, sub].contiguous()))
        us = time_graph(partial(prefill_attention, q, k_cache, v_cache, slots, positions, out=out), reps)
        keys_seen = s * start + s * (s + 1) / 2
        gflop = 4 * Hq * D * keys_seen / 1e9
        flash_us = None
        if start == 0:
            qt = q.transpose(1, 2)
            kt, vt = (t[0, :s].transpose(0, 1)[None].repeat_interleave(Hq // Hkv, dim=1) for t in (k_cache, v_cache))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                flash_us = time_graph(partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True), reps)
        bound_us = gflop / tflops * 1e3
        rows.append(dict(kind="prefill", B=1, S=s, context=L, us=round(us, 2), bound_us=round(bound_us, 2),
                         frac=round(bound_us / us, 3), flash_us=flash_us and round(flash_us, 2), rel_err=err))
        print(f"prefill S={s:<6} start={start:<6} {us:9.2f} µs  bound {bound_us:8.2f} µs ({100 * bound_us / us:5.1f}%)"
              f"  flash {flash_us or float('nan'):9.2f} µs  err {err:.2e}", flush=True)
    return rows


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for (shape, c) in sorted({(r["shape"], r["context"]) for r in rows if r["kind"] == "decode"}):
        pts = sorted((r["B"], 100 * r["frac"]) for r in rows if r["kind"] == "decode" and r["shape"] == shape
                     and r["context"] == c)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{shape} c={c}")
    axes[0].set(title="decode attention: % of KV read bound", xscale="log", xlabel="batch", ylim=(0, 100))
    for shape in sorted({r["shape"] for r in rows if r["kind"] == "prefill"}):
        pts = sorted((r["S"], 100 * r["frac"]) for r in rows if r["kind"] == "prefill" and r["shape"] == shape)
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=shape)
    axes[1].set(title="prefill attention: % of BF16 matmul bound", xscale="log", xlabel="S", ylim=(0, 100))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_attention.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--prefill", default="512,2048,8192", help="'' for none")
    p.add_argument("--prefill-start", type=int, default=0)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="decode: time (num_splits, num_stages) variants too")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceiling, tflops = read_ceiling_tbs(), bf16_matmul_tflops()
    print(f"read ceiling {ceiling:.3f} TB/s, BF16 matmul {tflops:.0f} TFLOP/s (CUDA graphs, median)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        new = bench_decode(shape, [int(b) for b in args.batches.split(",")],
                           [int(c) for c in args.contexts.split(",")], args.reps, ceiling, gen, args.sweep)
        new += bench_prefill(shape, [int(s) for s in args.prefill.split(",") if s], args.prefill_start, args.reps,
                             tflops, gen)
        rows += [dict(r, shape=name) for r in new]
    plot(rows, args.out)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, bf16_matmul_tflops=tflops, rows=rows), f)
    best = {}
    for r in rows:
        key = f"{r['shape']}/B{r['B']}/c{r['context']}"
        if r["kind"] == "decode_variant" and r["vs_shipped"] < best.get(key, {}).get("vs_shipped", 1.0):
            best[key] = dict(splits=r["splits"], stages=r["stages"], vs_shipped=r["vs_shipped"])
    print(json.dumps(dict(bench="attention", ceiling_tbs=round(ceiling, 3), bf16_matmul_tflops=round(tflops, 1),
                          decode_frac={f"{r['shape']}/B{r['B']}/c{r['context']}": r["frac"] for r in rows
                                       if r["kind"] == "decode"},
                          prefill_frac={f"{r['shape']}/S{r['S']}": r["frac"] for r in rows if r["kind"] == "prefill"},
                          prefill_vs_flash={f"{r['shape']}/S{r['S']}": round(r["flash_us"] / r["us"], 3)
                                            for r in rows if r["kind"] == "prefill" and r["flash_us"]},
                          best_variant=best, max_rel_err=max(r["rel_err"] for r in rows))))


if __name__ == "__main__":
    main()
