"""The torch reference for one MoE layer's experts: the `torch` kernel path, and the accuracy yardstick.

Every MoE kernel path computes the same function, with this signature:

    moe(hidden [T, H], topk_weights [T, k], topk_ids [T, k], w13, w2) -> [T, H] in hidden.dtype
      out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ hidden[t]) * (w13[e, I:] @ hidden[t])),
      e = topk_ids[t, j]

Shapes: T tokens, H hidden_size, I moe_intermediate_size, E num_experts, k num_experts_per_tok.
    w13  [E, 2I, H]  gate rows first, then up rows; [out, in] as in Hugging Face
    w2   [E, H, I]
each either a dense tensor (BF16 or FP32) or an MXFP8Tensor of that shape.

Here the experts are computed one at a time over the tokens routed to them (the loop of Hugging
Face's eager path), in `compute_dtype`; per-expert outputs are summed in FP32. With FP32 it is the
reference every other path is measured against; with BF16 it matches a plain BF16 implementation.
It reads only the experts that are routed to, so it also runs at the real model's shapes.
"""

import torch
import torch.nn.functional as F
import triton

from kernels.mxfp8 import MXFP8_BLOCK, MXFP8Tensor, as_dense


def check_moe_args(hidden, topk_weights, topk_ids, w13, w2) -> None:
    """Shape checks shared by every path's launcher; the error names the argument."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    T, H = hidden.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, k], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w13.shape[-1] != H or len(w13.shape) != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H={H}], got {tuple(w13.shape)}")
    E, two_i, _ = w13.shape
    if tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"w2 must be [E={E}, H={H}, I={two_i // 2}], got {tuple(w2.shape)}")


def check_tensor(name: str, tensor, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """One intermediate buffer of a kernel launcher: dtype, shape, contiguity and device, the error naming it."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (any strides) may share a byte: their [first, last] address spans intersect. Launchers
    use it to refuse an output that aliases an input."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def weight_parts(w, name: str, device: torch.device):
    """(data, scales or data as a placeholder, is_mx) of a kernel's weight operand: a contiguous BF16 tensor or
    MXFP8Tensor on `device`, the error naming it."""
    if isinstance(w, MXFP8Tensor):
        parts = {f"{name}.data": w.data, f"{name}.scales": w.scales}
    elif isinstance(w, torch.Tensor):
        if w.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be a bfloat16 tensor or an MXFP8Tensor, got {w.dtype}")
        parts = {name: w}
    else:
        raise TypeError(f"{name} must be a torch.Tensor or an MXFP8Tensor, got {type(w).__name__}")
    for label, tensor in parts.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{label} must be contiguous (row-major [E, out, in]), got strides {tensor.stride()}")
        if tensor.device != device:
            raise ValueError(f"{label} is on {tensor.device}, hidden is on {device}")
    return (w.data, w.scales, True) if isinstance(w, MXFP8Tensor) else (w, w, False)


def check_kernel_args(hidden, topk_weights, topk_ids, w13, w2) -> None:
    """What every Triton path's launcher needs beyond check_moe_args: BF16 hidden, float routing weights, H and I
    multiples of the MXFP8 block, contiguous inputs on one CUDA device (or Triton's interpreter)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dtype != torch.bfloat16:
        raise TypeError(f"hidden must be a bfloat16 tensor, got {getattr(hidden, 'dtype', type(hidden))}")
    if topk_weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"topk_weights must be float32, bfloat16 or float16, got {topk_weights.dtype}")
    check_moe_args(hidden, topk_weights, topk_ids, w13, w2)
    if w13.shape[-1] % MXFP8_BLOCK or w2.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"H and I must be multiples of {MXFP8_BLOCK}, got w13 {tuple(w13.shape)}")
    if hidden.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"hidden is on {hidden.device}: the kernels need CUDA tensors (or Triton's interpreter)")
    for name, tensor in (("hidden", hidden), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden is on {hidden.device}")


def moe_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: "torch.Tensor | MXFP8Tensor",
    w2: "torch.Tensor | MXFP8Tensor",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """SwiGLU experts summed with routing weights; computes in `compute_dtype` (default: hidden's)."""
    check_moe_args(hidden, topk_weights, topk_ids, w13, w2)
    dtype = compute_dtype or hidden.dtype
    x = hidden.to(dtype)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = F.linear(x[token], as_dense(w13[e], dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, as_dense(w2[e], dtype))
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(hidden.dtype)
