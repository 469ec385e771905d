"""Weight sync, the engine's side: staging, validation and the atomic swap (update), buckets, the collective and
CUDA IPC channels, and the worker's protocol endpoint (receiver). No Ray here: the Ray actors and the trainer's
WeightSync live in composer_rollout.rollout."""

from composer_rollout.sync.receiver import TRANSPORTS, SyncReceiver
from composer_rollout.sync.update import StaleVersionError, WeightSyncError, WeightUpdate

__all__ = ["TRANSPORTS", "StaleVersionError", "SyncReceiver", "WeightSyncError", "WeightUpdate"]
