"""The Qwen3-MoE policy: embedding, decoder layers (attention + sparse MoE), final norm, lm_head.

The module tree mirrors Hugging Face's names (`embed_tokens`, `layers.N.self_attn.q_proj`,
`layers.N.mlp.gate`, ...), so a checkpoint or weight-sync name maps onto a tensor by one dict
lookup: `hf_dense_weights()` is that dict for everything but the experts. Experts are set a layer
at a time with `set_experts`, which quantizes to MXFP8 when the model was built with
`weight_dtype="mxfp8"`; loading and random init never hold more than one layer's dense experts
beyond what the model keeps, so the largest preset can be built on one GPU.

The model owns no sequence state: the KV cache is passed in, so one set of weights can serve
several caches and the engine decides what a slot is.
"""

import torch
import torch.nn.functional as F
from torch import nn

from composer_rollout.model.args import ModelArgs
from composer_rollout.model.layers import Attention, KVCache, Packed, RMSNorm, check_dense, rope_inv_freq
from composer_rollout.model.moe import SparseMoE, resolve_kernel_path
from kernels import MXFP8Tensor, lm_head_logits, mxfp8_quantize

WEIGHT_DTYPES = ("bf16", "mxfp8")


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype, device, moe_fn, dense: str):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.self_attn = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                   args.head_dim, args.rms_norm_eps, dtype, device, dense)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.mlp = SparseMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                             args.num_experts_per_tok, args.norm_topk_prob, dtype, device, moe_fn)
        self.set_dense(dense)

    def set_dense(self, dense: str) -> None:
        check_dense(dense, self.input_layernorm.weight.dtype)
        self.fused = dense == "triton"
        self.self_attn.backend = dense
        self.mlp.fused_router = self.fused

    def forward(self, x, residual, positions, slots, layer, cache, inv_freq, capture=None,
                packed: Packed | None = None):
        """(the previous block's output, the residual stream before it; None at layer 0) -> the same pair. The
        triton backend runs each add + norm inside the launch after it where it can (the qkv projection's, the
        router's): at batch 1 each small launch is a latency chain of a few µs (docs/perf.md)."""
        if not self.fused:
            h, residual = self.input_layernorm.add_norm(x, residual, False)
            h = self.self_attn(h, positions, slots, layer, cache, inv_freq, packed)
            h, residual = self.post_attention_layernorm.add_norm(h, residual, False)
            return self.mlp(h, layer, capture), residual
        h, residual = self.self_attn.add_norm_forward(x, residual, self.input_layernorm, positions, slots, layer,
                                                      cache, inv_freq, packed)
        return self.mlp.add_norm_forward(h, residual, self.post_attention_layernorm, layer, capture)


class Qwen3MoE(nn.Module):
    """weight_dtype: "bf16" keeps experts dense in the model dtype (FP32 when dtype is float32, for
    reference runs); "mxfp8" stores them as MXFP8Tensor. Attention, router and lm_head stay dense.
    kernel: the MoE experts' path (composer_rollout.model.moe); dense: everything else in a layer, "torch" (the
    reference ops) or "triton" (fused Triton kernels: composer_rollout.model.layers).
    """

    def __init__(self, args: ModelArgs, *, dtype=torch.bfloat16, device="cpu", weight_dtype="bf16", kernel="torch",
                 dense="torch"):
        super().__init__()
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype {weight_dtype!r} is unknown; choose one of {WEIGHT_DTYPES}")
        self.args, self.dtype, self.device = args, dtype, torch.device(device)
        self.weight_dtype, self.kernel, self.dense = weight_dtype, kernel, dense
        moe_fn = resolve_kernel_path(kernel)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(args, dtype, device, moe_fn, dense)
                                    for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(
            args.hidden_size, args.vocab_size, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.register_buffer("inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, device), persistent=False)

    def set_paths(self, *, kernel: str | None = None, dense: str | None = None) -> "Qwen3MoE":
        """Switch the MoE kernel path and/or the dense backend in place (the weights stay): for comparing paths on
        one set of weights. CUDA graphs captured before hold the old paths: capture again."""
        if dense is not None:
            check_dense(dense, self.dtype)
        moe_fn = resolve_kernel_path(kernel) if kernel is not None else None
        for layer in self.layers:
            if moe_fn is not None:
                layer.mlp.moe_fn = moe_fn
            if dense is not None:
                layer.set_dense(dense)
        self.kernel = kernel or self.kernel
        self.dense = dense or self.dense
        return self

    def hf_dense_weights(self) -> dict[str, torch.Tensor]:
        """Every non-expert tensor under its Hugging Face name (tied lm_head omitted, as HF saves it)."""
        return {("" if name.startswith("lm_head") else "model.") + name: p for name, p in self.named_parameters()}

    def set_experts(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Install one layer's experts from dense [E, 2I, H] and [E, H, I], quantizing when MXFP8."""
        mlp = self.layers[layer].mlp
        for name, w, ref in (("w13", w13, mlp.w13), ("w2", w2, mlp.w2)):
            if tuple(w.shape) != tuple(ref.shape):
                raise ValueError(f"layer {layer} experts {name}: shape {tuple(w.shape)}, expected {tuple(ref.shape)}")
        if self.weight_dtype == "mxfp8":
            mlp.w13, mlp.w2 = mxfp8_quantize(w13.to(self.device)), mxfp8_quantize(w2.to(self.device))
        else:
            mlp.w13 = w13.to(device=self.device, dtype=self.dtype).contiguous()
            mlp.w2 = w2.to(device=self.device, dtype=self.dtype).contiguous()

    def experts(self, layer: int) -> tuple[torch.Tensor | MXFP8Tensor, torch.Tensor | MXFP8Tensor]:
        mlp = self.layers[layer].mlp
        return mlp.w13, mlp.w2

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> "Qwen3MoE":
        """Seeded normal(0, std) weights and unit norms: benchmarks at real shapes without files."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.hf_dense_weights().items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32) * std)
        for i, layer in enumerate(self.layers):
            w13, w2 = (torch.randn(w.shape, generator=gen, device=self.device, dtype=self.dtype) * std
                       for w in (layer.mlp.w13, layer.mlp.w2))
            self.set_experts(i, w13, w2)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: KVCache, capture=None, packed: Packed | None = None) -> torch.Tensor:
        """input_ids, positions [B, S]; slots [B] -> final hidden states [B, S, H] (after the last norm).
        `capture` (an ExpertCapture over B * S tokens, or None) records every layer's routed expert ids. `packed`
        (composer_rollout.model.layers.Packed): one row [1, T] of several sequences, slots one per sequence."""
        if packed is not None and (input_ids.shape[0] != 1 or packed.starts[-1] != input_ids.shape[1]
                                   or len(packed.starts) != slots.shape[0] + 1):
            raise ValueError(f"packed sequences {packed.starts} must tile one row of {input_ids.shape[1]} tokens "
                             f"with one slot each, got input_ids {tuple(input_ids.shape)} and {slots.shape[0]} slots")
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, slots, i, cache, self.inv_freq, capture, packed)
        return self.norm.add_norm(x, residual, self.dense == "triton")[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FP32 logits [..., V]. The triton backend takes them from the FP32 accumulator (kernels/lm_head.py); the
        torch one widens cuBLAS's BF16 output, whose rounding (a 0.125 quantum at logits near 20) reaches the
        logprobs (Hugging Face's behaviour, kept as the reference)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.dense == "triton":
            flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
            return lm_head_logits(flat, weight).view(*hidden.shape[:-1], weight.shape[0])
        return F.linear(hidden, weight).float()

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        a = self.args
        return KVCache(a.num_hidden_layers, num_slots, max_len, a.num_key_value_heads, a.head_dim,
                       self.dtype, self.device)

    def memory_bytes(self) -> int:
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        experts = 0
        for layer in self.layers:
            for w in (layer.mlp.w13, layer.mlp.w2):
                experts += w.nbytes if isinstance(w, MXFP8Tensor) else w.numel() * w.element_size()
        return dense + experts
