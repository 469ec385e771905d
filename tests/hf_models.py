"""Random Hugging Face Qwen3-MoE models for tests: transformers builds, initialises and saves them.

Weights are redrawn with scales that give peaked next-token distributions (transformers' default
std 0.02 gives nearly uniform logits, where greedy decoding would hinge on near-ties).
"""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TINY_HF = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
               num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=97, max_position_embeddings=256, rope_theta=10000.0)


def make_hf_model(seed: int = 0, dtype=torch.float32, **overrides) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(**{**TINY_HF, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / p.shape[-1] ** 0.5)
    return model


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], device=model.device)).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by full recomputation each step: transformers' forward, none of its cache code."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]
