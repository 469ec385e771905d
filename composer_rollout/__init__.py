"""composer-rollout: rollouts (token ids, logprobs, finish reasons, weight versions) from MoE policies.

The Triton kernels live in the top-level package `kernels`, a name Hugging Face's `kernels` package (which
transformers 5.25 requires) also takes; when that one comes first on the path, every later import would fail with a
puzzling "cannot import name", so the clash is named here, once, before anything else is imported.
"""

import importlib.util
from pathlib import Path

_kernels = importlib.util.find_spec("kernels")
if _kernels is None or Path(_kernels.origin or "").parent.parent != Path(__file__).resolve().parent.parent:
    raise ImportError(
        f"the 'kernels' package found at {_kernels.origin if _kernels else None} is not composer-rollout's "
        f"(expected {Path(__file__).resolve().parent.parent / 'kernels'}); Hugging Face's `kernels` package shadows "
        "it: uninstall it (pip uninstall kernels) or keep transformers below 5.25"
    )

from composer_rollout.engine import RolloutEngine, RolloutResult, SamplingParams  # noqa: E402

__all__ = ["RolloutEngine", "RolloutResult", "SamplingParams"]
