"""Ray actors for the rollout job: RolloutWorker (one RolloutEngine each) and RolloutPool (the driver's side).

Ray is imported only in this package (and by jobs/ and tests): the engine keeps working in-process without it.
"""

from composer_rollout.rollout.pool import RolloutPool, WorkersExhaustedError
from composer_rollout.rollout.worker import RolloutWorker

__all__ = ["RolloutPool", "RolloutWorker", "WorkersExhaustedError"]
