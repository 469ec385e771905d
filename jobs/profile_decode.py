"""Where a decode step's GPU time goes: the engine's captured step at batch B and context c under torch.profiler,
kernel by kernel, against the step's wall time.

bench_decode says how far a step is from its roofline; this says why. The profile is of the CUDA-graph replay
the engine runs (CUPTI records the kernels inside a graph), so launch gaps show up as the difference between the
wall time of a step and the sum of its kernels' times. A kernel launched under PDL (kernels/mx_tiles.pdl_launch)
starts before the previous one ends and its time includes that wait, so the sum can exceed the wall time: compare
steps by wall time, and read the per-kernel times of PDL kernels as upper bounds. Kernels are grouped by name; per
group: calls and µs per step, and the share of the step. Each row's cache holds c random keys and values, as in
bench_decode.

Prints a table per (kernel path, B), writes profile_decode.json under --out, ends with one JSON line. GPU only.
"""

import argparse
import json
import os
import re
import time
from collections import defaultdict

import torch

from composer_rollout.engine.graphs import DecodeGraphs
from composer_rollout.model import Qwen3MoE, preset
from jobs.bench_decode import fill_cache


def short_name(name: str) -> str:
    """Triton kernels keep their function name; cuBLAS/CUTLASS and torch kernels lose template noise."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:70]


def kernel_groups(prof) -> dict[str, list[float]]:
    """{kernel name (short_name): [calls, total µs]} of the CUDA kernels a torch.profiler run recorded."""
    groups = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            g = groups[short_name(e.name)]
            g[0] += 1
            g[1] += e.device_time
    return dict(groups)


def profile_step(graphs, inputs, steps: int) -> tuple[float, dict]:
    """(wall seconds per step, {kernel name: [calls, total µs]} per step) over `steps` replays of the step
    (`inputs`: DecodeGraphs.run's arguments)."""
    for _ in range(3):
        graphs.run(*inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graphs.run(*inputs)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graphs.run(*inputs)
        torch.cuda.synchronize()
    return wall, {k: [v[0] / steps, v[1] / steps] for k, v in kernel_groups(prof).items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--preset", default="qwen3_30b_a3b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kernels", default="warp_decode,expert_centric")
    p.add_argument("--dense", default="triton", choices=["torch", "triton"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    model = Qwen3MoE(preset(args.preset, eos_token_id=()), device=dev, weight_dtype="mxfp8", kernel="auto",
                     dense=args.dense).init_random(args.seed)
    batches = [int(b) for b in args.batches.split(",")]
    cache = model.new_kv_cache(max(batches), args.context + 1)
    fill_cache(cache, gen)
    results = []
    for kernel in args.kernels.split(","):
        model.set_paths(kernel=kernel)
        graphs = DecodeGraphs(model, cache, batches)
        for b in batches:
            ids = torch.randint(0, model.args.vocab_size, (b, 1), device=dev, generator=gen)
            positions = torch.full((b, 1), args.context - 1, device=dev)
            rows = torch.arange(b, device=dev)  # slots, and the rows' sampling seeds; temperature 1, step 0
            inputs = (ids, positions, rows, torch.ones(b, device=dev), rows, torch.zeros_like(rows))
            wall, groups = profile_step(graphs, inputs, args.steps)
            busy = sum(us for _, us in groups.values())
            print(f"\n{kernel} dense={args.dense} B={b} c={args.context}: step {wall * 1e6:.0f} µs wall, "
                  f"{busy:.0f} µs in kernels ({100 * busy / (wall * 1e6):.0f}%), "
                  f"{sum(n for n, _ in groups.values()):.0f} launches")
            ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
            for name, (calls, us) in ranked[:args.top]:
                print(f"  {us:9.1f} µs {100 * us / (wall * 1e6):5.1f}%  {calls:6.0f} calls  "
                      f"{us / calls:7.2f} µs/call  {name}")
            results.append(dict(kernel=kernel, dense=args.dense, B=b, context=args.context,
                                wall_us=round(wall * 1e6, 1), kernel_us=round(busy, 1),
                                launches=round(sum(n for n, _ in groups.values())),
                                top={k: [round(c, 1), round(us, 1)] for k, (c, us) in ranked[:args.top]}))
        del graphs
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(results, f)
    print(json.dumps(dict(bench="profile_decode", rows=[{k: r[k] for k in ("kernel", "B", "wall_us", "kernel_us",
                                                                            "launches")} for r in results])))


if __name__ == "__main__":
    main()
