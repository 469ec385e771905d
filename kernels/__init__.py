"""Triton kernels for MoE decode, and the types and torch references they share.

Imports only torch and triton: the model, engine and jobs build on this package, never the reverse.
"""

from kernels.expert_centric_moe import auto_moe, expert_centric_moe
from kernels.moe_reference import check_moe_args, moe_reference
from kernels.mxfp8 import MXFP8_BLOCK, MXFP8Tensor, as_dense, mxfp8_dequantize, mxfp8_quantize
from kernels.mxfp8_quantize_kernel import mxfp8_quantize_triton, mxfp8_quantize_triton_many, raise_if_nonfinite
from kernels.warp_decode_moe import warp_decode_moe

__all__ = [
    "MXFP8_BLOCK",
    "MXFP8Tensor",
    "as_dense",
    "auto_moe",
    "check_moe_args",
    "expert_centric_moe",
    "moe_reference",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_triton",
    "mxfp8_quantize_triton_many",
    "raise_if_nonfinite",
    "warp_decode_moe",
]
