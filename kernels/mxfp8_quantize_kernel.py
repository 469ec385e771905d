"""MXFP8 quantization on the GPU, bit-identical to the host quantizer (kernels/mxfp8.py): weight sync runs it
on each bucket as it arrives, writing straight into the worker's MXFP8 buffers.

Shapes and layout (n % 32 == 0; a block is 32 consecutive elements of the last dim):
    x            [..., n]                      bf16, fp16 or fp32
    out.data     float8_e4m3fn [..., n]        written as bytes
    out.scales   uint8 E8M0 [..., n // 32]     one per block, 2^(code - 127)
    nonfinite    int32, one element             the kernel adds the number of blocks holding inf or NaN
Each is row-major, or row-major under a strided first dim (a slice t[:, a:b] of a row-major tensor, so the
gate and up halves of a fused w13 [E, 2I, H] are written in place). Either way every run of blocks within one
first-dim index is contiguous, so the kernel is a stream of [BLOCKS, 32] tiles over a grid of
(blocks / BLOCKS, first dim or 1) programs, loads and stores 16 bytes wide. `mxfp8_quantize_triton_many` runs
a list of row-major tensors (a bucket of per-expert tensors) in one launch of the same kernel: grid row i reads
tensor i's addresses and block count from an int64 [S, 4] table.
Bytes moved: read 2 (bf16/fp16) or 4 (fp32) per element, write 1 + 1/32: 3.03 bytes per BF16 weight, 1.83 GB
per Qwen3-30B-A3B layer of experts. It is a streaming kernel: at the H200's ~4.5 TB/s each SM must retire ~6
elements per clock; compiled for sm_90 (BF16, 128 blocks, 4 warps) it issues ~19 instructions per element, ~11
of them on the 64-lane integer ALUs, so it should run near, not far under, the copy rate (jobs/bench_requant.py).

Why the arithmetic looks like this. Triton's interpreter rounds FP32 -> FP8 casts wrongly and flushes BF16
denormals when it widens them, so there is no cast: BF16 is read as int16 and shifted into FP32 bits, and every
later step is an integer operation or an IEEE FP32 multiply/add, correctly rounded both on the GPU (the PTX
has mul.f32 / fma.rn.f32 without .ftz: denormals kept) and in numpy. The CPU tests therefore run the GPU's
arithmetic. Per block, with a = |x| as FP32 bits and amax their integer max:
    code = clamp(E(amax) - 8 + (mantissa(amax) > 0x600000), 1, 254)
is the host's clamp(ceil(log2(amax / 448)), -126, 127) + 127 without the division: amax / 448 =
(1.m / 1.75) * 2^(E - 135), and 1.m / 1.75 > 1 exactly when m > 0.75 * 2^23 (checked for every finite amax
once offline, and at every binade's edges in the tests). Per element, y = |x| * 2^(127 - code) is exact (a
power of two; where it underflows the result is 0 either way) and is rounded to E4M3 by one FP32 add: with q
the E4M3 step at y, 2^(max(E(y), 121) - 130), y + 2^23 q lands in a binade whose FP32 step is q, so IEEE
round-half-even rounds y to a multiple of q and the sum's bits minus the constant's count the steps n (0..16).
The byte is ((max(E(y), 121) - 120) << 3) + n - 8, or'ed with the sign: a rounding that carries into the next
binade (n = 16) lands on the right exponent, and E4M3's subnormals (n < 8) fall out of the same expression
(checked for every FP32 y in [0, 448] once offline). Non-finite blocks get scale byte 255 (E8M0's NaN) and
unspecified data; counting them in `nonfinite` lets a sync check all its buckets with one host read.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.mxfp8 import MXFP8_BLOCK, MXFP8Tensor

_BLOCKS = 128  # 32-element blocks per program: 4096 elements, 8 KB of BF16 in flight per 4-warp program
_WARPS = 4
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (the strided first dim)


@triton.jit
def e8m0_code(amax):
    """The ceil-to-fit E8M0 code (1..254) of blocks whose largest |x| has FP32 bits `amax` (int32): the host's
    clamp(ceil(log2(amax / 448)), -126, 127) + 127 (module docstring)."""
    code = (amax >> 23) - 8 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(code, 1), 254)


@triton.jit
def inv_scale(code):
    """2^(127 - code) in FP32, normal for codes 1..253 (254 gives 2^-127, a denormal, still exact)."""
    return ((254 - code) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne(y):
    """y (FP32, 0 <= y <= 448) rounded to nearest-even E4M3: (its byte without the sign, int32; its value, FP32).
    One FP32 add does the rounding (module docstring); subtracting the constant back is exact (same binade)."""
    e_top = tl.maximum(y.to(tl.int32, bitcast=True) >> 23, 121)  # E4M3's binade of y; 121 = its subnormals
    magic = ((e_top + 20) << 23).to(tl.float32, bitcast=True)  # 2^23 * q for the E4M3 step q = 2^(e_top - 130)
    r = y + magic
    steps = r.to(tl.int32, bitcast=True) - magic.to(tl.int32, bitcast=True)
    return (e_top << 3) - 968 + steps, r - magic  # ((e_top - 120) << 3) + steps - 8


@triton.jit
def _mxfp8_quantize_kernel(x_ptr, d_ptr, s_ptr, bad_ptr, nblk, x_bstride, d_bstride, s_bstride, table_ptr,
                           BF16_BITS: tl.constexpr, TABLE: tl.constexpr, BLOCKS: tl.constexpr):
    pid, seg = tl.program_id(0), tl.program_id(1)
    if TABLE:  # segment = one tensor of a group: row `seg` of an int64 [S, 4] table (x, data, scales, blocks)
        x_ptr = tl.multiple_of(tl.load(table_ptr + seg * 4).to(x_ptr.dtype), 16)  # the launcher checks alignment
        d_ptr = tl.multiple_of(tl.load(table_ptr + seg * 4 + 1).to(d_ptr.dtype), 16)
        s_ptr = tl.load(table_ptr + seg * 4 + 2).to(s_ptr.dtype)
        nblk = tl.load(table_ptr + seg * 4 + 3)
        bad_ptr += seg
    else:  # segment = index along a strided first dim (0 when all is row-major)
        b = seg.to(tl.int64)
        x_ptr += b * x_bstride
        d_ptr += b * d_bstride
        s_ptr += b * s_bstride
    first = pid.to(tl.int64) * BLOCKS  # 64-bit offsets: a bucket may hold more than 2^31 elements
    row = tl.arange(0, BLOCKS)
    ok = pid * BLOCKS + row < nblk
    off = row[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + first * 32 + off, mask=ok[:, None], other=0)
    if BF16_BITS:  # BF16 read as int16: its FP32 bits are the top half (the interpreter's cast loses denormals)
        bits = x.to(tl.int32) << 16
    else:  # fp16 -> fp32 and fp32 -> fp32 are exact casts on both
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    amax = tl.max(a, axis=1)  # integer max of |x| bits: the float order for finite values, NaN-proof
    code = e8m0_code(amax)
    q, _ = e4m3_rne(a.to(tl.float32, bitcast=True) * inv_scale(code)[:, None])
    q = q | ((bits >> 24) & 0x80)
    bad = amax >= 0x7F800000
    tl.store(d_ptr + first * 32 + off, q.to(tl.uint8), mask=ok[:, None])
    tl.store(s_ptr + first + row, tl.where(bad, 255, code).to(tl.uint8), mask=ok)
    nbad = tl.sum((bad & ok).to(tl.int32), axis=0)
    if nbad > 0:
        tl.atomic_add(bad_ptr, nbad)


def _first_dim_stride(t: torch.Tensor, name: str, batched: bool) -> int:
    """The first dim's stride when `batched` (the rest must be row-major), else 0 (all row-major)."""
    if not batched:
        return 0
    if t.dim() < 2 or not (t.shape[0] == 0 or t[0].is_contiguous()):
        raise ValueError(f"{name} must be row-major, or row-major under a strided first dim (a slice t[:, a:b]), "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def _check_x(x, name):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be a bfloat16, float16 or float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"{name}: last dim must be a multiple of {MXFP8_BLOCK}, got shape {tuple(x.shape)}")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"{name} is on {x.device}: the kernel needs CUDA tensors (or Triton's interpreter)")


def _check_out(x, out, nonfinite, name):
    if not isinstance(out, MXFP8Tensor):
        raise TypeError(f"out must be an MXFP8Tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.device != x.device:
        raise ValueError(f"out must be {tuple(x.shape)} on {x.device} like {name}, got {tuple(out.shape)} on "
                         f"{out.device}")
    if nonfinite is not None and (not isinstance(nonfinite, torch.Tensor) or nonfinite.dtype != torch.int32
                                  or nonfinite.numel() != 1 or nonfinite.device != x.device):
        raise ValueError(f"nonfinite must be a one-element int32 tensor on {x.device}, got "
                         f"{getattr(nonfinite, 'dtype', type(nonfinite))} {tuple(getattr(nonfinite, 'shape', ()))}")


def mxfp8_quantize_triton(x: torch.Tensor, out: MXFP8Tensor | None = None, *, nonfinite: torch.Tensor | None = None,
                          name: str = "x", blocks_per_program: int = _BLOCKS, num_warps: int = _WARPS) -> MXFP8Tensor:
    """kernels.mxfp8.mxfp8_quantize(x), bit for bit, written into `out` if given (else a new MXFP8Tensor).

    Non-finite input: with `nonfinite` (a one-element int32 tensor, e.g. counts[i:i+1] of a per-sync array
    the caller zeroed) the kernel adds the number of blocks holding inf/NaN to it and the call never waits on
    the GPU; check once per sync with `raise_if_nonfinite`. Without it (checked mode) the call reads the count
    back, one host sync, and raises ValueError naming `name`, as the host quantizer raises. `name` also labels
    argument errors; `blocks_per_program` and `num_warps` are the tile (jobs/bench_requant.py sweeps them)."""
    _check_x(x, name)
    if out is None:
        out = MXFP8Tensor(torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                          torch.empty((*x.shape[:-1], x.shape[-1] // MXFP8_BLOCK), dtype=torch.uint8,
                                      device=x.device))
    _check_out(x, out, nonfinite, name)
    tensors = ((x, name), (out.data, "out.data"), (out.scales, "out.scales"))
    batched = not all(t.is_contiguous() for t, _ in tensors)
    strides = [_first_dim_stride(t, label, batched) for t, label in tensors]
    nb = x.shape[0] if batched else 1
    if nb > _MAX_GRID_Y:
        raise ValueError(f"{name}: a strided first dim of {nb} exceeds {_MAX_GRID_Y}; pass row-major tensors")
    checked = nonfinite is None
    if x.numel() == 0:
        return out
    if checked:
        nonfinite = torch.zeros(1, dtype=torch.int32, device=x.device)
    nblk = x.numel() // nb // MXFP8_BLOCK
    grid = (triton.cdiv(nblk, blocks_per_program), nb)
    bf16 = x.dtype == torch.bfloat16
    _mxfp8_quantize_kernel[grid](x.view(torch.int16) if bf16 else x, out.data.view(torch.uint8), out.scales,
                                 nonfinite, nblk, *strides, None, BF16_BITS=bf16, TABLE=False,
                                 BLOCKS=blocks_per_program, num_warps=num_warps)
    if checked:
        raise_if_nonfinite(nonfinite, [name])
    return out


def mxfp8_quantize_triton_many(xs: Sequence[torch.Tensor], outs: Sequence[MXFP8Tensor], *,
                               nonfinite: torch.Tensor | None = None, names: Sequence[str] | None = None,
                               blocks_per_program: int = _BLOCKS, num_warps: int = _WARPS) -> list[MXFP8Tensor]:
    """mxfp8_quantize_triton(xs[i], outs[i]) for every i in one launch (per 65,535 tensors). A weight-sync bucket
    of per-expert Hugging Face tensors (Qwen3-30B-A3B has 18,432) would otherwise pay a launch and its checks,
    tens of µs of host time, for ~1 µs of GPU work each. The xs share one dtype and device; every x, out.data
    and out.scales must be row-major, and x and out.data 16-byte aligned (the kernel reads their addresses from
    a table, so it cannot see their alignment). `nonfinite`: int32 [len(xs)], tensor i's count of non-finite
    blocks added at i, no host sync; without it the call reads the counts once and raises naming the tensors
    (`names`)."""
    names = list(names) if names is not None else [f"xs[{i}]" for i in range(len(xs))]
    if not len(xs) == len(outs) == len(names):
        raise ValueError(f"xs, outs and names need one entry per tensor, got {len(xs)}, {len(outs)}, {len(names)}")
    if not xs:
        return []
    _check_x(xs[0], names[0])
    dtype, device = xs[0].dtype, xs[0].device
    table = []
    for x, out, name in zip(xs, outs, names, strict=True):
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.device != device:
            raise TypeError(f"{name} must be a {dtype} tensor on {device} like {names[0]}, got "
                            f"{getattr(x, 'dtype', type(x))} on {getattr(x, 'device', None)}")
        if x.dim() == 0 or x.shape[-1] % MXFP8_BLOCK:
            raise ValueError(f"{name}: last dim must be a multiple of {MXFP8_BLOCK}, got shape {tuple(x.shape)}")
        _check_out(x, out, None, name)
        for t, label, align in ((x, name, 16), (out.data, f"{name}'s out.data", 16),
                                (out.scales, f"{name}'s out.scales", 1)):  # scales are stored byte by byte
            if not t.is_contiguous() or t.data_ptr() % align:
                raise ValueError(f"{label} must be row-major{' and 16-byte aligned' * (align > 1)}, got strides "
                                 f"{t.stride()} at {t.data_ptr():#x} (mxfp8_quantize_triton takes a strided first dim)")
        # An empty tensor is a segment of 0 blocks: its programs store nothing.
        table.append((x.data_ptr(), out.data.data_ptr(), out.scales.data_ptr(), x.numel() // MXFP8_BLOCK))
    checked = nonfinite is None
    if checked:
        nonfinite = torch.zeros(len(xs), dtype=torch.int32, device=device)
    elif not (isinstance(nonfinite, torch.Tensor) and nonfinite.dtype == torch.int32 and nonfinite.is_contiguous()
              and nonfinite.numel() == len(xs) and nonfinite.device == device):
        raise ValueError(f"nonfinite must be a contiguous int32 tensor of {len(xs)} elements on {device}")
    _launch_table(xs[0], outs[0], table, nonfinite, blocks_per_program, num_warps)
    if checked:
        raise_if_nonfinite(nonfinite, names)
    return list(outs)


def mxfp8_quantize_into_rows(xs: Sequence[torch.Tensor], out: MXFP8Tensor, rows: Sequence[int], *,
                             nonfinite: torch.Tensor, names: Sequence[str]) -> None:
    """xs[i] quantized into the rows rows[i] .. rows[i] + xs[i].numel() / C - 1 of `out`, a row-major MXFP8 buffer
    [..., C] read as [rows, C] (a weight sync's staged fused experts), in one launch per 65,535 tensors; `nonfinite`:
    int32 [len(xs)], tensor i's count of non-finite blocks added at i (no host sync). As
    `mxfp8_quantize_triton_many`, but `out` is checked once instead of an MXFP8Tensor view per tensor: the views and
    their checks were ~10 µs of host time per tensor, a quarter of a second per Hub-layout sync of Qwen3-30B-A3B.
    Each x must be row-major, 16-byte aligned, of xs[0]'s dtype and device, and whole rows of C."""
    if not (len(xs) == len(rows) == len(names)):
        raise ValueError(f"xs, rows and names need one entry per tensor, got {len(xs)}, {len(rows)}, {len(names)}")
    if not xs:
        return
    _check_x(xs[0], names[0])
    C = out.shape[-1]
    if not (out.data.is_contiguous() and out.scales.is_contiguous()) or out.device != xs[0].device:
        raise ValueError(f"out must be a row-major MXFP8 buffer on {xs[0].device}, got strides {out.data.stride()} "
                         f"on {out.device}")
    if not (isinstance(nonfinite, torch.Tensor) and nonfinite.dtype == torch.int32 and nonfinite.is_contiguous()
            and nonfinite.numel() == len(xs) and nonfinite.device == out.device):
        raise ValueError(f"nonfinite must be a contiguous int32 tensor of {len(xs)} elements on {out.device}")
    total, dtype, device = out.data.numel() // max(C, 1), xs[0].dtype, xs[0].device
    d0, s0 = out.data.data_ptr(), out.scales.data_ptr()
    table = []
    for x, row, name in zip(xs, rows, names, strict=True):
        n = x.numel()
        if x.dtype != dtype or x.device != device or not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"{name} must be a row-major, 16-byte aligned {dtype} tensor on {device} like "
                             f"{names[0]}, got {x.dtype} strides {x.stride()} at {x.data_ptr():#x} on {x.device}")
        if n % C or not 0 <= row <= total - n // C or (row * C) % 16:
            raise ValueError(f"{name}: {n} elements at row {row} do not fill whole, 16-byte aligned rows of out "
                             f"[{total}, {C}]")
        table.append((x.data_ptr(), d0 + row * C, s0 + row * (C // MXFP8_BLOCK), n // MXFP8_BLOCK))
    _launch_table(xs[0], out, table, nonfinite, _BLOCKS, _WARPS)


def _launch_table(x0: torch.Tensor, out0: MXFP8Tensor, table: list, nonfinite: torch.Tensor, blocks_per_program: int,
                  num_warps: int) -> None:
    """The kernel over a table of (x, data, scales addresses, blocks) rows; x0 and out0 give the pointer types."""
    most = max(row[3] for row in table)
    table = torch.tensor(table, dtype=torch.int64)
    if x0.device.type == "cuda":  # pinned, so the copy is queued on the stream instead of waiting for it
        table = table.pin_memory().to(x0.device, non_blocking=True)
    bf16 = x0.dtype == torch.bfloat16
    x0, d0 = (x0.view(torch.int16) if bf16 else x0), out0.data.view(torch.uint8)
    for c0 in range(0, table.shape[0], _MAX_GRID_Y):
        c1 = min(c0 + _MAX_GRID_Y, table.shape[0])
        grid = (max(1, triton.cdiv(most, blocks_per_program)), c1 - c0)
        _mxfp8_quantize_kernel[grid](x0, d0, out0.scales, nonfinite[c0:c1], 0, 0, 0, 0, table[c0:c1],
                                     BF16_BITS=bf16, TABLE=True, BLOCKS=blocks_per_program, num_warps=num_warps)


def raise_if_nonfinite(counts: torch.Tensor, names: list[str]) -> None:
    """One host read of per-tensor non-finite block counts (as filled by `nonfinite=counts[i:i+1]`); raises
    ValueError naming every tensor that had inf or NaN."""
    if len(names) != counts.numel():
        raise ValueError(f"counts has {counts.numel()} entries for {len(names)} names")
    bad = [(n, c) for n, c in zip(names, counts.reshape(-1).tolist(), strict=True) if c]
    if bad:
        listed = ", ".join(f"{n} ({c} block{'s' * (c > 1)} of 32)" for n, c in bad)
        raise ValueError(f"mxfp8_quantize_triton: non-finite values (inf or NaN) in {listed}")
