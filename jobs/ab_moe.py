"""A/B of the MoE kernel paths: the working tree's kernels/ against a base revision's, timed in one process.

Why. A kernel change is judged old against new on the same machine in the same device call: lent GPUs differ by a
few percent (and H100s stand in for H200s), and device time comes in short sessions, so the comparison must not need
a second call. `make ab-base REV=<rev>` exports that revision's kernels/ (and composer_rollout/) into .ab_base/
(ignored by git; name it in the device call's `carry`); this job imports both `kernels` packages side by side,
builds one set of MXFP8 layers (each tree wraps the same bytes in its own MXFP8Tensor), and at each T times every
path of both trees as CUDA-graph replays over --layers distinct weight sets (so L2 cannot serve repeated reads), in
--rounds interleaved rounds (base, new, base, new, ...). Per row: µs per layer (best round), the spread of the
rounds, the change against base, % of the read ceiling measured in the same run (the touched experts' bytes, as
jobs/bench_moe.py counts them), and whether new's output is bit-identical to base's. Table, one JSON line, a PNG. On
the CPU (--device cpu, Triton's interpreter, toy shape) it runs eagerly: a check that the job works, not a
measurement.

Usage: python3 jobs/ab_moe.py --base .ab_base --out DIR [--paths expert_centric,kernel_auto] [--tokens 16,32,64]
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch

from jobs.bench_moe import SHAPES as MODEL_SHAPES
from jobs.bench_moe import make_inputs, make_layers, read_ceiling_tbs, time_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {**MODEL_SHAPES, "tiny": dict(H=96, I=64, E=6, k=2)}
PATHS = ("warp_decode", "expert_centric", "kernel_auto")


def load_kernels(root: str) -> dict:
    """The MoE entry points and MXFP8 type of the `kernels` package under `root`, imported fresh; whatever `kernels`
    modules were loaded before are put back afterwards, so the two trees never mix."""
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "kernels" or m.startswith("kernels.")}
    sys.path.insert(0, root)
    try:
        wd = importlib.import_module("kernels.warp_decode_moe")
        ec = importlib.import_module("kernels.expert_centric_moe")
        mx = importlib.import_module("kernels.mxfp8")
    finally:
        sys.path.remove(root)
        for m in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
            del sys.modules[m]
        sys.modules.update(saved)
    if not os.path.abspath(wd.__file__).startswith(os.path.abspath(root) + os.sep):
        raise RuntimeError(f"{root}: imported kernels from {wd.__file__}, not from this tree")
    return dict(warp_decode=wd.warp_decode_moe, expert_centric=ec.expert_centric_moe, kernel_auto=ec.auto_moe,
                MXFP8Tensor=mx.MXFP8Tensor)


def timer(device: str):
    """fn -> µs of one call: a CUDA-graph replay on the GPU (jobs/bench_moe.py's), a plain call on the CPU."""
    if device == "cuda":
        return lambda fn: time_graph(fn, 20)

    def eager(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return eager


def run(base_root: str, shape: dict, tokens: list[int], paths: list[str], layers: int, rounds: int,
        device: str) -> list[dict]:
    trees = {"base": load_kernels(base_root), "new": load_kernels(ROOT)}
    H, I, E, k = shape["H"], shape["I"], shape["E"], shape["k"]
    weights, _ = make_layers(H, I, E, layers, 0, device)
    per_expert = sum(w.data.nbytes + w.scales.nbytes for w in weights[0]) / E
    time_us = timer(device)
    rows = []
    for T in tokens:
        inputs = make_inputs(T, H, E, k, layers, T, device)
        touched = statistics.mean(len(torch.unique(ids)) for _, _, ids in inputs)
        mb = (touched * per_expert + 4 * T * H) / 1e6
        for path in paths:
            calls, outs, times = {}, {}, {"base": [], "new": []}
            for tag, tree in trees.items():
                ws = [tuple(tree["MXFP8Tensor"](w.data, w.scales) for w in pair) for pair in weights]
                calls[tag] = lambda fn=tree[path], ws=ws, inputs=inputs: [fn(h, w, i, *ws[n]) for n, (h, w, i) in
                                                                          enumerate(inputs)]
                outs[tag] = calls[tag]()[0]
            for _ in range(rounds):
                for tag in trees:
                    times[tag].append(time_us(calls[tag]) / layers)
            same = torch.equal(outs["base"], outs["new"])
            for tag in trees:
                us = min(times[tag])
                rows.append(dict(T=T, path=path, tree=tag, us=round(us, 2), spread=round(max(times[tag]) - us, 2),
                                 mb=round(mb, 2), rounds=[round(t, 2) for t in times[tag]], bit_identical=same))
            print_rows(rows[-2:])
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        pct = f"{r['pct']:6.1f}" if "pct" in r else "      "
        change = f"{r['change_pct']:+6.1f}%" if "change_pct" in r else "       "
        print(f"T={r['T']:<5d} {r['path']:15s} {r['tree']:5s} {r['us']:10.2f} µs  spread {r['spread']:7.2f}  "
              f"{r['mb']:9.2f} MB {pct} %ceil {change}  bit-identical {r['bit_identical']}", flush=True)


def finish(rows: list[dict], ceiling_tbs: float | None) -> dict:
    """Adds % of the ceiling and new's change against base to the rows; the JSON summary."""
    base = {(r["T"], r["path"]): r["us"] for r in rows if r["tree"] == "base"}
    for r in rows:
        if ceiling_tbs:
            r["pct"] = round(100 * r["mb"] / ceiling_tbs / r["us"], 1)  # MB / (TB/s) = µs
        if r["tree"] == "new":
            r["change_pct"] = round(100 * (r["us"] / base[(r["T"], r["path"])] - 1), 1)
    return dict(ceiling_tbs=ceiling_tbs,
                change_pct={f"{r['path']}/T{r['T']}": r["change_pct"] for r in rows if r["tree"] == "new"},
                bit_identical={f"{r['path']}/T{r['T']}": r["bit_identical"] for r in rows if r["tree"] == "new"})


def plot(rows: list[dict], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in dict.fromkeys(r["path"] for r in rows):
        for tag, style in (("base", "--"), ("new", "-")):
            pts = [(r["T"], r["us"]) for r in rows if r["path"] == path and r["tree"] == tag]
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{path} ({tag})")
    ax.set(xscale="log", xlabel="T (tokens)", ylabel="µs per layer", title="MoE paths: base against the working tree")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ab_moe.png"), dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True, help="a tree holding the base revision's kernels/ (make ab-base)")
    p.add_argument("--out", default=".")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="16,32,64")
    p.add_argument("--paths", default="expert_centric,kernel_auto")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    paths = args.paths.split(",")
    if unknown := [x for x in paths if x not in PATHS]:
        p.error(f"--paths: unknown {unknown}; choose from {', '.join(PATHS)}")
    if not os.path.isfile(os.path.join(args.base, "kernels", "__init__.py")):
        p.error(f"--base {args.base}: no kernels/ package there (make ab-base REV=<rev> writes one to .ab_base)")
    os.makedirs(args.out, exist_ok=True)
    ceiling = None
    if args.device == "cuda":
        ceiling = read_ceiling_tbs()
        print(f"read ceiling {ceiling:.3f} TB/s (streaming read, 4 GiB, CUDA graph, median)", flush=True)
    rows = run(args.base, SHAPES[args.shape], [int(t) for t in args.tokens.split(",")], paths, args.layers,
               args.rounds, args.device)
    summary = finish(rows, ceiling)
    print("\nT      path            tree          µs/layer  spread      unique MB  %ceil  change   bit-identical")
    print_rows(rows)
    plot(rows, args.out)
    with open(os.path.join(args.out, "ab_moe.json"), "w") as f:
        json.dump(dict(summary, base=os.path.abspath(args.base), shape=args.shape, rows=rows), f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
