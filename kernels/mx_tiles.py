"""Tile loaders shared by the expert-centric grouped GEMMs: BF16 or MXFP8 operands, dequantized on load.

No kernel here: @triton.jit helpers that the kernels in kernels/moe_gate_up.py and kernels/moe_down.py
inline, as does warp decode's expert schedule (kernels/warp_decode_moe.py) for its FP32 TF32-dot tiles. Each
returns a tile in the dot's operand dtype `DOT`: BF16 on the GPU (tensor cores, FP32 accumulate), FP32 under
Triton's interpreter, whose BF16 tl.dot multiplies raw bits. MXFP8 dequantization is exact either way:
an E4M3 value (3 mantissa bits) times 2^(scale - 127) fits BF16, whose exponent range is FP32's. On the GPU the
E4M3 -> BF16 step is `e4m3_to`'s bit moves, not the compiler's conversion (E4M3 -> FP16 -> BF16, three conversion
instructions per two weights at a quarter of the integer issue rate).

Tiles are loaded as [BK/32, 32, R] so that each E8M0 scale is loaded once and broadcast over its 32 elements,
then reshaped to [BK, R] (the reduction dimension first, ready for tl.dot).

dequant "f16_rel" (`row_scale_max`, `row_tile_rel`, `kmajor_tile_rel`): FP16 dot operands, because E4M3 -> FP16
is exact and one instruction per two elements (cvt e4m3x2 -> f16x2), where the compiler's E4M3 -> BF16 took three
conversions per two weights before `e4m3_to` (the MXFP8 GEMMs were bound by per-weight arithmetic, not bytes).
FP16's exponent range (2^-24 .. 65504) cannot hold the E8M0 scales, so each operand is made relative: a weight row
holds its groups' values times 2^(s - smax) (smax: the row's largest scale code), a power of two <= 1 applied in
FP16, and the kernel multiplies the row's accumulator by 2^(smax - 127) after the K loop; an activation column
(token) is multiplied per K chunk by a power of two 2^c that puts its chunk maximum in [2^15, 2^16), and each
chunk's FP32 dot by 2^-c before it joins the accumulator. Exactness (docstrings below): exact unless one row's
scales span more than 15 binades, or one token's values within a chunk more than 33; beyond, the error is below
2^-24 of the row's largest weight and 2^-40 of the token chunk's largest value. Under the interpreter the same
FP16 values are computed, then widened to FP32 for the dot.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.mxfp8 import MXFP8Tensor

DEQUANT_MODES = ("bf16", "f16_rel")


def pdl_launch() -> dict:
    """Launch options for a kernel with a `PDL` constexpr that calls tl.extra.cuda.gdc_wait() before its first
    memory access: on the GPU it is launched as a programmatic dependent of the previous kernel (sm_90), so its
    CTAs are scheduled while that kernel's last wave drains, and wait there for its results (with
    kernels/skinny_linear.py, a batch-1 Qwen3-30B-A3B decode step went from 3,129 to 2,740 µs: docs/perf.md). The
    dense decode kernels also call gdc_launch_dependents() first, so the next launch's CTAs start as soon as all of
    this one's have, and a projection's weights (loaded before its wait) stream during the attention or norm before
    it (H100, 30B decode step: -3% at B = 1, -6% at 4, -1.2% at 64); the MoE's launches do not (through them it
    measured 2.5-3.9% slower). The wait is for the previous kernel's completion and every such kernel waits before
    touching activations, so a chain keeps stream order. Triton's interpreter cannot run griddepcontrol: off there."""
    if triton.knobs.runtime.interpret:
        return dict(PDL=False)
    return dict(PDL=True, launch_pdl=True)


def dot_dtype(dequant: str = "bf16"):
    """The tensor-core operand dtype: BF16 (FP16 for dequant "f16_rel"), except under Triton's interpreter (CPU),
    whose low-precision tl.dot is wrong: FP32 there, on operands holding the same values."""
    if triton.knobs.runtime.interpret:
        return tl.float32
    return tl.float16 if dequant == "f16_rel" else tl.bfloat16


def check_dequant(dequant: str, weights_mx: bool) -> bool:
    """True for "f16_rel"; raises on an unknown mode, or on "f16_rel" with BF16 weights (not exact in FP16)."""
    if dequant not in DEQUANT_MODES:
        raise ValueError(f"dequant must be one of {DEQUANT_MODES}, got {dequant!r}")
    if dequant == "f16_rel" and not weights_mx:
        raise ValueError("dequant 'f16_rel' needs MXFP8 weights: BF16 weights do not fit FP16's exponent range")
    return dequant == "f16_rel"


def operand_parts(x):
    """(data, scales, True) of an MXFP8Tensor, (x, x, False) of a dense tensor: the kernels' operand arguments."""
    return (x.data, x.scales, True) if isinstance(x, MXFP8Tensor) else (x, x, False)


@triton.jit
def block_slots(sorted_ptr, mb, P, BLOCK_M: tl.constexpr):
    """(slot, pair, ok) of row block `mb` of the grouped GEMMs: its BLOCK_M slots, the pair each holds
    (kernels/moe_align.py's sorted_ids), and which hold one (padding holds the sentinel P)."""
    slot = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + slot)
    return slot, pair, pair < P


@triton.jit
def tail_mask(idx, N: tl.constexpr, BLOCK: tl.constexpr):
    """idx < N for indices in blocks of BLOCK; a constant mask when BLOCK divides N, so that masked loads stay
    unpredicated 16-byte copies."""
    if N % BLOCK == 0:
        return tl.full(idx.shape, 1, tl.int1)
    return idx < N


@triton.jit
def e8m0_to_f32(s):
    """2^(s - 127) for E8M0 codes 1..254, by placing the code in FP32's exponent field."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to(x, DOT: tl.constexpr):
    """E4M3 values `x` in DOT dtype. To BF16 on the GPU by integer bit moves and one BF16 multiply per two values:
    the compiler's E4M3 -> BF16 goes E4M3 -> FP16 -> BF16, three conversion instructions per two values, and
    conversions issue at a quarter of the integer rate on sm_90 (the prefill GEMMs 6-8% faster without them, and
    4-warp tiles fit: docs/perf.md). The two values' 16 bits are sign-extended byte by byte into two 16-bit lanes
    (one byte permute), shifted left by 4 and masked, which leaves sign | 0000eeee | mmm0000 in each lane (the E4M3
    fields in BF16's places, the exponent still biased by 7), and a multiply by 2^120 rebiases it: exact for normal
    and subnormal E4M3 values alike (a subnormal's pattern is a BF16 subnormal, m/8 * 2^-126, which the multiply
    keeps; the GPU test checks every code). E4M3's NaN codes come out as +-480 (MXFP8 marks NaN blocks in the
    scale, not the elements). Triton's interpreter runs no inline PTX, and its dots are FP32 anyway: a plain
    conversion there and for other dtypes."""
    if DOT == tl.bfloat16:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, c;
            cvt.u32.u16 t, $1;
            prmt.b32 t, t, 0, 0x9180;
            shl.b32 t, t, 4;
            and.b32 t, t, 0x87F087F0;
            mov.b32 c, 0x7B807B80;
            mul.rn.bf16x2 $0, t, c;
            }""",
            constraints="=r,h", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=2)
    return x.to(DOT)


@triton.jit
def kmajor_tile(d_ptr, s_ptr, row, row_ok, k0, KDIM: tl.constexpr, BK: tl.constexpr, IS_MX: tl.constexpr,
                DOT: tl.constexpr):
    """M[row, k0:k0+BK] transposed to [BK, R] in DOT dtype, for a row-major matrix M [rows, KDIM] (data) with
    E8M0 scales [rows, KDIM/32] when IS_MX. Rows outside row_ok and columns past KDIM read as zero."""
    if IS_MX:
        g = tl.arange(0, BK // 32)
        kk = k0 + g[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
        w = tl.load(d_ptr + row[None, None, :] * KDIM + kk, mask=_mask(row_ok[None, None, :], kk, KDIM, BK), other=0.0)
        sg = k0 // 32 + g[:, None, None]
        s = tl.load(s_ptr + row[None, None, :] * (KDIM // 32) + sg, mask=row_ok[None, None, :] & (sg < KDIM // 32),
                    other=127)
        return tl.reshape(e4m3_to(w, DOT) * e8m0_to_f32(s).to(DOT), (BK, row.shape[0]))
    kk = k0 + tl.arange(0, BK)[:, None]
    return tl.load(d_ptr + row[None, :] * KDIM + kk, mask=_mask(row_ok[None, :], kk, KDIM, BK), other=0.0).to(DOT)


@triton.jit
def row_tile(d_ptr, s_ptr, row, row_ok, k0, KDIM: tl.constexpr, BK: tl.constexpr, IS_MX: tl.constexpr,
             DOT: tl.constexpr):
    """M[row, k0:k0+BK] as [R, BK] in DOT dtype (the dot's left operand); same storage as kmajor_tile."""
    if IS_MX:
        g = tl.arange(0, BK // 32)
        kk = k0 + g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        x = tl.load(d_ptr + row[:, None, None] * KDIM + kk, mask=_mask(row_ok[:, None, None], kk, KDIM, BK), other=0.0)
        sg = k0 // 32 + g[None, :, None]
        s = tl.load(s_ptr + row[:, None, None] * (KDIM // 32) + sg, mask=row_ok[:, None, None] & (sg < KDIM // 32),
                    other=127)
        return tl.reshape(e4m3_to(x, DOT) * e8m0_to_f32(s).to(DOT), (row.shape[0], BK))
    kk = k0 + tl.arange(0, BK)[None, :]
    return tl.load(d_ptr + row[:, None] * KDIM + kk, mask=_mask(row_ok[:, None], kk, KDIM, BK), other=0.0).to(DOT)


@triton.jit
def fp8_split_dot(w, x, F32: tl.constexpr):
    """w @ (hi + lo) in FP32: E4M3 weights [R, 32] against activations split into two E4M3 terms
    (kernels/fp8_split.py) as [32, 2M] columns (2m: hi of column m, 2m + 1: its lo), one FP8 tensor-core dot whose
    column pairs are added after it: [R, M]. F32: the same values widened to FP32 (the interpreter has no FP8 dot)."""
    if F32:
        d = tl.dot(w.to(tl.float32), x.to(tl.float32))
    else:
        d = tl.dot(w, x)
    return tl.sum(tl.reshape(d, (d.shape[0], d.shape[1] // 2, 2)), axis=2)


@triton.jit
def k_group(w, j: tl.constexpr, G: tl.constexpr):
    """Columns 32j .. 32j + 31 of a [R, 32 * G] tile (G = 1, 2 or 4): one 32-wide scale group of a TMA box that
    spans G of them. Halves by reshape / permute / split, which Triton lowers to views of the box in shared memory
    (no copies: offline sm_90 SASS), so a step's groups can come in one box."""
    R: tl.constexpr = w.shape[0]
    if G == 1:
        out = w
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(w, (R, 2, 16 * G)), (0, 2, 1)))
        if G == 2:
            if j == 0:
                out = lo
            else:
                out = hi
        else:
            if j < 2:
                half = lo
            else:
                half = hi
            lo2, hi2 = tl.split(tl.permute(tl.reshape(half, (R, 2, 32)), (0, 2, 1)))
            if j % 2 == 0:
                out = lo2
            else:
                out = hi2
    return out


TMA_BOX_K = 128  # widest box along K: 128 bytes of E4M3 a row, the widest the copy engine swizzles


def tma_box_k(block_k: int, tma: bool) -> int:
    """K-width of the weight loads of a step of block_k: with TMA the whole step where it fits one box, else 128;
    per-thread copies take one 32-wide group at a time."""
    return min(block_k, TMA_BOX_K) if tma else 32


def tma_descriptor(name: str, data: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of `data` (unit stride last, 16-byte aligned base and strides, as the copy engine
    needs) loading `block`-shaped boxes; out-of-bounds parts of a box read as zero."""
    if data.stride(-1) != 1 or data.data_ptr() % 16 or any(s * data.element_size() % 16 for s in data.stride()[:-1]):
        raise ValueError(f"{name} for TMA needs a 16-byte aligned base and row strides with unit stride last, got "
                         f"strides {data.stride()} at offset {data.data_ptr() % 16} of 16")
    return TensorDescriptor.from_tensor(data, block)


_PACKED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def packed_scales(scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """E8M0 scales [..., K / 32] viewed block_k / 32 to a word (no copy): a kernel stepping block_k along K loads
    one word per row per step, which cp.async can pipeline (it moves at least 4 bytes), instead of a byte per
    32-wide group; `packed_scale` takes a group's byte out of the word."""
    per = block_k // 32
    if per not in _PACKED or scales.shape[-1] % per:
        raise ValueError(f"block_k={block_k}: scales pack 1, 2, 4 or 8 to a word and must fill whole words "
                         f"({scales.shape[-1]} per row)")
    return scales.view(_PACKED[per])


@triton.jit
def packed_scale(words, j: tl.constexpr):
    """2^(code - 127) of byte j of each word from `packed_scales` (little-endian: byte j is group j of the step)."""
    if words.dtype.primitive_bitwidth == 64:
        w = words
    else:  # 32-bit shifts: one instruction each
        w = words.to(tl.int32)
    return e8m0_to_f32((w >> (8 * j)) & 0xFF)


@triton.jit
def row_scale_max(s_ptr, row, row_ok, scratch_ptr, KDIM: tl.constexpr, BK: tl.constexpr):
    """smax [R] int32: the largest E8M0 code of each row over all its KDIM/32 groups (0 for rows outside row_ok).

    Per row, not per K chunk, and read back through `scratch_ptr` (int32, indexed like the rows): Triton computes
    the weight tile's chain in the MMA operand layout (registers straight into wgmma) only when every input of
    the chain is a load or a constant. A per-chunk maximum (a reduction, or extra loads of the chunk's scales)
    made it convert every tile through shared memory, as did this maximum used directly (a reduction's result);
    stored and loaded back once before the K loop, it is a load (sm_90 SASS: down's 128 x 128 tile then goes from
    registers into wgmma; some other tile shapes, gate_up's 64 x 64 among them, still pass through shared memory by
    Triton's layout choice, which the tuner measures). Programs of other row blocks write the same values to the
    same rows, so their order does not matter."""
    g = tl.arange(0, BK // 32)
    smax = tl.zeros_like(row)
    for k0 in range(0, KDIM, BK):
        sg = k0 // 32 + g[None, :]
        s = tl.load(s_ptr + row[:, None] * (KDIM // 32) + sg, mask=row_ok[:, None] & (sg < KDIM // 32), other=0)
        smax = tl.maximum(smax, tl.max(s.to(tl.int32), axis=1))
    tl.store(scratch_ptr + row, smax, mask=row_ok)
    tl.debug_barrier()  # the block's stores are visible to all its threads past the barrier
    return tl.load(scratch_ptr + row, mask=row_ok, other=0)


@triton.jit
def row_tile_rel(d_ptr, s_ptr, row, row_ok, k0, smax, KDIM: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """MXFP8 M[row, k0:k0+BK] = W * 2^(smax - 127)[:, None]: W [R, BK] FP16 values (in DOT dtype), smax from
    row_scale_max.

    A group with code s holds x * 2^(s - smax) (x its E4M3 values), computed in FP16. Exact when s - smax >= -15:
    every E4M3 value (subnormals included) has its last bit at or above 2^-9, so times 2^-15 it is a multiple of
    FP16's smallest subnormal 2^-24. Beyond, the product rounds to that grid (to zero for s - smax <= -25, where
    the factor itself is zero in FP16): each weight's absolute error is then at most 448 * 2^-25 * 2^(smax - 127),
    under 2^-24 of the row's largest weight (the quantizer puts each group's maximum above 224 * 2^(s - 127)); the
    relative error of such a weight reaches 100% (flushed). So a row is exact unless its group scales span more
    than 15 binades; the tests check the bound."""
    g = tl.arange(0, BK // 32)
    kk = k0 + g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    x = tl.load(d_ptr + row[:, None, None] * KDIM + kk, mask=_mask(row_ok[:, None, None], kk, KDIM, BK), other=0.0)
    sg = k0 // 32 + g[None, :, None]
    s = tl.load(s_ptr + row[:, None, None] * (KDIM // 32) + sg, mask=row_ok[:, None, None] & (sg < KDIM // 32),
                other=0).to(tl.int32)
    # 2^(s - smax) as an FP16 power of two: FP32 2^-30 (the clamp keeps the exponent field valid) rounds to 0.
    rel = e8m0_to_f32(tl.maximum(s - smax[:, None, None], -30) + 127).to(tl.float16)
    return tl.reshape(x.to(tl.float16) * rel, (row.shape[0], BK)).to(DOT)


@triton.jit
def kmajor_tile_rel(d_ptr, s_ptr, row, row_ok, k0, KDIM: tl.constexpr, BK: tl.constexpr, IS_MX: tl.constexpr,
                    DOT: tl.constexpr):
    """(X, f): kmajor_tile's [BK, R] tile = X * f[None, :], X FP16 values (in DOT dtype), f [R] FP32.

    Per column (token): X = tile * 2^c, f = 2^-c, with c = 15 - floor(log2(column max)), so the column's
    maximum lands in [2^15, 2^16): no overflow, as a BF16 (or MXFP8) value there is at most 65280 < 65504 (c is
    capped at 126, reached only by columns whose maximum is under 2^-111, zero ones included). Exact for every
    value at least 2^-33 of the column maximum (8 significant bits, the last at or above 2^-24 after scaling);
    smaller ones round to FP16's subnormal grid, an absolute error of at most 2^-40 of the column maximum
    (values under 2^-41 of it flush to zero)."""
    x = kmajor_tile(d_ptr, s_ptr, row, row_ok, k0, KDIM, BK, IS_MX, tl.float32)
    # floor(log2) of the column maximum from its FP32 exponent field (-127 for zero, so c is then 126).
    e = (tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True) >> 23) - 127
    c = tl.minimum(15 - e, 126)
    return (x * e8m0_to_f32(c + 127)[None, :]).to(tl.float16).to(DOT), e8m0_to_f32(127 - c)


@triton.jit
def _mask(row_ok, kk, KDIM: tl.constexpr, BK: tl.constexpr):
    """row_ok, and k < KDIM only when BK does not divide KDIM: a mask constant along k keeps loads vectorized."""
    if KDIM % BK == 0:
        m = row_ok
    else:
        m = row_ok & (kk < KDIM)
    return m
