"""Warp decode's first kernel: for every (token, routed expert) pair, gate and up rows over all of H, SiLU(gate) * up
times the routing weight, in FP32.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k pairs (p = t * k + j).
Layout (row-major [out, in], as kernels/moe_reference.py):
    hidden [T, H] bf16   topk_ids [T, k] int32/64   topk_weights [T, k] float
    w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1): bf16, or MXFP8 data fp8 e4m3 [E, 2I, H] + scales uint8 E8M0
        [E, 2I, H / 32] (one per 32 reduction elements)
    act [P, I] fp32 (out) = topk_weight * silu(gate) * up
Work item: (pair p, block of BN rows n): the expert's gate rows n and up rows I + n, all of H in one tile, against the
token's hidden row. Each program serves one pair (the grid is a multiple of P: program q serves pair q % P) and walks
its expert's row blocks, so the expert id, routing weight and hidden row are loaded once per program; the programs of
pairs that share an expert walk its blocks at about the same time, and all but the first read them from L2.
Bytes: each touched expert's w13 once from HBM, 2 * I * H * (1 + 1/32) in MXFP8 (2 bytes per weight in BF16); pairs
sharing an expert re-read it from L2; hidden rows (L2), act written P * I * 4.

Why this shape. Decode at small T is a pure weight stream, and its limit is how many bytes each SM keeps in flight.
Programs that load their rows once and exit (one per item) leave the SM idle between the load and the next
program's; persistent programs (a few per SM, `programs` in all) instead walk the item list in a software-pipelined
loop: Triton's pipeliner turns each item's loads into cp.async copies into shared memory issued `num_stages - 1`
items ahead, so loads no longer wait on registers or on the previous item's arithmetic. Each row is reduced with
tl.sum; MXFP8 scales multiply each 32-element partial sum, so dequantization costs a convert per weight and a
multiply per 32. Measured against one-program-per-item kernels in docs/perf.md (version 6).
Which threads hold a row is Triton's choice, made from the tile's shape: it gives the contiguous dimension the lanes
first and then the warps, so an [BN, 2, H] tile splits each row over the warps and every item ends in a cross-warp
reduction through shared memory. `chunk_h` leads with the chunk index instead ([H / chunk_h, BN, 2, chunk_h]): at
chunk_h = 512 one warp's lanes span a chunk, the warps split the rows, and a row's sum stays in its warp until the
finished gate and up sums meet (2-3% faster at T = 2-32, docs/perf.md "gate_up's warps own rows"). Scale tiles
narrower than 4 bytes a thread are not pipelined and are moved through shared memory into the sums' layout; the
kernel is weakly issue-bound, so that costs less than the cross-warp reduction did.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import e8m0_to_f32, tail_mask
from kernels.mxfp8 import as_dense


@triton.jit
def _expert_rows(d_ptr, e, nb, H: tl.constexpr, HP: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
                 HC: tl.constexpr):
    """Expert e's gate rows n = nb * BN .. + BN and up rows I + n over all of H, as C = HP / HC chunks of HC: the
    weights as FP32 [C, BN, 2, HC / 32, 32], the rows [BN, 2] (for _row_scales), n [BN] and which n exist. The chunk
    index leads so that, where a warp's lanes fill one HC-wide chunk, the warps split the rows and the chunks repeat
    in each thread's registers (HC = HP: the layout of one [BN, 2, H] tile)."""
    C: tl.constexpr = HP // HC
    n = nb * BN + tl.arange(0, BN)
    n_ok = tail_mask(n, I, BN)
    kk = tl.arange(0, C)[:, None, None, None] * HC + tl.arange(0, HC)[None, None, None, :]
    k_ok = tail_mask(kk, H, HP)  # constant when H is a power of two (HP == H)
    row = e.to(tl.int64) * 2 * I + n[:, None] + I * tl.arange(0, 2)[None, :]
    m = n_ok[None, :, None, None] & k_ok
    w = tl.load(d_ptr + row[None, :, :, None] * H + kk, mask=m, other=0.0).to(tl.float32)
    return tl.reshape(w, (C, BN, 2, HC // 32, 32)), row, n, n_ok


@triton.jit
def _row_scales(s_ptr, row, n_ok, H: tl.constexpr, HP: tl.constexpr, HC: tl.constexpr, IS_MX: tl.constexpr):
    """The factor of each 32-group of _expert_rows' rows, [C, BN, 2, HC / 32]: its E8M0 scale, or 1 for BF16."""
    C: tl.constexpr = HP // HC
    GC: tl.constexpr = HC // 32
    if IS_MX:
        sg = tl.arange(0, C)[:, None, None, None] * GC + tl.arange(0, GC)[None, None, None, :]
        sm = n_ok[None, :, None, None] & (sg < H // 32)
        return e8m0_to_f32(tl.load(s_ptr + row[None, :, :, None] * (H // 32) + sg, mask=sm, other=127))
    return tl.full([C, row.shape[0], 2, GC], 1.0, tl.float32)


@triton.jit
def _hidden_row(x_ptr, t, H: tl.constexpr, HP: tl.constexpr, HC: tl.constexpr):
    """Token t's hidden row as FP32 [C, 1, 1, HC / 32, 32], broadcastable against _expert_rows' weights."""
    kk = tl.arange(0, HP // HC)[:, None] * HC + tl.arange(0, HC)[None, :]
    x = tl.load(x_ptr + t * H + kk, mask=tail_mask(kk, H, HP), other=0.0).to(tl.float32)
    return tl.reshape(x, (HP // HC, 1, 1, HC // 32, 32))


@triton.jit
def _gate_up_sums(w, f, x):
    """One token's gate and up sums [BN] each, from _expert_rows' w, _row_scales' f and _hidden_row's x: each 32-element
    partial sum times its group's factor, then the groups and chunks summed."""
    return tl.split(tl.sum(tl.sum(tl.sum(w * x, axis=4) * f, axis=3), axis=0))


@triton.jit
def _gate_up_item(x, e, rw, p, nb, d_ptr, s_ptr, act_ptr, H: tl.constexpr, HP: tl.constexpr, I: tl.constexpr,
                  IS_MX: tl.constexpr, BN: tl.constexpr, HC: tl.constexpr):
    w, row, n, n_ok = _expert_rows(d_ptr, e, nb, H, HP, I, BN, HC)
    g, u = _gate_up_sums(w, _row_scales(s_ptr, row, n_ok, H, HP, HC, IS_MX), x)
    tl.store(act_ptr + p * I + n, rw * g * tl.sigmoid(g) * u, mask=n_ok)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, rw_ptr, d_ptr, s_ptr, act_ptr, P, n_blocks, n_programs, H: tl.constexpr,
                    HP: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, IS_MX: tl.constexpr, BN: tl.constexpr,
                    HC: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next launch's CTAs may start (and load their weights) as soon as SMs have room
        tl.extra.cuda.gdc_launch_dependents()
    # Program q serves pair q % P (the grid is a multiple of P): its expert, hidden row and routing weight are
    # loaded once, outside the loop, and only the expert's row blocks stream through it.
    q = tl.program_id(0)
    p = q % P
    e = tl.load(ids_ptr + p)
    x = _hidden_row(x_ptr, p // K_TOP, H, HP, HC)
    rw = tl.load(rw_ptr + p).to(tl.float32)
    stride = n_programs // P
    if INTERPRET:  # the interpreter's range() takes no runtime bounds; the GPU needs a for loop to pipeline
        nb = q // P
        while nb < n_blocks:
            _gate_up_item(x, e, rw, p, nb, d_ptr, s_ptr, act_ptr, H, HP, I, IS_MX, BN, HC)
            nb += stride
    else:
        for nb in tl.range(q // P, n_blocks, stride, num_stages=STAGES):
            _gate_up_item(x, e, rw, p, nb, d_ptr, s_ptr, act_ptr, H, HP, I, IS_MX, BN, HC)


def warp_decode_gate_up(hidden, topk_weights, topk_ids, w13_parts, act, *, block_n: int, num_warps: int,
                        num_stages: int, programs: int, chunk_h: int | None = None,
                        pdl: bool = False) -> torch.Tensor:
    """act[p] = topk_weights[p] * silu(gate_e(hidden[t])) * up_e(hidden[t]) for every pair p = t * k + j routed to
    e = topk_ids[t, j]; writes and returns `act` [P, I] fp32. w13_parts: (data, scales, is_mx) from
    kernels.moe_reference.weight_parts (the caller, warp_decode_moe, checks the MoE arguments); `programs`:
    persistent programs in the grid (a few per SM), rounded to a multiple of the pair count (at least one program a
    pair, at most one per row block); chunk_h: the width of H a warp's lanes span (a power of two, at most H rounded
    up to one; None for all of it), see _expert_rows."""
    d13, s13, is_mx = w13_parts
    (T, H), k = hidden.shape, topk_ids.shape[1]
    I = d13.shape[1] // 2
    check_tensor("act", act, torch.float32, (T * k, I), d13.device)
    hp = triton.next_power_of_2(H)
    hc = hp if chunk_h is None else chunk_h
    if block_n & (block_n - 1) or hc & (hc - 1) or not 32 <= hc <= hp or num_stages < 1 or programs < 1:
        raise ValueError(f"block_n must be a power of two, chunk_h one in 32..{hp} and num_stages, programs >= 1, "
                         f"got {block_n}, {chunk_h}, {num_stages}, {programs}")
    n_blocks, P = triton.cdiv(I, block_n), T * k
    grid = P * min(max(1, programs // P), n_blocks)
    if grid:
        _gate_up_kernel[(grid,)](hidden, topk_ids, topk_weights, d13, s13, act, P, n_blocks, grid, H, hp, I,
                                 K_TOP=k, IS_MX=is_mx, BN=block_n, HC=hc, STAGES=num_stages,
                                 INTERPRET=triton.knobs.runtime.interpret, PDL=pdl, num_warps=num_warps,
                                 num_stages=num_stages)
    return act


def gate_up_reference(hidden, topk_weights, topk_ids, w13) -> torch.Tensor:
    """act [P, I] in FP32 on the dequantized weights: the FP32 answer warp_decode_gate_up approximates."""
    x = hidden.float()
    I = w13.shape[1] // 2
    act = torch.empty(topk_ids.numel(), I, dtype=torch.float32, device=hidden.device)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        gate, up = (x[pairs // topk_ids.shape[1]] @ as_dense(w13[e], torch.float32).T).split(I, dim=-1)
        act[pairs] = topk_weights.reshape(-1)[pairs, None].float() * torch.nn.functional.silu(gate) * up
    return act
