"""Router top-k: softmax over the experts, the k largest probabilities, optional renormalisation, in one launch
(torch spends ~4 kernels on it: softmax, topk, sum, divide).

Shapes: T tokens, E experts (up to 512), k = top_k <= E. Layout: logits [T, E] bf16 or fp32 row-major (the router
gate's output) -> weights [T, k] fp32, ids [T, k] int64 (what the MoE kernels take, int32 or int64).
Numerics, those of `route` (composer_rollout.model.moe) and router_topk_reference below:
    p = softmax(fp32(logits)) = exp(l - max) / sum(exp(l - max))   (IEEE division, as torch's softmax)
    the k largest p in descending order; if norm_topk_prob: w = p / sum of the k p (IEEE division)
Ties (equal p, e.g. equal logits or exp underflowing to 0) go to the lower expert index; torch.topk leaves the
order of ties unspecified, so only tie-free rows are compared id for id against the reference. The sums' order
and exp (libdevice expf on the GPU, ~2 ulp) differ from torch's: weights agree to ~1e-7 relative, and the ids
differ only where two probabilities are within that of each other. NaN logits give unspecified ids.

Top-k: each probability (>= 0, so its FP32 bits order like its value) is packed with its index e into one int64
key, bits << log2(EP) | (EP - 1 - e) (EP = next_power_of_2(E)): keys are distinct, and a larger key is a larger p
or, among equal p, a lower index. A bitonic top-k (tl.topk's algorithm: sort runs of k, then log2(E/k) times keep
the larger of paired runs and re-merge) yields the k keys in order. For E = 128, k = 8 on one warp (4 keys per
thread) that is 22 dependent compare-exchange layers, 9 of them across lanes (a shuffle), where k rounds of
argmax-and-mask would chain 56 reduction levels, 40 across lanes. One warp per token (4 per program), so no
reduction crosses warps; only the [4, k] results go through shared memory, to be stored coalesced.
Bytes: T * E * (2 or 4) read, T * k * 12 written (+ T * k * 1, 2 or 4 with a capture buffer).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import pdl_launch
from kernels.rmsnorm import widen_bf16

CAPTURE_DTYPES = (torch.uint8, torch.int16, torch.int32)
MAX_E = 512  # 16 keys per thread on one warp per token: 64 registers on sm_90, no spills; more would grow that
_ROWS = 4  # tokens per program, one warp each
_INTERPRETER_ROWS = 16  # the interpreter's cost is per program and per op, nearly whatever the tile's size


@triton.jit
def _bit(n_dims: tl.constexpr, j: tl.constexpr):
    """0 / 1 along the j-th innermost axis of an n_dims hypercube, broadcastable against it."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _merge(h, stage: tl.constexpr, order: tl.constexpr):
    """Bitonic merge of runs of 2^stage along h's innermost `stage` axes: ascending runs for order 0, descending
    for 1, alternating with axis `stage` for 2. Each key's partner is the pair's sum minus itself: a built-in
    reduction (triton's tl.topk uses an xor reduction, which the interpreter runs element by element in Python).
    Keys are < 2^40, so the sum cannot overflow."""
    n_dims: tl.constexpr = len(h.shape)
    flip = _bit(n_dims, stage) if order == 2 else order
    for i in tl.static_range(stage):  # axis stage - 1 - i from the innermost: the pair's distance halves
        partner = tl.sum(h, axis=n_dims - stage + i, keep_dims=True) - h
        h = tl.where((h > partner) != (flip ^ _bit(n_dims, stage - 1 - i)), partner, h)
    return h


@triton.jit
def _topk(key, ROWS: tl.constexpr, LOG_E: tl.constexpr, LOG_K: tl.constexpr):
    """The 2^LOG_K largest of each row of key [ROWS, 2^LOG_E], descending: bitonic top-k, as tl.topk."""
    h = tl.reshape(key, [ROWS] + [2] * LOG_E)
    for i in tl.static_range(1, LOG_K + 1):  # sorted runs of 2^LOG_K, alternating direction
        h = _merge(h, i, 2 if i < LOG_E else 1)
    for i in tl.static_range(LOG_K + 1, LOG_E + 1):  # pairwise max of an ascending and a descending run: the
        h = tl.max(h, axis=len(h.shape) - 1 - LOG_K)  # pair's top 2^LOG_K, a bitonic run, merged again
        h = _merge(h, LOG_K, 2 if i < LOG_E else 1)
    return tl.reshape(h, [ROWS, 2 ** LOG_K])


@triton.jit
def _router_topk_kernel(logits_ptr, w_ptr, ids_ptr, cap_ptr, T, E: tl.constexpr, K: tl.constexpr, LOG_E: tl.constexpr,
                        LOG_K: tl.constexpr, ROWS: tl.constexpr, BF16: tl.constexpr, NORM: tl.constexpr,
                        CAPTURE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see mx_tiles.pdl_launch: the next launch may start now; no memory access before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, 2 ** LOG_E)
    # Rows past T load zeros (finite, not NaN, and never stored); padding experts become -inf (p = 0).
    raw = tl.load(logits_ptr + row.to(tl.int64)[:, None] * E + e[None, :],
                  mask=(row < T)[:, None] & (e < E)[None, :], other=0.0)
    x = widen_bf16(raw) if BF16 else raw
    softmax_topk_store(x, e, row, T, w_ptr, ids_ptr, cap_ptr, E, K, LOG_E, LOG_K, NORM, CAPTURE, INTERPRET)


@triton.jit
def softmax_topk_store(x, e, row, T, w_ptr, ids_ptr, cap_ptr, E: tl.constexpr, K: tl.constexpr,
                       LOG_E: tl.constexpr, LOG_K: tl.constexpr, NORM: tl.constexpr, CAPTURE: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """FP32 logits x [rows, 2^LOG_E] (columns >= E ignored) -> the rows' top-k weights and ids stored at row * K,
    and with CAPTURE the ids again at cap_ptr in its integer type (the routed-expert capture, check_capture_out)."""
    x = tl.where((e < E)[None, :], x, float("-inf"))
    z = x - tl.max(x, axis=1)[:, None]
    if INTERPRET:  # libdevice has no interpreter implementation; numpy's exp is as accurate
        ex = tl.exp(z)
    else:  # not tl.exp: its ex2.approx of z * log2(e) loses ~|z| * 2^-24 relative
        ex = libdevice.exp(z)
    p = tl.math.div_rn(ex, tl.sum(ex, axis=1)[:, None])
    low = 2 ** LOG_E - 1 - e  # the index part of the key: larger for a lower expert index
    key = tl.where((e < E)[None, :], (p.to(tl.int32, bitcast=True).to(tl.int64) << LOG_E) | low[None, :], -1)
    top = _topk(key, x.shape[0], LOG_E, LOG_K)  # [rows, 2^LOG_K], descending
    ids = (2 ** LOG_E - 1) - (top & (2 ** LOG_E - 1))
    w = (top >> LOG_E).to(tl.int32).to(tl.float32, bitcast=True)
    j = tl.arange(0, 2 ** LOG_K)
    if NORM:
        w = tl.math.div_rn(w, tl.sum(tl.where((j < K)[None, :], w, 0.0), axis=1)[:, None])
    offs = row.to(tl.int64)[:, None] * K + j[None, :]
    m = (row < T)[:, None] & (j < K)[None, :]
    tl.store(w_ptr + offs, w, mask=m)
    tl.store(ids_ptr + offs, ids, mask=m)
    if CAPTURE:
        tl.store(cap_ptr + offs, ids.to(cap_ptr.dtype.element_ty), mask=m)


def check_capture_out(capture_out: torch.Tensor | None, T: int, top_k: int, E: int, device: torch.device) -> None:
    """A routed-expert capture buffer [T, k] (ExpertCapture.ids[layer]): uint8 (E <= 256), int16 or int32."""
    if capture_out is None:
        return
    cap_dtype = getattr(capture_out, "dtype", None)
    if cap_dtype not in CAPTURE_DTYPES:
        raise TypeError(f"capture_out must be a uint8, int16 or int32 tensor, got "
                        f"{cap_dtype or type(capture_out).__name__}")
    if cap_dtype == torch.uint8 and E > 256:
        raise TypeError(f"capture_out: uint8 cannot hold the ids of E={E} experts (use int16)")
    check_tensor("capture_out", capture_out, cap_dtype, (T, top_k), device)


def router_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, *, weights_out: torch.Tensor | None = None,
                ids_out: torch.Tensor | None = None,
                capture_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int64) of router logits [T, E]: `route`'s result, ties to the
    lower expert index. `weights_out` and `ids_out` are allocated when None; `capture_out` [T, k] (uint8, int16
    or int32, e.g. ExpertCapture.ids[layer]) receives the ids too when given, in the same launch."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"logits must be a bfloat16 or float32 tensor, got "
                        f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= E <= MAX_E:
        raise ValueError(f"logits: E must be in 1..{MAX_E}, got shape {tuple(logits.shape)}")
    check_tensor("logits", logits, logits.dtype, (T, E), logits.device)
    if logits.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"logits is on {logits.device}: the kernel needs CUDA tensors (or Triton's interpreter)")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in 1..E={E}, got {top_k!r}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device) if weights_out is None else weights_out
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device) if ids_out is None else ids_out
    check_tensor("weights_out", weights, torch.float32, (T, top_k), logits.device)
    check_tensor("ids_out", ids, torch.int64, (T, top_k), logits.device)
    check_capture_out(capture_out, T, top_k, E, logits.device)
    interpret = triton.knobs.runtime.interpret
    rows = _INTERPRETER_ROWS if interpret else _ROWS
    if T > 0:
        capture = ids if capture_out is None else capture_out  # a placeholder pointer when there is no capture
        _router_topk_kernel[(triton.cdiv(T, rows),)](logits, weights, ids, capture, T, E=E, K=top_k,
                                                     LOG_E=(E - 1).bit_length(), LOG_K=(top_k - 1).bit_length(),
                                                     ROWS=rows, BF16=logits.dtype == torch.bfloat16,
                                                     NORM=bool(norm_topk_prob), CAPTURE=capture_out is not None,
                                                     INTERPRET=interpret, num_warps=_ROWS, **pdl_launch())
    return weights, ids


def router_topk_reference(logits: torch.Tensor, top_k: int,
                          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical definition (the model's torch path): FP32 softmax over experts, torch.topk, optional
    renormalisation -> (weights [T, k] fp32, ids [T, k] int64). Tie order is torch.topk's (unspecified)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
