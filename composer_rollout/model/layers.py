"""Dense building blocks of a Qwen3-MoE layer: RMSNorm, RoPE, GQA attention over a slot KV cache.

They follow Hugging Face's Qwen3-MoE numerics step by step (normalise in FP32 and cast back before
the weight, RoPE tables computed in FP32 and cast to the activation dtype) so that an FP32 model
matches transformers to rounding, and a BF16 one differs from it only where we choose to
(routing weights and the MoE sum stay FP32).

Attention reads and writes a KV cache laid out per sequence slot, [slots, max_len, kv_heads,
head_dim] per layer. One code path serves prefill (one slot, S new tokens), decode (B slots, one
token each) and teacher-forced scoring: new keys go to (slot, position), and every query attends to
all cached positions <= its own. Shapes depend only on (B, S) and the cache size, never on the
lengths inside the batch, so a decode step can be captured in a CUDA graph per batch bucket.

Two backends ("dense", as they cover a layer's ops outside the MoE experts): "torch", the reference ops (math
SDPA over the whole slot, masked: every row reads max_len keys), and "triton", fused kernels where a decode step
would otherwise run dozens of tiny launches per layer: RMSNorm with its residual add (kernels/rmsnorm.py, or inside
the qkv projection's launch at a decode step's few tokens: Attention.add_norm_forward), q/k-norm + RoPE + the cache
write (kernels/qk_norm_rope.py, computed in FP32 and rounded once; at S = 1 inside the decode attention launch),
and attention (kernels/prefill_attention.py for S > 1, kernels/decode_attention.py for S = 1: each row reads only
its own keys, FP32 softmax and accumulation), and the projections of a decode step's few tokens
(kernels/skinny_linear.py, see fused_linear).

The residual stream is passed as (block output, residual before it) so that the add and the next norm are one
launch; the torch backend computes the sums in BF16 as Hugging Face does, the triton one keeps the stream in FP32
and adds attention's output to it unrounded (o_proj's FP32 accumulator).
q_proj, k_proj and v_proj are row views of one [q + k + v rows, H] weight, so the triton backend projects in one
GEMM (and the torch one in three, as Hugging Face does): whatever writes those weights must write into them
(copy_), never rebind them.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import decode_attention, prefill_attention, qk_norm_rope, rms_norm, skinny_linear
from kernels.decode_attention import NewKV, new_kv_pays
from kernels.skinny_gemm import gemm_counter, skinny_gemm
from kernels.skinny_gemm import max_tokens as gemm_max_tokens
from kernels.skinny_linear import add_norm_linear
from kernels.skinny_linear import max_tokens as skinny_max_tokens

DENSE_BACKENDS = ("torch", "triton")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool):
        """(norm(x + residual), x + residual), or (norm(x), x) when residual is None. fused: one Triton launch, and
        the residual stream is kept in FP32 (it starts as the widened embedding), so it is not rounded to BF16 twice
        per layer (its effect against an FP32 model: docs/perf.md). The torch path keeps Hugging Face's BF16 stream."""
        if not fused:
            x = x if residual is None else x + residual
            return self(x), x
        shape = x.shape
        flat = None if residual is None else residual.view(-1, shape[-1])
        normed, summed = rms_norm(x.view(-1, shape[-1]), self.weight, self.eps, flat)
        return normed.view(shape), (x.float() if summed is None else summed.view(shape))


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D] rotated by positions [B, S] (half-split layout, as in Hugging Face)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, :, None, :], emb.sin().to(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values for every layer, preallocated: [layers, slots, max_len, kv_heads, head_dim] each.

    The last slot is scratch: padding rows of a decode batch and teacher-forced scoring write there,
    so they never touch a live sequence's cache.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_slots + 1, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len
        self.scratch_slot = num_slots

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_prefix(self, src_slot: int, dst_slots: list[int], length: int) -> None:
        """Share a prompt's KV with other samples of its group: one prefill, n sequences."""
        if dst_slots:
            idx = torch.tensor(dst_slots, device=self.k.device)
            self.k[:, idx, :length] = self.k[:, src_slot : src_slot + 1, :length]
            self.v[:, idx, :length] = self.v[:, src_slot : src_slot + 1, :length]


@dataclass(frozen=True)
class Packed:
    """Several sequences back to back in the one row of a forward (input_ids [1, T]), as the engine prefills whole
    prompts without padding rows: sequence i is tokens starts[i] .. starts[i + 1] - 1 and uses cache slot slots[i]
    of the forward's `slots`. Attention is the only op that needs to know: everything else is per token."""

    starts: tuple[int, ...]  # host copy: the torch path's split, the grid's size
    seq_starts: torch.Tensor  # int32 [sequences + 1] on the device
    token_slots: torch.Tensor  # [T] each token's slot, where its key and value are cached

    @classmethod
    def of(cls, lengths: list[int], slots: list[int], device) -> "Packed":
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        token_slots = [s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
        return cls(tuple(starts), torch.tensor(starts, dtype=torch.int32, device=device),
                   torch.tensor(token_slots, device=device))

    @property
    def longest(self) -> int:
        return max(b - a for a, b in pairwise(self.starts))


class Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, eps, dtype, device, backend: str = "torch"):
        super().__init__()
        check_dense(backend, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend

        def linear(out_features, in_features):
            return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device).requires_grad_(False)

        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.zeros(q_rows + 2 * kv_rows, hidden_size, dtype=dtype, device=device)
        # A buffer, not a parameter: the three views below are the parameters (the Hugging Face names), so the
        # weights are counted and named once.
        self.register_buffer("qkv_weight", qkv, persistent=False)
        self.q_proj, self.k_proj, self.v_proj = (_linear_view(qkv[a:b]) for a, b in (
            (0, q_rows), (q_rows, q_rows + kv_rows), (q_rows + kv_rows, q_rows + 2 * kv_rows)))
        self.o_proj = linear(hidden_size, num_heads * head_dim)
        self.q_norm = RMSNorm(head_dim, eps, dtype, device)
        self.k_norm = RMSNorm(head_dim, eps, dtype, device)
        # skinny_gemm's split-K arrival counters, shared by qkv and o_proj (launched one after the other).
        self.register_buffer("gemm_counter", gemm_counter(max(q_rows + 2 * kv_rows, hidden_size), device),
                             persistent=False)

    def forward(self, x, positions, slots, layer: int, cache: KVCache, inv_freq, packed: Packed | None = None):
        """x [B, S, H], positions [B, S], slots [B] -> [B, S, H]; writes this layer's cache rows. With `packed`, x is
        one row of several sequences and slots has one per sequence."""
        B, S, _ = x.shape
        if self.backend == "triton":
            return self._fused(x, positions, slots, layer, cache, inv_freq, packed)
        if packed is not None:  # the reference: one sequence at a time (forward, not __call__: this module's hooks
            # see the packed call once, not once more per sequence)
            bounds = list(pairwise(packed.starts))
            return torch.cat([self.forward(x[:, a:b], positions[:, a:b], slots[i:i + 1], layer, cache, inv_freq)
                              for i, (a, b) in enumerate(bounds)], dim=1)
        q = self.q_norm(self.q_proj(x).view(B, S, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        cache.k[layer, slots[:, None], positions] = k
        cache.v[layer, slots[:, None], positions] = v
        keys = cache.k[layer, slots].transpose(1, 2)  # [B, kv_heads, max_len, D]
        values = cache.v[layer, slots].transpose(1, 2)
        key_pos = torch.arange(cache.max_len, device=x.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, max_len]
        # The math backend, pinned: on the H200 (torch 2.11) SDPA otherwise picks cuDNN for BF16 with a mask,
        # whose logits came out 7x further from FP32 (9.3e-2 against 1.3e-2 relative; docs/perf.md). This is the
        # reference attention; the fast one is a Triton kernel of its own (issue 6).
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def _fused(self, x, positions, slots, layer, cache, inv_freq, packed=None):
        # The launchers refuse what they cannot run (FP32 activations, CPU tensors outside Triton's interpreter).
        qkv = fused_linear(x, self.qkv_weight, counter=self.gemm_counter)
        return self._attend(qkv, positions, slots, layer, cache, inv_freq, packed)

    def add_norm_forward(self, x, residual, norm: "RMSNorm", positions, slots, layer, cache, inv_freq,
                         packed: Packed | None = None):
        """(attention of norm(x + residual), x + residual) on the triton backend, the sum in FP32 (residual None at
        layer 0: the stream starts as the widened embedding); at a decode step's few tokens the add and the norm run
        inside the qkv projection's launch (add_norm_linear)."""
        B, S, H = x.shape
        if residual is None or B * S > skinny_max_tokens(self.qkv_weight.shape[0]):
            h, residual = norm.add_norm(x, residual, fused=True)
            return self._fused(h, positions, slots, layer, cache, inv_freq, packed), residual
        qkv, _, summed = add_norm_linear(x.view(B * S, H), residual.view(B * S, H), norm.weight, norm.eps,
                                         self.qkv_weight)
        return self._attend(qkv, positions, slots, layer, cache, inv_freq, packed), summed.view(B, S, H)

    def _attend(self, qkv, positions, slots, layer, cache, inv_freq, packed: Packed | None = None):
        """q/k-norm + RoPE + the cache write, attention and o_proj, from the projected qkv [B, S, q + k + v rows]. The
        output is FP32: the next add + norm takes it into the FP32 stream unrounded (its BF16 rounding was the
        second largest term of the decode path's distance from FP32: docs/perf.md, the accuracy attribution)."""
        B, S = positions.shape
        qkv = qkv.view(B, S, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)  # strided views
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        if packed is not None:  # each token is a row of its own for the cache write: its slot is per token
            T, Hq, Hkv = S, self.num_heads, self.num_kv_heads
            q = qk_norm_rope(q.view(T, 1, Hq, -1), k.view(T, 1, Hkv, -1), v.view(T, 1, Hkv, -1), self.q_norm.weight,
                             self.k_norm.weight, self.q_norm.eps, inv_freq, positions.view(T, 1), packed.token_slots,
                             k_cache, v_cache)
            out = prefill_attention(q.view(1, T, Hq, -1), k_cache, v_cache, slots, positions,
                                    packed=(packed.seq_starts, packed.longest))
            return fused_linear(out.view(1, T, Hq * self.head_dim), self.o_proj.weight, torch.float32,
                                self.gemm_counter)
        # A decode step's attention kernel can normalise, rotate and cache q and k itself (one launch fewer) where
        # that pays for the batch's grid.
        if S == 1 and new_kv_pays(B, self.num_kv_heads, k_cache.shape[1]):
            out = decode_attention(q, k_cache, v_cache, slots, positions, new_kv=NewKV(
                k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, inv_freq))
        else:
            q = qk_norm_rope(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, inv_freq, positions,
                             slots, k_cache, v_cache)
            out = (decode_attention if S == 1 else prefill_attention)(q, k_cache, v_cache, slots, positions)
        return fused_linear(out.view(B, S, self.num_heads * self.head_dim), self.o_proj.weight, torch.float32,
                            self.gemm_counter)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 counter: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T on the Triton dense path. A decode step's few tokens (up to
    kernels.skinny_linear.max_tokens: 2 for the attention projections, 8 for the router gate) take skinny_linear,
    one launch of CUDA-core FMAs that beat cuBLAS there on the H200 (cuBLAS: two launches for o_proj, ~2 CTAs for
    the gate); up to kernels.skinny_gemm.max_tokens, skinny_gemm, the same weight stream on tensor cores (with
    `counter`, the call site's zeroed int32 buffer, it may split K inside its one launch). More tokens take
    cuBLAS; out_dtype=float32 (the router's logits, o_proj's output) is its FP32 accumulator (the BF16 x BF16 ->
    FP32 GEMM; on the CPU, which lacks it, FP32 copies multiplied: the same values)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= skinny_max_tokens(weight.shape[0]):
        y = skinny_linear(flat, weight, out_dtype=out_dtype)
    elif flat.shape[0] <= gemm_max_tokens(weight.shape[0]) and flat.dtype == torch.bfloat16:
        y = skinny_gemm(flat, weight, out_dtype=out_dtype, counter=counter)
    elif out_dtype == torch.float32 and flat.is_cuda:
        y = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    elif out_dtype == torch.float32:
        y = F.linear(flat.float(), weight.float())
    else:
        y = F.linear(flat, weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def _linear_view(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear whose weight is `weight` itself (a view), not a copy."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def check_dense(backend: str, dtype: torch.dtype) -> None:
    """The Triton kernels take BF16 activations only, so an FP32 model (reference runs) is refused here, before
    any work, rather than deep inside the first forward."""
    if backend not in DENSE_BACKENDS:
        raise ValueError(f"dense backend {backend!r} is unknown; choose one of {DENSE_BACKENDS}")
    if backend == "triton" and dtype != torch.bfloat16:
        raise ValueError(f"dense backend 'triton' needs a bfloat16 model, got dtype {dtype}; use dense='torch'")
