"""The Qwen3-MoE policy model: its shape (args), layers, MoE block and kernel paths, and checkpoint I/O."""

from composer_rollout.model.args import PRESETS, ModelArgs, from_hf_config, preset
from composer_rollout.model.checkpoint import load_checkpoint, save_checkpoint
from composer_rollout.model.layers import KVCache, Packed
from composer_rollout.model.moe import KERNEL_PATHS, resolve_kernel_path
from composer_rollout.model.qwen3_moe import WEIGHT_DTYPES, Qwen3MoE

__all__ = [
    "KERNEL_PATHS", "PRESETS", "WEIGHT_DTYPES", "KVCache", "ModelArgs", "Packed", "Qwen3MoE",
    "from_hf_config", "load_checkpoint", "preset", "resolve_kernel_path", "save_checkpoint",
]
