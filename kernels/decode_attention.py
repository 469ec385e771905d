"""Decode attention (S = 1) over the slot KV cache, split-KV ("flash decoding"): the op of
kernels/attention_reference.py for one query token per row, in two Triton launches.

Shapes: B rows, Hq query heads, Hkv kv heads, G = Hq // Hkv query heads per kv head (GP: G padded to >= 16),
D head dim, N cache slots (the engine's last one is scratch for padding rows), L positions per slot, NS splits.
Layout: q [B, 1, Hq, D] bf16; one layer's k, v [N, L, Hkv, D] bf16, contiguous (a key row is Hkv * D
contiguous elements); slots [B], positions [B, 1] int32/64; out [B, 1, Hq, D] bf16;
workspace [B, Hq, NS, D + 4] fp32: per (row, query head, split) the split's unnormalised output [..., :D], its
running max in the log2 domain [..., D] and its sum of exponentials [..., D + 1]; the two spare columns keep rows
16-byte aligned, so partial stores and loads vectorize.
Bytes per row (n = min(positions[b] + 1, L) keys): K and V read 2 * n * Hkv * D * 2, q read and out written
Hq * D * 2 each; with NS > 1 the partials are written and read back once, at most 2 * NS * Hq * (D + 4) * 4.

Design.
* Grid (B, Hkv, NS), one program per (row, kv head, split) taking all G query heads of its kv head: each K/V
  byte is read from HBM once, not G times. Split s of row b takes keys [s * c, (s + 1) * c) with
  c = ceil(n / NS) rounded up to whole BLOCK_N blocks, clipped to n: the chunk follows the row's own length,
  so a batch of short rows in a grid sized for long ones still spreads each row over its splits, and programs
  past a row's length load and write nothing (the combine derives from the row's length which splits hold
  partials, split 0 always, so a row without keys merges one empty partial). The grid and every buffer
  depend only on (B, Hq, Hkv, D, L): no host sync, CUDA-graph capturable.
* Online softmax in FP32 with exp2 (log2(e) folded into the scale, applied to the FP32 scores so q is not
  rounded again); QK^T and PV are tl.dot in BF16 with FP32 accumulation (FP32 operands under the interpreter,
  see mx_tiles.dot_dtype). P is rounded to BF16 for the PV dot, as in FlashAttention.
* The key loop is an scf.for on the GPU, which Triton software-pipelines (the next num_stages - 1 blocks' K and V,
  see default_num_stages, go to shared memory by 16-byte cp.async while this one is computed: 80 registers at
  D = 128, against 160 and no overlap for the same body in a while loop), and a while loop under the interpreter,
  which cannot take range() over a runtime bound. Both run one _step body; the CPU tests exercise the while
  loop, the GPU test the for loop.
* A second launch, one program per (row, query head), merges the NS partials in split order (deterministic,
  no atomics) and rounds once to BF16. With NS == 1 the first launch writes out itself and the workspace is
  unused (the large-batch regime, where B * Hkv alone fills the GPU).
* Offsets into the cache are int64 at the slot (N * L * Hkv * D passes 2^31 at 128 slots x 40960 x 4 x 128);
  within a slot they stay int32 (the launcher checks L * Hkv * D < 2^31).
* Fused q/k norm + RoPE (new_kv): at a decode step the separate kernels/qk_norm_rope.py launch costs ~3.3 µs
  per layer of a ~50 µs batch-1 layer for a few KB of work, so the split kernel can take the projections raw.
  Each program normalises and rotates its G query heads itself (every split of a row repeats it: G * D values
  and D / 2 sincos, against a loop over the row's keys) and its kv head's new key; the program whose key range
  holds the new position (exactly one: start <= pos < end) writes the new k and v rows into the cache, reads the
  cache only below pos, and merges the new key from registers as one more online-softmax step. Same math as
  qk_norm_rope (FP32 from the BF16 inputs, rounded once to BF16), except that each head's sum of squares runs
  over the whole row rather than two halves, so a value on a rounding boundary may land one BF16 step apart.
  Rows must hold distinct slots (a decode batch's live sequences; padding rows on the shared scratch slot race
  there, as in qk_norm_rope, and their outputs are discarded): a row never sees another row's new key. The
  layer takes this path only where new_kv_pays (every program repeats the query heads' norm + RoPE).
* Keys past a row's length are masked at the load (read as 0, their scores set to -inf): whatever the cache
  holds there, NaN included, never reaches the output. A row with positions[b] < 0 has no keys: out is 0.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention_reference import check_attention_args
from kernels.moe_reference import check_tensor
from kernels.mx_tiles import dot_dtype, pdl_launch
from kernels.qk_norm_rope import check_head_view, to_bf16
from kernels.rmsnorm import check_eps

_BLOCK_N = 64  # keys per loop step: K and V tiles of 16 KB each at D = 128, loaded together
_SMS = 132  # H200
# A program with one key block in flight is latency-bound (~1.5-2 µs a loop step), so a program needs a second block
# in flight, or company: where the (row, kv head) pairs leave SMs idle, the rows split until the grid is about one
# program per SM, each with a 3-stage pipeline (two blocks in flight). Measured on an H100 (docs/perf.md, "Decode
# attention: one program per SM, three stages"): one split of 3 stages at B = 32, c = 1k took 27.0 µs against 36.2
# for ~4 programs per SM of 2 stages, and 33 splits at B = 1, c = 16k 20.2 against 32.6 for 132; where the pairs
# alone fill two programs per SM (B >= 64), a third stage costs 2-3%.
_LOG2E = 1.4426950408889634
# new_kv pays while the programs it adds norm + RoPE work to fit about two per SM (docs/perf.md: B = 1 and 64
# faster fused, B = 8, 512 programs, slower)
_NEW_KV_MAX_PROGRAMS = 2 * _SMS


@triton.jit
def _load_block(k_base, v_base, j, end, d, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K and V rows of keys [j, j + BLOCK_N) clipped to `end` (masked keys read as 0), and the mask."""
    kpos = j + tl.arange(0, BLOCK_N)
    k_ok = kpos < end
    offs = kpos[:, None] * (HKV * D) + d[None, :]
    return tl.load(k_base + offs, mask=k_ok[:, None], other=0.0), tl.load(v_base + offs, mask=k_ok[:, None],
                                                                            other=0.0), k_ok


@triton.jit
def _attend_block(q, k, v, k_ok, m_i, l_i, acc, qk_scale, DOT: tl.constexpr):
    """One loaded block of keys (at least one unmasked) into the online softmax (m_i, l_i, acc)."""
    s = tl.where(k_ok[None, :], tl.dot(q, tl.trans(k.to(DOT))) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the block has at least one key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT))


@triton.jit
def _step(q, k_base, v_base, j, end, d, m_i, l_i, acc, qk_scale, HKV: tl.constexpr, D: tl.constexpr,
          BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """One block of keys [j, j + BLOCK_N) clipped to `end` into the online softmax (m_i, l_i, acc)."""
    k, v, k_ok = _load_block(k_base, v_base, j, end, d, HKV, D, BLOCK_N)
    return _attend_block(q, k, v, k_ok, m_i, l_i, acc, qk_scale, DOT)


@triton.jit
def _row_chunk(pos_ptr, b, L, NS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(n, c): row b's key count and its split length, ceil(n / NS) in whole BLOCK_N blocks (module docstring).
    The split kernel and the combine both derive which splits hold partials from it."""
    n = tl.minimum(tl.load(pos_ptr + b).to(tl.int32) + 1, L)
    return n, tl.cdiv(tl.cdiv(n, NS), BLOCK_N) * BLOCK_N


@triton.jit
def _norm_rope_rows(x, xp, w, wp, cos, ssin, eps, D: tl.constexpr):
    """kernels/qk_norm_rope.py's per-head RMSNorm * weight and RoPE on whole head rows x [H, D]: rotate_half pairs
    element i with i +- D/2, given as xp (the same rows loaded at the partner offsets) with its weights wp, and
    ssin carries the sign (-sin for the first half). FP32, rounded once to BF16."""
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) * (1.0 / D) + eps)[:, None]  # 1 / D exact (a power of two)
    y = x * r * w.to(tl.float32)[None, :]
    yp = xp * r * wp.to(tl.float32)[None, :]
    return to_bf16(y * cos + yp * ssin)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, ws_ptr, out_ptr, qk_scale, L, q_sb,
                  kn_ptr, vn_ptr, qw_ptr, kw_ptr, inv_freq_ptr, eps, kv_sb, N,
                  HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT: tl.constexpr, PIPELINE: tl.constexpr, STAGES: tl.constexpr,
                  ROPE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see mx_tiles.pdl_launch: the next launch may start now; no memory access before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n, chunk = _row_chunk(pos_ptr, b, L, NS, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, n)

    # The G heads are the dot's M, padded to 16 rows (zero queries, never stored): on sm_90 a 4-warp M = 16 dot
    # is an mma.sync m16n8k16 (wgmma needs M = 64), and its spare rows cost tensor-core slots this
    # bandwidth-bound loop leaves idle. Broadcast-multiply + tl.sum instead holds a [G, BLOCK_N, D] FP32 product:
    # compiled for sm_90 at G = 8, D = 128 it put 7 KB per thread on the stack (BLOCK_N = 64) or used 255
    # registers (BLOCK_N = 16), against 80 registers and no stack here.
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    hq = h * G + g
    g_ok = g < G
    q_ptrs = q_ptr + b * q_sb + hq[:, None] * D + d[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kv_off = slot * L * (HKV * D) + h * D
    k_base = k_ptr + kv_off
    v_base = v_ptr + kv_off
    cache_end = end
    if ROPE:  # this step's raw q, k, v (module docstring, "Fused q/k norm + RoPE")
        # Every load first, so that one round trip covers them all.
        pd = (d + D // 2) % D
        k_ptrs = kn_ptr + b * kv_sb + h * D + d[None, :]
        qr = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0)
        qp = tl.load(q_ptrs + (pd - d)[None, :], mask=g_ok[:, None], other=0.0)
        kr = tl.load(k_ptrs)
        kp = tl.load(k_ptrs + (pd - d)[None, :])
        v_new = tl.load(vn_ptr + b * kv_sb + h * D + d[None, :])
        qw, qwp, kw, kwp = tl.load(qw_ptr + d), tl.load(qw_ptr + pd), tl.load(kw_ptr + d), tl.load(kw_ptr + pd)
        inv_freq = tl.load(inv_freq_ptr + d % (D // 2))
        pos = tl.load(pos_ptr + b).to(tl.int32)
        cache_end = tl.minimum(end, pos)
        # The first key block's copies go out with these loads, not after the math below.
        k0, v0, ok0 = _load_block(k_base, v_base, start, cache_end, d, HKV, D, BLOCK_N)
        angle = pos.to(tl.float32) * inv_freq
        cos = tl.cos(angle)[None, :]
        ssin = tl.where(d < D // 2, -tl.sin(angle), tl.sin(angle))[None, :]
        q = _norm_rope_rows(qr, qp, qw, qwp, cos, ssin, eps, D).to(DOT)
        k_new = _norm_rope_rows(kr, kp, kw, kwp, cos, ssin, eps, D)
        owner = (start <= pos) & (pos < end)  # the one program whose keys include the new one
        if owner & (slot >= 0) & (slot < N):
            tl.store(k_base + pos * (HKV * D) + d[None, :], k_new)
            tl.store(v_base + pos * (HKV * D) + d[None, :], v_new)
    else:
        q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0).to(DOT)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    first = start
    if ROPE:
        if start < cache_end:
            m_i, l_i, acc = _attend_block(q, k0, v0, ok0, m_i, l_i, acc, qk_scale, DOT)
        first = start + BLOCK_N
    if PIPELINE:  # see the module docstring; 38 KB of shared memory per program at D = 128 with 2 stages, 70 with 3
        for j in tl.range(first, cache_end, BLOCK_N, num_stages=STAGES):
            m_i, l_i, acc = _step(q, k_base, v_base, j, cache_end, d, m_i, l_i, acc, qk_scale, HKV, D, BLOCK_N, DOT)
    else:
        j = first
        while j < cache_end:
            m_i, l_i, acc = _step(q, k_base, v_base, j, cache_end, d, m_i, l_i, acc, qk_scale, HKV, D, BLOCK_N, DOT)
            j += BLOCK_N
    if ROPE:
        if owner:  # the new key from registers: one more online-softmax step, P rounded as the dot's is
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p.to(DOT).to(tl.float32)[:, None] * v_new.to(tl.float32)
            m_i = m_new

    if NS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row without keys: acc is 0
        tl.store(out_ptr + (b * (HKV * G) + hq)[:, None] * D + d[None, :], o.to(tl.bfloat16), mask=g_ok[:, None])
    elif split == 0 or start < n:  # the combine reads only the splits a row's keys reach (and split 0)
        W: tl.constexpr = D + 4
        row = ws_ptr + ((b * (HKV * G) + hq) * NS + split) * W
        tl.store(row[:, None] + d[None, :], acc, mask=g_ok[:, None])
        tl.store(row + D, m_i, mask=g_ok)
        tl.store(row + D + 1, l_i, mask=g_ok)


@triton.jit
def _merge(base, s0, active, m, d, acc, l, W: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """Splits [s0, s0 + BS) below `active` into the running (acc, l) of the combine, weighted by exp2(max - m)."""
    sb = s0 + tl.arange(0, BS)
    ok = sb < active
    w = tl.exp2(tl.load(base + sb * W + D, mask=ok, other=float("-inf")) - m)
    l += tl.load(base + sb * W + D + 1, mask=ok, other=0.0) * w
    a = tl.load(base + sb[:, None] * W + d[None, :], mask=ok[:, None], other=0.0)
    return acc + tl.sum(a * w[:, None], axis=0), l


@triton.jit
def _combine_kernel(ws_ptr, out_ptr, pos_ptr, L, HQ: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
                    SP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # see mx_tiles.pdl_launch: the next launch may start now; no memory access before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    W: tl.constexpr = D + 4
    r = tl.program_id(0)  # b * Hq + query head
    # Only the splits the row's keys reach hold partials: a short row in a grid sized for long ones merges a few,
    # not NS.
    n, chunk = _row_chunk(pos_ptr, r // HQ, L, NS, BLOCK_N)
    active = tl.maximum(tl.cdiv(n, tl.maximum(chunk, 1)), 1)
    base = ws_ptr + r * (NS * W)
    s = tl.arange(0, SP)
    m = tl.max(tl.load(base + s * W + D, mask=s < active, other=float("-inf")), axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row without keys: every weight is 0 and out is 0
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    l = tl.zeros([BS], tl.float32)
    if PIPELINE:
        for s0 in range(0, active, BS):
            acc, l = _merge(base, s0, active, m, d, acc, l, W, D, BS)
    else:
        s0 = 0
        while s0 < active:
            acc, l = _merge(base, s0, active, m, d, acc, l, W, D, BS)
            s0 += BS
    lt = tl.sum(l, axis=0)
    tl.store(out_ptr + r * D + d, (acc / tl.where(lt > 0, lt, 1.0)).to(tl.bfloat16))


def default_num_splits(B: int, Hkv: int, L: int) -> int:
    """Splits per (row, kv head), a pure function of shapes (so one captured graph serves every length): as many
    as keep the grid at most one program per SM of the H200's 132 (1 once B * Hkv fills them), capped so that a
    full slot of L keys gives each split at least one block of keys."""
    return max(1, min(_SMS // max(1, B * Hkv), L // _BLOCK_N))


def default_num_stages(B: int, Hkv: int, num_splits: int) -> int:
    """The key loop's pipeline depth: 3 (two key blocks in flight, ~70 KB of shared memory a program) on a grid of
    at most one program per SM; 2 where programs share SMs and so keep each other's copies in flight."""
    return 3 if B * Hkv * num_splits <= _SMS else 2


def new_kv_pays(B: int, Hkv: int, L: int) -> bool:
    """Whether decode_attention(new_kv=...) beats qk_norm_rope + decode_attention for this batch: every program
    repeats its query heads' norm + RoPE, which is free while the grid is about one wave of two programs per SM
    and costs more than the saved launch beyond (measured on the H200, 30B, c = 1k: -90 µs per step at B = 1,
    -140 at B = 64, +80 at B = 8 when its grid was 512 programs)."""
    return B * Hkv * default_num_splits(B, Hkv, L) <= _NEW_KV_MAX_PROGRAMS


def active_splits(n: int, num_splits: int) -> int:
    """How many of a row's num_splits splits hold partials for n keys: _row_chunk's chunk and the combine's count,
    on the host (for benchmarks that charge the combine its bytes)."""
    chunk = triton.cdiv(triton.cdiv(n, num_splits), _BLOCK_N) * _BLOCK_N
    return max(triton.cdiv(n, max(chunk, 1)), 1)


def workspace_shape(B: int, Hq: int, D: int, num_splits: int) -> tuple[int, int, int, int]:
    """The fp32 workspace's shape: (B, Hq, num_splits, D + 4), see the module docstring."""
    return (B, Hq, num_splits, D + 4)


class NewKV(NamedTuple):
    """This step's raw projections, for decode_attention to finish itself (module docstring, "Fused q/k norm +
    RoPE"): k, v [B, 1, Hkv, D] bf16 (views of the qkv output: contiguous heads, unit stride in D), the q/k norm
    weights [D] bf16, their eps, RoPE's inv_freq [D/2] fp32."""
    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, *, scale: float | None = None, num_splits: int | None = None,
                     out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                     new_kv: NewKV | None = None, num_stages: int | None = None) -> torch.Tensor:
    """out[b, 0, h] = softmax(q[b, 0, h] . K^T * scale) V over the keys of slot slots[b] at positions
    0..positions[b, 0] (kv head h // G); writes and returns `out` [B, 1, Hq, D] bf16 (allocated when None).
    scale: default D ** -0.5. num_splits: default default_num_splits(B, Hkv, L). workspace: fp32
    workspace_shape(B, Hq, D, num_splits), allocated when None and unused when num_splits == 1 (a captured
    graph passes its own). Slots must be valid cache indices; that is not checked (it would need a host sync).
    new_kv: q is this step's raw projection (a view of the qkv output is fine), normed and rotated here with
    new_kv's k, which is written to the cache at (slots[b], positions[b]) with v, as qk_norm_rope would.
    num_stages: the key loop's software-pipeline depth on the GPU (key blocks in flight + 1; 32 KB of shared
    memory per block at D = 128), default default_num_stages(B, Hkv, num_splits)."""
    check_attention_args(q, k_cache, v_cache, slots, positions, q_rows_strided=new_kv is not None)
    B, S, Hq, D = q.shape
    N, L, Hkv, _ = k_cache.shape
    if S != 1:
        raise ValueError(f"decode_attention takes one query token per row (S = 1), got q with S = {S}")
    if L * Hkv * D >= 2**31:
        raise ValueError(f"k_cache slot of {L} x {Hkv} x {D} elements does not fit int32 offsets")
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, L)
    elif not isinstance(num_splits, int) or not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits must be an int in 1..65535, got {num_splits!r}")
    if num_stages is None:
        num_stages = default_num_stages(B, Hkv, num_splits)
    elif not isinstance(num_stages, int) or isinstance(num_stages, bool) or not 1 <= num_stages <= 6:
        raise ValueError(f"num_stages must be an int in 1..6, got {num_stages!r}")
    if out is None:
        out = torch.empty((B, 1, Hq, D), dtype=torch.bfloat16, device=q.device)
    check_tensor("out", out, torch.bfloat16, (B, 1, Hq, D), q.device)
    shape = workspace_shape(B, Hq, D, num_splits)
    if B * Hq * num_splits * (D + 4) >= 2**31:
        raise ValueError(f"num_splits = {num_splits}: the workspace {shape} does not fit int32 offsets")
    if workspace is not None:
        check_tensor("workspace", workspace, torch.float32, shape, q.device)
    elif num_splits > 1:
        workspace = torch.empty(shape, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    G = Hq // Hkv
    qk_scale = (D**-0.5 if scale is None else scale) * _LOG2E
    ws = workspace if num_splits > 1 else out  # unused by the kernel then: one specialization either way
    if new_kv is not None:
        _check_new_kv(new_kv, B, Hkv, D, q.device)
        if q.stride(0) != new_kv.k.stride(0):
            raise ValueError(f"new_kv.k's row stride {new_kv.k.stride(0)} differs from q's {q.stride(0)}")
        rope = (new_kv.k, new_kv.v, new_kv.q_weight, new_kv.k_weight, new_kv.inv_freq, float(new_kv.eps),
                new_kv.k.stride(0))
    else:
        rope = (q, q, q, q, q, 0.0, 0)  # unused placeholders: one specialization either way
    _split_kernel[(B, Hkv, num_splits)](q, k_cache, v_cache, slots, positions, ws, out, qk_scale, L, q.stride(0),
                                        *rope, N, HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D,
                                        NS=num_splits, BLOCK_N=_BLOCK_N, DOT=dot_dtype(),
                                        PIPELINE=not triton.knobs.runtime.interpret, STAGES=num_stages,
                                        ROPE=new_kv is not None, num_warps=4, **pdl_launch())
    if num_splits > 1:
        sp = triton.next_power_of_2(num_splits)
        _combine_kernel[(B * Hq,)](workspace, out, positions, L, HQ=Hq, D=D, NS=num_splits, SP=sp, BS=min(sp, 16),
                                   BLOCK_N=_BLOCK_N, PIPELINE=not triton.knobs.runtime.interpret, num_warps=4,
                                   **pdl_launch())
    return out


def _check_new_kv(new_kv: NewKV, B: int, Hkv: int, D: int, device) -> None:
    for name, t in (("new_kv.k", new_kv.k), ("new_kv.v", new_kv.v)):
        check_head_view(name, t, (B, 1, Hkv, D), device)
        if t.stride(2) != D:  # the kernel addresses head h of a row at h * D
            raise ValueError(f"{name} must have contiguous heads, got strides {t.stride()}")
    if new_kv.v.stride(0) != new_kv.k.stride(0):
        raise ValueError(f"new_kv.v's row stride {new_kv.v.stride(0)} differs from new_kv.k's {new_kv.k.stride(0)}")
    check_tensor("new_kv.q_weight", new_kv.q_weight, torch.bfloat16, (D,), device)
    check_tensor("new_kv.k_weight", new_kv.k_weight, torch.bfloat16, (D,), device)
    check_tensor("new_kv.inv_freq", new_kv.inv_freq, torch.float32, (D // 2,), device)
    check_eps(new_kv.eps, "new_kv.eps")
