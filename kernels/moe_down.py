"""Grouped GEMM down with the routing weight applied: the second GEMM of the expert-centric MoE path.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k (token, expert) pairs
(pair p = t * k + j), S row slots after alignment (kernels/moe_align.py), BLOCK_M rows per block.
Layout (row-major):
    act [S, I] bf16 from kernels/moe_gate_up.py (row s: the pair in slot s), or MXFP8 (data fp8 e4m3 [S, I],
        scales uint8 [S, I/32]) with act_dtype "mxfp8"
    sorted_ids [S] int32 (padding = P)   block_expert [S / BLOCK_M] int32 (-1: empty)   topk_weights [P] float
    w2 [E, H, I]: bf16, or MXFP8 data [E, H, I] + scales [E, H, I/32]
    part [P, H] fp32 (out): row p = topk_weights[p] * w2[e] @ act[slot of p]; summed per token by the combine
Program (n block of H, row block): the same swap-AB schedule as the gate_up kernel (weights are the MMA's M
operand, dequantized in registers; act rows of the block are contiguous). The routing weight multiplies the
FP32 accumulator before the store, and each pair owns its own row of `part`, so the sum over a token's k experts
happens later in a fixed order (deterministic, no atomics).
Bytes: each touched expert's w2 once (H * I * (1 + 1/32) in MXFP8, 2 bytes per weight in BF16), act read
S * I * 2 (mostly from L2), part written P * H * 4.
dequant "f16_rel" (F16_REL, MXFP8 weights only): as in the gate_up kernel, FP16 dots on relative operands
(scratch `rmax` [E, H] int32).
"""

import torch
import triton
import triton.language as tl

from kernels.moe_align import check_alignment
from kernels.moe_reference import check_tensor
from kernels.mx_tiles import (
    block_slots,
    check_dequant,
    dot_dtype,
    e8m0_to_f32,
    kmajor_tile,
    kmajor_tile_rel,
    operand_parts,
    row_scale_max,
    row_tile,
    row_tile_rel,
)
from kernels.mxfp8 import MXFP8Tensor


@triton.jit
def _down_kernel(a_ptr, as_ptr, sorted_ptr, block_expert_ptr, rw_ptr, d_ptr, s_ptr, rmax_ptr, part_ptr, P,
                 H: tl.constexpr, I: tl.constexpr, A_MX: tl.constexpr, W_MX: tl.constexpr, DOT: tl.constexpr,
                 F16_REL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    nb, mb = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + mb).to(tl.int64)
    if e < 0:  # past the last expert's rows: the grid is sized for the worst case
        return
    slot, pair, ok = block_slots(sorted_ptr, mb, P, BLOCK_M)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    wd = d_ptr + e * (H * I)  # the expert's base in int64; offsets within an expert fit int32
    ws = s_ptr + e * (H * (I // 32))
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if F16_REL:  # each row's reference scale: its weights enter the dots relative to it, its factor joins at the end
        smax = row_scale_max(ws, n, n_ok, rmax_ptr + e * H, I, BLOCK_K)
    for k0 in range(0, I, BLOCK_K):
        if F16_REL:
            at, af = kmajor_tile_rel(a_ptr, as_ptr, slot, ok, k0, I, BLOCK_K, A_MX, DOT)
            acc += tl.dot(row_tile_rel(wd, ws, n, n_ok, k0, smax, I, BLOCK_K, DOT), at) * af[None, :]
        else:
            at = kmajor_tile(a_ptr, as_ptr, slot, ok, k0, I, BLOCK_K, A_MX, DOT)
            acc = tl.dot(row_tile(wd, ws, n, n_ok, k0, I, BLOCK_K, W_MX, DOT), at, acc)
    if F16_REL:
        acc *= e8m0_to_f32(smax)[:, None]
    rw = tl.load(rw_ptr + pair, mask=ok, other=0.0).to(tl.float32)
    tl.store(part_ptr + pair[None, :].to(tl.int64) * H + n[:, None], acc * rw[None, :],
             mask=ok[None, :] & n_ok[:, None])


def moe_down(act, sorted_ids, block_expert, topk_weights, w2, part, *, block_m: int, block_n: int, block_k: int,
             num_warps: int = 4, num_stages: int = 3, dequant: str = "bf16") -> torch.Tensor:
    """part[p] = topk_weights[p] * w2[e] @ act[s] for the pair p in slot s, e = block_expert[s // block_m];
    writes and returns `part` [P, H] fp32. act and w2: bf16 tensors or MXFP8Tensor (w2 checked by the caller,
    kernels/expert_centric_moe.py, with the rest of the MoE arguments); dequant: "bf16" or "f16_rel"."""
    device = sorted_ids.device
    E, H, I = w2.shape
    P = topk_weights.numel()
    S = check_alignment(sorted_ids, block_expert, block_m)
    check_tensor("part", part, torch.float32, (P, H), device)
    if not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous, got strides {topk_weights.stride()}")
    if isinstance(act, MXFP8Tensor):
        check_tensor("act.data", act.data, torch.float8_e4m3fn, (S, I), device)
        check_tensor("act.scales", act.scales, torch.uint8, (S, I // 32), device)
    else:
        check_tensor("act", act, torch.bfloat16, (S, I), device)
    ad, as_, a_mx = operand_parts(act)
    if block_k % 32 or I % 32:
        raise ValueError(f"block_k={block_k} and I={I} must be multiples of 32 (the MXFP8 block)")
    wd, ws, w_mx = operand_parts(w2)
    f16_rel = check_dequant(dequant, w_mx)
    # Each weight row's largest scale code (mx_tiles.row_scale_max); a placeholder on the BF16 path.
    rmax = torch.empty(w2.shape[:2] if f16_rel else (1,), dtype=torch.int32, device=device)
    grid = (triton.cdiv(H, block_n), S // block_m)
    _down_kernel[grid](ad, as_, sorted_ids, block_expert, topk_weights, wd, ws, rmax, part, P, H, I, A_MX=a_mx,
                       W_MX=w_mx, DOT=dot_dtype(dequant), F16_REL=f16_rel, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return part

