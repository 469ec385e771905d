"""Prefill on the GPU: what one prefill forward costs per shape (first call and warm, the host's part, kernel by
kernel) against its roofline, and the engine's prefill throughput on GRPO-shaped prompts per prefill budget.

Why it exists: the 30B rollout job spent a quarter of its warm time in prefill, ~100 ms per forward of ~600 padded
tokens, three to four times what bench_moe's MoE layers add up to (docs/perf.md); this says which part takes it:
first use of a shape (Triton compiling, or loading from its disk cache), the host launching ~700 kernels eagerly,
or a kernel.

Sections (--sections):
- forwards: for each B x S in --shapes, the engine's whole-prompt prefill: the model's forward of B prompts of S random
  tokens packed in one row into empty slots, then the FP32 logits of each prompt's last token (kernel=auto,
  dense=triton, eager, as the engine runs prefill). Per shape: the first call in this process, the median of --reps
  warm calls, the host's part of a warm call (until everything is enqueued; near the total means the launches, not
  the GPU, set the time), the kernels' summed GPU time from torch.profiler with the top kernels (GPU only), and the
  roofline: max(FLOPs / BF16 matmul rate, bytes / streaming read), both measured in this run. FLOPs: the q/k/v, o
  and router projections and the routed experts' GEMMs (2 x 3 x H x I per token-expert pair) per token, attention
  4 x D x Hq x (position + 1) per token, lm_head per prompt. Bytes: the dense weights, the experts the forward's
  tokens were routed to (counted from its own routing) and the K/V it writes.
- engine: RolloutEngine on --prompts prompts of random tokens, lengths uniform in [--min-len, --max-len], n = --n
  samples of one token each (the first token is drawn right after prefill, so the time is prefill), --slots KV
  slots, once per max_prefill_tokens in --budgets and twice each (the first run pays first use of its shapes):
  prefill tokens/s, forwards, padding.

Prints a table per section, writes bench_prefill.png and bench_prefill.json under --out, ends with one JSON line.
On a CPU (`--device cpu`, Triton's interpreter, toy sizes) it runs so that tests keep it working; its numbers mean
nothing there.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.engine.capture import ExpertCapture
from composer_rollout.model import Packed, Qwen3MoE, preset
from jobs.bench_decode import host_read_ceiling_tbs, weight_bytes
from jobs.bench_moe import bf16_matmul_tflops, read_ceiling_tbs
from jobs.profile_decode import kernel_groups


def forward_flops(a, B: int, S: int) -> float:
    """Useful FLOPs of a prefill forward of B rows x S tokens from position 0 (see the module docstring)."""
    D, Hq, Hkv, H = a.head_dim, a.num_attention_heads, a.num_key_value_heads, a.hidden_size
    per_token = 2 * H * (Hq + 2 * Hkv) * D + 2 * Hq * D * H + 2 * H * a.num_experts
    per_token += 2 * 3 * H * a.moe_intermediate_size * a.num_experts_per_tok
    attention = 4 * D * Hq * B * S * (S + 1) / 2  # sum over positions p of (p + 1)
    return a.num_hidden_layers * (B * S * per_token + attention) + 2 * B * H * a.vocab_size


def host_matmul_tflops(n: int = 512) -> float:
    x = torch.randn(n, n)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x @ x
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times) / 1e12


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def kernel_times(call, dev) -> dict[str, list[float]]:
    """{kernel name: [calls, µs]} of one call, from torch.profiler (empty off CUDA)."""
    if dev.type != "cuda":
        return {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        sync(dev)
    return kernel_groups(prof)


@torch.inference_mode()
def measure_shape(model, B: int, S: int, reps: int, gen):
    """(first call s, warm host s per call, warm total s per call, experts touched over all layers, kernel times)
    of the prefill forward of B prompts of S random tokens, packed in one row as the engine runs them, into a fresh
    cache."""
    a, dev = model.args, model.device
    cache = model.new_kv_cache(B, S + 1)
    ids = torch.randint(0, a.vocab_size, (1, B * S), device=dev, generator=gen)
    positions = torch.arange(S, device=dev).repeat(B)[None]
    slots = torch.arange(B, device=dev)
    packed = Packed.of([S] * B, list(range(B)), dev)
    last = torch.arange(S - 1, B * S, S, device=dev)

    def call(capture=None):
        hidden = model(ids, positions, slots, cache, capture, packed)
        return model.compute_logits(hidden[0, last])

    sync(dev)
    start = time.perf_counter()
    call()
    sync(dev)
    first, host, total = time.perf_counter() - start, [], []
    for _ in range(reps):
        sync(dev)
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
        sync(dev)
        total.append(time.perf_counter() - start)
    capture = ExpertCapture(a.num_hidden_layers, B * S, a.num_experts_per_tok, a.num_experts, dev)
    call(capture)
    distinct = sum(len(torch.unique(capture.ids[layer])) for layer in range(a.num_hidden_layers))
    return first, host, total, distinct, kernel_times(call, dev)


def bench_forwards(model, shapes, reps, ceiling_tbs, matmul_tflops, gen, top):
    a, rows = model.args, []
    dense, per_expert, _ = weight_bytes(model)
    kv_token = a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 2
    for B, S in shapes:
        first, host, total, distinct, groups = measure_shape(model, B, S, reps, gen)
        flops = forward_flops(a, B, S)
        weights, kv = dense + distinct * per_expert, B * S * kv_token
        roofline = max(flops / (matmul_tflops * 1e12), (weights + kv) / (ceiling_tbs * 1e12))
        warm, host_s = statistics.median(total), statistics.median(host)
        gpu_ms = sum(us for _, us in groups.values()) / 1e3 if groups else None
        ranked = sorted(groups.items(), key=lambda kv_: -kv_[1][1])[:top]
        rows.append(dict(B=B, S=S, tokens=B * S, first_ms=round(first * 1e3, 2), warm_ms=round(warm * 1e3, 3),
                         host_ms=round(host_s * 1e3, 3), gpu_ms=None if gpu_ms is None else round(gpu_ms, 3),
                         launches=sum(int(c) for c, _ in groups.values()), tok_s=round(B * S / warm, 1),
                         tflops=round(flops / 1e12, 3), bytes_gb=round((weights + kv) / 1e9, 3),
                         roofline_ms=round(roofline * 1e3, 3), roofline_frac=round(roofline / warm, 3),
                         top={k: [int(c), round(us, 1)] for k, (c, us) in ranked}))
        r = rows[-1]
        print(f"B={B:<4} S={S:<5} first {r['first_ms']:9.1f} ms  warm {r['warm_ms']:8.2f} ms  host {r['host_ms']:8.2f}"
              f" ms  gpu {r['gpu_ms'] if gpu_ms is not None else '-':>8} ms  {r['tok_s']:9.0f} tok/s  roofline "
              f"{r['roofline_ms']:7.2f} ms ({100 * r['roofline_frac']:5.1f}%)", flush=True)
        for name, (calls, us) in ranked:
            print(f"    {us / 1e3:8.3f} ms {100 * us / 1e3 / r['warm_ms']:5.1f}%  {calls:5d} calls  {name}")
    return rows


def bench_engine(model, prompts, n, min_len, max_len, slots, budgets, seed):
    rng = np.random.default_rng(seed)
    ps = [rng.integers(0, model.args.vocab_size, int(rng.integers(min_len, max_len + 1))).tolist()
          for _ in range(prompts)]
    rows = []
    for budget in budgets:
        for run in ("first", "second"):
            engine = RolloutEngine(model, max_num_seqs=slots, max_model_len=max_len + 2, seed=seed,
                                   max_prefill_tokens=budget, cuda_graphs=False)
            start = time.perf_counter()
            engine.generate(ps, SamplingParams(temperature=1.0, max_tokens=1, n=n, seed=seed))
            seconds, s = time.perf_counter() - start, engine.stats
            rows.append(dict(budget=budget, run=run, prompts=prompts, n=n, seconds=round(seconds, 3),
                             prefill_s=round(s.prefill_s, 3), prefill_tokens=s.prefill_tokens,
                             prefill_rows=s.prefill_rows, forwards=s.prefill_forwards,
                             padding=round(1 - s.prefill_tokens / s.prefill_rows, 3),
                             prefill_tok_s=round(s.prefill_tokens / s.prefill_s, 1),
                             ms_per_forward=round(1e3 * s.prefill_s / s.prefill_forwards, 2)))
            print("engine", rows[-1], flush=True)
            del engine
    return rows


def plot(forwards, engine, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    labels = [f"{r['B']}x{r['S']}" for r in forwards]
    x = np.arange(len(forwards))
    for i, (key, name) in enumerate((("warm_ms", "warm"), ("host_ms", "host"), ("gpu_ms", "GPU kernels"),
                                     ("roofline_ms", "roofline"))):
        axes[0].bar(x + 0.2 * i, [r[key] or 0 for r in forwards], 0.2, label=name)
    axes[0].set(title="prefill forward, ms", xticks=x + 0.3, xticklabels=labels, yscale="log", xlabel="B x S")
    axes[0].legend(fontsize=8)
    axes[1].plot(labels, [100 * r["roofline_frac"] for r in forwards], marker="o")
    axes[1].set(title="% of roofline (warm)", ylim=(0, 100), xlabel="B x S")
    for run in ("first", "second"):
        pts = [(r["budget"], r["prefill_tok_s"]) for r in engine if r["run"] == run]
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{run} run")
    axes[2].set(title="engine prefill tokens/s", xscale="log", xlabel="max_prefill_tokens")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_prefill.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--preset", default="qwen3_30b_a3b")
    p.add_argument("--sections", default="forwards,engine")
    p.add_argument("--shapes", default="1x64,1x256,1x1024,1x2048,2x1024,4x512,64x16,1x8192")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=800)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--budgets", default="2048,4096,8192")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    if sections - {"forwards", "engine"}:
        raise SystemExit(f"--sections: unknown {sorted(sections - {'forwards', 'engine'})}")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--shapes: expected B x S pairs like 1x256,4x512, got {args.shapes!r}") from None
    os.makedirs(args.out, exist_ok=True)
    on_gpu = args.device == "cuda"
    ceiling = read_ceiling_tbs() if on_gpu else host_read_ceiling_tbs()
    matmul = bf16_matmul_tflops() if on_gpu else host_matmul_tflops()
    print(f"read ceiling {ceiling:.3f} TB/s, matmul {matmul:.1f} TFLOP/s (measured)", flush=True)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    model = Qwen3MoE(preset(args.preset, eos_token_id=()), device=args.device, weight_dtype="mxfp8", kernel="auto",
                     dense="triton").init_random(args.seed)
    forwards, engine = [], []
    if "forwards" in sections:
        forwards = bench_forwards(model, shapes, args.reps, ceiling, matmul, gen, args.top)
    if "engine" in sections:
        engine = bench_engine(model, args.prompts, args.n, args.min_len, args.max_len, args.slots,
                              [int(b) for b in args.budgets.split(",")], args.seed)
    plot(forwards, engine, args.out)
    summary = dict(bench="prefill", ceiling_tbs=round(ceiling, 3), matmul_tflops=round(matmul, 1),
                   forwards={f"{r['B']}x{r['S']}": {k: r[k] for k in ("first_ms", "warm_ms", "host_ms", "gpu_ms",
                                                                      "roofline_frac")} for r in forwards},
                   engine={f"{r['budget']}/{r['run']}": {k: r[k] for k in ("prefill_tok_s", "forwards", "padding")}
                           for r in engine})
    with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:
        json.dump(dict(summary, forward_rows=forwards, engine_rows=engine), f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
