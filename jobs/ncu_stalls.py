"""Where a kernel's warps stall, per SASS instruction: a summary of Nsight Compute's source page.

Why: the FP8 expert-centric GEMMs were steered twice by this reading (docs/perf.md: the scale words and load
queues before TMA, the weight boxes' mbarrier wait after), each time by an ad-hoc parse of the same CSV. Per
kernel in the export: the warp-stall samples by reason (stall_long_sb, stall_barrier, ...), by opcode (the SASS
mnemonic before the first dot), and the instructions holding the most samples with the reasons that make up at
least a fifth of each. The CPU can run it on a CSV fetched from the GPU machine.

Usage (on the GPU machine, then anywhere):
    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:NAME -o REP python ...
    ncu -i REP.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 jobs/ncu_stalls.py sass.csv [--top 14]
prints a block per kernel and ends with one JSON line ({kernel: {samples, reasons %, opcodes %}}).
"""

import argparse
import csv
import io
import json
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(text: str) -> dict[str, list[dict]]:
    """{kernel name: its rows} of a `--page source --csv` export: one '"Kernel Name","..."' line per kernel, each
    followed by a header line and one row per SASS instruction."""
    out = {}
    for part in text.split('"Kernel Name",')[1:]:
        first, _, body = part.partition("\n")
        name = next(csv.reader([first]))[0]
        out[name] = list(csv.DictReader(io.StringIO(body)))
    if not out:
        raise ValueError("no '\"Kernel Name\"' line: not an `ncu --page source --csv` export")
    return out


def opcode(source: str) -> str:
    """'BRA' of '@!P2  BRA 0x7f..', 'WARPGROUP' of 'WARPGROUP.DEPBAR.LE gsb0, 0x0'."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def summarize(rows: list[dict], top: int) -> dict:
    if not rows or SAMPLES not in rows[0]:
        raise ValueError(f"no '{SAMPLES}' column: profile with --section WarpStateStats --section SourceCounters")
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    samples = [int(r[SAMPLES] or 0) for r in rows]
    total = sum(samples) or 1
    by_reason, by_op = Counter(), Counter()
    hot = []
    for r, s in zip(rows, samples, strict=True):
        counts = {k.removeprefix("stall_"): int(r[k] or 0) for k in reasons}
        by_reason.update(counts)
        by_op[opcode(r["Source"])] += s
        hot.append((s, r["Address"], r["Source"].strip(), {k: v for k, v in counts.items() if v >= 0.2 * s > 0}))
    hot.sort(key=lambda h: -h[0])
    return dict(samples=sum(samples), reasons={k: round(100 * v / total, 1) for k, v in by_reason.most_common(10)},
                opcodes={k: round(100 * v / total, 1) for k, v in by_op.most_common(12)},
                hot=[dict(pct=round(100 * s / total, 1), address=a, source=src[:80], reasons=why)
                     for s, a, src, why in hot[:top]])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    with open(args.csv) as f:
        found = kernels(f.read())
    result = {}
    for name, rows in found.items():
        s = result[name] = summarize(rows, args.top)
        print(f"{name}: {s['samples']} samples")
        print("  by reason: " + ", ".join(f"{k} {v}%" for k, v in s["reasons"].items()))
        print("  by opcode: " + ", ".join(f"{k} {v}%" for k, v in s["opcodes"].items()))
        for h in s["hot"]:
            print(f"  {h['pct']:5.1f}%  {h['source']:60s} {h['reasons']}")
    print(json.dumps({name: {k: v for k, v in s.items() if k != "hot"} for name, s in result.items()}))


if __name__ == "__main__":
    main()
