"""Triton kernels for MoE decode, and the types and torch references they share.

Imports only torch and triton: the model, engine and jobs build on this package, never the reverse.
"""

from kernels.moe_reference import check_moe_args, moe_reference
from kernels.mxfp8 import MXFP8_BLOCK, MXFP8Tensor, as_dense, mxfp8_dequantize, mxfp8_quantize
from kernels.warp_decode_moe import warp_decode_moe

__all__ = [
    "MXFP8_BLOCK",
    "MXFP8Tensor",
    "as_dense",
    "check_moe_args",
    "moe_reference",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "warp_decode_moe",
]
