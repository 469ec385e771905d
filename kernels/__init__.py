"""Triton kernels for MoE decode and for attention over the slot KV cache, and the types and torch references they
share.

Imports only torch and triton: the model, engine and jobs build on this package, never the reverse.
"""

from kernels.attention_reference import cache_attention_reference, check_attention_args
from kernels.decode_attention import decode_attention
from kernels.expert_centric_moe import auto_moe, expert_centric_moe
from kernels.gumbel_sample import gumbel_sample, gumbel_sample_reference
from kernels.lm_head import lm_head_logits, lm_head_reference
from kernels.moe_reference import check_moe_args, moe_reference
from kernels.mxfp8 import MXFP8_BLOCK, MXFP8Tensor, as_dense, mxfp8_dequantize, mxfp8_quantize
from kernels.mxfp8_quantize_kernel import mxfp8_quantize_triton, mxfp8_quantize_triton_many, raise_if_nonfinite
from kernels.prefill_attention import prefill_attention
from kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from kernels.rmsnorm import rms_norm, rms_norm_reference
from kernels.router_topk import router_topk, router_topk_reference
from kernels.skinny_gemm import skinny_gemm, skinny_gemm_reference
from kernels.skinny_linear import skinny_linear, skinny_linear_reference
from kernels.warp_decode_moe import warp_decode_moe

__all__ = [
    "MXFP8Tensor",
    "MXFP8_BLOCK",
    "as_dense",
    "auto_moe",
    "cache_attention_reference",
    "check_attention_args",
    "check_moe_args",
    "decode_attention",
    "expert_centric_moe",
    "gumbel_sample",
    "gumbel_sample_reference",
    "lm_head_logits",
    "lm_head_reference",
    "moe_reference",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_triton",
    "mxfp8_quantize_triton_many",
    "prefill_attention",
    "qk_norm_rope",
    "qk_norm_rope_reference",
    "raise_if_nonfinite",
    "rms_norm",
    "rms_norm_reference",
    "router_topk",
    "router_topk_reference",
    "skinny_gemm",
    "skinny_gemm_reference",
    "skinny_linear",
    "skinny_linear_reference",
    "warp_decode_moe",
]
