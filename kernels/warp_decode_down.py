"""Warp decode's second kernel: for every token, the down projection of its k routed experts summed in FP32 (the routing
weights are already folded into act), rounded to BF16 once.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token (KP: k rounded up to a power of
two), P = T * k pairs (p = t * k + j).
Layout (row-major [out, in], as kernels/moe_reference.py):
    act [P, I] fp32 (kernels/warp_decode_gate_up.py)   topk_ids [T, k] int32/64
    w2 [E, H, I]: bf16, or MXFP8 data fp8 e4m3 [E, H, I] + scales uint8 E8M0 [E, H, I / 32]
    out [T, H] bf16
Work item: (token t, block of BH rows h): rows h of each of the token's k experts, [KP, BH, BK] per step over BK-wide
chunks of I, against the token's act rows [KP, BK], loaded once per chunk and broadcast over the BH rows. Items are
token-major, so neighbouring programs share a token's act (L2).
Bytes: each touched expert's w2 once from HBM, H * I * (1 + 1/32) in MXFP8 (2 bytes per weight in BF16); tokens
sharing an expert re-read it from L2; act P * I * 4 (L2), out T * H * 2.

Why this shape: as the gate_up kernel, persistent programs walk their items in one software-pipelined loop (Triton's
pipeliner issues the cp.async copies of the next `num_stages - 1` steps before the current step's arithmetic); the
loop runs over (item, chunk) steps, so an item's FP32 accumulator [KP, BH] lives across its chunks and is stored and
cleared after the last. The summation order is fixed (chunks in order, then experts j = 0..k-1): deterministic,
no atomics.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import e8m0_to_f32, tail_mask
from kernels.mxfp8 import as_dense


@triton.jit
def _down_step(act_ptr, ids_ptr, d_ptr, s_ptr, out_ptr, q, n_programs, step, acc, H: tl.constexpr, I: tl.constexpr,
               K_TOP: tl.constexpr, KP: tl.constexpr, IS_MX: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    """Chunk c of this program's (step // C)-th item; returns the accumulator the next step continues."""
    C: tl.constexpr = (I + BK - 1) // BK
    G: tl.constexpr = BK // 32
    NHB: tl.constexpr = (H + BH - 1) // BH
    item = q + (step // C) * n_programs
    c = step % C
    t = item // NHB
    h = (item % NHB) * BH + tl.arange(0, BH)
    j = tl.arange(0, KP)
    h_ok = tail_mask(h, H, BH)  # masks constant where the shape divides evenly: unpredicated 16-byte copies
    j_ok = tail_mask(j, K_TOP, KP)
    p = t * K_TOP + j
    e = tl.load(ids_ptr + p, mask=j_ok, other=0).to(tl.int64)
    kk = c * BK + tl.arange(0, BK)
    k_ok = tail_mask(kk, I, BK)
    row = e[:, None] * H + h[None, :]
    row_ok = j_ok[:, None] & h_ok[None, :]
    w = tl.load(d_ptr + row[:, :, None] * I + kk[None, None, :], mask=row_ok[:, :, None] & k_ok[None, None, :],
                other=0.0).to(tl.float32)
    a = tl.load(act_ptr + p[:, None] * I + kk[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
    part = tl.sum(tl.reshape(w * a[:, None, :], (KP, BH, G, 32)), axis=3)
    if IS_MX:
        sg = c * G + tl.arange(0, G)
        part *= e8m0_to_f32(tl.load(s_ptr + row[:, :, None] * (I // 32) + sg[None, None, :],
                                    mask=row_ok[:, :, None] & (sg < I // 32)[None, None, :], other=127))
    acc += tl.sum(part, axis=2)
    last = c == C - 1
    tl.store(out_ptr + t * H + h, tl.sum(acc, axis=0).to(tl.bfloat16), mask=h_ok & last)
    return tl.where(last, 0.0, acc)


@triton.jit
def _down_kernel(act_ptr, ids_ptr, d_ptr, s_ptr, out_ptr, n_items, n_programs, H: tl.constexpr, I: tl.constexpr,
                 K_TOP: tl.constexpr, KP: tl.constexpr, IS_MX: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched programmatic-dependent: wait for gate_up's act before the first load
        tl.extra.cuda.gdc_wait()
    q = tl.program_id(0)
    steps = (n_items - q + n_programs - 1) // n_programs * ((I + BK - 1) // BK)
    acc = tl.zeros([KP, BH], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() takes no runtime bounds; the GPU needs a for loop to pipeline
        step = 0
        while step < steps:
            acc = _down_step(act_ptr, ids_ptr, d_ptr, s_ptr, out_ptr, q, n_programs, step, acc, H, I, K_TOP, KP,
                             IS_MX, BH, BK)
            step += 1
    else:
        for step in tl.range(0, steps, num_stages=STAGES):
            acc = _down_step(act_ptr, ids_ptr, d_ptr, s_ptr, out_ptr, q, n_programs, step, acc, H, I, K_TOP, KP,
                             IS_MX, BH, BK)


def warp_decode_down(act, topk_ids, w2_parts, out, *, block_h: int, block_k: int, num_warps: int, num_stages: int,
                     programs: int, pdl: bool = False) -> torch.Tensor:
    """out[t] = sum_j w2[topk_ids[t, j]] @ act[t * k + j] in FP32, rounded to BF16; writes and returns `out` [T, H].
    w2_parts: (data, scales, is_mx) from kernels.moe_reference.weight_parts (the caller, warp_decode_moe, checks the
    MoE arguments); `programs`: persistent programs in the grid (a few per SM); pdl: this launch is
    programmatic-dependent on the one that writes act."""
    d2, s2, is_mx = w2_parts
    T, k = topk_ids.shape
    H, I = d2.shape[1], d2.shape[2]
    check_tensor("act", act, torch.float32, (T * k, I), d2.device)
    check_tensor("out", out, torch.bfloat16, (T, H), d2.device)
    if block_h & (block_h - 1) or block_k & (block_k - 1) or block_k < 32 or num_stages < 1 or programs < 1:
        raise ValueError(f"block_h and block_k must be powers of two (block_k >= 32) and num_stages, programs >= 1, "
                         f"got {block_h}, {block_k}, {num_stages}, {programs}")
    n_items = T * triton.cdiv(H, block_h)
    grid = min(n_items, programs)
    if grid:
        _down_kernel[(grid,)](act, topk_ids, d2, s2, out, n_items, grid, H, I, K_TOP=k, KP=triton.next_power_of_2(k),
                              IS_MX=is_mx, BH=block_h, BK=block_k, STAGES=num_stages,
                              INTERPRET=triton.knobs.runtime.interpret, PDL=pdl, num_warps=num_warps,
                              num_stages=num_stages, **(dict(launch_pdl=True) if pdl else {}))
    return out


def down_reference(act, topk_ids, w2) -> torch.Tensor:
    """out [T, H] in FP32 on the dequantized weights: the FP32 answer warp_decode_down approximates."""
    T, k = topk_ids.shape
    out = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=act.device)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        out.index_add_(0, pairs // k, act[pairs].float() @ as_dense(w2[e], torch.float32).T)
    return out
