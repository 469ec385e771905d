"""Expert-grouped MoE decode on tensor cores with FP16 operands: weight rows are the M operand, tokens the N.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k pairs (pair
p = t * k + j), R weight rows per program (M), TB = 16 pairs per tile (N, padded), G scale groups of 32 per
dot (batched K = 32 dots). Layout as in kernels/warp_decode_moe.py:
    hidden [T, H] bf16   topk_ids [T, k] int32/64   topk_weights [T, k] float
    w13 [E, 2I, H] (gate rows, then up rows)   w2 [E, H, I]   BF16, or MXFP8Tensor (data fp8 e4m3 of that
        shape, scales uint8 E8M0 [..., in // 32])
    act [P, I] fp32 = topk_weight * silu(gate) * up      part [P, H] fp32, summed per token by a combine launch
Bytes moved: every touched expert once, 3 * H * I * (1 + 1/32) in MXFP8 (2 per weight in BF16), plus
2 * T * H * 2 (hidden, out) + 2 * P * I * 4 (act) + 2 * P * H * 4 (part): at T = 64 (30B) 613 MB of weights,
1.6 + 8.4 MB of act and part.

Why. The shipped schedules are instruction-bound (docs/perf.md): two conversions per FP8 weight to reach FP32,
then FP32 FMAs (pair) or FP32 operands staged through shared memory for a TF32 dot (expert). Here an E4M3
element goes to FP16 in one cvt per two elements and stays FP16 into mma; FP16 holds every E4M3 value
exactly (max 448, smallest subnormal 2^-9 >= 2^-24), so the E8M0 scale cannot be folded into the operand
(it may leave FP16's range) and is applied per (row, group) to the FP32 result of a K = 32 dot instead:
the dot runs batched over G groups, [G, R, 32] x [G, 32, TB], and the [G, R, TB] accumulators are summed over
G once at the end (`batched=True`), or G = 1 and a loop of 2-D dots (the default: 80-96 registers against
144-162 for the batched form at R = 32, compiled for sm_90, so 5 CTAs of 4 warps per SM rather than 3).
Programs are per (distinct expert, block of R rows), leaders found in-kernel from topk_ids as in the expert
schedule, so each weight byte is read from HBM once however many tokens share the expert.

Numerics. Accumulation is FP32 throughout. The N operand (hidden, or act) is scaled per (32-group, pair) by
a power of two that puts its absolute max in [2^14, 2^15) before the FP16 cast, and the FP32 dot result is
scaled back: FP16 then never overflows (BF16 hidden beyond 65504, large act) and elements down to 2^-31 of
their group's max stay exact, so BF16 hidden is exact in FP16. act (FP32) goes in as an FP16 hi + lo pair
(two dots), about 21 significant bits. Non-finite inputs stay non-finite. BF16 weights are multiplied by 2^8
before their FP16 cast (undone on the result): exact for 2^-22 <= |w| < 256, which covers trained weights.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.warp_decode_moe import (
    _check_args,
    _combine_kernel,
    _e8m0,
    _k_mask,
    _pair_tile,
    _routed_pairs,
    _weight_parts,
)

_TB = 16  # tokens are the N operand: mma needs N >= 16; decode rarely routes more pairs to one expert


@triton.jit
def _w_tile(d_ptr, s_ptr, row, row_ok, k0, KDIM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
            IS_MX: tl.constexpr):
    """W[row, k0 : k0 + 32G] as FP16 [G, R, 32] and the FP32 factor of each (group, row), [G, R, 1]."""
    g = tl.arange(0, G)
    kk = k0 + g[:, None, None] * 32 + tl.arange(0, 32)[None, None, :]
    m = row_ok[None, :, None] & _k_mask(kk, KDIM, BK)
    w = tl.load(d_ptr + row[None, :, None] * KDIM + kk, mask=m, other=0.0)
    if IS_MX:
        gs = k0 // 32 + g
        s = tl.load(s_ptr + row[None, :] * (KDIM // 32) + gs[:, None],
                    mask=row_ok[None, :] & (gs < KDIM // 32)[:, None], other=127)
        return w.to(tl.float16), _e8m0(s)[:, :, None]
    # 2^8 lifts small BF16 weights out of FP16's subnormal range (module docstring, Numerics).
    w16 = (w.to(tl.float32) * 256.0).to(tl.float16)
    return w16, tl.full([G, row.shape[0], 1], 1.0 / 256.0, tl.float32)


@triton.jit
def _b_tile(ptr, col, col_ok, k0, KDIM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    """src[col, k0 : k0 + 32G] transposed to FP32 [G, 32, TB] (the N operand: one column per pair)."""
    kk = k0 + tl.arange(0, G)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
    m = col_ok[None, None, :] & _k_mask(kk, KDIM, BK)
    return tl.load(ptr + col[None, None, :] * KDIM + kk, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _pow2_fit(b):
    """b [G, 32, TB] times 2^-s per (group, column), s chosen so the column's absolute max lands in
    [2^14, 2^15): the FP16 cast neither overflows nor flushes the column's small elements. Returns the
    scaled b and 2^s [G, 1, TB] (exact powers of two, built from the exponent bits)."""
    amax = tl.max(tl.abs(b), axis=1, keep_dims=True)
    ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)); -127 for zero
    sh = tl.minimum(tl.maximum(ex - 14, -100), 100)
    return b * ((127 - sh) << 23).to(tl.float32, bitcast=True), ((127 + sh) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot16(w, b16, G: tl.constexpr):
    """[G, R, 32] x [G, 32, TB] -> [G, R, TB] FP32; G = 1 runs a plain 2-D dot (wgmma-eligible)."""
    if G == 1:
        d = tl.dot(tl.reshape(w, (w.shape[1], 32)), tl.reshape(b16, (32, b16.shape[2])))
        return tl.expand_dims(d, 0)
    return tl.dot(w, b16)


@triton.jit
def _gate_up_mma_kernel(x_ptr, ids_ptr, rw_ptr, d_ptr, s_ptr, act_ptr, P, H: tl.constexpr, I: tl.constexpr,
                        K_TOP: tl.constexpr, IS_MX: tl.constexpr, BY_PAIR: tl.constexpr, PP: tl.constexpr,
                        TB: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    e, cnt = _routed_pairs(ids_ptr, P, tl.program_id(1), BY_PAIR, PP)
    n = tl.program_id(0) * R + tl.arange(0, R)
    n_ok = n < I
    base = cnt * 0
    while base < cnt:  # not range(): the interpreter cannot take a computed trip count
        pr, ok = _pair_tile(ids_ptr, P, e, base, cnt, TB, PP)
        ag = tl.zeros([G, R, TB], dtype=tl.float32)
        au = tl.zeros([G, R, TB], dtype=tl.float32)
        for k0 in range(0, H, BK):
            for kg in tl.static_range(0, BK, 32 * G):
                xv, xs = _pow2_fit(_b_tile(x_ptr, pr // K_TOP, ok, k0 + kg, H, BK, G))
                xv = xv.to(tl.float16)
                w, s = _w_tile(d_ptr, s_ptr, e * 2 * I + n, n_ok, k0 + kg, H, BK, G, IS_MX)
                ag += _dot16(w, xv, G) * (s * xs)
                w, s = _w_tile(d_ptr, s_ptr, e * 2 * I + I + n, n_ok, k0 + kg, H, BK, G, IS_MX)
                au += _dot16(w, xv, G) * (s * xs)
        g = tl.sum(ag, axis=0)
        u = tl.sum(au, axis=0)
        rw = tl.load(rw_ptr + pr, mask=ok, other=0.0).to(tl.float32)
        tl.store(act_ptr + pr[None, :] * I + n[:, None], rw[None, :] * g * tl.sigmoid(g) * u,
                 mask=ok[None, :] & n_ok[:, None])
        base += TB


@triton.jit
def _down_mma_kernel(act_ptr, ids_ptr, d_ptr, s_ptr, part_ptr, P, H: tl.constexpr, I: tl.constexpr,
                     IS_MX: tl.constexpr, BY_PAIR: tl.constexpr, PP: tl.constexpr, TB: tl.constexpr,
                     R: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    e, cnt = _routed_pairs(ids_ptr, P, tl.program_id(1), BY_PAIR, PP)
    h = tl.program_id(0) * R + tl.arange(0, R)
    h_ok = h < H
    base = cnt * 0
    while base < cnt:  # not range(): the interpreter cannot take a computed trip count
        pr, ok = _pair_tile(ids_ptr, P, e, base, cnt, TB, PP)
        acc = tl.zeros([G, R, TB], dtype=tl.float32)
        for k0 in range(0, I, BK):
            for kg in tl.static_range(0, BK, 32 * G):
                a, as_ = _pow2_fit(_b_tile(act_ptr, pr, ok, k0 + kg, I, BK, G))
                # FP16 keeps 11 significant bits of act; the remainder as a second FP16 operand keeps ~21.
                hi = a.to(tl.float16)
                lo = (a - hi.to(tl.float32)).to(tl.float16)
                w, s = _w_tile(d_ptr, s_ptr, e * H + h, h_ok, k0 + kg, I, BK, G, IS_MX)
                acc += (_dot16(w, hi, G) + _dot16(w, lo, G)) * (s * as_)
        tl.store(part_ptr + pr[None, :] * H + h[:, None], tl.sum(acc, axis=0), mask=ok[None, :] & h_ok[:, None])
        base += TB


@dataclass(frozen=True)
class MmaTiles:
    """R rows per program (gate_up: R gate + R up rows), BK reduction chunk, batched: one [G = BK/32] batched
    dot per chunk (True) or BK/32 2-D dots (False). Powers of two; R >= 16, BK a multiple of 32. Not measured
    on a GPU yet (docs/perf.md, Version 4): R = 64 reaches wgmma but needs 245-255 registers."""

    gate_up_rows: int = 32
    down_rows: int = 32
    bk: int = 128
    batched: bool = False
    warps: int = 4
    stages: int = 2


def warp_decode_mma(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2, *,
                    tiles: MmaTiles = MmaTiles(), out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of a decode batch, [T, H] bf16 (written to `out` if given), on FP16 tensor cores.
    Same arguments and checks as kernels.warp_decode_moe.warp_decode_moe, with `tiles` in place of `schedule`."""
    _check_args(hidden, topk_weights, topk_ids, w13, w2)
    d13, s13, mx13 = _weight_parts(w13, "w13", hidden.device)
    d2, s2, mx2 = _weight_parts(w2, "w2", hidden.device)
    if mx13 != mx2:
        raise TypeError("w13 and w2 must both be MXFP8Tensor or both bfloat16")
    if tiles.bk % 32 or tiles.gate_up_rows < 16 or tiles.down_rows < 16:
        raise ValueError(f"tiles need bk % 32 == 0 and rows >= 16, got {tiles}")
    out = torch.empty_like(hidden) if out is None else out
    if (out.dtype, out.shape, out.device) != (torch.bfloat16, hidden.shape, hidden.device) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 {tuple(hidden.shape)} tensor on {hidden.device}, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    (T, H), k, E, I = hidden.shape, topk_ids.shape[1], w13.shape[0], w2.shape[-1]
    if T == 0:
        return out
    P = T * k
    # Fewer pairs than experts: a program per pair, the first of each expert leads; else one per expert.
    by_pair = P < E
    leaders = P if by_pair else E
    pp = triton.next_power_of_2(max(P, 16))
    g = tiles.bk // 32 if tiles.batched else 1
    act = torch.empty((P, I), dtype=torch.float32, device=hidden.device)
    part = torch.empty((P, H), dtype=torch.float32, device=hidden.device)
    common = dict(BY_PAIR=by_pair, PP=pp, TB=_TB, BK=tiles.bk, G=g, num_warps=tiles.warps, num_stages=tiles.stages)
    _gate_up_mma_kernel[(triton.cdiv(I, tiles.gate_up_rows), leaders)](
        hidden, topk_ids, topk_weights, d13, s13, act, P, H, I, K_TOP=k, IS_MX=mx13, R=tiles.gate_up_rows, **common)
    _down_mma_kernel[(triton.cdiv(H, tiles.down_rows), leaders)](
        act, topk_ids, d2, s2, part, P, H, I, IS_MX=mx2, R=tiles.down_rows, **common)
    _combine_kernel[(triton.cdiv(H, 256), T)](part, out, H, K_TOP=k, KP=triton.next_power_of_2(k), BH=256,
                                              num_warps=4)
    return out
