"""Grouped GEMM down on FP8 tensor cores, the routing weight applied: the second GEMM of dequant "fp8".

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k pairs (pair p = t * k
+ j), S row slots after alignment (kernels/moe_align.py), BLOCK_M rows per block.
Layout (row-major):
    act: FP8Split from kernels/moe_gate_up_fp8.py: data [S, 2, I] e4m3 (hi, lo), scales [S, I / 32] (row s: slot s)
    sorted_ids [S] int32 (padding = P)   block_expert [S / BLOCK_M] int32 (-1: empty)   topk_weights [P] float
    w2: MXFP8 data [E, H, I] e4m3 + scales [E, H, I / 32]
    part [P, H] fp32 (out): row p = topk_weights[p] * w2[e] @ act[slot of p]; summed per token by the combine
Program (n block of H, row block): each 32-wide K group is one FP8 dot against the slots' hi and lo columns side
by side (kernels/moe_gate_up_fp8.py says why one), each column pair added and the sum promoted into the FP32
accumulator times the outer product of the weight rows' and the slots' scales of that group (a multiply and an FMA
per accumulator element per 32 of K: 2 * BLOCK_M / 32 per weight).
Weight tiles: per-thread cp.async, or with `tma` TMA boxes ([BLOCK_N, BOX_K] of w2 viewed [E * H, I], a box per
step up to 128 wide, split into groups in shared memory), as in kernels/moe_gate_up_fp8.py. The activation tiles,
a row block's slots being contiguous rows of act (unlike gate_up's gathered tokens), can come by TMA too
(`tma_act`: [2 * BLOCK_M, 32] boxes of act.data viewed [2S, I], taken transposed as the dot's K-major operand): no
per-thread loads or address arithmetic left in the K loop. A box also brings the padding slots' rows, which
cp.async masks to zero; a slot's columns only ever reach its own accumulator column, which the store masks, so
the outputs are the same bits either way.
Bytes: each touched expert's w2 once (H * I * (1 + 1/32)), act read S * I * (2 + 1/32) (mostly from L2), part
written P * H * 4.
"""

import torch
import triton
import triton.language as tl

from kernels.fp8_split import FP8Split
from kernels.moe_align import check_alignment
from kernels.moe_reference import check_tensor
from kernels.mx_tiles import block_slots, fp8_split_dot, k_group, packed_scale, packed_scales, tma_box_k, tma_descriptor
from kernels.mxfp8 import MXFP8Tensor


@triton.jit
def _down_fp8_kernel(a_ptr, a_desc, as_ptr, sorted_ptr, block_expert_ptr, rw_ptr, d_ptr, w_desc, s_ptr, part_ptr, P,
                     H: tl.constexpr, I: tl.constexpr, F32_DOT: tl.constexpr, TMA: tl.constexpr,
                     TMA_ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BOX_K: tl.constexpr):
    nb, mb = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + mb).to(tl.int64)
    if e < 0:  # past the last expert's rows: the grid is sized for the worst case
        return
    slot, pair, ok = block_slots(sorted_ptr, mb, P, BLOCK_M)
    # Operand columns 2m, 2m + 1: hi and lo of slot m (act.data [S, 2, I] keeps them adjacent).
    col = tl.arange(0, 2 * BLOCK_M)
    col_ok = tl.load(sorted_ptr + mb * BLOCK_M + col // 2) < P
    arow = (mb * BLOCK_M + col // 2) * 2 + col % 2
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    wd = d_ptr + e * (H * I)  # the expert's base in int64; offsets within an expert fit int32
    ws = s_ptr + e * (H * (I // BLOCK_K))  # scales packed BLOCK_K / 32 to a word (the launcher's views)
    c = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The scale words are loaded one step ahead (in registers: cp.async pipelines only the dots' operands), so
    # their latency hides behind a step of dots instead of stalling the promotion.
    sw_next = tl.load(ws + n * (I // BLOCK_K), mask=n_ok, other=0)
    sa_next = tl.load(as_ptr + slot * (I // BLOCK_K), mask=ok, other=0)
    for k0 in range(0, I, BLOCK_K):
        sw, sa = sw_next, sa_next
        more = k0 + BLOCK_K < I
        sw_next = tl.load(ws + n * (I // BLOCK_K) + (k0 + BLOCK_K) // BLOCK_K, mask=n_ok & more, other=0)
        sa_next = tl.load(as_ptr + slot * (I // BLOCK_K) + (k0 + BLOCK_K) // BLOCK_K, mask=ok & more, other=0)
        for b in tl.static_range(BLOCK_K // BOX_K):
            if TMA:
                box = w_desc.load([(e * H + nb * BLOCK_N).to(tl.int32), k0 + b * BOX_K])
            for g in tl.static_range(BOX_K // 32):
                j = b * (BOX_K // 32) + g  # the step's group
                kk = k0 + j * 32 + c
                if TMA_ACT:
                    a = tl.trans(a_desc.load([(mb * 2 * BLOCK_M).to(tl.int32), k0 + j * 32]))
                else:
                    a = tl.load(a_ptr + arow[None, :] * I + kk[:, None], mask=col_ok[None, :], other=0.0)
                if TMA:
                    w = k_group(box, g, BOX_K // 32)
                else:
                    w = tl.load(wd + n[:, None] * I + kk[None, :], mask=n_ok[:, None], other=0.0)
                f = packed_scale(sw, j)[:, None] * packed_scale(sa, j)[None, :]
                acc += fp8_split_dot(w, a, F32_DOT) * f
    rw = tl.load(rw_ptr + pair, mask=ok, other=0.0).to(tl.float32)
    tl.store(part_ptr + pair[None, :].to(tl.int64) * H + n[:, None], acc * rw[None, :],
             mask=ok[None, :] & n_ok[:, None])


def moe_down_fp8(act: FP8Split, sorted_ids, block_expert, topk_weights, w2: MXFP8Tensor, part, *, block_m: int,
                 block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3, tma: bool = False,
                 tma_act: bool = False) -> torch.Tensor:
    """part[p] = topk_weights[p] * w2[e] @ act[s] for the pair p in slot s, e = block_expert[s // block_m];
    writes and returns `part` [P, H] fp32."""
    device = sorted_ids.device
    if not isinstance(w2, MXFP8Tensor):
        raise TypeError(f"w2 must be an MXFP8Tensor for FP8 dots, got {type(w2).__name__}")
    E, H, I = w2.shape
    P = topk_weights.numel()
    S = check_alignment(sorted_ids, block_expert, block_m)
    check_tensor("part", part, torch.float32, (P, H), device)
    act.check("act", S, I, I // 32, device)
    if not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous, got strides {topk_weights.stride()}")
    if block_k % 32 or I % block_k:
        raise ValueError(f"block_k={block_k} must be a multiple of 32 dividing I={I}")
    grid = (triton.cdiv(H, block_n), S // block_m)
    # TMA: [block_n, box_k] boxes of w2 viewed [E * H, I]; a box past an expert's H rows reads the next expert's
    # (finite values whose outputs are masked at the store), past the last expert's zeros.
    box_k = tma_box_k(block_k, tma)
    w_desc = tma_descriptor("w2", w2.data.view(E * H, I), [block_n, box_k]) if tma else w2.data
    a_desc = tma_descriptor("act", act.data.view(2 * S, I), [2 * block_m, 32]) if tma_act else act.data
    _down_fp8_kernel[grid](act.data, a_desc, packed_scales(act.scales, block_k), sorted_ids, block_expert,
                           topk_weights, w2.data, w_desc, packed_scales(w2.scales, block_k), part, P, H, I,
                           F32_DOT=triton.knobs.runtime.interpret, TMA=tma, TMA_ACT=tma_act, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_K=block_k, BOX_K=box_k, num_warps=num_warps,
                           num_stages=num_stages)
    return part
