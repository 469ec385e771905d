"""Ray actors for the rollout job: RolloutWorker (one RolloutEngine each), RolloutPool (the driver's side), and
WeightSync (a trainer's side of weight sync into the workers).

Ray is imported only in this package (and by jobs/ and tests): the engine keeps working in-process without it.
"""

from composer_rollout.rollout.pool import NAMESPACE, RolloutPool, WorkersExhaustedError
from composer_rollout.rollout.weight_sync import SyncStats, WeightSync
from composer_rollout.rollout.worker import RolloutWorker
from composer_rollout.sync import StaleVersionError, WeightSyncError

__all__ = ["NAMESPACE", "RolloutPool", "RolloutWorker", "StaleVersionError", "SyncStats", "WeightSync",
           "WeightSyncError", "WorkersExhaustedError"]
