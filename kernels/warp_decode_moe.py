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
touched expert from HBM once. The schedules:

* pair ("literal" warp decode): kernels/warp_decode_gate_up.py and kernels/warp_decode_down.py. gate_up's work
  items are (pair, block of I rows), down's (token, block of H rows) with the k experts' rows loaded together; rows
  are reduced with tl.sum over an axis one warp spans (Triton's form of the shuffle butterfly) and MXFP8 scales
  multiply each 32-element partial sum. No sorting, no padding, no combine. A few persistent programs per SM walk
  the items in a software-pipelined loop (cp.async copies issued ahead), which keeps more bytes in flight than a
  program per item did (docs/perf.md, version 6). Tokens sharing an expert each read its rows (the first from
  HBM, the rest mostly from L2) and redo its FMAs, so time grows with T; measured fastest up to T = 32 (k = 8).
* expert: one program per (distinct expert, block of rows), found in-kernel from topk_ids (the first pair
  routed to an expert leads, the rest exit), loops over the pairs routed to it in tiles of 16 and runs a
  TF32 tl.dot on the dequantized FP32 tile, so each weight byte is read once however many tokens share it.
  TF32 is exact for MXFP8 and BF16 weights and BF16 hidden; act loses the bits past its 10-bit mantissa (a
  hi + lo split kept them but cost 255 registers and so occupancy). Down writes per-pair rows of `part`
  and a small combine launch sums each token's k rows in a fixed order (deterministic, no atomics).
`warp_decode_moe` picks per T ("auto": expert from 512 pairs on); docs/perf.md has the measurements behind
the choice and the tile sizes, and the schedules that lost (a grouped CUDA-core variant, compute-bound; gate_up
over expert-grouped slot blocks, 2.8-3x slower than pair at T = 8-32).
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.moe_combine import moe_combine
from kernels.moe_reference import check_kernel_args, weight_parts
from kernels.mx_tiles import kmajor_tile, tail_mask
from kernels.warp_decode_down import warp_decode_down
from kernels.warp_decode_gate_up import warp_decode_gate_up

SCHEDULES = ("auto", "pair", "expert_gate_up", "expert")
_PAIR_TILE = 16  # tl.dot needs at least 16 rows; decode rarely routes more pairs than that to one expert


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
            k_ok = tail_mask(kk, H, BK)
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
            k_ok = tail_mask(kk, I, BK)
            a = tl.load(act_ptr + pr[:, None] * I + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = kmajor_tile(d_ptr, s_ptr, e * H + h, h_ok, k0, I, BK, IS_MX, tl.float32)
            acc = tl.dot(a, w, acc, input_precision="tf32")
        tl.store(part_ptr + pr[:, None] * H + h[None, :], acc, mask=ok[:, None] & h_ok[None, :])
        base += TB


@dataclass(frozen=True)
class Tiles:
    """Tile sizes (powers of two; reduction chunks multiples of 32); `tiles_for` picks them per T from the
    measurements in docs/perf.md (H200; the chunked gate_up, H100). pair_*: kernels/warp_decode_gate_up.py (BN gate
    and BN up rows per item; pair_hc its chunk_h), pair_down_*: kernels/warp_decode_down.py (BH rows of each of the
    k experts per item, BK-wide chunks of I);
    *_ctas: persistent programs per SM; *_stages: the pipeliner's stages (items or chunks in flight + 1).
    pair_min_expert_pairs: "auto" takes the expert schedule from this many pairs (T * k) on.
    pdl: launch the later kernels with programmatic dependent launch, so their CTAs start while the previous kernel
    drains."""

    pair_bn: int = 4
    pair_warps: int = 4
    pair_stages: int = 3
    pair_ctas: int = 5
    pair_hc: int | None = None
    pair_down_bh: int = 8
    pair_down_bk: int = 256
    pair_down_warps: int = 4
    pair_down_stages: int = 3
    pair_down_ctas: int = 3
    expert_bn: int = 32
    expert_bh: int = 64
    expert_bk: int = 128
    expert_warps: int = 4
    expert_stages: int = 1
    pair_min_expert_pairs: int = 512
    pdl: bool = False


# Triton's interpreter costs milliseconds per program, whatever its size: the fewest, largest tiles, and two
# programs, so each walks several items as the GPU's persistent programs do.
INTERPRETER_TILES = Tiles(pair_bn=32, pair_ctas=2, pair_down_bh=32, pair_down_bk=64, pair_down_ctas=2, expert_bn=64,
                          expert_bh=64, expert_bk=128)


def tiles_for(num_tokens: int, hidden_size: int = 2048) -> Tiles:
    """The tiles measured fastest at this T (docs/perf.md, version 6 and "gate_up's warps own rows")."""
    if triton.knobs.runtime.interpret:
        return INTERPRETER_TILES
    if num_tokens == 1:
        return Tiles(pair_stages=2, pair_ctas=8)
    down = Tiles() if num_tokens > 4 else Tiles(pair_down_ctas=4)
    if hidden_size == 2048:
        # gate_up on 2-warp programs of one gate and one up row each, lanes over 512-wide chunks of H: a row's sum
        # stays in its warp. Measured at H = 2048 only, on an H100 (2-3.5% faster at T = 2-32); at H = 4096 the
        # hidden row alone would take 128 registers a thread.
        return replace(down, pair_hc=512, pair_bn=1, pair_warps=2, pair_ctas=12 if num_tokens <= 4 else 14)
    if num_tokens == 2:
        return replace(down, pair_bn=2, pair_warps=2, pair_ctas=8)
    return down


def _programs(device: torch.device, per_sm: int) -> int:
    """A persistent grid: `per_sm` programs on each SM (the interpreter runs them one after another: one 'SM')."""
    if device.type != "cuda":
        return per_sm
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def warp_decode_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2, *,
                    schedule: str = "auto", tiles: Tiles | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of a decode batch, [T, H] bf16, written to `out` if given. `schedule`: "auto",
    "pair", "expert_gate_up" (expert-grouped TF32 gate_up, pair down) or "expert" (both grouped, plus combine);
    `tiles`: None for `tiles_for(T, H)`."""
    check_kernel_args(hidden, topk_weights, topk_ids, w13, w2)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    d13, s13, mx13 = weight_parts(w13, "w13", hidden.device)
    d2, s2, mx2 = weight_parts(w2, "w2", hidden.device)
    if mx13 != mx2:
        raise TypeError("w13 and w2 must both be MXFP8Tensor or both bfloat16")
    (T, H), k, E, I = hidden.shape, topk_ids.shape[1], w13.shape[0], w2.shape[-1]
    P = T * k
    tiles = tiles_for(T, H) if tiles is None else tiles
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
    # Programmatic dependent launch (sm_90) is inline PTX that Triton's interpreter cannot run; it changes
    # when the later launches start, never what they compute.
    hints = dict(PDL=tiles.pdl and not triton.knobs.runtime.interpret)
    later = dict(launch_pdl=True) if hints["PDL"] else {}
    if schedule == "pair":
        warp_decode_gate_up(hidden, topk_weights, topk_ids, (d13, s13, mx13), act, block_n=tiles.pair_bn,
                            num_warps=tiles.pair_warps, num_stages=tiles.pair_stages,
                            programs=_programs(hidden.device, tiles.pair_ctas), chunk_h=tiles.pair_hc,
                            pdl=hints["PDL"])
    else:
        _gate_up_expert_kernel[(triton.cdiv(I, tiles.expert_bn), leaders)](
            hidden, topk_ids, topk_weights, d13, s13, act, P, H, I, K_TOP=k, IS_MX=mx13, BY_PAIR=by_pair,
            PP=pp, TB=_PAIR_TILE, BN=tiles.expert_bn, BK=tiles.expert_bk, num_warps=tiles.expert_warps,
            num_stages=tiles.expert_stages, **hints)
    if schedule != "expert":
        return warp_decode_down(act, topk_ids, (d2, s2, mx2), out, block_h=tiles.pair_down_bh,
                                block_k=tiles.pair_down_bk, num_warps=tiles.pair_down_warps,
                                num_stages=tiles.pair_down_stages, programs=_programs(hidden.device,
                                                                                      tiles.pair_down_ctas),
                                pdl=hints["PDL"])
    part = torch.empty((P, H), dtype=torch.float32, device=hidden.device)
    _down_expert_kernel[(triton.cdiv(H, tiles.expert_bh), leaders)](
        act, topk_ids, d2, s2, part, P, H, I, IS_MX=mx2, BY_PAIR=by_pair, PP=pp, TB=_PAIR_TILE, BH=tiles.expert_bh,
        BK=tiles.expert_bk, num_warps=tiles.expert_warps, num_stages=tiles.expert_stages, **hints, **later)
    moe_combine(part, out, k, pdl=hints["PDL"])
    return out
