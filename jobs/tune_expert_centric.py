"""Tune the expert-centric MoE's tiles on this GPU per T bucket, and measure where `auto` leaves warp decode.

Qwen3-30B-A3B MoE shape (H 2048, I 768, E 128, k 8), MXFP8 experts, uniform random routing, each candidate timed
as CUDA-graph replays over --layers layers of distinct weights (jobs/bench_moe.py's helpers; 8 layers are 5 GB,
far over the 60 MB L2). Per T bucket: for each BLOCK_M near the mean rows per expert (T * k / E), every tile of a
small grid (BLOCK_N 64/128, BLOCK_K 64/128, num_warps 4/8, num_stages 2-4, pruned to what fits: at most 128 FP32
accumulators per thread, as compiling for sm_90 showed spills beyond, and 8 warps from 4096 elements on)
for gate_up and for down, each kernel timed alone; the BLOCK_M with the fastest pair wins. Then the whole path
with the winners, its relative error against the FP32 reference, and warp decode (its auto schedule) at the same
T. crossover_tokens = the largest bucket up to which warp decode is faster at every bucket (warp decode stops
being measured once expert-centric has won twice in a row). A candidate that fails (compile, shared memory) is
printed and skipped. About 3 minutes on an H200 (much of it compiling the 80 kernel variants).

--dequant f16_rel tunes that variant of the GEMMs (FP16 dots, kernels/mx_tiles.py) into its own table,
expert_centric_<gpu>_f16_rel.json (same format, no crossover: `auto` keeps the BF16 table's), and skips warp
decode. --dequant fp8 tunes the FP8-dot GEMMs (kernels/moe_gate_up_fp8.py, moe_down_fp8.py) into
expert_centric_<gpu>_fp8.json, with its own crossover against warp decode (every tile with and without TMA
weight loads, down's TMA tiles also with TMA activation loads; the full grid adds BLOCK_K 256 and num_stages 5).
--quick keeps one num_stages per tile (3), halving the grid, for a short check of a variant. --verbose prints
every candidate's time; --block-m tries the given BLOCK_M values at every T instead of those near T * k / E;
--num-stages and --tma (on/off/both) set those axes of the FP8 grid.

Usage: PYTHONPATH=. python3 jobs/tune_expert_centric.py [--out DIR] [--dequant f16_rel|fp8] [--quick] [--verbose]
       [--block-m 16,32] [--num-stages 3,4] [--tma on|off|both] [--replace]
writes DIR/expert_centric_<gpu>[_f16_rel|_fp8].json (default kernels/configs/, where the launcher reads it), prints
a table. A table of the same dequant mode already there keeps the buckets and shapes this run did not tune (a retune
of the prefill buckets must not drop the decode ones), and its crossover is recomputed over the merged measurements;
--replace writes this run's buckets alone.
"""

import argparse
import dataclasses
import datetime
import json
import os
import time

import torch
import triton

from jobs.bench_moe import make_inputs, make_layers, rel_err, time_graph
from kernels import moe_reference
from kernels.expert_centric_moe import (
    CONFIG_DIR,
    ExpertCentricConfig,
    GemmConfig,
    device_key,
    expert_centric_moe,
    shape_key,
    table_name,
)
from kernels.fp8_split import FP8Split, fp8_split_rows
from kernels.moe_align import moe_align
from kernels.moe_down import moe_down
from kernels.moe_down_fp8 import moe_down_fp8
from kernels.moe_gate_up import moe_gate_up
from kernels.moe_gate_up_fp8 import moe_gate_up_fp8
from kernels.warp_decode_moe import warp_decode_moe

SHAPE = dict(H=2048, I=768, E=128, k=8)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def block_ms(T: int, k: int, E: int) -> tuple[int, ...]:
    rows = T * k / E
    return ((16,) if rows <= 8 else (16, 32) if rows <= 24 else (32, 64) if rows <= 64 else (64, 128) if rows <= 128
            else (128, 256))


def candidates(kernel: str, block_m: int, quick: bool = False, fp8: bool = False, stages: tuple[int, ...] = (),
               tma: tuple[bool, ...] = (False, True)) -> list[GemmConfig]:
    out = []
    if fp8:  # block_k is only an unroll count of 32-wide FP8 steps there; each step's tiles are cp.async-pipelined
        # The dot's M: gate_up stacks gate and up rows. wgmma needs 64 rows per warpgroup (fewer fall back to mma.sync
        # with FP8 -> FP16 converts); at 128 rows on one warpgroup the scale vector passes through shared memory each
        # step (sm_90 PTX), on two it does not: 4 warps per 64 rows, and fewer warps at 128 and 256 rows for the tuner
        # to compare (with TMA weights one warpgroup won at 128 rows; at 256, n128 w4 compiles to 164 registers, no
        # spills). More rows per program share each activation tile among more weights: L2 is the busiest unit
        # (docs/perf.md), and 256 rows halve the activation re-reads of 128.
        for bn in (32, 64, 128, 256):
            m = bn * (2 if kernel == "gate_up" else 1)
            for bk in (64, 128) if quick else (64, 128, 256):
                for warps in {64: (4,), 128: (8, 4), 256: (16, 8, 4)}.get(m, ()):
                    if m * 2 * block_m > 128 * 32 * warps:  # FP32 accumulators per thread (hi and lo columns)
                        continue
                    # down's activation rows are contiguous per block, so with TMA weights they may come by TMA too.
                    out += [GemmConfig(bn, bk, warps, st, t, act) for st in stages or ((3,) if quick else (2, 3, 4, 5))
                            for t in tma for act in ((False, True) if t and kernel == "down" else (False,))]
        return out
    for bn in (64, 128):
        acc = bn * block_m * (2 if kernel == "gate_up" else 1)  # FP32 accumulator elements (gate and up: two)
        for bk in (64, 128):
            for warps in (4, 8):
                # At most 128 FP32 accumulators per thread: since the dequantization is integer moves
                # (mx_tiles.e4m3_to), 4-warp prefill tiles at 128 fit without spills and won (docs/perf.md).
                if acc > 128 * 32 * warps or (warps == 8 and acc < 4096):
                    continue
                # BLOCK_K 64 loads 2-byte scale runs, which cp.async cannot pipeline: more stages hide their latency.
                stages = (3,) if quick else (3, 4) if bk == 64 else (2, 3)
                out += [GemmConfig(bn, bk, warps, st) for st in stages]
    return out


def int_list(text: str) -> list[int]:
    return [int(m) for m in text.split(",") if m]


def best(label, configs, call, reps, verbose=False):
    """(µs of one replay over all layers, config) of the fastest candidate; `call(cfg)` runs every layer once."""
    timed = []
    for cfg in configs:
        try:
            timed.append((time_graph(lambda cfg=cfg: call(cfg), reps), cfg))
            if verbose:
                print(f"    {label} {short(cfg)}: {timed[-1][0]:.1f} µs", flush=True)
        except Exception as exc:  # a failing candidate is reported and skipped
            print(f"  FAILED {label} {short(cfg)}: {str(exc).splitlines()[0][:200]}", flush=True)
    if not timed:
        raise RuntimeError(f"every {label} candidate failed")
    return min(timed, key=lambda x: x[0])


def tune_bucket(T, mx, layers, reps, dequant="bf16", quick=False, verbose=False, block_m=None, grid=None):
    """`grid`: candidates()'s stages and tma keywords (FP8 only)."""
    H, I, E, k = SHAPE["H"], SHAPE["I"], SHAPE["E"], SHAPE["k"]
    inputs = make_inputs(T, H, E, k, layers, seed=T)
    device = inputs[0][0].device
    part = torch.empty(T * k, H, dtype=torch.float32, device=device)
    results = []
    fp8 = dequant == "fp8"
    xs = [fp8_split_rows(h) if fp8 else h for h, _, _ in inputs]
    for bm in block_m or block_ms(T, k, E):
        aligned = [moe_align(ids, E, bm) for _, _, ids in inputs]
        if fp8:
            acts = [FP8Split.empty(s.shape[0], I, I // 32, device) for s, _ in aligned]
        else:
            acts = [torch.zeros(s.shape[0], I, dtype=torch.bfloat16, device=device) for s, _ in aligned]

        def gate_up(cfg, bm=bm, aligned=aligned, acts=acts):
            for x, (s, b), w, act in zip(xs, aligned, mx, acts, strict=True):
                kw = dict(num_pairs=T * k, top_k=k, block_m=bm, block_n=cfg.block_n, block_k=cfg.block_k,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                if fp8:
                    moe_gate_up_fp8(x, s, b, w[0], act, **kw, tma=cfg.tma)
                else:
                    moe_gate_up(x, s, b, w[0], act, **kw, dequant=dequant)

        def down(cfg, bm=bm, aligned=aligned, acts=acts):
            for (_, wts, _), (s, b), w, act in zip(inputs, aligned, mx, acts, strict=True):
                kw = dict(block_m=bm, block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages)
                if fp8:
                    moe_down_fp8(act, s, b, wts, w[1], part, **kw, tma=cfg.tma, tma_act=cfg.tma_act)
                else:
                    moe_down(act, s, b, wts, w[1], part, **kw, dequant=dequant)

        gu_us, gu = best(f"T={T} bm={bm} gate_up", candidates("gate_up", bm, quick, fp8, **grid or {}), gate_up, reps,
                          verbose)
        gate_up(gu)  # real act values for down
        dn_us, dn = best(f"T={T} bm={bm} down", candidates("down", bm, quick, fp8, **grid or {}), down, reps, verbose)
        print(f"  T={T} block_m={bm}: gate_up {gu_us / layers:.1f} µs ({short(gu)}), down {dn_us / layers:.1f} µs "
              f"({short(dn)})", flush=True)
        results.append((gu_us + dn_us, ExpertCentricConfig(bm, gu, dn)))
    cfg = min(results, key=lambda x: x[0])[1]
    outs = [torch.empty_like(h) for h, _, _ in inputs]
    ec_us = time_graph(lambda: [expert_centric_moe(*inp, *w, config=cfg, dequant=dequant, out=o)
                                for inp, w, o in zip(inputs, mx, outs, strict=True)], reps) / layers
    h0, w0, i0 = inputs[0]
    err = rel_err(outs[0], moe_reference(h0.float(), w0, i0, *mx[0], compute_dtype=torch.float32))
    if not err < 1e-2:  # a tile that skips work is fast too: the winners must still compute the layer
        raise RuntimeError(f"T={T}: the fastest tiles {short(cfg)} give relative error {err:.3g} against FP32")
    return cfg, ec_us, err, inputs


def short(cfg) -> str:
    """'n128 k64 w8 s3' for a GemmConfig, 'm64 | gate_up ... | down ...' for an ExpertCentricConfig."""
    if isinstance(cfg, GemmConfig):
        return (f"n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + (" tma" if cfg.tma else "")
                + (" act" if cfg.tma_act else ""))
    return f"m{cfg.block_m} | gate_up {short(cfg.gate_up)} | down {short(cfg.down)}"


def crossover_of(measured: dict) -> int:
    """The largest tuned T up to which warp decode measured faster than expert-centric at every bucket (0: not even
    at the first); a bucket where either was not measured ends the run of wins."""
    crossover = 0
    for T in sorted(measured, key=int):
        warp, ec = measured[T].get("warp_decode_us"), measured[T].get("expert_centric_us")
        if warp is None or ec is None or warp > ec:
            break
        crossover = int(T)
    return crossover


def merge_table(old: dict | None, fresh: dict, key: str) -> dict:
    """The table to write: `fresh` (this run's, one shape `key`) over `old` (the file already at the path, or None).
    Of the same dequant mode, old's other shapes and untuned buckets stay, a tuned bucket's config and measurements
    replace old's, the crossover is recomputed over the merged measurements and the note records the retune."""
    if not old or old.get("dequant", "bf16") != fresh["dequant"]:
        return fresh
    was, now = old.get("shapes", {}).get(key, {}), fresh["shapes"][key]
    entry = dict(was, weights=now["weights"])
    for part in ("configs", "measured"):
        entry[part] = dict(sorted({**was.get(part, {}), **now[part]}.items(), key=lambda kv: int(kv[0])))
    if "crossover_tokens" in now:
        entry["crossover_tokens"] = crossover_of(entry["measured"])
    tuned = ", ".join(sorted(now["configs"], key=int))
    note = f"{old.get('note', fresh['note'])} {fresh['date']}: T = {tuned} retuned on an {fresh['device']}."
    return dict(fresh, note=note, shapes={**old.get("shapes", {}), key: entry})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=CONFIG_DIR)
    parser.add_argument("--tokens", default=",".join(map(str, BUCKETS)))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=240, help="no new bucket is started after this many seconds")
    parser.add_argument("--dequant", default="bf16", choices=("bf16", "f16_rel", "fp8"))
    parser.add_argument("--quick", action="store_true", help="one num_stages per tile: a short check of a variant")
    parser.add_argument("--verbose", action="store_true", help="print every candidate's time")
    parser.add_argument("--block-m", type=int_list, default=[],
                        help="BLOCK_M values to try at every T, comma-separated (default: near T * k / E)")
    parser.add_argument("--num-stages", type=int_list, default=[],
                        help="FP8 only: the num_stages values to try (default: 3 with --quick, else 2-5)")
    parser.add_argument("--tma", default="both", choices=("both", "on", "off"),
                        help="FP8 only: time each tile with TMA weight loads, without, or both")
    parser.add_argument("--replace", action="store_true",
                        help="write this run's buckets alone instead of merging them into the table already there")
    args = parser.parse_args()
    grid = dict(stages=tuple(args.num_stages), tma={"both": (False, True), "on": (True,), "off": (False,)}[args.tma])
    start = time.time()
    H, I, E, k = SHAPE["H"], SHAPE["I"], SHAPE["E"], SHAPE["k"]
    mx, _ = make_layers(H, I, E, args.layers, keep_bf16=0)
    print(f"{args.layers} layers of MXFP8 weights ready in {time.time() - start:.1f} s", flush=True)
    configs, measured, ec_wins = {}, {}, 0
    for T in (int(t) for t in args.tokens.split(",")):
        if time.time() - start > args.budget_s:
            print(f"WARNING: over the {args.budget_s:.0f} s budget, T >= {T} not tuned (the launcher takes the nearest "
                  "tuned bucket there)", flush=True)
            break
        cfg, ec_us, err, inputs = tune_bucket(T, mx, args.layers, args.reps, args.dequant, args.quick,
                                             args.verbose, args.block_m, grid)
        row = dict(expert_centric_us=round(ec_us, 2), rel_err=float(f"{err:.3g}"))
        if ec_wins < 2 and args.dequant != "f16_rel":  # f16_rel (opt-in) keeps the BF16 table's crossover
            outs = [torch.empty_like(h) for h, _, _ in inputs]
            row["warp_decode_us"] = round(time_graph(lambda inputs=inputs, outs=outs: [
                warp_decode_moe(*inp, *w, out=o) for inp, w, o in zip(inputs, mx, outs, strict=True)],
                args.reps) / args.layers, 2)
            ec_wins = ec_wins + 1 if ec_us < row["warp_decode_us"] else 0
        configs[str(T)], measured[str(T)] = dataclasses.asdict(cfg), row
        print(f"T={T:5d} {short(cfg):50s} expert_centric {ec_us:8.1f} µs  warp_decode "
              f"{row.get('warp_decode_us', '-')} µs  rel_err {err:.2e}  ({time.time() - start:.0f} s)", flush=True)
        del inputs
        torch.cuda.empty_cache()
    device, key = torch.cuda.get_device_name(), shape_key(E, H, I, k)
    props = torch.cuda.get_device_properties()
    # A GPU with no table of its own takes one whose capability and SM count match (expert_centric_moe.table_device).
    table = dict(device=device, capability=[props.major, props.minor], multiprocessors=props.multi_processor_count,
                 triton=triton.__version__, torch=torch.__version__,
                 date=datetime.date.today().isoformat(), tool="jobs/tune_expert_centric.py",
                 note="µs per layer, CUDA-graph replays over 8 layers of MXFP8 experts, uniform random routing",
                 dequant=args.dequant, shapes={key: dict(weights="mxfp8", configs=configs, measured=measured)})
    if args.dequant != "f16_rel":
        table["shapes"][key]["crossover_tokens"] = crossover_of(measured)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, table_name(device_key(torch.device("cuda")), args.dequant))
    if os.path.exists(path) and not args.replace:
        with open(path) as f:
            table = merge_table(json.load(f), table, key)
    entry = table["shapes"][key]
    crossover = entry.get("crossover_tokens", 0)
    if args.dequant != "f16_rel" and crossover == 0 and min(map(int, entry["measured"])) > 1:
        print(f"WARNING: expert-centric won the first tuned bucket, T = {min(map(int, entry['measured']))}; warp "
              "decode was not measured below it, so crossover_tokens 0 sends every T there to expert-centric: tune "
              "from T = 1", flush=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    print(json.dumps(dict(tune="expert_centric", dequant=args.dequant, device=device, crossover_tokens=crossover,
                          path=path,
                          seconds=round(time.time() - start, 1),
                          us={T: (m["expert_centric_us"], m.get("warp_decode_us")) for T, m in measured.items()})))


if __name__ == "__main__":
    main()
