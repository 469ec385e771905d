"""A decode step's MoE router in one launch: (the residual add and post-attention RMSNorm,) the gate GEMM, softmax,
top-k, renormalisation and the capture of the expert ids.

Why: at batch 1 each small launch of a CUDA-graph decode step is a latency chain of a few µs whatever its bytes,
and the Triton dense path spent three on this (rms_norm, the gate, router_topk: ~8.6 µs per layer on the H200);
this launch measured 4.69 µs (docs/perf.md, "Fewer launches per decode layer"). The gate's bytes (0.5 MB at
H 2048, E 128) want many SMs, the top-k wants all E logits of a token in one program, so: a grid of
skinny_linear programs (kernels/skinny_linear.skinny_rows: BLOCK_N gate rows each, all T tokens, FP32 sums; with
add_norm, the norm computed in every program and stored by program 0) writes FP32 logits to a scratch
[T, E]; each program then bumps a counter (atomic, acq_rel at GPU scope, after a CTA barrier so the whole
program's stores precede it), and the program that arrives last runs router_topk's softmax + bitonic top-k
(kernels/router_topk.softmax_topk_store) over the T rows and resets the counter to zero for the next launch. The
counter is the caller's zeroed int32 [1] buffer (one per call site, e.g. per MoE block: two launches sharing one
must not run concurrently); the logits are read back through L2 (.cg), never from a stale L1 line.
Shapes: T tokens (<= skinny_linear.MAX_T, 16), H hidden (a multiple of 8, <= 8192 with the norm), E experts (<=
512), k = top_k <= E. Layout: hidden [T, H] bf16 (or fp32: with the norm, the o_proj output) with unit stride
along H; gate_weight [E, H] bf16 row-major;
residual [T, H] fp32 -> weights [T, k] fp32, ids [T, k] int64, the capture [T, k] uint8 / int16 / int32, and with
the norm normed [T, H] bf16 (the experts' input) and the residual sum [T, H] fp32.
Numerics: logits = normed @ gate_weight^T from BF16 operands, FP32 accumulation, kept FP32 (skinny_linear's sums;
the torch path rounds logits to BF16: at a trained router's logit spread, experts a BF16 step apart tie or swap);
from there router_topk's math exactly; the norm is rmsnorm.py's FP32-residual formula.
Bytes: E * H * 2 (gate weight, once) + T * H * (2 + 4) per program (hidden and residual, from L2) + T * E * 4
written and read back once + T * k * (12 + capture) written (+ T * H * 6 by program 0 with the norm).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import pdl_launch
from kernels.rmsnorm import rms_norm_reference
from kernels.router_topk import MAX_E, check_capture_out, router_topk_reference, softmax_topk_store
from kernels.skinny_linear import check_add_norm, check_skinny, kernel_constexprs, launch_config, skinny_rows

MAX_T_NORM = 8  # tokens with add_norm: the norm prologue holds every token's row (T = 16 spilled at H 2048, sm_90)
_TOPK_ROWS = 4  # tokens per step of the last program's top-k (router_topk's rows per program)


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32
    ids: torch.Tensor  # [T, k] int64
    normed: torch.Tensor | None = None  # [T, H] bf16, the experts' input (with add_norm)
    residual: torch.Tensor | None = None  # [T, H] fp32, hidden + residual (with add_norm)


@triton.jit
def _router_gate_topk_kernel(x_ptr, g_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, logits_ptr, count_ptr, w_ptr,
                             ids_ptr, cap_ptr, T, E, stride_x, eps, n_programs, K: tl.constexpr, BT: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr, EARLY: tl.constexpr,
                             NORM: tl.constexpr, OUT_BF16: tl.constexpr, TOP_K: tl.constexpr, LOG_E: tl.constexpr,
                             LOG_K: tl.constexpr, ROWS: tl.constexpr, NORM_TOPK: tl.constexpr,
                             CAPTURE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    acc = skinny_rows(x_ptr, g_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, T, E, stride_x, eps, pid, K, BT,
                      BLOCK_N, BLOCK_K, LANES, EARLY, NORM, False, INTERPRET, PDL)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BT)
    tl.store(logits_ptr + t[:, None] * E + n[None, :], acc, mask=(t < T)[:, None] & (n < E)[None, :])
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
        e = tl.arange(0, 2 ** LOG_E)
        for r0 in tl.static_range(0, BT, ROWS):
            row = r0 + tl.arange(0, ROWS)
            x = tl.load(logits_ptr + row[:, None] * E + e[None, :], mask=(row < T)[:, None] & (e < E)[None, :],
                        other=0.0, cache_modifier=".cg")
            softmax_topk_store(x, e, row, T, w_ptr, ids_ptr, cap_ptr, E, TOP_K, LOG_E, LOG_K, NORM_TOPK, CAPTURE,
                               INTERPRET)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


def router_gate_topk(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
                     counter: torch.Tensor, *, capture_out: torch.Tensor | None = None,
                     add_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> Routing:
    """The router of `hidden` [T, H] with `gate_weight` [E, H]: router_topk(hidden @ gate_weight.T) with FP32
    logits (module docstring). add_norm = (residual [T, H] fp32, norm_weight [H] bf16, eps): route
    rms_norm(hidden + residual) instead, and return it (normed) and the sum. counter: a zeroed int32 [1] buffer of
    the call site (left zeroed). capture_out [T, k] (uint8, int16 or int32, e.g. ExpertCapture.ids[layer])
    receives the ids too when given."""
    T, H, E = check_skinny(hidden, gate_weight, "hidden", "gate_weight")
    if not 1 <= E <= MAX_E:
        raise ValueError(f"gate_weight: E must be in 1..{MAX_E}, got shape {tuple(gate_weight.shape)}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in 1..E={E}, got {top_k!r}")
    check_tensor("counter", counter, torch.int32, (1,), hidden.device)
    check_capture_out(capture_out, T, top_k, E, hidden.device)
    device = hidden.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=device)
    normed = summed = None
    residual = norm_weight = hidden
    eps = 0.0
    if add_norm is not None:
        residual, norm_weight, eps = add_norm
        check_add_norm(hidden, residual, norm_weight, eps)
        normed, summed = torch.empty(T, H, dtype=torch.bfloat16, device=device), torch.empty_like(residual)
    if T == 0:
        return Routing(weights, ids, normed, summed)
    cfg = launch_config(T, E, H, add_norm is not None)
    grid = triton.cdiv(E, cfg.block_n)
    bt = triton.next_power_of_2(T)
    logits = torch.empty(T, E, dtype=torch.float32, device=device)
    _router_gate_topk_kernel[(grid,)](
        hidden, gate_weight, residual, norm_weight, summed if summed is not None else logits,
        normed if normed is not None else hidden, logits, counter, weights, ids,
        ids if capture_out is None else capture_out, T, E, hidden.stride(0), float(eps), grid,
        num_warps=cfg.num_warps, TOP_K=top_k, LOG_E=(E - 1).bit_length(), LOG_K=(top_k - 1).bit_length(),
        ROWS=min(bt, _TOPK_ROWS), NORM_TOPK=bool(norm_topk_prob), CAPTURE=capture_out is not None,
        **kernel_constexprs(T, H, cfg, torch.float32, add_norm is not None), **pdl_launch())
    return Routing(weights, ids, normed, summed)


def router_gate_topk_reference(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
                               add_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> Routing:
    """The same in torch: (rms_norm_reference with the FP32 residual,) FP32 logits from the BF16 operands, then
    router_topk_reference. (The model's torch path rounds the logits to BF16 first.)"""
    normed = summed = None
    if add_norm is not None:
        residual, norm_weight, eps = add_norm
        normed, summed = rms_norm_reference(hidden, norm_weight, eps, residual)
        hidden = normed
    weights, ids = router_topk_reference(hidden.float() @ gate_weight.float().T, top_k, norm_topk_prob)
    return Routing(weights, ids, normed, summed)
