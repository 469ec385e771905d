"""Grouped GEMM gate_up on FP8 tensor cores: MXFP8 weights as stored, hidden as hi + lo E4M3 (dequant "fp8").

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k pairs (pair p = t * k
+ j), S row slots after alignment (kernels/moe_align.py), BLOCK_M rows per block.
Layout (row-major):
    x: FP8Split of hidden (kernels/fp8_split.py): data [T, 2, H] e4m3 (hi, lo), scales [T, 1] (one per token)
    sorted_ids [S] int32 (padding = P)   block_expert [S / BLOCK_M] int32 (-1: empty)
    w13: MXFP8 data [E, 2I, H] e4m3 + scales [E, 2I, H / 32] (gate rows 0..I-1, up rows I..2I-1)
    act: FP8Split of silu(gate) * up (out): data [S, 2, I] e4m3 (hi, lo), scales [S, I / 32] (one per 32 of I)
Program (n block of I, row block): as kernels/moe_gate_up.py, weights the MMA's M operand ("swap AB"), but each
32-wide K group is one FP8 dot of the block's gate and up rows stacked ([2 * BLOCK_N, 32]) against the slots' hi
and lo columns side by side ([32, 2 * BLOCK_M]); each column pair is added and the sum promoted into the FP32
accumulator times the rows' scale of that group: no per-weight arithmetic, ~1 FP32 FMA per accumulator element
per 32 of K (BLOCK_M / 32 per weight, against ~2.5 instructions per weight to dequantize to BF16). One dot per
group, not four (gate, up, hi, lo): Triton waits for each such dot (its result is scaled before it joins the
accumulator, so it is not pipelined), and v1's four waits per group left the tensor pipe's latency exposed. The
token scale joins after the K loop. The epilogue splits act per 32 rows of I (BLOCK_N is a multiple of 32), so the
down GEMM takes FP8 operands too. Error: hidden splits exactly (BF16, kernels/fp8_split.py); act keeps ~8 bits as
when stored in BF16; each FP8 dot sums 32 exact products.
Weight tiles come by per-thread cp.async, or with `tma` as TMA boxes ([1, 2, BLOCK_N, BOX_K] of w13 viewed [E, 2,
I, H]: the step's gate and up rows together, rows past I zero-filled), which frees the load queues that sm_90 stall
sampling found busy: on the H200 gate_up's best TMA tile is 13-18% faster than its best cp.async tile at T = 8-128
(up to 35% on one tile; docs/perf.md), and the tuned table uses it up to T = 1024. A box spans the whole step (BOX_K
= BLOCK_K, at most 128: mx_tiles.tma_box_k) and the groups' dots read its 32-wide column slices (mx_tiles.k_group,
views of the box in shared memory), so a step costs one copy and one mbarrier wait instead of one per group.
Bytes: each touched expert's w13 once (2 * I * H * (1 + 1/32)), hidden 2 * T * H (+ rows re-read from L2),
act written S * I * (2 + 1/32).
"""

import torch
import triton
import triton.language as tl

from kernels.fp8_split import FP8Split, split_codes, split_e4m3
from kernels.moe_align import check_alignment
from kernels.mx_tiles import (
    block_slots,
    e8m0_to_f32,
    fp8_split_dot,
    k_group,
    packed_scale,
    packed_scales,
    tma_box_k,
    tma_descriptor,
)
from kernels.mxfp8 import MXFP8Tensor


@triton.jit
def _gate_up_fp8_kernel(x_ptr, xs_ptr, sorted_ptr, block_expert_ptr, d_ptr, w_desc, s_ptr, a_ptr, as_ptr, P,
                        H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, F32_DOT: tl.constexpr, TMA: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BOX_K: tl.constexpr):
    nb, mb = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + mb).to(tl.int64)
    if e < 0:  # past the last expert's rows: the grid is sized for the worst case
        return
    # Operand columns 2m, 2m + 1: hi and lo of slot m's token (x.data [T, 2, H] keeps them adjacent).
    col = tl.arange(0, 2 * BLOCK_M)
    cpair = tl.load(sorted_ptr + mb * BLOCK_M + col // 2)
    col_ok = cpair < P
    xrow = tl.where(col_ok, cpair // K_TOP, 0) * 2 + col % 2
    # Operand rows: the block's BLOCK_N gate rows, then its BLOCK_N up rows (one dot for both).
    r = tl.arange(0, 2 * BLOCK_N)
    n = nb * BLOCK_N + r % BLOCK_N
    r_ok = n < I
    wrow = tl.where(r < BLOCK_N, n, I + n)
    wd = d_ptr + e * (2 * I * H)  # the expert's base in int64; offsets within an expert fit int32
    ws = s_ptr + e * (2 * I * (H // BLOCK_K))  # scales packed BLOCK_K / 32 to a word (the launcher's view)
    c = tl.arange(0, 32)
    acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The scale words are loaded one step ahead (in registers: cp.async pipelines only the dots' operands), so
    # their latency hides behind a step of dots instead of stalling the promotion.
    s_next = tl.load(ws + wrow * (H // BLOCK_K), mask=r_ok, other=0)
    for k0 in range(0, H, BLOCK_K):
        sw = s_next
        s_next = tl.load(ws + wrow * (H // BLOCK_K) + (k0 + BLOCK_K) // BLOCK_K, mask=r_ok & (k0 + BLOCK_K < H),
                         other=0)
        for b in tl.static_range(BLOCK_K // BOX_K):
            if TMA:
                box = tl.reshape(w_desc.load([e.to(tl.int32), 0, nb * BLOCK_N, k0 + b * BOX_K]),
                                 (2 * BLOCK_N, BOX_K))
            for g in tl.static_range(BOX_K // 32):
                j = b * (BOX_K // 32) + g  # the step's group
                kk = k0 + j * 32 + c
                x = tl.load(x_ptr + xrow[None, :] * H + kk[:, None], mask=col_ok[None, :], other=0.0)
                if TMA:
                    w = k_group(box, g, BOX_K // 32)
                else:
                    w = tl.load(wd + wrow[:, None] * H + kk[None, :], mask=r_ok[:, None], other=0.0)
                acc += fp8_split_dot(w, x, F32_DOT) * packed_scale(sw, j)[:, None]
    slot, pair, ok = block_slots(sorted_ptr, mb, P, BLOCK_M)
    acc *= e8m0_to_f32(tl.load(xs_ptr + tl.where(ok, pair // K_TOP, 0), mask=ok, other=127))[None, :]
    g, u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    act = tl.reshape(g * tl.sigmoid(g) * u, (BLOCK_N // 32, 32, BLOCK_M))
    bits = act.to(tl.int32, bitcast=True)
    code = split_codes(bits, 1)
    hi, lo = split_e4m3(bits, code[:, None, :])
    out = tl.reshape(slot[None, None, :] * (2 * I) + nb * BLOCK_N + tl.arange(0, BLOCK_N // 32)[:, None, None] * 32 +
                     c[None, :, None], (BLOCK_N, BLOCK_M))
    n_ok = (nb * BLOCK_N + tl.arange(0, BLOCK_N) < I)[:, None]
    tl.store(a_ptr + out, tl.reshape(hi, (BLOCK_N, BLOCK_M)), mask=n_ok)
    tl.store(a_ptr + I + out, tl.reshape(lo, (BLOCK_N, BLOCK_M)), mask=n_ok)
    grp = nb * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(as_ptr + slot[None, :] * (I // 32) + grp[:, None], code.to(tl.uint8), mask=(grp < I // 32)[:, None])


def moe_gate_up_fp8(x: FP8Split, sorted_ids, block_expert, w13: MXFP8Tensor, act: FP8Split, *, num_pairs: int,
                    top_k: int, block_m: int, block_n: int, block_k: int, num_warps: int = 4,
                    num_stages: int = 3, tma: bool = False) -> FP8Split:
    """act[s] = split(silu(hidden[t] @ gate[e].T) * (hidden[t] @ up[e].T)) for the pair t * k + j in slot s, routed
    to expert e = block_expert[s // block_m]; writes and returns `act`. x: the hidden rows split per token."""
    device = sorted_ids.device
    if not isinstance(w13, MXFP8Tensor):
        raise TypeError(f"w13 must be an MXFP8Tensor for FP8 dots, got {type(w13).__name__}")
    E, two_i, H = w13.shape
    I = two_i // 2
    T = x.data.shape[0]
    S = check_alignment(sorted_ids, block_expert, block_m)
    x.check("x", T, H, 1, device)
    act.check("act", S, I, I // 32, device)
    if block_k % 32 or H % block_k or block_n % 32 or I % 32:
        raise ValueError(f"block_k={block_k} must be a multiple of 32 dividing H={H}, and block_n={block_n} and "
                         f"I={I} multiples of 32 (the scale groups)")
    grid = (triton.cdiv(I, block_n), S // block_m)
    # TMA: the step's gate and up rows as [1, 2, block_n, box_k] boxes of w13 viewed [E, 2, I, H] (rows past I read 0).
    box_k = tma_box_k(block_k, tma)
    w_desc = tma_descriptor("w13", w13.data.view(E, 2, I, H), [1, 2, block_n, box_k]) if tma else w13.data
    _gate_up_fp8_kernel[grid](x.data, x.scales, sorted_ids, block_expert, w13.data, w_desc,
                              packed_scales(w13.scales, block_k), act.data.view(torch.uint8), act.scales, num_pairs, H,
                              I, K_TOP=top_k, F32_DOT=triton.knobs.runtime.interpret, TMA=tma, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k, BOX_K=box_k, num_warps=num_warps, num_stages=num_stages)
    return act
