"""RMSNorm, optionally fused with the residual add before it: one launch for the decoder layer's
`x = x + attn(...)` followed by `post_attention_layernorm(x)` (and the next layer's input norm), which in
torch are ~8 elementwise/reduction kernels each.

Shapes: T tokens, H hidden (up to 8192). Layout: x, out [T, H] bf16 row-major; weight [H] bf16; residual and
residual_out [T, H] row-major, both bf16 or both fp32. With an fp32 residual x may be fp32 too: the fast decode
path's o_proj output, added to the stream unrounded (docs/perf.md, the accuracy attribution).
Numerics with a BF16 residual, those of composer_rollout.model.layers.RMSNorm (Hugging Face's):
    s = bf16(x + residual)                                     (torch's BF16 add: FP32 sum, one rounding)
    out = bf16(weight * bf16(s * rsqrt(mean(s^2) + eps)))      (FP32 inside; the two BF16 roundings kept)
With an FP32 residual (the fast decode path's stream, which would otherwise be rounded to BF16 twice per layer),
nothing is rounded but the output:
    s = x + residual (FP32)                out = bf16(weight * (s * rsqrt(mean(s^2) + eps)))
The mean is sum(s^2) * fp32(1/H), as torch's CUDA mean computes it (its CPU mean divides by H; the same for
H a power of two). Compiled without FMA contraction (enable_fp_fusion=False), so every FP32 product and sum is
rounded on its own, as in torch. What still differs: the order of the sum, and rsqrt (the hardware's
approximation, ~2 ulp, as torch's CUDA rsqrtf; 1 / sqrt under the interpreter). So a normalised value at a BF16
rounding boundary may round the other way: out is then one BF16 step off (two, where a weight < 1 takes the
product into a lower binade). Rare: none at H = 2048 in the tests, ~1 in 10^5 elements at H = 96 or 200.
Each program holds whole rows in registers (BLOCK = next_power_of_2(H)); small H packs several rows per program.
Bytes: T * H * 2 read (x; 4 in fp32), + T * H * 2 read and T * H * 2 written with a BF16 residual (4 and 4 with an FP32
one), T * H * 2 written (out),
H * 2 read per program (weight).
Outputs must not overlap inputs (checked): in-place use is not supported.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor, overlaps
from kernels.mx_tiles import pdl_launch

MAX_H = 8192  # 16 values per thread per row tensor on 16 warps (36 registers on sm_90); beyond, rows need a loop


@triton.jit
def widen_bf16(v):
    """BF16 -> FP32 through the bits (exact): Triton's interpreter flushes BF16 denormals in its cast."""
    return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(v, INTERPRET: tl.constexpr):
    """FP32 -> BF16 rounded to nearest even. The interpreter's cast truncates, so there the rounding is done on
    the bits (NaN kept NaN: the carry would turn a canonical NaN into -0); on the GPU it is one cvt.rn."""
    if INTERPRET:
        b = v.to(tl.int32, bitcast=True)
        r = tl.where(v != v, 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, T, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, HAS_RES: tl.constexpr, RES_F32: tl.constexpr, X_F32: tl.constexpr,
                    INTERPRET: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see mx_tiles.pdl_launch: the next launch may start now; no memory access before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    m = (row < T)[:, None] & (col < H)[None, :]
    offs = row.to(tl.int64)[:, None] * H + col[None, :]  # int64: T * H may pass 2^31 in a long prefill
    s = tl.load(x_ptr + offs, mask=m, other=0.0)
    s = s if X_F32 else widen_bf16(s)
    if HAS_RES:
        if RES_F32:
            s = s + tl.load(res_ptr + offs, mask=m, other=0.0)
            tl.store(res_out_ptr + offs, s, mask=m)
        else:
            s16 = round_bf16(s + widen_bf16(tl.load(res_ptr + offs, mask=m, other=0.0)), INTERPRET)
            tl.store(res_out_ptr + offs, s16, mask=m)
            s = widen_bf16(s16)
    inv = tl.math.rsqrt(tl.sum(s * s, axis=1) * (1.0 / H) + eps)  # padding columns and rows add 0
    w = widen_bf16(tl.load(w_ptr + col, mask=col < H, other=0.0))
    if RES_F32:
        n = s * inv[:, None]
    else:
        n = widen_bf16(round_bf16(s * inv[:, None], INTERPRET))
    tl.store(out_ptr + offs, round_bf16(w[None, :] * n, INTERPRET), mask=m)


def _launch_shape(H: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps): ~1024+ elements per program, 8 per thread (one 16-byte access of BF16) up to
    16 warps; H = 2048 is one row on 8 warps, H = 128 eight rows on 4 warps."""
    block = triton.next_power_of_2(H)
    rows = max(1, 1024 // block)
    return block, rows, min(16, max(1, rows * block // 256))


def check_eps(eps, name: str = "eps") -> None:
    """An RMSNorm epsilon: a Python int or float >= 0 (NaN and bools refused), checked before any launch; the error
    names it as the caller calls it."""
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """(normed [T, H], residual_sum [T, H] or None): the RMSNorm of x, or of s = x + residual (written to
    `residual_out`, the stream the next residual add reads) when `residual` is given. The residual is bf16 or
    fp32 and residual_out has its dtype; x is bf16, or fp32 with an fp32 residual. `out` and `residual_out` are
    allocated when None; neither may overlap x, residual or weight."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be a bfloat16 or float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    x_f32 = x.dtype == torch.float32
    if x_f32 and (residual is None or residual.dtype != torch.float32):
        raise TypeError("x is float32 but residual is not: an fp32 x is added to an fp32 residual stream only")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if not 1 <= H <= MAX_H:
        raise ValueError(f"x: H must be in 1..{MAX_H}, got shape {tuple(x.shape)}")
    check_tensor("x", x, x.dtype, (T, H), x.device)
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"x is on {x.device}: the kernel needs CUDA tensors (or Triton's interpreter)")
    check_tensor("weight", weight, torch.bfloat16, (H,), x.device)
    check_eps(eps)
    inputs = {"x": x, "weight": weight}
    res_f32 = residual is not None and residual.dtype == torch.float32
    if residual is not None:
        check_tensor("residual", residual, torch.float32 if res_f32 else torch.bfloat16, (T, H), x.device)
        inputs["residual"] = residual
        residual_out = torch.empty_like(residual) if residual_out is None else residual_out
        check_tensor("residual_out", residual_out, residual.dtype, (T, H), x.device)
    elif residual_out is not None:
        raise ValueError("residual_out is given but residual is None: there is no sum to write")
    out = torch.empty(T, H, dtype=torch.bfloat16, device=x.device) if out is None else out
    check_tensor("out", out, torch.bfloat16, (T, H), x.device)
    checks = [("out", out, name, t) for name, t in inputs.items()]
    if residual_out is not None:
        checks += [("residual_out", residual_out, name, t) for name, t in [*inputs.items(), ("out", out)]]
    for o_name, o, i_name, i in checks:
        if overlaps(o, i):
            raise ValueError(f"{o_name} overlaps {i_name}: in-place rms_norm is not supported")
    if T > 0:
        block, rows, warps = _launch_shape(H)
        _rmsnorm_kernel[(triton.cdiv(T, rows),)](x, x if residual is None else residual, weight, out,
                                                 out if residual_out is None else residual_out, T, float(eps), H=H,
                                                 BLOCK=block, ROWS=rows, HAS_RES=residual is not None,
                                                 RES_F32=res_f32, X_F32=x_f32,
                                                 INTERPRET=triton.knobs.runtime.interpret, num_warps=warps,
                                                 enable_fp_fusion=False, **pdl_launch())
    return out, residual_out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.bfloat16):
    """The same in torch, op for op as the model's path: the BF16 add, then RMSNorm.forward's formula; with an
    FP32 residual, the FP32 sum and one rounding of the output to out_dtype (float32: none, the value that
    skinny_linear.add_norm_linear multiplies)."""
    if residual is not None and residual.dtype == torch.float32:
        s = x.float() + residual
        return (weight.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))).to(out_dtype), s
    s = x if residual is None else x + residual
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * sf.to(s.dtype), (None if residual is None else s)
