"""Activations as two FP8 E4M3 terms, hi + lo, under one power-of-two scale: operands for FP8 tensor-core dots.

Why. The expert-centric GEMMs on MXFP8 weights were bound by dequantizing each weight to BF16 (docs/perf.md). With
FP8 dots (kernels/moe_gate_up_fp8.py, kernels/moe_down_fp8.py) the weights go to the tensor cores as they are
stored, and the activation becomes two E4M3 operands instead of one BF16: x * 2^-s = hi + lo, hi = rne(x * 2^-s),
lo = rne(x * 2^-s - hi), both in the same units, so the dot on x is the dot on hi plus the dot on lo.
hi keeps 4 significant bits and lo the next 4, so a BF16 value (8 significant bits) splits exactly whenever it is
at least 2^-10 of its scale group's maximum (lo's lowest bit then stays on E4M3's grid, 2^-9 in scaled units);
smaller values err by at most 2^-10 in scaled units, 2^-18 of the group maximum. An FP32 value keeps ~8 bits, as
in BF16. Scales follow the MXFP8 rule (kernels/mxfp8.py: ceil(log2(amax / 448)), codes 1..254; 255 marks a group
with inf or NaN, which decodes to inf so that the GEMM's output is not finite either).

Layout (row-major), R rows of N elements, G = N / group scale groups per row (group = N: one scale per row):
    x [R, N] bf16 or fp32   data [R, 2, N] float8_e4m3fn (data[r, 0] = hi, data[r, 1] = lo)   scales [R, G] uint8
A row's hi and lo are adjacent, so a GEMM loads them as one [32, 2M] operand (columns 2m and 2m + 1: hi and lo of
row m) and runs one dot for both, adding each column pair after it.
`fp8_split_rows` is the launch for a row scale (one program per row); the hidden rows before the gate_up GEMM are
split by the align launch (kernels/moe_align.py) with the same `split_row`, and the gate_up GEMM splits its output
tile per 32 with the same `split_e4m3` helper. Rounding is integer arithmetic and
IEEE FP32 adds (kernels/mxfp8_quantize_kernel.py), so Triton's interpreter computes the GPU's bytes.
Bytes: read R * N * 2 (bf16), write R * N * 2 + R * G.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mxfp8 import ceil_exponent
from kernels.mxfp8_quantize_kernel import e4m3_rne, e8m0_code, inv_scale


@dataclass(frozen=True)
class FP8Split:
    """x ~= (hi + lo) * 2^(scales - 127) per scale group: data float8_e4m3fn [R, 2, N] (hi, lo), scales uint8
    [R, G]."""

    data: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def empty(cls, rows: int, n: int, groups: int, device) -> "FP8Split":
        return cls(torch.empty((rows, 2, n), dtype=torch.float8_e4m3fn, device=device),
                   torch.empty((rows, groups), dtype=torch.uint8, device=device))

    @property
    def hi(self) -> torch.Tensor:
        return self.data[:, 0]

    @property
    def lo(self) -> torch.Tensor:
        return self.data[:, 1]

    def check(self, name: str, rows: int, n: int, groups: int, device) -> None:
        """Dtypes, shapes, contiguity and device, the error naming `name`."""
        check_tensor(f"{name}.data", self.data, torch.float8_e4m3fn, (rows, 2, n), device)
        check_tensor(f"{name}.scales", self.scales, torch.uint8, (rows, groups), device)


@triton.jit
def split_codes(bits, axis: tl.constexpr):
    """The scale code of each group along `axis` of |x|'s FP32 bits `bits` (int32): 255 where a value is not
    finite, else the MXFP8 ceil-to-fit code."""
    amax = tl.max(bits & 0x7FFFFFFF, axis=axis)  # integer max of |x| bits: the float order, NaN-proof
    return tl.where(amax >= 0x7F800000, 255, e8m0_code(amax))


@triton.jit
def split_e4m3(bits, code):
    """(hi, lo) E4M3 bytes (uint8) of x = FP32 bits `bits` (int32) under scale code `code` (broadcast to bits)."""
    y = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_scale(tl.minimum(code, 254))
    hq, hv = e4m3_rne(y)
    r = y - hv  # exact: hv is y rounded to 4 significant bits
    lq, _ = e4m3_rne(tl.abs(r))
    sign = (bits >> 24) & 0x80
    lo_sign = tl.where(r == 0, 0, tl.where(r < 0, sign ^ 0x80, sign))  # x - x is +0, as in the reference
    return (hq | sign).to(tl.uint8), (lq | lo_sign).to(tl.uint8)


@triton.jit
def split_row(x_ptr, d_ptr, s_ptr, r, N: tl.constexpr, BF16_BITS: tl.constexpr, BN: tl.constexpr):
    """Row r of x [R, N] split under one scale: hi and lo to d [R, 2, N], the code to s [R]. A helper, so that a
    launch that runs anyway (kernels/moe_align.py) can split the rows too."""
    r = r.to(tl.int64)
    n = tl.arange(0, BN)
    ok = n < N
    x = tl.load(x_ptr + r * N + n, mask=ok, other=0)
    if BF16_BITS:  # BF16 read as int16: its FP32 bits are the top half (the interpreter's cast loses denormals)
        bits = x.to(tl.int32) << 16
    else:
        bits = x.to(tl.int32, bitcast=True)
    code = split_codes(bits, 0)
    hi, lo = split_e4m3(bits, code)
    tl.store(d_ptr + r * 2 * N + n, hi, mask=ok)
    tl.store(d_ptr + r * 2 * N + N + n, lo, mask=ok)
    tl.store(s_ptr + r, code.to(tl.uint8))


@triton.jit
def _split_rows_kernel(x_ptr, d_ptr, s_ptr, N: tl.constexpr, BF16_BITS: tl.constexpr, BN: tl.constexpr):
    split_row(x_ptr, d_ptr, s_ptr, tl.program_id(0), N, BF16_BITS, BN)


def split_rows_args(x: torch.Tensor, out: FP8Split | None) -> tuple[FP8Split, tuple, dict]:
    """Checks x and `out` for a row-scale split; (out, the kernel's pointer arguments, its constexprs)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be a bfloat16 or float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [R, N] tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    R, N = x.shape
    out = FP8Split.empty(R, N, 1, x.device) if out is None else out
    out.check("out", R, N, 1, x.device)
    bf16 = x.dtype == torch.bfloat16
    ptrs = (x.view(torch.int16) if bf16 else x, out.data.view(torch.uint8), out.scales)
    return out, ptrs, dict(N=N, BF16_BITS=bf16, BN=triton.next_power_of_2(N))


def split_rows_warps(bn: int) -> int:
    """Warps for a program that splits a row of `bn` (a power of two) elements."""
    return 4 if bn <= 2048 else 8


def fp8_split_rows(x: torch.Tensor, out: FP8Split | None = None) -> FP8Split:
    """x [R, N] (bf16 or fp32, contiguous) split with one scale per row, into `out` if given (scales [R, 1])."""
    out, ptrs, cx = split_rows_args(x, out)
    if x.shape[0]:
        _split_rows_kernel[(x.shape[0],)](*ptrs, **cx, num_warps=split_rows_warps(cx["BN"]))
    return out


def fp8_split_reference(x: torch.Tensor, group: int | None = None) -> FP8Split:
    """The torch reference of the split, [R, N] -> FP8Split with one scale per `group` elements (None: per row).
    Assumes finite x (the kernels mark non-finite groups with code 255; this reference does not)."""
    R, N = x.shape
    g = N if group is None else group
    blocks = x.float().reshape(R, N // g, g)
    exp = ceil_exponent(blocks.abs().amax(dim=-1))
    y = blocks * torch.exp2(-exp.float()).unsqueeze(-1)  # exact: a power of two
    hi = y.to(torch.float8_e4m3fn)
    lo = (y - hi.float()).to(torch.float8_e4m3fn)
    return FP8Split(torch.stack([hi.reshape(R, N), lo.reshape(R, N)], dim=1), (exp + 127).to(torch.uint8))


def fp8_split_value(s: FP8Split, group: int | None = None) -> torch.Tensor:
    """(hi + lo) * 2^(scale - 127) in FP32: the value the FP8 dots compute with."""
    R, N = s.hi.shape
    g = N if group is None else group
    v = (s.hi.float() + s.lo.float()).reshape(R, N // g, g)
    return (v * torch.exp2(s.scales.float() - 127).unsqueeze(-1)).reshape(R, N)
