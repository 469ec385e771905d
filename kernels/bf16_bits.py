"""BF16 <-> FP32 by the bits, for kernels whose results must be the same bits on the GPU and under Triton's
interpreter (which flushes BF16 denormals when it widens and truncates when it narrows): the residual stream's
add + norm (kernels/rmsnorm.py), the projections that round like it (kernels/skinny_linear.py, skinny_gemm.py),
and the MoE combine, whose BF16 sum the norm can also take over (kernels/moe_combine.py). No kernel here.
"""

import triton
import triton.language as tl


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
