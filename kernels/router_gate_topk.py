"""MoE router in one launch: the gate GEMM, softmax, top-k, renormalisation, and the capture of the expert ids. In a
CUDA-graph decode step every launch costs ~2-3 us of fixed latency; the torch path spends three here (the gate
GEMM, kernels/router_topk.py, ExpertCapture.record's copy into its uint8 buffer).

Shapes: T tokens, H hidden (a multiple of 16), E experts (up to 512), k = top_k <= E. Layout: hidden [T, H] bf16
and gate_weight [E, H] bf16 row-major -> weights [T, k] fp32, ids [T, k] int64, and optionally the same ids in
capture [T, k] uint8 / int16 / int32 (ExpertCapture's row block for the layer).
Numerics: logits = hidden @ gate_weight.T from the BF16 operands with FP32 accumulation, kept in FP32. This is
deliberately NOT the torch path, which rounds the gate GEMM's output to BF16 (8 significant bits: at the logit
spread of a trained router, experts a BF16 step apart tie or swap). FP32 logits route as the FP64 product does
except within ~1e-6 of a tie (tests/test_router_gate_topk.py counts it). From the logits on, router_topk's math
exactly: FP32 softmax (libdevice expf, IEEE division), the k largest probabilities descending, ties to the lower
expert index, optional renormalisation; its @triton.jit bitonic top-k on the same int64 keys.
Grid: one program per BLOCK_T tokens (16 = the MMA minimum, masked, for decode; up to 64 in a long prefill, so
that the gate weight is re-read fewer times). Each program streams the whole gate weight over H in BLOCK_K chunks
with tl.dot (tokens x experts, FP32 accumulator [BLOCK_T, EP], EP = next_power_of_2(E) >= 16); the loop over a
constexpr H is software-pipelined (cp.async, 3 stages of 32 KB of weight in flight). The top-k reshapes the
accumulator into router_topk's per-token hypercube [BLOCK_T, 2, .., 2] where it lies: Triton relabels the MMA
layout's registers, no data moves. Unlike router_topk (one warp per token) a token's experts then stay spread over
a quad of lanes and over the warps (at BLOCK_T 16 the MMA splits E across the warps: M = 16 is one MMA row block),
so bitonic steps cross lanes by shuffles and warps through shared memory (16 barriers at E 128 on sm_90). Moving
rows onto warps would need a layout conversion, which Triton's language cannot request (Gluon could).
Bytes: T * H * 2 (hidden) + E * H * 2 per program (the gate weight, 0.5 MB at H 2048, E 128: from HBM once, then
from L2) + T * k * (12 + capture's 1, 2 or 4) written.
At T <= 16 a single SM streams the whole gate weight: its load bandwidth (~100-200 GB/s, so a few us; unmeasured),
not the DRAM's, bounds the launch. Splitting H over programs (a last-arriving program doing the top-k) would lift it.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import dot_dtype
from kernels.rmsnorm import widen_bf16
from kernels.router_topk import MAX_E, check_capture_out, router_topk_reference, softmax_topk_store

_KEYS_PER_PROGRAM = 8192  # BLOCK_T * EP int64 keys: 16 per thread on 16 warps, router_topk's largest per thread
_STAGE_BYTES = 32768  # one pipeline stage of the gate weight (BLOCK_K * EP * 2): bytes in flight per SM at T = 1
_MIN_PROGRAMS = 128  # ~the SM count: BLOCK_T grows past 16 only when T still fills the GPU


@triton.jit
def _router_gate_topk_kernel(x_ptr, g_ptr, w_ptr, ids_ptr, cap_ptr, T, H: tl.constexpr, E: tl.constexpr, K: tl.constexpr,
            LOG_E: tl.constexpr, LOG_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
            NORM: tl.constexpr, CAPTURE: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, 2 ** LOG_E)
    kk = tl.arange(0, BLOCK_K)
    # Masks constant along H (BLOCK_K divides H), so the loads stay 16-byte vectors. Rows past T and experts
    # past E read zeros: finite logits, never stored (rows) or set to -inf below (experts).
    x_ptrs = x_ptr + row.to(tl.int64)[:, None] * H + kk[None, :]  # int64: T * H passes 2^31 in a long prefill
    g_ptrs = g_ptr + e[:, None] * H + kk[None, :]
    x_ok = (row < T)[:, None]
    g_ok = (e < E)[:, None]
    acc = tl.zeros([BLOCK_T, 2 ** LOG_E], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=x_ok, other=0.0)
        g = tl.load(g_ptrs + k0, mask=g_ok, other=0.0)
        if INTERPRET:  # the interpreter's BF16 dot is wrong (dot_dtype): exact FP32 copies of the BF16 values
            x = widen_bf16(x)
            g = widen_bf16(g)
        # BF16 x BF16 products are exact in FP32 (and in TF32): only the accumulation rounds.
        acc = tl.dot(x.to(DOT), tl.trans(g.to(DOT)), acc)
    softmax_topk_store(acc, e, row, T, w_ptr, ids_ptr, cap_ptr, E, K, LOG_E, LOG_K, NORM, CAPTURE, INTERPRET)


def launch_config(T: int, H: int, E: int) -> dict:
    """The kernel's tile constexprs and launch options for a [T, H] x [E, H] problem (also what a compile check
    needs): BLOCK_T 16 until T fills ~_MIN_PROGRAMS programs, then up to 64 (gate weight re-read T / BLOCK_T
    times) within _KEYS_PER_PROGRAM; BLOCK_K the largest power of two <= 256 dividing H within _STAGE_BYTES;
    16 keys per thread for the top-k (4 warps at BLOCK_T 16, E 128)."""
    log_e = max(4, (E - 1).bit_length())  # tl.dot needs N >= 16: E = 12 computes 16 columns, 4 of them -inf
    ep = 2 ** log_e
    block_t = 16
    while block_t < 64 and T >= 2 * block_t * _MIN_PROGRAMS and 2 * block_t * ep <= _KEYS_PER_PROGRAM:
        block_t *= 2
    block_k = 16
    while block_k < 256 and H % (2 * block_k) == 0 and 2 * block_k * ep * 2 <= _STAGE_BYTES:
        block_k *= 2
    return dict(LOG_E=log_e, BLOCK_T=block_t, BLOCK_K=block_k, num_warps=max(4, min(16, block_t * ep // 512)),
                num_stages=4)


def router_gate_topk(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool, *,
                     weights_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                     capture_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int64) of the router of `hidden` [T, H] with `gate_weight`
    [E, H]: router_topk(hidden @ gate_weight.T) with FP32 logits (module docstring). `weights_out` and `ids_out`
    are allocated when None; `capture_out` [T, k] (uint8, int16 or int32, e.g. ExpertCapture.ids[layer])
    receives the ids too when given."""
    if not isinstance(hidden, torch.Tensor) or hidden.dtype != torch.bfloat16:
        raise TypeError(f"hidden must be a bfloat16 tensor, got {getattr(hidden, 'dtype', type(hidden).__name__)}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    T, H = hidden.shape
    if H < 16 or H % 16:
        raise ValueError(f"hidden: H must be a positive multiple of 16, got shape {tuple(hidden.shape)}")
    check_tensor("hidden", hidden, torch.bfloat16, (T, H), hidden.device)
    if hidden.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"hidden is on {hidden.device}: the kernel needs CUDA tensors (or Triton's interpreter)")
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dtype != torch.bfloat16:
        raise TypeError(f"gate_weight must be a bfloat16 tensor, got "
                        f"{getattr(gate_weight, 'dtype', type(gate_weight).__name__)}")
    if gate_weight.dim() != 2 or gate_weight.shape[1] != H:
        raise ValueError(f"gate_weight must be [E, H={H}] (hidden's H), got shape {tuple(gate_weight.shape)}")
    E = gate_weight.shape[0]
    if not 1 <= E <= MAX_E:
        raise ValueError(f"gate_weight: E must be in 1..{MAX_E}, got shape {tuple(gate_weight.shape)}")
    check_tensor("gate_weight", gate_weight, torch.bfloat16, (E, H), hidden.device)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in 1..E={E}, got {top_k!r}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=hidden.device) if weights_out is None else weights_out
    ids = torch.empty(T, top_k, dtype=torch.int64, device=hidden.device) if ids_out is None else ids_out
    check_tensor("weights_out", weights, torch.float32, (T, top_k), hidden.device)
    check_tensor("ids_out", ids, torch.int64, (T, top_k), hidden.device)
    check_capture_out(capture_out, T, top_k, E, hidden.device)
    interpret = triton.knobs.runtime.interpret
    if T > 0:
        cfg = launch_config(T, H, E)
        _router_gate_topk_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            hidden, gate_weight, weights, ids, ids if capture_out is None else capture_out, T, H=H, E=E, K=top_k,
            LOG_K=(top_k - 1).bit_length(), NORM=bool(norm_topk_prob), CAPTURE=capture_out is not None,
            DOT=dot_dtype(), INTERPRET=interpret, **cfg)
    return weights, ids


def router_gate_topk_reference(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
                               norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch: FP32 logits from the BF16 operands, then router_topk_reference. (The model's path
    rounds the logits to BF16 first: route(F.linear(hidden, gate_weight)).)"""
    return router_topk_reference(hidden.float() @ gate_weight.float().T, top_k, norm_topk_prob)
