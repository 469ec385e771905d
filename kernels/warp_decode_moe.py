"""Warp-decode MoE for small decode batches: the routed experts of T tokens in two or three Triton launches.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k (token, expert)
pairs, pair p = t * k + j. Layout (row-major [out, in], as in kernels/moe_reference.py):
    hidden [T, H] bf16   topk_ids [T, k] int32/64   topk_weights [T, k] float
    w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1)   w2 [E, H, I]   BF16, or MXFP8Tensor with
        data fp8 e4m3 of that shape and scales uint8 E8M0 [..., in // 32] (one per 32 reduction elements)
    act [P, I] fp32 = topk_weight * silu(gate) * up, the only intermediate (the routing weight is folded in FP32)
    part [P, H] fp32, only on the expert-grouped down path (see below), summed per token by a combine launch
Bytes moved: every touched expert once, 3 * H * I * (1 + 1/32) bytes in MXFP8 (2 bytes per weight in BF16),
plus 2 * T * H * 2 (hidden, out) + 2 * P * I * 4 (act written and read), + 2 * P * H * 4 with `part`.

Why this shape. Decode at T = 1..64 should be a pure weight stream (3 * H * I * k FLOPs per token against
4.87 MB per touched expert, Qwen3-30B-A3B): the aim is to keep enough bytes in flight and to read each
touched expert from HBM once. Two schedules:

* pair ("literal" warp decode): one program per (pair, block of I rows) for gate_up and one per (token,
  block of H rows) for down, the k experts' rows loaded together as one [k * BH, I-chunk] tile. Rows are
  reduced with tl.sum over an axis one warp spans (Triton's form of the shuffle butterfly); MXFP8 scales
  multiply each 32-element partial sum, so dequantization costs a convert per weight and a multiply per 32.
  No sorting, no padding, no combine. Tokens sharing an expert each read its rows (through L2) and redo
  its FMAs, so its time grows with T; measured fastest up to T = 16 (k = 8). A program takes its rows' whole
  H in one chunk (loads issued together, none waiting on the last iteration's), and at T = 1 the down
  launch is programmatic-dependent: its CTAs load their weights while gate_up drains and only the act load
  waits (griddepcontrol.wait).
* expert: one program per (distinct expert, block of rows), found in-kernel from topk_ids (the first pair
  routed to an expert leads, the rest exit), loops over the pairs routed to it in tiles of 16 and runs a
  TF32 tl.dot on the dequantized FP32 tile, so each weight byte is read once however many tokens share it.
  TF32 is exact for MXFP8 and BF16 weights and BF16 hidden; act loses the bits past its 10-bit mantissa (a
  hi + lo split kept them but cost 255 registers and so occupancy). Down writes per-pair rows of `part`
  and a small combine launch sums each token's k rows in a fixed order (deterministic, no atomics).
`warp_decode_moe` picks per T ("auto": expert from 256 pairs on); docs/perf.md has the measurements behind
the choice and the tile sizes, and a grouped CUDA-core variant that lost (compute-bound).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe_combine import moe_combine
from kernels.moe_reference import check_kernel_args, weight_parts
from kernels.mx_tiles import e8m0_to_f32, kmajor_tile

_PAIR_TILE = 16  # tl.dot needs at least 16 rows; decode rarely routes more pairs than that to one expert


@triton.jit
def _k_mask(kk, KDIM: tl.constexpr, BK: tl.constexpr):
    """A mask that is constant along the reduction when BK divides it, so the loads vectorize (16 B)."""
    if KDIM % BK == 0:
        return tl.full(kk.shape, 1, tl.int1)
    return kk < KDIM


@triton.jit
def _load_rows(d_ptr, s_ptr, row, row_ok, kk, k_ok, sg, KDIM, IS_MX: tl.constexpr):
    """W[row, kk] as FP32 [R, G, 32] for row [R], kk [G, 32], and the factor of each 32-group [R, G] (its E8M0
    scale, or 1 for BF16): the scale multiplies a 32-element partial sum, not every weight."""
    m = row_ok[:, None, None] & k_ok[None, :, :]
    w = tl.load(d_ptr + row[:, None, None] * KDIM + kk[None, :, :], mask=m, other=0.0).to(tl.float32)
    if IS_MX:
        s = tl.load(s_ptr + row[:, None] * (KDIM // 32) + sg[None, :],
                    mask=row_ok[:, None] & (sg < KDIM // 32)[None, :], other=127)
        return w, e8m0_to_f32(s)
    return w, tl.full([row.shape[0], sg.shape[0]], 1.0, tl.float32)


@triton.jit
def _rows_dot(d_ptr, s_ptr, row, row_ok, vec, kk, k_ok, sg, KDIM, IS_MX: tl.constexpr):
    """sum_k W[row, k] * vec[.., k], vec broadcastable to [R, G, 32], sg [G] the scale column of each group."""
    w, f = _load_rows(d_ptr, s_ptr, row, row_ok, kk, k_ok, sg, KDIM, IS_MX)
    return tl.sum(tl.sum(w * vec, axis=2) * f, axis=1)


@triton.jit
def _routed_pairs(ids_ptr, P, slot, BY_PAIR: tl.constexpr, PP: tl.constexpr):
    """The expert this program leads and how many pairs route to it (0 when it leads none)."""
    i = tl.arange(0, PP)
    ids = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int64)
    if BY_PAIR:
        e = tl.load(ids_ptr + slot).to(tl.int64)
        lead = tl.min(tl.where(ids == e, i, PP), axis=0) == slot
    else:
        e = slot.to(tl.int64)
        lead = slot >= 0
    return e, tl.where(lead, tl.sum((ids == e).to(tl.int32), axis=0), 0)


@triton.jit
def _pair_tile(ids_ptr, P, e, base, cnt, TB: tl.constexpr, PP: tl.constexpr):
    """Pairs base .. base + TB - 1 (in pair order) of those routed to e, and which exist. The ids are
    scanned in chunks (a loop, not unrolled) so the [TB, chunk] match matrix stays small: its registers
    would otherwise set the whole kernel's register count and cut occupancy."""
    CH: tl.constexpr = 64 if PP > 64 else PP
    r = base + tl.arange(0, TB)
    pr = tl.zeros([TB], dtype=tl.int32)
    seen = cnt * 0
    for c0 in range(0, PP, CH):
        i = c0 + tl.arange(0, CH)
        m = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int64) == e
        rank = seen + tl.cumsum(m.to(tl.int32), axis=0) - 1
        pr += tl.sum(tl.where(m[None, :] & (rank[None, :] == r[:, None]), i[None, :], 0), axis=1)
        seen += tl.sum(m.to(tl.int32), axis=0)
    return pr, r < cnt


@triton.jit
def _gate_up_pair_kernel(x_ptr, ids_ptr, rw_ptr, d_ptr, s_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr,
                         K_TOP: tl.constexpr, IS_MX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         PDL: tl.constexpr):
    nb, p = tl.program_id(0), tl.program_id(1)
    if PDL:  # down's CTAs may start (and load their weights) as soon as SMs have room
        tl.extra.cuda.gdc_launch_dependents()
    t = p // K_TOP
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = nb * BN + tl.arange(0, BN)
    n_ok = n < I
    g0 = tl.arange(0, BK // 32)
    kk0 = g0[:, None] * 32 + tl.arange(0, 32)[None, :]
    g = tl.zeros([BN], dtype=tl.float32)
    u = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + kk0
        k_ok = _k_mask(kk, H, BK)
        xv = tl.load(x_ptr + t * H + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        g += _rows_dot(d_ptr, s_ptr, e * 2 * I + n, n_ok, xv, kk, k_ok, k0 // 32 + g0, H, IS_MX)
        u += _rows_dot(d_ptr, s_ptr, e * 2 * I + I + n, n_ok, xv, kk, k_ok, k0 // 32 + g0, H, IS_MX)
    rw = tl.load(rw_ptr + p).to(tl.float32)
    tl.store(act_ptr + p * I + n, rw * g * tl.sigmoid(g) * u, mask=n_ok)


@triton.jit
def _down_token_kernel(act_ptr, ids_ptr, d_ptr, s_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr,
                       KP: tl.constexpr, IS_MX: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                       PDL: tl.constexpr):
    hb, t = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, KP * BH)
    j = r // BH
    h = hb * BH + r % BH
    row_ok = (j < K_TOP) & (h < H)
    p = t * K_TOP + j
    e = tl.load(ids_ptr + p, mask=j < K_TOP, other=0).to(tl.int64)
    g0 = tl.arange(0, BK // 32)
    kk0 = g0[:, None] * 32 + tl.arange(0, 32)[None, :]
    acc = tl.zeros([KP * BH], dtype=tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + kk0
        k_ok = _k_mask(kk, I, BK)
        # The weights do not depend on gate_up: under PDL they load while gate_up still runs, and only the act
        # load waits for it (a no-op after the first chunk).
        w, f = _load_rows(d_ptr, s_ptr, e * H + h, row_ok, kk, k_ok, k0 // 32 + g0, I, IS_MX)
        if PDL:
            tl.extra.cuda.gdc_wait()
        a = tl.load(act_ptr + p[:, None, None] * I + kk[None, :, :], mask=row_ok[:, None, None] & k_ok[None, :, :],
                    other=0.0)
        acc += tl.sum(tl.sum(w * a, axis=2) * f, axis=1)
    y = tl.sum(tl.reshape(acc, (KP, BH)), axis=0)
    hh = hb * BH + tl.arange(0, BH)
    tl.store(out_ptr + t * H + hh, y.to(tl.bfloat16), mask=hh < H)


@triton.jit
def _gate_up_expert_kernel(x_ptr, ids_ptr, rw_ptr, d_ptr, s_ptr, act_ptr, P, H: tl.constexpr, I: tl.constexpr,
                           K_TOP: tl.constexpr,
                           IS_MX: tl.constexpr, BY_PAIR: tl.constexpr, PP: tl.constexpr, TB: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    nb = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    e, cnt = _routed_pairs(ids_ptr, P, tl.program_id(1), BY_PAIR, PP)
    n = nb * BN + tl.arange(0, BN)
    n_ok = n < I
    kb = tl.arange(0, BK)
    base = cnt * 0
    while base < cnt:  # not range(): the interpreter cannot take a computed trip count
        pr, ok = _pair_tile(ids_ptr, P, e, base, cnt, TB, PP)
        g = tl.zeros([TB, BN], dtype=tl.float32)
        u = tl.zeros([TB, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + kb
            k_ok = _k_mask(kk, H, BK)
            xv = tl.load(x_ptr + (pr // K_TOP)[:, None] * H + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            # FP32 weight tiles for a TF32 dot: exact for MXFP8 and BF16 weights (the interpreter's BF16 dot is wrong)
            gate = kmajor_tile(d_ptr, s_ptr, e * 2 * I + n, n_ok, k0, H, BK, IS_MX, tl.float32)
            up = kmajor_tile(d_ptr, s_ptr, e * 2 * I + I + n, n_ok, k0, H, BK, IS_MX, tl.float32)
            g = tl.dot(xv, gate, g, input_precision="tf32")
            u = tl.dot(xv, up, u, input_precision="tf32")
        rw = tl.load(rw_ptr + pr, mask=ok, other=0.0).to(tl.float32)
        tl.store(act_ptr + pr[:, None] * I + n[None, :], rw[:, None] * g * tl.sigmoid(g) * u,
                 mask=ok[:, None] & n_ok[None, :])
        base += TB


@triton.jit
def _down_expert_kernel(act_ptr, ids_ptr, d_ptr, s_ptr, part_ptr, P, H: tl.constexpr, I: tl.constexpr,
                        IS_MX: tl.constexpr,
                        BY_PAIR: tl.constexpr, PP: tl.constexpr, TB: tl.constexpr, BH: tl.constexpr,
                        BK: tl.constexpr, PDL: tl.constexpr):
    hb = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    e, cnt = _routed_pairs(ids_ptr, P, tl.program_id(1), BY_PAIR, PP)
    if PDL:
        tl.extra.cuda.gdc_wait()
    h = hb * BH + tl.arange(0, BH)
    h_ok = h < H
    kb = tl.arange(0, BK)
    base = cnt * 0
    while base < cnt:  # not range(): the interpreter cannot take a computed trip count
        pr, ok = _pair_tile(ids_ptr, P, e, base, cnt, TB, PP)
        acc = tl.zeros([TB, BH], dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + kb
            k_ok = _k_mask(kk, I, BK)
            a = tl.load(act_ptr + pr[:, None] * I + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = kmajor_tile(d_ptr, s_ptr, e * H + h, h_ok, k0, I, BK, IS_MX, tl.float32)
            acc = tl.dot(a, w, acc, input_precision="tf32")
        tl.store(part_ptr + pr[:, None] * H + h[None, :], acc, mask=ok[:, None] & h_ok[None, :])
        base += TB


@dataclass(frozen=True)
class Tiles:
    """Tile sizes (powers of two, multiples of 32 for the reduction chunks); `tiles_for` picks them per T from
    the H200 measurements in docs/perf.md. pair_min_expert_pairs: "auto" takes the expert schedule from this
    many pairs (T * k) on. pdl: launch the later kernels with programmatic dependent launch, so their CTAs start
    and load weights while the previous kernel drains (measured to help only when gate_up is a single wave)."""

    pair_bn: int = 2
    pair_bk: int = 2048
    pair_down_rows: int = 32
    pair_down_bk: int = 256
    pair_warps: int = 2
    expert_bn: int = 32
    expert_bh: int = 64
    expert_bk: int = 128
    expert_warps: int = 4
    expert_stages: int = 1
    pair_min_expert_pairs: int = 256
    pdl: bool = False


# Triton's interpreter costs milliseconds per program, whatever its size: the fewest, largest tiles.
INTERPRETER_TILES = Tiles(pair_bn=64, pair_bk=128, pair_down_rows=128, pair_down_bk=128, expert_bn=64, expert_bh=64,
                          expert_bk=128)


def tiles_for(num_tokens: int) -> Tiles:
    """The tiles measured fastest at this T (docs/perf.md, version 5): a whole row of H per program (no
    loop-carried load latency), more programs at T = 1, where gate_up is one wave and PDL overlaps the down
    launch with its tail."""
    if triton.knobs.runtime.interpret:
        return INTERPRETER_TILES
    if num_tokens == 1:
        return Tiles(pair_bn=4, pair_warps=8, pdl=True)
    if num_tokens < 4:
        return Tiles(pair_warps=4)
    return Tiles()


def warp_decode_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2, *,
                    schedule: str = "auto", tiles: Tiles | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of a decode batch, [T, H] bf16, written to `out` if given. `schedule`: "auto",
    "pair", "expert_gate_up" (expert-grouped gate_up, pair down) or "expert" (both grouped, plus combine);
    `tiles`: None for `tiles_for(T)`."""
    check_kernel_args(hidden, topk_weights, topk_ids, w13, w2)
    if schedule not in ("auto", "pair", "expert_gate_up", "expert"):
        raise ValueError(f"schedule must be auto, pair, expert_gate_up or expert, got {schedule!r}")
    d13, s13, mx13 = weight_parts(w13, "w13", hidden.device)
    d2, s2, mx2 = weight_parts(w2, "w2", hidden.device)
    if mx13 != mx2:
        raise TypeError("w13 and w2 must both be MXFP8Tensor or both bfloat16")
    (T, H), k, E, I = hidden.shape, topk_ids.shape[1], w13.shape[0], w2.shape[-1]
    P = T * k
    tiles = tiles_for(T) if tiles is None else tiles
    if schedule == "auto":
        schedule = "pair" if P < tiles.pair_min_expert_pairs else "expert"
    out = torch.empty_like(hidden) if out is None else out
    if (out.dtype, out.shape, out.device) != (torch.bfloat16, hidden.shape, hidden.device) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 {tuple(hidden.shape)} tensor on {hidden.device}, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if T == 0:
        return out
    act = torch.empty((P, I), dtype=torch.float32, device=hidden.device)
    # Fewer pairs than experts: a program per pair, the first of each expert leads; else one per expert.
    by_pair = P < E
    leaders = P if by_pair else E
    pp = triton.next_power_of_2(max(P, 16))
    kp = triton.next_power_of_2(k)
    # Programmatic dependent launch (sm_90) is inline PTX that Triton's interpreter cannot run; it changes
    # when the later launches start, never what they compute.
    hints = dict(PDL=tiles.pdl and not triton.knobs.runtime.interpret)
    later = dict(launch_pdl=True) if hints["PDL"] else {}
    if schedule == "pair":
        _gate_up_pair_kernel[(triton.cdiv(I, tiles.pair_bn), P)](
            hidden, topk_ids, topk_weights, d13, s13, act, H, I, K_TOP=k, IS_MX=mx13, BN=tiles.pair_bn,
            BK=tiles.pair_bk, num_warps=tiles.pair_warps, **hints)
    else:
        _gate_up_expert_kernel[(triton.cdiv(I, tiles.expert_bn), leaders)](
            hidden, topk_ids, topk_weights, d13, s13, act, P, H, I, K_TOP=k, IS_MX=mx13, BY_PAIR=by_pair,
            PP=pp, TB=_PAIR_TILE, BN=tiles.expert_bn, BK=tiles.expert_bk, num_warps=tiles.expert_warps,
            num_stages=tiles.expert_stages, **hints)
    if schedule != "expert":
        bh = max(1, tiles.pair_down_rows // kp)
        _down_token_kernel[(triton.cdiv(H, bh), T)](
            act, topk_ids, d2, s2, out, H, I, K_TOP=k, KP=kp, IS_MX=mx2, BH=bh, BK=tiles.pair_down_bk,
            num_warps=tiles.pair_warps, **hints, **later)
        return out
    part = torch.empty((P, H), dtype=torch.float32, device=hidden.device)
    _down_expert_kernel[(triton.cdiv(H, tiles.expert_bh), leaders)](
        act, topk_ids, d2, s2, part, P, H, I, IS_MX=mx2, BY_PAIR=by_pair, PP=pp, TB=_PAIR_TILE, BH=tiles.expert_bh,
        BK=tiles.expert_bk, num_warps=tiles.expert_warps, num_stages=tiles.expert_stages, **hints, **later)
    moe_combine(part, out, k, pdl=hints["PDL"])
    return out
