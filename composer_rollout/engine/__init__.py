"""The generation engine: slots, KV cache, batched sampling; runs in-process with no Ray or Hydra."""

from composer_rollout.engine.engine import DTYPES, RolloutEngine, batch_buckets, resolve_max_model_len
from composer_rollout.engine.sampling import FINISH_REASONS, RolloutResult, SamplingParams

__all__ = ["DTYPES", "FINISH_REASONS", "RolloutEngine", "RolloutResult", "SamplingParams", "batch_buckets",
           "resolve_max_model_len"]
