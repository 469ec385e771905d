"""Grouped GEMM gate_up with SiLU(gate) * up fused: the first GEMM of the expert-centric MoE path.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k (token, expert) pairs
(pair p = t * k + j), S row slots after alignment (kernels/moe_align.py), BLOCK_M rows per block.
Layout (row-major):
    hidden [T, H] bf16, or MXFP8 (data fp8 e4m3 [T, H], scales uint8 [T, H/32]) with act_dtype "mxfp8"
    sorted_ids [S] int32 (pair ids grouped by expert, padding = P)   block_expert [S / BLOCK_M] int32 (-1: empty)
    w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1): bf16, or MXFP8 data [E, 2I, H] + scales [E, 2I, H/32]
    act [S, I] bf16 (out): row s = silu(gate) * up of the pair in slot s; padding rows are zeros
Program (n block, row block): one expert's gate and up rows n .. n + BLOCK_N against the BLOCK_M pairs of a row
block (hidden gathered by token), two tensor-core dots per BLOCK_K step into FP32 accumulators. Weights are the
dots' left operand ("swap AB"): the MMA's M dimension is BLOCK_N >= 64 weight rows, so wgmma runs even when an
expert has only a few tokens (decode), and the dequantized MXFP8 tile goes from registers straight into the MMA
(wgmma takes its left operand from registers) instead of back through shared memory; the raw bytes arrive by
pipelined cp.async. The n blocks of one row block are adjacent in launch order, so its hidden rows are read from
HBM once and then from L2, as is each expert's weight across its row blocks.
Bytes: each touched expert's w13 once (2 * I * H * (1 + 1/32) in MXFP8, 2 bytes per weight in BF16), hidden
rows S * H * 2 (mostly from L2), act written S * I * 2.
dequant "f16_rel" (F16_REL, MXFP8 weights only): FP16 dots on relative operands (kernels/mx_tiles.py): each
step's dot scaled by its tokens' factors before it joins the FP32 accumulator, each row's factor applied after the
loop. The rows' reference scales go through `rmax` [E, 2I] int32 (scratch, see mx_tiles.row_scale_max).
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


@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, sorted_ptr, block_expert_ptr, d_ptr, s_ptr, rmax_ptr, act_ptr, P,
                    H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, X_MX: tl.constexpr, W_MX: tl.constexpr,
                    DOT: tl.constexpr, F16_REL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    nb, mb = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + mb).to(tl.int64)
    if e < 0:  # past the last expert's rows: the grid is sized for the worst case
        return
    slot, pair, ok = block_slots(sorted_ptr, mb, P, BLOCK_M)
    tok = pair // K_TOP
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    wd = d_ptr + e * (2 * I * H)  # the expert's base in int64; offsets within an expert fit int32
    ws = s_ptr + e * (2 * I * (H // 32))
    g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if F16_REL:  # each row's reference scale: its weights enter the dots relative to it, its factor joins at the end
        g_max = row_scale_max(ws, n, n_ok, rmax_ptr + e * (2 * I), H, BLOCK_K)
        u_max = row_scale_max(ws, I + n, n_ok, rmax_ptr + e * (2 * I), H, BLOCK_K)
    for k0 in range(0, H, BLOCK_K):
        if F16_REL:
            xt, xf = kmajor_tile_rel(x_ptr, xs_ptr, tok, ok, k0, H, BLOCK_K, X_MX, DOT)
            g += tl.dot(row_tile_rel(wd, ws, n, n_ok, k0, g_max, H, BLOCK_K, DOT), xt) * xf[None, :]
            u += tl.dot(row_tile_rel(wd, ws, I + n, n_ok, k0, u_max, H, BLOCK_K, DOT), xt) * xf[None, :]
        else:
            xt = kmajor_tile(x_ptr, xs_ptr, tok, ok, k0, H, BLOCK_K, X_MX, DOT)
            g = tl.dot(row_tile(wd, ws, n, n_ok, k0, H, BLOCK_K, W_MX, DOT), xt, g)
            u = tl.dot(row_tile(wd, ws, I + n, n_ok, k0, H, BLOCK_K, W_MX, DOT), xt, u)
    if F16_REL:
        g *= e8m0_to_f32(g_max)[:, None]
        u *= e8m0_to_f32(u_max)[:, None]
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + slot[None, :] * I + n[:, None], act.to(act_ptr.dtype.element_ty), mask=n_ok[:, None])


def moe_gate_up(hidden, sorted_ids, block_expert, w13, act, *, num_pairs: int, top_k: int, block_m: int,
                block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3,
                dequant: str = "bf16") -> torch.Tensor:
    """act[s] = silu(hidden[t] @ gate[e].T) * (hidden[t] @ up[e].T) for the pair t * k + j in slot s, routed to
    expert e = block_expert[s // block_m]; writes and returns `act` [S, I] bf16. w13 and hidden: bf16 tensors or
    MXFP8Tensor (checked by the caller, kernels/expert_centric_moe.py, with the rest of the MoE arguments);
    dequant: "bf16" or "f16_rel" (the dot's operand dtype, kernels/mx_tiles.py)."""
    device = sorted_ids.device
    E, two_i, H = w13.shape
    I = two_i // 2
    S = check_alignment(sorted_ids, block_expert, block_m)
    check_tensor("act", act, torch.bfloat16, (S, I), device)
    if block_k % 32 or H % 32:
        raise ValueError(f"block_k={block_k} and H={H} must be multiples of 32 (the MXFP8 block)")
    xd, xs, x_mx = operand_parts(hidden)
    wd, ws, w_mx = operand_parts(w13)
    f16_rel = check_dequant(dequant, w_mx)
    # Each weight row's largest scale code (mx_tiles.row_scale_max); a placeholder on the BF16 path.
    rmax = torch.empty(w13.shape[:2] if f16_rel else (1,), dtype=torch.int32, device=device)
    grid = (triton.cdiv(I, block_n), S // block_m)
    _gate_up_kernel[grid](xd, xs, sorted_ids, block_expert, wd, ws, rmax, act, num_pairs, H, I, K_TOP=top_k, X_MX=x_mx,
                          W_MX=w_mx, DOT=dot_dtype(dequant), F16_REL=f16_rel, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return act
