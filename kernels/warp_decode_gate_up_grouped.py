"""Warp decode's gate_up with the pairs grouped by expert (schedule "grouped"): each expert's rows are copied once per
block of up to TB pairs, instead of once per pair as in kernels/warp_decode_gate_up.py. Not yet measured on a GPU.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k pairs (p = t * k + j),
TB pairs per slot block, S slots (kernels/moe_align.py with block_m = TB).
Layout (row-major [out, in], as kernels/moe_reference.py):
    hidden [T, H] bf16   topk_weights [T, k] float
    sorted_ids [S] int32 (pairs grouped by expert, padding = P)   block_expert [S / TB] int32 (-1: no expert)
    w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1): bf16, or MXFP8 data fp8 e4m3 [E, 2I, H] + scales uint8 E8M0
        [E, 2I, H / 32]
    act [P, I] fp32 (out) = topk_weight * silu(gate) * up, in pair order (the pair down kernel reads it as it is)
Work item: (slot block mb, block of BN rows n): expert block_expert[mb]'s gate rows n and up rows I + n over all of H,
against the hidden rows of the block's TB slots (padding slots load nothing and store nothing; blocks of -1 load
nothing). Items are numbered slot-block-major, so a program's neighbours in the grid read the same expert.
Bytes: each touched expert's w13 once per slot block it fills (once for experts with at most TB pairs), 2 * I * H *
(1 + 1/32) in MXFP8; hidden rows per pair (L2); act written P * I * 4. The pair kernel copies the rows once per pair
(the repeats from L2): at T = 16 (k = 8) its copies through L2 are ~1.5x the unique bytes, here ~1.1x.

Why this shape: past T ~ 8 the pair kernel's copies through L2 grow with the pairs that share an expert (docs/perf.md,
"where v6.1 stands"). Persistent programs and the software-pipelined item loop are the pair kernel's; the TB slots
are a static loop over one weight tile in registers, each slot's hidden row a separate (pipelined) copy.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_align import check_alignment
from kernels.moe_reference import check_tensor
from kernels.warp_decode_gate_up import expert_rows, gate_up_sums, hidden_row, row_scales


@triton.jit
def _grouped_item(x_ptr, rw_ptr, sorted_ptr, block_expert_ptr, d_ptr, s_ptr, act_ptr, P, n_row_blocks, item,
                  H: tl.constexpr, HP: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, IS_MX: tl.constexpr,
                  BN: tl.constexpr, TB: tl.constexpr):
    mb = item // n_row_blocks
    e = tl.load(block_expert_ptr + mb)
    w, row, n, n_ok = expert_rows(d_ptr, tl.maximum(e, 0), item % n_row_blocks, e >= 0, H, HP, I, BN)
    f = row_scales(s_ptr, row, n_ok, e >= 0, H, HP, IS_MX)
    for i in tl.static_range(TB):
        p = tl.load(sorted_ptr + mb * TB + i)
        ok = p < P
        g, u = gate_up_sums(w, f, hidden_row(x_ptr, p // K_TOP, ok, H, HP))
        rw = tl.load(rw_ptr + p, mask=ok, other=0.0).to(tl.float32)
        tl.store(act_ptr + p * I + n, rw * g * tl.sigmoid(g) * u, mask=n_ok & ok)


@triton.jit
def _grouped_kernel(x_ptr, rw_ptr, sorted_ptr, block_expert_ptr, d_ptr, s_ptr, act_ptr, P, n_row_blocks, n_items,
                    n_programs, H: tl.constexpr, HP: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr,
                    IS_MX: tl.constexpr, BN: tl.constexpr, TB: tl.constexpr, STAGES: tl.constexpr,
                    INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter's range() takes no runtime bounds; the GPU needs a for loop to pipeline
        item = tl.program_id(0)
        while item < n_items:
            _grouped_item(x_ptr, rw_ptr, sorted_ptr, block_expert_ptr, d_ptr, s_ptr, act_ptr, P, n_row_blocks, item,
                          H, HP, I, K_TOP, IS_MX, BN, TB)
            item += n_programs
    else:
        for item in tl.range(tl.program_id(0), n_items, n_programs, num_stages=STAGES):
            _grouped_item(x_ptr, rw_ptr, sorted_ptr, block_expert_ptr, d_ptr, s_ptr, act_ptr, P, n_row_blocks, item,
                          H, HP, I, K_TOP, IS_MX, BN, TB)


def warp_decode_gate_up_grouped(hidden, topk_weights, sorted_ids, block_expert, w13_parts, act, *, top_k: int,
                                block_m: int, block_n: int, num_warps: int, num_stages: int,
                                programs: int) -> torch.Tensor:
    """act[p] = topk_weights[p] * silu(gate_e(hidden[t])) * up_e(hidden[t]) for every pair p = t * k + j, read by
    expert from moe_align's (sorted_ids, block_expert) for block_m; writes and returns `act` [P, I] fp32. w13_parts:
    (data, scales, is_mx) from kernels.moe_reference.weight_parts (the caller, warp_decode_moe, checks the MoE
    arguments); `programs`: persistent programs in the grid (a few per SM)."""
    d13, s13, is_mx = w13_parts
    T, H = hidden.shape
    I = d13.shape[1] // 2
    S = check_alignment(sorted_ids, block_expert, block_m)
    check_tensor("act", act, torch.float32, (T * top_k, I), d13.device)
    if block_n & (block_n - 1) or num_stages < 1 or programs < 1:
        raise ValueError(f"block_n must be a power of two and num_stages, programs >= 1, got {block_n}, "
                         f"{num_stages}, {programs}")
    n_row_blocks = triton.cdiv(I, block_n)
    n_items = n_row_blocks * (S // block_m)
    grid = min(n_items, programs)
    if grid:
        _grouped_kernel[(grid,)](hidden, topk_weights, sorted_ids, block_expert, d13, s13, act, T * top_k,
                                 n_row_blocks, n_items, grid, H, triton.next_power_of_2(H), I, K_TOP=top_k,
                                 IS_MX=is_mx, BN=block_n, TB=block_m, STAGES=num_stages,
                                 INTERPRET=triton.knobs.runtime.interpret, num_warps=num_warps,
                                 num_stages=num_stages)
    return act
