"""composer-rollout: rollouts (token ids, logprobs, finish reasons, weight versions) from MoE policies."""

from composer_rollout.engine import RolloutEngine, RolloutResult, SamplingParams

__all__ = ["RolloutEngine", "RolloutResult", "SamplingParams"]
