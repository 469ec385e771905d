"""Everything between the q/k/v projections and attention in one launch: per-head RMSNorm of q and k, RoPE on both,
and the new key/value rows written into one layer's slot KV cache (the ~40 small torch ops of layers.Attention).

Shapes: B rows, S tokens per row, Hq query heads, Hkv kv heads, D head dim (a power of two), N cache slots, L
positions per slot.
Layout: q [B, S, Hq, D], k and v [B, S, Hkv, D] bf16, any strides with unit stride in D (views of one fused qkv
projection's output work); q_weight, k_weight [D] bf16; inv_freq [D/2] fp32 (layers.rope_inv_freq); positions
[B, S] and slots [B] int32/int64; one layer's k_cache, v_cache [N, L, Hkv, D] bf16, contiguous; q_out [B, S, Hq, D]
bf16, contiguous (it may be q itself when q is contiguous: a program reads its token's q before writing it).
Effect: q_out = rope(norm(q)); k_cache[slots[b], positions[b, s]] = rope(norm(k[b, s])); v_cache[...] = v[b, s].
Bytes per token: q, k, v read (Hq + 2 Hkv) * D * 2; q_out and the two cache rows written as many; weights and
inv_freq (D * 6 bytes) stay in L2.

Design.
* Grid (B * S,): one program per token takes all its Hq + 2 Hkv head rows. cos/sin depend only on the position,
  so they are computed once per token and shared by every head; every load is issued up front (no loop), so at
  B * S = 1 the single program costs about one memory round trip plus the sincos, which overlaps the loads.
  More programs per token would only repeat the sincos: the op is latency-bound until B * S is in the hundreds.
  sm_90, Hq 32, Hkv 4, D 128, 4 warps: 95 registers, no spills, every global load issued before the first use (the
  32-byte stack is libdevice's never-taken slow range reduction, for angles past 1e5 rad). 8 warps: 80 registers
  but a shared-memory layout conversion and barrier, and scalar 2-byte loads and stores.
* Head rows are loaded as their two halves [H, D/2]: rotate_half pairs element i with i + D/2, so the rotation is
  elementwise on the halves, with no gather or shuffle.
* Numerics: everything in FP32 from the BF16 inputs (the norm, the weight, the rotation with FP32 cos/sin of
  position * inv_freq, that product rounded to FP32 as torch's `positions.float() * inv_freq` is), rounded once to
  BF16 by explicit round-to-nearest-even (`to_bf16`: Triton's interpreter truncates on a plain cast, so tests on
  CPU would see a different rounding). Hugging Face rounds to BF16 after the norm, after the weight, for cos/sin
  and after each RoPE multiply and add; this is closer to the FP32 function. tl.cos/tl.sin lower to libdevice's
  precise cosf/sinf on sm_90 (not cos.approx, which loses accuracy at angles of thousands of radians).
* Positions outside [0, L) or slots outside [0, N) write no cache row (their q_out is still computed): the values
  cannot be checked without a host sync, so a bad index is the caller's bug, but it never writes outside the
  cache. Duplicate (slot, position) pairs in one call (padding rows on the scratch slot) race; one of them wins.
* Offsets are int32 within each tensor (checked) except the cache slot term, int64 (N * L * Hkv * D can pass 2^31).
  No host sync: CUDA-graph capturable.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import pdl_launch
from kernels.rmsnorm import check_eps


@triton.jit
def to_bf16(x):
    # fp32 -> bf16, round to nearest even, identical on the GPU and in the interpreter (NaNs with a quiet bit stay NaN)
    bits = x.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, D: tl.constexpr):
    """Halves x1, x2 [H, D/2] of H head rows, weight halves w1, w2 [D/2] -> RMSNorm * weight, rotated, in FP32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # 1 / D is exact (D a power of two); a `/ D` compiles to an approximate division on sm_90
    r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * (1.0 / D) + eps)[:, None]
    y1 = x1 * r * w1.to(tl.float32)[None, :]
    y2 = x2 * r * w2.to(tl.float32)[None, :]
    return y1 * cos - y2 * sin, y2 * cos + y1 * sin


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, inv_freq_ptr, pos_ptr, slots_ptr, q_out_ptr,
                         k_cache_ptr, v_cache_ptr, eps, S, N, L, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                         HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
                         D: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see mx_tiles.pdl_launch: the next launch may start now; no memory access before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    b = t // S
    s = t % S
    half = tl.arange(0, D // 2)
    hq = tl.arange(0, HQ_P)
    hk = tl.arange(0, HKV_P)
    q_ok = (hq < HQ)[:, None]
    k_ok = (hk < HKV)[:, None]
    q_row = q_ptr + b * q_sb + s * q_ss + hq[:, None] * q_sh + half[None, :]
    k_row = k_ptr + b * k_sb + s * k_ss + hk[:, None] * k_sh + half[None, :]
    d = tl.arange(0, D)
    v = tl.load(v_ptr + b * v_sb + s * v_ss + hk[:, None] * v_sh + d[None, :], mask=k_ok)
    q1 = tl.load(q_row, mask=q_ok)
    q2 = tl.load(q_row + D // 2, mask=q_ok)
    k1 = tl.load(k_row, mask=k_ok)
    k2 = tl.load(k_row + D // 2, mask=k_ok)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slots_ptr + b)
    # Loaded here, with the rest: inside _norm_rope they were issued after the norm's reduction, a second round trip.
    qw1 = tl.load(qw_ptr + half)
    qw2 = tl.load(qw_ptr + D // 2 + half)
    kw1 = tl.load(kw_ptr + half)
    kw2 = tl.load(kw_ptr + D // 2 + half)

    angle = (pos.to(tl.float32) * tl.load(inv_freq_ptr + half))[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    o1, o2 = _norm_rope(q1, q2, qw1, qw2, cos, sin, eps, D)
    q_dst = q_out_ptr + (t * HQ + hq)[:, None] * D + half[None, :]
    tl.store(q_dst, to_bf16(o1), mask=q_ok)
    tl.store(q_dst + D // 2, to_bf16(o2), mask=q_ok)

    ok = (pos >= 0) & (pos < L) & (slot >= 0) & (slot < N)
    # Clamped as well as masked: no out-of-cache address is even formed.
    row = tl.where(ok, slot, 0).to(tl.int64) * L * (HKV * D) + tl.where(ok, pos, 0).to(tl.int32) * (HKV * D)
    o1, o2 = _norm_rope(k1, k2, kw1, kw2, cos, sin, eps, D)
    k_dst = k_cache_ptr + row + hk[:, None] * D + half[None, :]
    tl.store(k_dst, to_bf16(o1), mask=k_ok & ok)
    tl.store(k_dst + D // 2, to_bf16(o2), mask=k_ok & ok)
    tl.store(v_cache_ptr + row + hk[:, None] * D + d[None, :], v, mask=k_ok & ok)


def check_head_view(name: str, x, shape: tuple, device) -> None:
    """A bf16 activation view: shape, unit stride in D, int32-addressable."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be a torch.bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last (D) dimension, got strides {x.stride()}")
    if sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) >= 2**31:
        raise ValueError(f"{name} spans 2^31 elements or more (strides {x.stride()}): offsets are int32")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, inv_freq: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, *, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """q_out = rope(rmsnorm(q) * q_weight); k_cache/v_cache[slots[b], positions[b, s]] = rope(rmsnorm(k) * k_weight),
    v (see the module docstring). Returns q_out [B, S, Hq, D] bf16 (allocated when None; may be q itself).
    Positions must be in [0, L) and slots in [0, N): rows outside write nothing, unchecked (no host sync)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, S, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    B, S, Hq, D = q.shape
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a [B, S, Hkv, D] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    Hkv = k.shape[2]
    dev = q.device
    if dev.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"q is on {dev}: qk_norm_rope needs CUDA tensors (or Triton's interpreter)")
    if D < 2 or D & (D - 1):
        raise ValueError(f"q's head dim D = {D} must be a power of two (RoPE rotates halves of D/2)")
    check_head_view("q", q, (B, S, Hq, D), dev)
    check_head_view("k", k, (B, S, Hkv, D), dev)
    check_head_view("v", v, (B, S, Hkv, D), dev)
    check_tensor("q_weight", q_weight, torch.bfloat16, (D,), dev)
    check_tensor("k_weight", k_weight, torch.bfloat16, (D,), dev)
    check_tensor("inv_freq", inv_freq, torch.float32, (D // 2,), dev)
    check_eps(eps)
    for name, idx, shape in (("positions", positions, (B, S)), ("slots", slots, (B,))):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {getattr(idx, 'dtype', type(idx))}")
        check_tensor(name, idx, idx.dtype, shape, dev)
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be one layer's [N, L, Hkv, D] tensor, got {getattr(k_cache, 'shape', None)}")
    N, L = k_cache.shape[:2]
    check_tensor("k_cache", k_cache, torch.bfloat16, (N, L, Hkv, D), dev)
    check_tensor("v_cache", v_cache, torch.bfloat16, (N, L, Hkv, D), dev)
    if L * Hkv * D >= 2**31:
        raise ValueError(f"k_cache slot of {L} x {Hkv} x {D} elements does not fit int32 offsets")
    if q_out is None:
        q_out = torch.empty((B, S, Hq, D), dtype=torch.bfloat16, device=dev)
    check_tensor("q_out", q_out, torch.bfloat16, (B, S, Hq, D), dev)
    if q_out.numel() >= 2**31:
        raise ValueError(f"q_out has {q_out.numel()} elements, 2^31 or more: offsets are int32")
    if B * S == 0:
        return q_out
    _qk_norm_rope_kernel[(B * S,)](q, k, v, q_weight, k_weight, inv_freq, positions, slots, q_out, k_cache, v_cache,
                                   float(eps), S, N, L, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                   HQ=Hq, HKV=Hkv, HQ_P=triton.next_power_of_2(Hq),
                                   HKV_P=triton.next_power_of_2(Hkv), D=D, num_warps=4, **pdl_launch())
    return q_out


def qk_norm_rope_reference(q, k, v, q_weight, k_weight, eps, inv_freq, positions):
    """The kernel's math in FP32 torch, from the same BF16 inputs: (q fp32, k fp32, v), what the kernel rounds once.
    The cache write is indexing (k_cache[slots[:, None], positions] = k), left to the caller."""
    freqs = positions.float()[..., None] * inv_freq  # [B, S, D/2]: FP32 product, as apply_rope forms it
    cos, sin = freqs.cos()[:, :, None], freqs.sin()[:, :, None]

    def norm_rope(x, w):
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v
