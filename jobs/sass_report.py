"""What a Triton kernel compiles to on sm_90, without a GPU: registers, shared memory, spills and the SASS of its
hottest loop, from triton.compile and the ptxas / cuobjdump that ship in Triton's wheel.

Why: device time comes in short sessions and many of them start no machine, while most kernel questions asked of
the GPU so far were answered by the SASS (the FP8 GEMMs' scale words converted through shared memory every K
step, the E4M3 conversions of the prefill tiles, a fused epilogue's registers: docs/perf.md). Every session
rebuilt this in a scratch script; one of them forgot the JIT's pointer alignment, and its "SASS" loaded the
hidden tile byte by byte. Here every pointer argument gets the 16-byte divisibility the JIT gives aligned tensors,
and the loop reported is the largest backward branch's body (a K loop), with the instructions that say where a
step waits: barriers, shared memory, global loads and copies, tensor-core ops.

Usage: python3 jobs/sass_report.py MODULE:KERNEL --sig "x_ptr=*fp8e4nv,P=i32,..." --const "H=2048,TMA=True,..."
    [--warps 4] [--stages 3] [--sass FILE]
--sig names every runtime argument with Triton's signature types (*bf16, *fp8e4nv, *i32, i32, fp32,
tensordesc<fp8e4nv[1, 2, 64, 32]>); --const every constexpr (ints, True / False, or tl dtypes as "tl.bfloat16").
Give each pointer the dtype its launcher passes for those constexprs: the FP8 GEMMs' scale words are *i16 at
BLOCK_K 64, *i32 at 128, *i64 at 256 (mx_tiles.packed_scales). With a narrower word the byte shifts pass the word's
width, LLVM treats the result as poison, and the dots that depend on it vanish from the SASS (seen: gate_up n32
k256 compiled with *i16 reported no QGMMA, 32 registers and a 128-instruction loop, against 389 with *i64).
Prints a table and ends with one JSON line.
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# The loop instructions worth counting: what a step waits on or moves data with.
LOOP_OPS = ("BAR", "MEMBAR", "LDS", "LDSM", "STS", "LDG", "LDGSTS", "LDGDEPBAR", "UTMALDG", "SYNCS", "QGMMA", "HGMMA",
            "WARPGROUP", "SHFL")
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """triton.compile of `fn` for sm_90: `signature` {arg: type} for runtime arguments, `constexprs` {arg: value}."""
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise TypeError(f"{getattr(fn, '__name__', fn)} is not a JITFunction (TRITON_INTERPRET set?): the interpreter "
                        f"compiles nothing; unset TRITON_INTERPRET")
    names = fn.arg_names
    missing = [a for a in names if a not in signature and a not in constexprs]
    unknown = [a for a in (*signature, *constexprs) if a not in names]
    if missing or unknown:
        raise ValueError(f"{fn.__name__}: arguments without a --sig or --const {missing}, unknown {unknown}")
    sig = {a: "constexpr" if a in constexprs else signature[a] for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(BIN, "cuobjdump"), *flags, path], capture_output=True, text=True,
                              check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS line, its predicate (@P0, @!UP1) kept; lines predicated on never (@!PT,
    ptxas's padding) left out."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines())
            if m and not m.group(2).startswith("@!PT ")]


def opcode(instr: str) -> str:
    """'LDG' of '@!P0 LDG.E.U16 R3, ...'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def loop_body(instrs: list[tuple[int, str]]) -> list[str]:
    """The instructions of the largest loop: from a conditional backward branch's target to the branch. Unconditional
    backward branches are the out-of-line mbarrier spin-waits returning into the loop, and a spin-wait's own
    conditional branch jumps one instruction back: neither is a loop."""
    best = (0, 0)
    for addr, ins in instrs:
        m = re.match(r"@!?U?P\w+\s+BRA\s+(0x[0-9a-f]+)", ins)
        if m and 0x20 < addr - int(m.group(1), 16) and addr - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr)
    return [ins for addr, ins in instrs if best[0] <= addr <= best[1]] if best[1] else []


def report(kernel) -> dict:
    cubin = kernel.asm["cubin"]
    sass = _cuobjdump(cubin, "-sass")
    res = re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage"))
    instrs = instructions(sass)
    ops = Counter(opcode(i) for _, i in instrs)
    loop = loop_body(instrs)
    loop_ops = Counter(opcode(i) for i in loop)
    return dict(registers=int(res.group(1)), shared_bytes=kernel.metadata.shared,
                spills=bool(ops["STL"] or ops["LDL"]), instructions=len(instrs), loop_instructions=len(loop),
                loop_ops={o: loop_ops[o] for o in LOOP_OPS if loop_ops[o]}, sass=sass)


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    if text.startswith("tl."):
        return getattr(tl, text[3:])
    return int(text)


def _pairs(text: str) -> dict:
    # split on commas outside brackets: tensordesc types hold their own commas
    parts = re.split(r",(?![^\[]*\])", text) if text else []
    return dict(p.split("=", 1) for p in parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", help="MODULE:KERNEL, e.g. kernels.moe_gate_up_fp8:_gate_up_fp8_kernel")
    p.add_argument("--sig", required=True)
    p.add_argument("--const", default="")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--sass", help="write the whole SASS here")
    args = p.parse_args()
    module, _, name = args.kernel.partition(":")
    fn = getattr(importlib.import_module(module), name)
    consts = {k: _value(v) for k, v in _pairs(args.const).items()}
    out = report(compile_sm90(fn, _pairs(args.sig), consts, args.warps, args.stages))
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(out["sass"])
    del out["sass"]
    print(f"{args.kernel} (sm_90, {args.warps} warps, {args.stages} stages)")
    for key in ("registers", "shared_bytes", "spills", "instructions", "loop_instructions"):
        print(f"  {key:18} {out[key]}")
    print("  loop ops          " + "  ".join(f"{o} {n}" for o, n in out["loop_ops"].items()))
    print(json.dumps(dict(kernel=args.kernel, warps=args.warps, stages=args.stages, **out)))


if __name__ == "__main__":
    main()
