"""Prefill attention over the slot KV cache: causal flash attention for S new tokens per row, whose keys are in the
cache already, after any cached prefix (prompt prefill, chunked prefill, batched scoring). The op, its argument
checks and its FP32 reference are in kernels/attention_reference.py.

Shapes: B rows, S query tokens per row, Hq query heads, Hkv kv heads, G = Hq // Hkv query heads per kv head,
D head dim (power of two >= 16), N cache slots, L cache positions per slot.
Layout: q [B, S, Hq, D] bf16, one layer's cache k, v [N, L, Hkv, D] bf16 (contiguous), slots [B], positions [B, S]
(int32 or int64) -> out [B, S, Hq, D] bf16. Query (b, s), head h reads kv head h // G of slot slots[b] at cache
positions 0..positions[b, s].
Packed (`packed=(seq_starts, longest)`, the engine's whole-prompt prefill without padding rows): q [1, T, Hq, D] holds
B sequences back to back, sequence b being tokens seq_starts[b] .. seq_starts[b + 1] - 1 (int32 [B + 1]) on slot
slots[b]; the grid is sized for the longest, and the blocks past a shorter sequence's end read nothing.

Packed GQA: one program per (block of BLOCK_M query rows, row or sequence b, kv head), where the S * G query rows of a
kv head are ordered (token, head in group): row r is token r // G, head r % G. The G heads reading one kv head share its
K/V tiles in one program, so a short chunk (S * G >= BLOCK_M rows, i.e. S >= 16 tokens at G = 8) still fills the
MMA's M dimension, and a block spans BLOCK_M / G tokens, so the causal diagonal (masked blocks, wasted half-blocks)
is G times thinner than one head per program would make it. Rows are independent: any positions work (padding
rows at 0, non-contiguous positions); each program loops over key blocks from 0 to its largest position, blocks
entirely at or below its smallest position without a mask, the rest masked by key_pos <= query_pos.
Online softmax in FP32 with exp2 (log2(e) folded into the scale), FP32 accumulator; QK^T and P @ V are tl.dot on
BF16 operands (FP32 under Triton's interpreter, whose BF16 dot is wrong: see kernels/mx_tiles.dot_dtype).

Bit-reproducibility: a query row's result depends only on its own position and its keys, visited in the same
key-block order from 0 (blocks past its position add exact zeros, the mask only ever turns scores to -inf), so it
does not depend on which block or call the row falls in: a prompt computed in chunks equals the one-call result.
Cache positions past a program's largest query position are never used (loads masked to zero), so stale or
non-finite values there cannot leak in; positions >= L read as L - 1, and a negative one (no keys) gives NaN,
as in the reference.

FLOPs: 4 * D * Hq * sum over query tokens of (positions + 1), plus the masked diagonal blocks' waste.
Bytes: q read and out written once, 4 * B * S * Hq * D; K and V read once per (query block, kv head):
4 * D * sum over programs of (largest position + 1), i.e. about B * Hkv * (S * G / BLOCK_M) * (start + S / 2) * 4 * D
for a contiguous chunk; mostly L2 hits, as the programs of one (b, kv head) run side by side and read the same
prefix (the grid's fastest dimension is the query block, heaviest blocks first for the causal tail).
"""

import torch
import triton
import triton.language as tl

from kernels.attention_reference import check_attention_args
from kernels.moe_reference import check_tensor
from kernels.mx_tiles import dot_dtype

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_block(acc, m_i, l_i, q, k_base, v_base, n0, pos, kv_end, qk_scale, KV_STRIDE: tl.constexpr,
              D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) folded into the online softmax state (acc, m_i, l_i) of the query rows."""
    n = n0 + tl.arange(0, BLOCK_N)
    off = n[:, None] * KV_STRIDE + tl.arange(0, D)[None, :]
    if MASKED:
        # Constant along D, so the loads stay vectorized; zeros past kv_end keep stale cache values out of P @ V.
        ok = (n < kv_end)[:, None]
        k = tl.load(k_base + off, mask=ok, other=0.0)
        v = tl.load(v_base + off, mask=ok, other=0.0)
    else:
        k = tl.load(k_base + off)
        v = tl.load(v_base + off)
    s = tl.dot(q, tl.trans(k.to(DOT)))
    if MASKED:
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
    # Scaled after the mask, so both paths give the same arithmetic (the same FMA fusion on the GPU) for a key:
    # what keeps a row's result independent of whether its blocks were masked, i.e. of its query block.
    s = s * qk_scale
    # Every row has key 0 (positions >= 0) in the first block, so m_new is finite from then on: no -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(DOT), v.to(DOT), acc=acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, starts_ptr, out_ptr, S, L, qk_scale,
                              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr, WHILE: tl.constexpr):
    G: tl.constexpr = HQ // HKV
    blk = tl.num_programs(0) - 1 - tl.program_id(0)  # the latest (longest) query blocks start first
    b = tl.program_id(1) // HKV
    hkv = tl.program_id(1) % HKV
    if PACKED:  # sequence b is tokens starts[b] .. starts[b + 1] - 1 of the one packed row
        start = tl.load(starts_ptr + b).to(tl.int64)
        n = (tl.load(starts_ptr + b + 1) - start).to(tl.int32)
    else:
        start = b.to(tl.int64) * S
        n = S
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n * G
    tok = rows // G
    d = tl.arange(0, D)
    # int64: B * S * Hq * D and N * L * Hkv * D pass 2^31 at real shapes; offsets within one slot stay int32.
    row_off = (start + tok) * (HQ * D) + (hkv * G + rows % G) * D
    q = tl.load(q_ptr + row_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
    pos = tl.minimum(tl.load(pos_ptr + start + tok, mask=row_ok, other=0), L - 1).to(tl.int32)
    # A packed sequence shorter than the longest leaves some of its programs without rows: they read no keys.
    some = blk * BLOCK_M < n * G
    kv_end = tl.where(some, tl.max(pos, axis=0) + 1, 0)
    full_end = tl.where(some, (tl.min(tl.where(row_ok, pos, L - 1), axis=0) + 1) // BLOCK_N * BLOCK_N, 0)
    kv_off = tl.load(slots_ptr + b).to(tl.int64) * L * (HKV * D) + hkv * D
    k_base = k_ptr + kv_off
    v_base = v_ptr + kv_off

    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if WHILE:  # the interpreter: its range() cannot take a runtime bound
        n0 = 0
        while n0 < full_end:
            acc, m_i, l_i = _kv_block(acc, m_i, l_i, q, k_base, v_base, n0, pos, kv_end, qk_scale, HKV * D, D,
                                      BLOCK_N, DOT, False)
            n0 += BLOCK_N
        while n0 < kv_end:
            acc, m_i, l_i = _kv_block(acc, m_i, l_i, q, k_base, v_base, n0, pos, kv_end, qk_scale, HKV * D, D,
                                      BLOCK_N, DOT, True)
            n0 += BLOCK_N
    else:  # the GPU: Triton software-pipelines for loops only (K/V tiles prefetched num_stages - 1 blocks ahead)
        for n0 in tl.range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _kv_block(acc, m_i, l_i, q, k_base, v_base, n0, pos, kv_end, qk_scale, HKV * D, D,
                                      BLOCK_N, DOT, False)
        for n0 in tl.range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _kv_block(acc, m_i, l_i, q, k_base, v_base, n0, pos, kv_end, qk_scale, HKV * D, D,
                                      BLOCK_N, DOT, True)
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # rows past the sequence (not stored) would divide 0 by 0
    tl.store(out_ptr + row_off[:, None] + d[None, :], out.to(tl.bfloat16), mask=row_ok[:, None])


def launch_config(head_dim: int) -> dict:
    """Block sizes and launch options. sm_90, D = 128: 128 query rows x 64 keys, 8 warps (a warpgroup per 64 rows
    for wgmma; the FP32 accumulator is 64 registers a thread; ptxas: 188 registers, no spills), K and V tiles
    (16 KiB each) double-buffered by cp.async. The interpreter's cost is per program and per op: small tiles, which
    still span several blocks at the test shapes."""
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, *, scale: float | None = None, out: torch.Tensor | None = None,
                      packed: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """out[b, s, h] = softmax(q[b, s, h] . K^T * scale) @ V over kv head h // (Hq // Hkv) of slot slots[b], cache
    positions 0..positions[b, s]; scale defaults to D ** -0.5. Writes and returns `out` [B, S, Hq, D] bf16 (allocated
    when not given). The new tokens' K/V must be in the cache already.
    packed (seq_starts, longest): q is one row of T tokens [1, T, Hq, D] (positions [1, T]) holding len(slots)
    sequences back to back, sequence i being tokens seq_starts[i] .. seq_starts[i + 1] - 1 (int32 [len(slots) + 1] on
    q's device, from 0 to T: unchecked, that would need a host sync) and reading slot slots[i]; `longest` (a host
    int, at least the longest sequence) sizes the grid."""
    check_attention_args(q, k_cache, v_cache, slots, positions, packed=packed is not None)
    B, S, Hq, D = q.shape
    _, L, Hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, torch.bfloat16, (B, S, Hq, D), q.device)
    rows, longest, starts = B, S, positions  # `starts` unread unless packed
    if packed is not None:
        starts, longest = packed
        rows = slots.shape[0]
        check_tensor("seq_starts", starts, torch.int32, (rows + 1,), q.device)
        if not (isinstance(longest, int) and 0 < longest <= S):
            raise ValueError(f"packed: the longest sequence {longest!r} must be an int in [1, T={S}]")
    if rows * Hkv > 65535:  # the grid's second dimension, a CUDA limit
        raise ValueError(f"{rows} sequences x Hkv = {rows * Hkv} programs exceed the grid's 65535: split the batch")
    if rows == 0 or S == 0:
        return out
    scale = D**-0.5 if scale is None else float(scale)
    cfg = launch_config(D)
    grid = (triton.cdiv(longest * (Hq // Hkv), cfg["BLOCK_M"]), rows * Hkv)
    _prefill_attention_kernel[grid](q, k_cache, v_cache, slots, positions, starts, out, S, L, scale * _LOG2E, HQ=Hq,
                                    HKV=Hkv, D=D, DOT=dot_dtype(), PACKED=packed is not None,
                                    WHILE=triton.knobs.runtime.interpret, **cfg)
    return out
