"""Config schemas: the one module of dataclasses that jobs register in Hydra's ConfigStore.

Values live in `conf/` groups (model/, kernel/, sampling/, engine/); these classes give them types,
so an unknown key or an enum value out of range fails in Hydra before anything runs. Entry points
turn the composed config into these frozen dataclasses once (`OmegaConf.to_object`) and pass plain
values on; nothing in the library sees OmegaConf. Enums are StrEnums, so library code compares and
passes them as plain strings.
"""

from dataclasses import dataclass, field
from enum import StrEnum

from composer_rollout.engine import RolloutEngine, SamplingParams


class KernelName(StrEnum):
    torch = "torch"
    warp_decode = "warp_decode"
    expert_centric = "expert_centric"
    auto = "auto"


class WeightDtype(StrEnum):
    bf16 = "bf16"
    mxfp8 = "mxfp8"


class Dtype(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


@dataclass(frozen=True)
class ModelConfig:
    """`path` (a Hugging Face checkpoint directory) wins over `preset` (random init with `seed`)."""

    preset: str = "tiny"
    path: str | None = None
    weight_dtype: WeightDtype = WeightDtype.bf16
    dtype: Dtype = Dtype.bfloat16
    seed: int = 0

    @property
    def source(self) -> str:
        return self.path or self.preset


@dataclass(frozen=True)
class KernelConfig:
    name: KernelName = KernelName.torch


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int | None = None
    device: str | None = None  # None: cuda when available, else cpu


DEFAULT_PROMPTS = [[3, 14, 15, 92, 65], [2, 7, 18, 28], [1, 4, 1, 4, 2, 1, 3, 5, 6], [10, 20, 30]]


@dataclass(frozen=True)
class GenerateJobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompts: list[list[int]] = field(default_factory=lambda: [list(p) for p in DEFAULT_PROMPTS])


def build_engine(model: ModelConfig, kernel: KernelConfig, engine: EngineConfig) -> RolloutEngine:
    return RolloutEngine.from_pretrained(
        model.source, kernel=kernel.name.value, weight_dtype=model.weight_dtype.value, dtype=model.dtype.value,
        device=engine.device, seed=model.seed, max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len)
