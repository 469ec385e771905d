"""Weight-sync test sources: a "trainer" model with known weights, its tensors under Hugging Face names the way
exporters produce them (per-expert Hub names or transformers 5's fused names, BF16 or FP32), and what an engine
holding them must contain afterwards (dense tensors in the engine's dtype; experts quantized from the source as
sent when the engine keeps MXFP8)."""

import torch

from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.sync.update import live_weights
from kernels import mxfp8_quantize


def source_model(seed: int, **overrides) -> Qwen3MoE:
    """A tiny FP32 model with weights of its own (not the engines' seed-0 init), e.g. tie_word_embeddings=True."""
    model = Qwen3MoE(preset("tiny", **overrides), dtype=torch.float32).init_random(seed)
    with torch.no_grad():  # norms away from 1, so that a norm left unsynced shows
        for name, p in model.hf_dense_weights().items():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return model


def named(model: Qwen3MoE, layout: str = "hub", dtype=torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    out = [(n, p.detach().to(dtype).clone()) for n, p in model.hf_dense_weights().items()]
    I = model.args.moe_intermediate_size
    for layer in range(model.args.num_hidden_layers):
        w13, w2 = (w.to(dtype) for w in model.experts(layer))
        prefix = f"model.layers.{layer}.mlp.experts"
        if layout == "fused":
            out += [(f"{prefix}.gate_up_proj", w13.clone()), (f"{prefix}.down_proj", w2.clone())]
        else:
            for e in range(model.args.num_experts):
                out += [(f"{prefix}.{e}.gate_proj.weight", w13[e, :I].clone()),
                        (f"{prefix}.{e}.up_proj.weight", w13[e, I:].clone()),
                        (f"{prefix}.{e}.down_proj.weight", w2[e].clone())]
    return out


def fused_experts(named_tensors, layer: int, num_experts: int):
    """(w13, w2) of `layer` assembled from either layout, in the source dtype."""
    d = dict(named_tensors)
    prefix = f"model.layers.{layer}.mlp.experts"
    if f"{prefix}.gate_up_proj" in d:
        return d[f"{prefix}.gate_up_proj"], d[f"{prefix}.down_proj"]
    w13 = torch.stack([torch.cat([d[f"{prefix}.{e}.gate_proj.weight"], d[f"{prefix}.{e}.up_proj.weight"]])
                       for e in range(num_experts)])
    return w13, torch.stack([d[f"{prefix}.{e}.down_proj.weight"] for e in range(num_experts)])


def expected(named_tensors, engine_model: Qwen3MoE) -> dict[str, torch.Tensor]:
    """The engine's live_weights() after a full sync of `named_tensors`."""
    d = dict(named_tensors)
    out = {n: d[n].to(engine_model.dtype) for n in engine_model.hf_dense_weights()}
    for layer in range(engine_model.args.num_hidden_layers):
        for which, w in zip(("w13", "w2"), fused_experts(named_tensors, layer, engine_model.args.num_experts),
                            strict=True):
            key = f"model.layers.{layer}.mlp.experts.{which}"
            if engine_model.weight_dtype == "mxfp8":
                q = mxfp8_quantize(w)
                out[f"{key}.data"], out[f"{key}.scales"] = q.data.view(torch.uint8), q.scales
            else:
                out[key] = w.to(engine_model.dtype)
    return out


def assert_bitwise_equal(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(live) == sorted(want)
    for name, t in want.items():
        got = live[name].cpu()
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name  # bits


def snapshot(model: Qwen3MoE) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in live_weights(model).items()}
