"""Attention over the slot KV cache: the op the Triton attention kernels compute, its argument checks and its
torch reference (shared by the kernels' tests, the engine's reference path and the benchmarks).

Shapes: B rows (sequences), S query tokens per row, Hq query heads, Hkv key/value heads (Hq a multiple of Hkv:
query head h reads kv head h // (Hq // Hkv)), D head dim, N cache slots, L cache positions per slot.
Layout: q [B, S, Hq, D] bf16 (after RoPE); one layer's cache k, v [N, L, Hkv, D] bf16, contiguous; slots [B] and
positions [B, S] int32 or int64. Query (b, s) attends to the keys of slot slots[b] at positions 0..positions[b, s]
(inclusive): that one rule serves prefill (S new tokens), chunked prefill (S tokens after a cached prefix), decode
(S = 1) and teacher-forced scoring. The new tokens' keys are in the cache already (written before the call).
out [B, S, Hq, D] bf16.
"""

from itertools import pairwise

import torch
import triton

from kernels.moe_reference import check_tensor


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         positions: torch.Tensor, q_rows_strided: bool = False, packed: bool = False) -> None:
    """Dtypes, shapes, strides and devices of a cache-attention call; each error names the argument.
    q_rows_strided: q may be a view of a wider buffer (e.g. the fused qkv projection's output): each row's heads
    contiguous, any stride between rows. packed: q is one row of several sequences, slots one per sequence."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S, Hq, D], got shape {tuple(q.shape)}")
    B, S, Hq, D = q.shape
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [N, L, Hkv, D], got shape {tuple(k_cache.shape)}")
    N, L, Hkv, _ = k_cache.shape
    if q.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"q is on {q.device}: the attention kernels need CUDA tensors (or Triton's interpreter)")
    if q_rows_strided:
        if q.dtype != torch.bfloat16 or q.stride()[2:] != (D, 1) or q.stride(1) != Hq * D and S > 1:
            raise ValueError(f"q must be a bfloat16 view with contiguous heads per row, got {q.dtype} strides "
                             f"{q.stride()}")
    else:
        check_tensor("q", q, torch.bfloat16, (B, S, Hq, D), q.device)
    check_tensor("k_cache", k_cache, torch.bfloat16, (N, L, Hkv, D), q.device)
    check_tensor("v_cache", v_cache, torch.bfloat16, (N, L, Hkv, D), q.device)
    if Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {Hkv} kv heads")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head dim {D} must be a power of two >= 16")
    if packed and B != 1:
        raise ValueError(f"packed sequences come as one row: q must be [1, T, Hq, D], got {tuple(q.shape)}")
    slot_shape = (slots.shape[0],) if packed and slots.dim() == 1 else (B,)
    for name, t, shape in (("slots", slots, slot_shape), ("positions", positions, (B, S))):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(f"{name} must be {shape} on {q.device}, got {tuple(t.shape)} on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def cache_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                              positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The op in FP32 (from the same BF16 inputs), returned in FP32: what kernels and the engine's math-SDPA path are
    measured against. Reads each row's whole slot and masks: for tests and benchmarks, not for speed."""
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    scale = D ** -0.5 if scale is None else scale
    keys = k_cache[slots.long()].float().repeat_interleave(Hq // Hkv, dim=2)  # [B, L, Hq, D]
    values = v_cache[slots.long()].float().repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bshd,blhd->bhsl", q.float(), keys) * scale
    key_pos = torch.arange(k_cache.shape[1], device=q.device)
    mask = key_pos[None, None, :] <= positions.long()[:, :, None]  # [B, S, L]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhsl,blhd->bshd", torch.softmax(scores, dim=-1), values)


def packed_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                               positions: torch.Tensor, seq_starts: torch.Tensor,
                               scale: float | None = None) -> torch.Tensor:
    """The op on packed sequences (prefill_attention's `packed`: q [1, T, Hq, D], sequence i the tokens
    seq_starts[i] .. seq_starts[i + 1] - 1 on slot slots[i], seq_starts ending at T), one sequence at a time."""
    bounds = seq_starts.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(a > b for a, b in pairwise(bounds)):
        raise ValueError(f"seq_starts {bounds} must rise from 0 to T = {q.shape[1]}")
    return torch.cat([cache_attention_reference(q[:, a:b], k_cache, v_cache, slots[i:i + 1], positions[:, a:b], scale)
                      for i, (a, b) in enumerate(pairwise(bounds))], dim=1)
