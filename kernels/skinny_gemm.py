"""Skinny GEMM: y = x @ weight^T for a decode step of 3..128 tokens on tensor cores, accumulated in FP32.

Why: kernels/skinny_linear.py streams a projection's weight at up to 2 tokens with CUDA-core FMAs, which lose to
cuBLAS from T ~ 4 (2 * T FMAs per weight pair). cuBLAS in turn runs the decode projections from T = 4 to 128 at
40-60% of the H200's read ceiling: o_proj with an FP32 output as a split-K launch plus a separate reduce launch
(7.4 + 2.0 µs at T = 32 against 3.7 µs of bytes), qkv 8.1 µs against 4.6. Here the same weight stream feeds
tl.dot (mma), and a split over K is reduced inside the one launch. The gain is modest (H100: 5-15% per call at
T = 4..64, the router gate 35%; max_tokens): a 17-21 MB launch alone does not reach the read ceiling either way.

Shapes: T tokens (1..MAX_T), N output features, K input features (a multiple of 8: 16-byte rows).
Layout: x [T, K] bf16 with unit stride along K (any row stride); weight [N, K] bf16 row-major (nn.Linear's);
out [T, N] bf16 or fp32, contiguous.
Program (pid_n, pid_s): weight rows pid_n * BLOCK_N .. + BLOCK_N, all T tokens (padded to BT >= 16, the mma's
smallest M), K steps pid_s, pid_s + SPLIT, ... of BLOCK_K (interleaved, so the splits' step counts differ by at
most one): acc [BT, BLOCK_N] += x tile [BT, BLOCK_K] @ w tile [BLOCK_N, BLOCK_K]^T, the tiles loaded by the
software pipeline (tl.range, STAGES deep). x is re-read from L2 by every n block (T / BLOCK_N of the
weight's bytes), which is what bounds BLOCK_N from below at large T.
Split-K (SPLIT > 1): each program stores its partial [BT, BLOCK_N] to a scratch [n blocks, SPLIT, BT, BLOCK_N],
then bumps its n block's arrival counter (atomic, acq_rel at GPU scope, after a CTA barrier); the program that
arrives last sums the SPLIT partials in split order (read through L2, .cg), stores the output and resets the
counter to zero. So the sum's order does not depend on who arrives last (deterministic, no atomics on data).
The counter is the caller's zeroed int32 buffer of >= cdiv(N, BLOCK_N) entries, left zeroed (one per call site
or per model: launches sharing one must not run concurrently).
Tails: rows past N and tokens past T load the last valid one (no mask) and are not stored; a K that is not a
multiple of BLOCK_K masks the last step's columns.
PDL (mx_tiles.pdl_launch): the launch lets the next one start at once, then waits for the previous one before its
pipelined loop (whose first loads are x's as much as the weight's).
Numerics: BF16 x BF16 products are exact in FP32; the sum is FP32 in a fixed order for a given config
(deterministic); a bf16 output is rounded once, to nearest even.
Bytes: N * K * 2 weight (the cost) + cdiv(N, BLOCK_N) * T * K * 2 of x from L2 + T * N * (2 or 4) written
(+ 2 * SPLIT * T * N * 4 of partials through L2 with a split).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.mx_tiles import pdl_launch
from kernels.rmsnorm import round_bf16
from kernels.skinny_linear import check_skinny, make_out, skinny_linear_reference

MAX_T = 128  # tokens per call: above, cuBLAS's larger tiles take over (the weight is no longer the whole cost)
_MIN_T = 16  # the mma's smallest M: fewer tokens are padded to it


class Config(NamedTuple):
    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4
    stages: int = 4


def max_tokens(N: int) -> int:
    """The most tokens at which skinny_gemm is the decode projections' launch (fused_linear in the model). On the
    H100 (jobs/bench_skinny_linear.py, 30B shapes, µs per call against cuBLAS as the model calls it): qkv 9.8-10.3
    against 10.5-11.1 at T = 4..64 but 12.9 against 11.2 at 128; o_proj 9.2-9.7 against 10.4-11.2 at 4..64, a tie
    at 128; the router gate (N 128) 3.5-4.8 against 5.2-5.7 at every T up to 128."""
    return MAX_T if N <= 512 else 64


def gemm_counter(N: int, device) -> torch.Tensor:
    """A zeroed arrival-counter buffer for skinny_gemm launches with up to N output features (any split)."""
    return torch.zeros(triton.cdiv(N, _MIN_T), dtype=torch.int32, device=device)


def _config(T: int, N: int, K: int, split_ok: bool) -> Config:
    """The launch for [T, K] x [N, K], from the H100 sweep (bench_skinny_linear --sweep, docs/perf.md): 64-row
    blocks where N gives >= 32 of them (fewer, longer weight streams won: qkv's 80 programs beat 320), 16 rows for
    a router gate; then a split over K up to 4 while the grid stays within one program per SM (132) and every
    split keeps >= 2 steps (o_proj: 32 blocks x 4). BLOCK_K 256, 128 from 64 tokens (shared memory: STAGES
    copies of [BT + BLOCK_N, BLOCK_K] bf16)."""
    block_n = 64 if N >= 64 * 32 else _MIN_T
    bt = max(_MIN_T, triton.next_power_of_2(T))
    block_k = 256 if bt <= 32 else 128
    blocks = triton.cdiv(N, block_n)
    split = 1
    while split_ok and split < 4 and blocks * split * 2 <= 132 and triton.cdiv(K, block_k) >= 4 * split:
        split *= 2
    return Config(block_n, block_k, split)


@triton.jit
def _step(acc, x_rows, w_rows, k0, K, k, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_rows + k0)
        x = tl.load(x_rows + k0)
    else:
        w = tl.load(w_rows + k0, mask=k0 + k[None, :] < K, other=0.0)
        x = tl.load(x_rows + k0, mask=k0 + k[None, :] < K, other=0.0)
    if INTERPRET:  # the interpreter's dot misreads BF16 operands; FP32 holds them exactly
        x, w = x.to(tl.float32), w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, T, N, K, stride_x,
                        BT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        STAGES: tl.constexpr, EVEN_K: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                        PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BT)
    k = tl.arange(0, BLOCK_K)
    # Tails read the last valid row / token (module docstring); int64 rows: N * K may pass 2^31.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K + k[None, :]
    x_rows = x_ptr + tl.minimum(t, T - 1).to(tl.int64)[:, None] * stride_x + k[None, :]
    if PDL:  # see mx_tiles.pdl_launch: the next launch may start; x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BT, BLOCK_N], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() takes no runtime bounds; the GPU needs a for loop to pipeline
        k0 = pid_s * BLOCK_K
        while k0 < K:
            acc = _step(acc, x_rows, w_rows, k0, K, k, EVEN_K, INTERPRET)
            k0 += BLOCK_K * SPLIT
    else:
        for k0 in tl.range(pid_s * BLOCK_K, K, BLOCK_K * SPLIT, num_stages=STAGES):
            acc = _step(acc, x_rows, w_rows, k0, K, k, EVEN_K, INTERPRET)
    dst = out_ptr + t[:, None] * N + n[None, :]
    ok = (t < T)[:, None] & (n < N)[None, :]
    if SPLIT > 1:
        tile = t[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        block = part_ptr + pid_n * (SPLIT * BT * BLOCK_N)
        tl.store(block + pid_s * (BT * BLOCK_N) + tile, acc)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            acc = tl.load(block + tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                acc += tl.load(block + s * (BT * BLOCK_N) + tile, cache_modifier=".cg")
            _store(dst, acc, ok, OUT_BF16, INTERPRET)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _store(dst, acc, ok, OUT_BF16, INTERPRET)


@triton.jit
def _store(dst, acc, ok, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    if OUT_BF16:
        tl.store(dst, round_bf16(acc, INTERPRET), mask=ok)
    else:
        tl.store(dst, acc, mask=ok)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                out: torch.Tensor | None = None, counter: torch.Tensor | None = None,
                config: Config | None = None) -> torch.Tensor:
    """out[t, n] = sum_k x[t, k] * weight[n, k], accumulated in FP32 and stored as out_dtype (bf16: rounded to
    nearest even once). x [T, K] bf16 with x.stride(1) == 1, 1 <= T <= MAX_T; weight [N, K] bf16 contiguous, K a
    multiple of 8. counter: a zeroed int32 buffer of >= cdiv(N, 16) entries, left zeroed, which lets the launch
    split K (module docstring); without it the launch does not split. Writes and returns `out` [T, N] (allocated
    when None; it must not overlap x or weight). `config` overrides the launch's choice (benchmarks and tests)."""
    T, K, N = check_skinny(x, weight, limit=MAX_T)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a bfloat16 tensor (the mma's operand), got {x.dtype}")
    if counter is not None and (not isinstance(counter, torch.Tensor) or counter.dtype != torch.int32
                                or counter.dim() != 1 or not counter.is_contiguous() or counter.device != x.device
                                or counter.numel() < triton.cdiv(N, _MIN_T)):
        raise ValueError(f"counter must be a contiguous int32 vector of >= cdiv(N, {_MIN_T}) = "
                         f"{triton.cdiv(N, _MIN_T)} entries on {x.device}, got "
                         f"{getattr(counter, 'dtype', type(counter).__name__)} {getattr(counter, 'shape', '')}")
    out = make_out(out, (T, N), out_dtype, x, weight)
    if T == 0 or N == 0:
        return out
    cfg = config or _config(T, N, K, counter is not None)
    if not (_MIN_T <= cfg.block_n <= 256 and 16 <= cfg.block_k <= 1024 and cfg.split >= 1 and cfg.stages >= 1
            and all(v & (v - 1) == 0 for v in (cfg.block_n, cfg.block_k, cfg.num_warps))):
        raise ValueError(f"config {cfg}: block_n in {_MIN_T}..256 and block_k in 16..1024, powers of two")
    if cfg.split > 1 and counter is None:
        raise ValueError(f"config {cfg} splits K: pass a zeroed int32 counter")
    bt = max(_MIN_T, triton.next_power_of_2(T))
    blocks = triton.cdiv(N, cfg.block_n)
    part = (torch.empty(blocks * cfg.split * bt * cfg.block_n, dtype=torch.float32, device=x.device)
            if cfg.split > 1 else out)
    _skinny_gemm_kernel[(blocks, cfg.split)](
        x, weight, out, part, counter if counter is not None else out, T, N, K, x.stride(0), BT=bt,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split, STAGES=cfg.stages, EVEN_K=K % cfg.block_k == 0,
        OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=triton.knobs.runtime.interpret, num_warps=cfg.num_warps,
        **pdl_launch())
    return out


skinny_gemm_reference = skinny_linear_reference  # the same op: an FP32 matmul of the same values, rounded once
