"""The Qwen3-MoE architecture's shape, under Hugging Face's config names, and the presets we ship.

A frozen dataclass rather than transformers' config object: the model, the checkpoint loader and
the benchmarks need only these numbers, and transformers is not needed at run time. Reading a
config.json checks every field we rely on and rejects what this implementation does not model
(dense MLP layers, sliding windows, RoPE scaling), naming the field, instead of silently computing
a different function.
"""

from dataclasses import asdict, dataclass, field, replace

QWEN3_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    norm_topk_prob: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = field(default=())

    def __post_init__(self):
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok {self.num_experts_per_tok} > "
                             f"num_experts {self.num_experts}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model config: num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim {self.head_dim} must be even for RoPE")

    def to_hf_dict(self) -> dict:
        """config.json contents that transformers reads back as the same architecture."""
        d = asdict(self)
        eos = d.pop("eos_token_id")
        d.update(
            architectures=list(QWEN3_MOE_ARCHITECTURES), model_type="qwen3_moe", hidden_act="silu",
            intermediate_size=self.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
            attention_bias=False, use_sliding_window=False, torch_dtype="bfloat16",
            eos_token_id=(eos[0] if len(eos) == 1 else list(eos)) if eos else None,
        )
        return d


def _tiny() -> ModelArgs:
    # Small enough that a few hundred tokens decode in seconds on 2 CPU cores (a 512-token context keeps the
    # reference engine's full-cache attention cheap); H and I are multiples
    # of 32 (the MXFP8 block) but I is not of 64, and E is not a power of two, so every path sees
    # irregular shapes even in the default job.
    return ModelArgs(hidden_size=128, moe_intermediate_size=96, num_experts=12, num_experts_per_tok=4,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     vocab_size=512, max_position_embeddings=512, eos_token_id=(1,))


PRESETS = {
    "tiny": _tiny(),
    "qwen3_30b_a3b": ModelArgs(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               vocab_size=151936, max_position_embeddings=40960, eos_token_id=(151645, 151643)),
    "qwen3_235b_a22b": ModelArgs(hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                                 num_experts_per_tok=8, num_hidden_layers=94, num_attention_heads=64,
                                 num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, eos_token_id=(151645, 151643)),
}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only default RoPE)")
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json: rope_theta is missing")
    return float(theta)


def from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a Hugging Face config dict; every error names the field and the file."""
    arch = cfg.get("architectures") or []
    if cfg.get("model_type") != "qwen3_moe" and not set(arch) & set(QWEN3_MOE_ARCHITECTURES):
        raise ValueError(f"{source}: architectures={arch} model_type={cfg.get('model_type')!r} is not "
                         f"Qwen3-MoE ({QWEN3_MOE_ARCHITECTURES[0]}, model_type 'qwen3_moe')")
    if cfg.get("mlp_only_layers"):
        raise ValueError(f"{source}: mlp_only_layers={cfg['mlp_only_layers']} (dense MLP layers) is not supported")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{source}: decoder_sparse_step={cfg['decoder_sparse_step']} is not supported (must be 1)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported")
    if cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
    if "num_experts" not in cfg and "num_local_experts" in cfg:  # transformers 5 writes this name
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
    required = ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    for name in required:
        if name not in cfg:
            raise ValueError(f"{source}: required field {name!r} is missing")
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    try:
        return ModelArgs(
            **{name: cfg[name] for name in required}, head_dim=head_dim,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), rope_theta=_rope_theta(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_id=eos,
        )
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
