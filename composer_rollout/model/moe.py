"""The MoE block (router + experts) and the one interface every kernel path implements.

A kernel path is a function

    moe(hidden [T, H], topk_weights [T, k] fp32, topk_ids [T, k], w13, w2) -> [T, H]

with w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I] held as dense tensors or MXFP8Tensor.
The model only routes and calls the path it was built with, so a Triton path plugs in by adding an
entry to `KERNEL_PATHS`, without touching the model. The router follows Hugging Face: logits in the
model dtype, softmax in FP32, top-k, renormalisation when `norm_topk_prob`; the routing weights stay
FP32 all the way into the expert sum.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from composer_rollout.model.layers import fused_linear
from kernels import (
    MXFP8Tensor,
    auto_moe,
    expert_centric_moe,
    moe_reference,
    router_topk,
    router_topk_reference,
    warp_decode_moe,
)
from kernels.expert_centric_moe import table_source
from kernels.router_gate_topk import router_gate_topk
from kernels.skinny_gemm import gemm_counter

MoEPath = Callable[..., torch.Tensor]
# Up to this many tokens the router is one launch (router_gate_topk with the residual add and RMSNorm in its
# prologue); above, rms_norm + the gate GEMM (fused_linear) + router_topk. jobs/bench_router.py on the H200, 30B
# shape, µs per call in a CUDA graph: T = 1 4.32 fused vs 4.89, T = 2 4.80 vs 5.23, T = 4 6.15 vs 5.51, T = 8
# 10.14 vs 6.66, T = 16 18.0 (without the norm) vs 9.1; the 235B shape (H 4096) already loses at T = 2 (6.00 vs
# 5.81) but by less than the 30B shape gains. The single launch's one program per gate block holds all T rows. In
# the 30B decode step, 16 -> 8 took B = 16 from 11.34 to 9.82 ms; 8 -> 2 moved B = 8 by -27 µs, within the noise.
FUSED_ROUTER_MAX_T = 2


def _torch_path(hidden, topk_weights, topk_ids, w13, w2):
    return moe_reference(hidden, topk_weights, topk_ids, w13, w2)


def _warp_decode_path(hidden, topk_weights, topk_ids, w13, w2):
    # The launcher rejects what it cannot run (FP32 activations or weights, CPU tensors outside Triton's
    # interpreter) with an error naming the argument, rather than this path quietly computing in torch.
    return warp_decode_moe(hidden, topk_weights, topk_ids, w13, w2)


def _expert_centric_path(hidden, topk_weights, topk_ids, w13, w2):
    return expert_centric_moe(hidden, topk_weights, topk_ids, w13, w2)


def _auto_path(hidden, topk_weights, topk_ids, w13, w2):
    # Warp decode up to the crossover T measured on this GPU (kernels/configs/), expert-centric above it.
    return auto_moe(hidden, topk_weights, topk_ids, w13, w2)


KERNEL_PATHS: dict[str, MoEPath] = {"torch": _torch_path, "warp_decode": _warp_decode_path,
                                    "expert_centric": _expert_centric_path, "auto": _auto_path}


def resolve_kernel_path(name: str) -> MoEPath:
    """The MoE function for `kernel=name`; a path that cannot run here is an error, never a fallback."""
    if name in KERNEL_PATHS:
        return KERNEL_PATHS[name]
    raise ValueError(f"kernel {name!r} is unknown; choose one of {sorted(KERNEL_PATHS)}")


def tuned_table(kernel: str, device: torch.device) -> str | None:
    """Which tuned tile table (kernels/configs/) kernel=expert_centric or auto runs with on this device, for the jobs'
    start-up lines: a GPU without its own table may take one of the same architecture, or none (default tiles);
    None for the other paths and off CUDA."""
    if kernel not in ("expert_centric", "auto") or device.type != "cuda":
        return None
    return table_source(device)


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, fused: bool = False,
          capture_out: torch.Tensor | None = None):
    """FP32 softmax over experts, top-k, optional renormalisation -> (weights [T, k] fp32, ids [T, k]); fused: one
    Triton launch (kernels/router_topk.py) instead of the torch ops, which also writes the ids into `capture_out`
    (a layer's rows of an ExpertCapture) where the torch path copies them."""
    if fused:
        return router_topk(router_logits, top_k, norm_topk_prob, capture_out=capture_out)
    weights, ids = router_topk_reference(router_logits, top_k, norm_topk_prob)
    if capture_out is not None:
        capture_out.copy_(ids)
    return weights, ids


class SparseMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob, dtype, device,
                 moe_fn: MoEPath):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.moe_fn = top_k, norm_topk_prob, moe_fn
        self.fused_router = False
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device).requires_grad_(False)
        # Plain attributes, not parameters: either form (dense or MXFP8Tensor) is swapped in whole.
        # They start as meta tensors (shape only, no memory) until the model's set_experts fills them.
        self.w13: torch.Tensor | MXFP8Tensor = torch.empty(
            num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device="meta")
        self.w2: torch.Tensor | MXFP8Tensor = torch.empty(
            num_experts, hidden_size, intermediate_size, dtype=dtype, device="meta")
        # The fused decode router's arrival counter (kernels/router_gate_topk.py): one per block, zero between launches.
        self.register_buffer("router_counter", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("gate_counter", gemm_counter(num_experts, device), persistent=False)  # skinny_gemm's

    def forward(self, x: torch.Tensor, layer: int = 0, capture=None) -> torch.Tensor:
        """x [..., H]; `capture` (composer_rollout.engine.capture.ExpertCapture, or None) records this layer's
        expert ids when the engine asks for them."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        cap = None if capture is None else capture.layer(layer)
        # The fused router takes FP32 logits (Hugging Face's are BF16): a near-tie between experts is not decided by
        # a rounding. (Its one-launch form runs with the add + norm, in add_norm_forward.)
        logits = (fused_linear(flat, self.gate.weight, torch.float32, self.gate_counter) if self.fused_router
                  else F.linear(flat, self.gate.weight))
        weights, ids = route(logits, self.top_k, self.norm_topk_prob, self.fused_router, cap)
        return self.moe_fn(flat, weights, ids, self.w13, self.w2).reshape(shape)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm, layer: int = 0, capture=None):
        """(the block's output for norm(x + residual), x + residual) on the fused path, the sum in FP32 (`norm` the
        layer's post-attention RMSNorm). Up to FUSED_ROUTER_MAX_T tokens the add and the norm run in the router's
        launch."""
        shape = x.shape
        if x.numel() // shape[-1] > FUSED_ROUTER_MAX_T:
            h, residual = norm.add_norm(x, residual, fused=True)
            return self(h, layer, capture), residual
        flat = x.reshape(-1, shape[-1])
        routing = router_gate_topk(flat, self.gate.weight, self.top_k, self.norm_topk_prob, self.router_counter,
                                   capture_out=None if capture is None else capture.layer(layer),
                                   add_norm=(residual.reshape(flat.shape), norm.weight, norm.eps))
        out = self.moe_fn(routing.normed, routing.weights, routing.ids, self.w13, self.w2)
        return out.reshape(shape), routing.residual.view(shape)
