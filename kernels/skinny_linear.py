"""Skinny linear: y = x @ weight^T for a decode step's few tokens, in one launch, accumulated in FP32.

Why: at T <= 16 tokens the dense projections of an MoE decode step (qkv, o_proj, the router gate) are weight
streams (2 * T FLOPs per weight byte). cuBLAS at T = 1 reaches ~59% of the H200's read ceiling on qkv, splits
o_proj into two launches (split-K + reduce) and runs the 0.5 MB gate on ~2 CTAs. Here a grid of cdiv(N, BLOCK_N)
programs (>= 2 per SM where N allows) reads every weight byte once, and the router gate's logits can stay FP32
(out_dtype=torch.float32) instead of being rounded to BF16.

Shapes: T tokens (1..MAX_T), N output features, K input features (a multiple of 8: 16-byte weight rows).
Layout: x [T, K] bf16 or fp32 with unit stride along K (any row stride: views of a wider buffer work); weight
[N, K] bf16 row-major (nn.Linear's); out [T, N] bf16 or fp32, contiguous. (An fp32 x is the fast decode path's
o_proj output entering the router's norm prologue unrounded.)
Program (BLOCK_N weight rows, all T tokens): the weight tile is loaded as [1, BLOCK_N, BLOCK_K] and the token tile
as [BT, 1, BLOCK_K] (BT = next_power_of_2(T)), so both land in one layout: 8 consecutive K elements per thread (a
16-byte load), then the lanes and all warps along K, every row and token in each thread. Widened to FP32, their
broadcast product is summed along K by tl.sum: each thread's FMA chains over the elements it owns, then one
shuffle tree per (token, row) and a cross-warp step through shared memory. Warps span K rather than rows so that
the x values a thread converts serve all of its BLOCK_N rows (x's widening costs 1 / BLOCK_N of the FMAs), at the
price of that final reduction (~10 instructions per (token, row) per thread against K / (32 * num_warps) FMAs).
_config balances the two at 32 weights per row per thread (num_warps = K / 1024) and 4 rows (2 at T > 8, where
the [BT, BLOCK_N] accumulators would exhaust registers): 128 weights, 64 registers of loads in flight per thread;
a router gate's one-row programs take twice the warps from T = 4 (H100, gate 128 x 2048: T = 8 2.99 -> 2.23 µs,
T = 16 5.31 -> 2.82).
BLOCK_K = K up to 8192 (padded to a power of two): a program loads its whole slab at once, so no load waits on
earlier FMAs; a larger K is a static loop of such chunks. ptxas would still interleave the loads with the FMAs to
save registers (measured in the SASS: 6 of 20 loads issued before the first FMA at qkv T = 1, then one more round
trip per few loads); _after_weights makes the FMAs depend on every weight load, so all are issued first.
Compiled for sm_90a (qkv, o_proj, gate at T = 1 / 8 / 16): 96 / 178 / 134 registers (gate: 44 / 88 / 86), no
spills, weights and x by ld.global.v4. FFMA are ~46% of the instructions at T = 8, so the launch is predicted
bandwidth-bound up to T ~ 8 and issue-bound above (2 * T FMAs per weight pair, CUDA cores only: a tensor-core
variant would be the step for T = 8..16).
Tails: rows past N and tokens past T load the last valid one (no mask in the loads) and are not stored; a K that
is not a power of two masks the padded columns (constant over each 8 elements, so the loads stay 16-byte).
Norm prologue (add_norm_linear): x is the previous block's output and the input is rmsnorm(x + residual), the
decoder layer's add + norm (kernels/rmsnorm.py's FP32-residual formula). Every program computes it from the
whole row (K <= BLOCK_K: one chunk), 4-12 KB per token from L2, instead of a separate launch; program 0
stores the FP32 sum and the normed BF16 row for the launches after. add_norm_linear multiplies the FP32 normed
values (the qkv projection: its input's BF16 rounding was the largest single term of the decode path's distance
from FP32, docs/perf.md); the router multiplies the stored BF16 ones, which its experts read. It holds every
token's row at once, so the launch spreads them over more warps as T grows (_config).
Numerics: BF16 x BF16 products are exact in FP32 (products with an FP32 x or normed value are rounded once); the
sum is FP32 in a fixed order (deterministic, no atomics); bf16 output is rounded once, to nearest even
(round_bf16: bit arithmetic under the interpreter, whose cast truncates).
Bytes: N * K * 2 weight (the cost), T * K * 2 x (4 in fp32; per program, from L2), T * N * (2 or 4) written.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor, overlaps
from kernels.mx_tiles import pdl_launch
from kernels.rmsnorm import check_eps, rms_norm_reference, round_bf16, widen_bf16

MAX_T = 16  # tokens per call; the caller uses cuBLAS above (the FMAs grow with T, the bytes do not)
OUT_DTYPES = (torch.bfloat16, torch.float32)
_MIN_PROGRAMS = 264  # two per H200 SM: one program's FMAs and reduction overlap the other's loads
_MAX_BLOCK_K = 8192  # 128 weights per thread at 4 rows and 8 warps: all in flight, no spills (ptxas, sm_90a)


class Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    early_loads: bool = True  # _after_weights (used where block_k >= 256 * num_warps)


def max_tokens(N: int) -> int:
    """The most tokens at which the model runs skinny_linear (layers.fused_linear; above, kernels/skinny_gemm.py):
    8 for a router gate (N <= 512; on the H200 it beat cuBLAS, which runs ~2 CTAs there, 3.2x at T = 1; on the
    H100 jobs/bench_router.py's gate + top-k with the norm took 9.27 µs at T = 16 through skinny_linear against
    7.78 through skinny_gemm), 2 for the attention projections (H200: 1.15-1.53x over cuBLAS at T = 1, 0.94-1.34x
    at 2, 0.6-0.9x at 4-8: CUDA-core FMAs lose to tensor cores as T grows)."""
    return 8 if N <= 512 else 2


def _config(T: int, N: int, K: int, norm: bool = False) -> Config:
    """The launch for [T, K] x [N, K]: see the module docstring. The norm prologue holds x, the residual and the
    normed row of every token at once, so it spreads them over more warps (T = 2 on 2 warps took 224 registers
    at K = 2048; T = 4 spilled)."""
    block_k = min(triton.next_power_of_2(K), _MAX_BLOCK_K)
    block_n = 4 if T <= 8 else 2
    while block_n > 1 and triton.cdiv(N, block_n) < _MIN_PROGRAMS:
        block_n //= 2
    warps = max(1, min(8, block_k // 1024))
    if block_n == 1 and T >= 4:  # a router gate's one-row programs: more warps for the T products per weight
        warps = min(16, 2 * warps)
    if norm:
        warps = max(warps, min(16, warps * triton.next_power_of_2(T), block_k // 256))
    return Config(block_n, block_k, warps)


def launch_config(T: int, N: int, K: int, norm: bool = False) -> Config:
    """_config's launch, except under Triton's interpreter, which runs programs one after another at ~ms each:
    there a program takes up to 64 rows. Each output is still the same sum along K, so the values do not change.
    (Also kernels/router_gate_topk.py's launch.)"""
    cfg = _config(T, N, K, norm)
    if triton.knobs.runtime.interpret:
        cfg = cfg._replace(block_n=min(64, triton.next_power_of_2(N)))
    return cfg


@triton.jit
def _after_weights(w, xf, N, BT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   LANES: tl.constexpr):
    """xf, the widened x tile [BT, 1, BLOCK_K], unchanged but data-dependent on every weight load of the thread.
    Left alone, ptxas interleaves the weight loads with the FMAs to save registers (at T = 1 a program waits
    several round trips instead of one); now no FMA can start before all loads are issued. The dependency: the
    first element of each 16-byte vector (tl.split only selects registers), max-reduced within the thread,
    AND-ed with N >> 31 (zero, as N >= 0, which the compiler cannot know) and OR-ed into xf's bits (merged into
    the widening LOP3 for half of them: +6% instructions at T = 8, +11% at T = 1). The reshapes relabel
    registers: the tile layout holds 8 elements per thread, then LANES = 32 * num_warps threads along K, then RK
    repeats, so [.., RK, LANES, 8] moves no data."""
    RK: tl.constexpr = BLOCK_K // (8 * LANES)
    v, _ = tl.split(tl.reshape(w.to(tl.int16, bitcast=True), [BLOCK_N, RK, LANES, 4, 2]))
    v, _ = tl.split(tl.reshape(v, [BLOCK_N, RK, LANES, 2, 2]))
    v, _ = tl.split(v)
    zero = tl.max(tl.max(v, axis=1), axis=0) & (N >> 31)
    xb = tl.reshape(xf.to(tl.int32, bitcast=True), [BT, RK, LANES, 8]) | zero[None, None, :, None]
    return tl.reshape(xb, [BT, 1, BLOCK_K]).to(tl.float32, bitcast=True)


@triton.jit
def skinny_rows(x_ptr, w_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, T, N, stride_x, eps, pid,
                K: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr,
                EARLY: tl.constexpr, NORM: tl.constexpr, NORM_F32: tl.constexpr, INTERPRET: tl.constexpr,
                PDL: tl.constexpr):
    """The program's [BT, BLOCK_N] FP32 sums (rows pid * BLOCK_N + i, all T tokens); also kernels/router_gate_topk.py's
    main loop. With NORM the input is the RMSNorm of x + residual: see the module docstring's "Norm prologue";
    NORM_F32: the products take its FP32 values, not the BF16 ones stored."""
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BT)
    # Tails read the last valid row / token (module docstring); int64 rows: N * K may pass 2^31.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[None, :, None] * K
    x_rows = x_ptr + tl.minimum(t, T - 1).to(tl.int64)[:, None, None] * stride_x
    k = tl.arange(0, BLOCK_K)[None, None, :]
    acc = tl.zeros([BT, BLOCK_N], dtype=tl.float32)
    if PDL:  # the next launch's CTAs may start (and stream their own weights) while this one runs
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in tl.static_range(0, K, BLOCK_K):
        # Weights are never written by the kernel before this one: under PDL (mx_tiles.pdl_launch) they stream
        # while it drains, and only x waits for it.
        if k0 + BLOCK_K <= K:
            w = tl.load(w_rows + k0 + k)
            if PDL:
                tl.extra.cuda.gdc_wait()
            x = tl.load(x_rows + k0 + k)
        else:
            w = tl.load(w_rows + k0 + k, mask=k0 + k < K, other=0.0)
            if PDL:
                tl.extra.cuda.gdc_wait()
            x = tl.load(x_rows + k0 + k, mask=k0 + k < K, other=0.0)
        xf = x if x.dtype == tl.float32 else widen_bf16(x)
        if NORM:  # K <= BLOCK_K (checked): the whole row is in this one chunk
            xf = _add_norm(xf, res_ptr, nw_ptr, res_out_ptr, normed_ptr, T, eps, pid, K, BT, BLOCK_K, NORM_F32,
                           INTERPRET)
        if EARLY:
            xf = _after_weights(w, xf, N, BT, BLOCK_N, BLOCK_K, LANES)
        acc += tl.sum(xf * widen_bf16(w), axis=2)
    return acc


@triton.jit
def _add_norm(xf, res_ptr, nw_ptr, res_out_ptr, normed_ptr, T, eps, pid, K: tl.constexpr, BT: tl.constexpr,
              BLOCK_K: tl.constexpr, NORM_F32: tl.constexpr, INTERPRET: tl.constexpr):
    """kernels/rmsnorm.py's FP32-residual formula on the widened x tile [BT, 1, BLOCK_K]: s = x + residual,
    n = weight * (s * rsqrt(mean(s^2) + eps)), returned for the products as it is (NORM_F32) or as bf16(n)
    widened again; program 0 also stores s and bf16(n) for the launches after this one."""
    t = tl.arange(0, BT)[:, None, None]
    k = tl.arange(0, BLOCK_K)[None, None, :]
    rows = tl.minimum(t, T - 1).to(tl.int64) * K + k
    ok = k < K
    s = xf + tl.load(res_ptr + rows, mask=ok, other=0.0)
    inv = tl.math.rsqrt(tl.sum(s * s, axis=2, keep_dims=True) * (1.0 / K) + eps)
    n = widen_bf16(tl.load(nw_ptr + k, mask=ok, other=0.0)) * (s * inv)
    normed = round_bf16(n, INTERPRET)
    if pid == 0:
        store = ok & (t < T)
        tl.store(res_out_ptr + rows, s, mask=store)
        tl.store(normed_ptr + rows, normed, mask=store)
    return n if NORM_F32 else widen_bf16(normed)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, T, N, stride_x, eps,
                          K: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          LANES: tl.constexpr, EARLY: tl.constexpr, NORM: tl.constexpr, OUT_BF16: tl.constexpr,
                          INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    acc = skinny_rows(x_ptr, w_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, T, N, stride_x, eps, pid, K, BT,
                      BLOCK_N, BLOCK_K, LANES, EARLY, NORM, True, INTERPRET, PDL)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BT)
    dst = out_ptr + t[:, None] * N + n[None, :]
    ok = (t < T)[:, None] & (n < N)[None, :]
    if OUT_BF16:
        tl.store(dst, round_bf16(acc, INTERPRET), mask=ok)
    else:
        tl.store(dst, acc, mask=ok)


def kernel_constexprs(T: int, K: int, cfg: Config, out_dtype: torch.dtype, norm: bool = False) -> dict:
    """_skinny_linear_kernel's constexprs for a launch (also what an offline compile check needs)."""
    lanes = 32 * cfg.num_warps
    return dict(K=K, BT=triton.next_power_of_2(T), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LANES=lanes,
                EARLY=bool(cfg.early_loads) and cfg.block_k >= 8 * lanes, NORM=norm,
                OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=triton.knobs.runtime.interpret)


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                  out: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """out[t, n] = sum_k x[t, k] * weight[n, k], accumulated in FP32 and stored as out_dtype (bf16: rounded to
    nearest even once; fp32: the accumulator). x [T, K] bf16 or fp32 with x.stride(1) == 1, T <= MAX_T; weight [N, K]
    bf16 contiguous, K a multiple of 8. Writes and returns `out` [T, N] (allocated when None; it must not overlap
    x or weight). `config` overrides _config's choice (benchmarks and tests)."""
    T, K, N = check_skinny(x, weight)
    out = make_out(out, (T, N), out_dtype, x, weight)
    if T and N:
        _launch(x, weight, out, config, x, x, x, x, 0.0, norm=False)
    return out


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                    config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, N], normed [T, K] bf16, s [T, K] fp32): s = x + residual, n = its RMSNorm (kernels/rmsnorm.py's
    FP32-residual formula, weight norm_weight [K] bf16) in FP32, normed = bf16(n), out = n @ weight^T as
    skinny_linear computes it (the FP32 n, not normed: one rounding fewer than rms_norm then skinny_linear).
    residual [T, K] fp32 contiguous; K <= the largest one-chunk BLOCK_K (8192)."""
    T, K, N = check_skinny(x, weight)
    check_add_norm(x, residual, norm_weight, eps)
    out = make_out(None, (T, N), out_dtype, x, weight)
    normed, summed = torch.empty(T, K, dtype=torch.bfloat16, device=x.device), torch.empty_like(residual)
    if T and N:
        _launch(x, weight, out, config, residual, norm_weight, summed, normed, eps, norm=True)
    return out, normed, summed


def check_skinny(x: torch.Tensor, weight: torch.Tensor, x_name: str = "x", w_name: str = "weight",
                 limit: int = MAX_T) -> tuple[int, int, int]:
    """(T, K, N) of a skinny product with at most `limit` rows, or an error naming the argument (as the caller
    calls it)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{x_name} must be a bfloat16 or float32 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"{x_name} must be a 2-D tensor [T, K], got shape {tuple(x.shape)}")
    T, K = x.shape
    if T > limit:
        raise ValueError(f"{x_name} has T = {T} tokens, more than the kernel's {limit}: use F.linear")
    if K == 0 or K % 8:
        raise ValueError(f"{x_name}: K = {K} must be a positive multiple of 8 (16-byte weight rows)")
    if x.stride(1) != 1:
        raise ValueError(f"{x_name} must have contiguous rows (stride(1) == 1), got strides {x.stride()}")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"{x_name} is on {x.device}: the kernel needs CUDA tensors (or Triton's interpreter)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{w_name} must be a 2-D tensor [N, K], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    check_tensor(w_name, weight, torch.bfloat16, (weight.shape[0], K), x.device)
    return T, K, weight.shape[0]


def check_add_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> None:
    """The norm prologue's arguments (x already checked): an error naming the one that is wrong."""
    T, K = x.shape
    check_tensor("residual", residual, torch.float32, (T, K), x.device)
    check_tensor("norm_weight", norm_weight, torch.bfloat16, (K,), x.device)
    check_eps(eps)
    if K > _MAX_BLOCK_K:
        raise ValueError(f"norm_weight: K = {K} is over {_MAX_BLOCK_K}: the norm needs the whole row in one chunk")


def make_out(out, shape, dtype, x, weight) -> torch.Tensor:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    out = torch.empty(shape, dtype=dtype, device=x.device) if out is None else out
    check_tensor("out", out, dtype, shape, x.device)
    for name, t in (("x", x), ("weight", weight)):
        if out.numel() and overlaps(out, t):
            raise ValueError(f"out overlaps {name}: in-place skinny_linear is not supported")
    return out


def _launch(x, weight, out, config, residual, norm_weight, summed, normed, eps, *, norm: bool) -> None:
    T, K = x.shape
    N = weight.shape[0]
    cfg = config or launch_config(T, N, K, norm)
    if not (_pow2(cfg.block_n) and _pow2(cfg.block_k) and cfg.block_k >= 8 and _pow2(cfg.num_warps)
            and cfg.num_warps <= 16 and K <= 64 * cfg.block_k and (not norm or K <= cfg.block_k)):
        raise ValueError(f"config {cfg}: powers of two, block_k >= 8, num_warps <= 16, K = {K} in <= 64 chunks"
                         f"{' (one chunk with the norm)' if norm else ''}")
    _skinny_linear_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, out, residual, norm_weight, summed, normed, T, N, x.stride(0), float(eps), num_warps=cfg.num_warps,
        **kernel_constexprs(T, K, cfg, out.dtype, norm), **pdl_launch())


def add_norm_linear_reference(x, residual, norm_weight, eps, weight, out_dtype=torch.bfloat16):
    """The same in torch: rms_norm_reference with the FP32 residual, its FP32 result multiplied (and rounded to
    BF16 for `normed`)."""
    n, summed = rms_norm_reference(x, norm_weight, eps, residual, out_dtype=torch.float32)
    return skinny_linear_reference(n, weight, out_dtype), n.bfloat16(), summed


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same in torch: an FP32 matmul of the same values, rounded once to out_dtype."""
    return (x.float() @ weight.float().T).to(out_dtype)
