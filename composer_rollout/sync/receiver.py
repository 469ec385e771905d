"""SyncReceiver: a worker's side of the two-phase weight-sync protocol, with the transports' receiving ends.

    begin(session, version)  ->  stage_*(session, bucket) ...  ->  prepare(session)  ->  take(session) -> apply
                                                                          abort(session) / a newer begin / timeout

One session is open at a time. `begin` checks the version against the one being served (versions only increase)
and opens a WeightUpdate; each `stage_*` call unpacks one bucket into it; `prepare` validates the whole update and
is the worker's vote; `take` hands the prepared update to the engine loop, which swaps it in between two steps.
Any failure discards the session's staged buffers at once, and so does a newer `begin` (a trainer that died and
came back) or `timeout_s` without a call (a trainer that died for good): the engine never saw any of it. The worker
actor (composer_rollout.rollout.worker) forwards Ray calls here; nothing here imports Ray.
"""

import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from composer_rollout.model.weight_names import WeightNames
from composer_rollout.sync.buckets import TensorMeta, unpack
from composer_rollout.sync.channels import GroupSpec, SharedBucket, SyncGroup, as_views, local_device, open_bucket
from composer_rollout.sync.update import WeightSyncError, WeightUpdate

TRANSPORTS = ("object_store", "collective", "cuda_ipc")


@dataclass
class _Session:
    id: str
    update: WeightUpdate
    touched: float
    prepared: bool = False
    error: str | None = None
    mapped: list = field(default_factory=list)  # CUDA IPC storages, kept until the staging stream is done with them


class SyncReceiver:
    def __init__(self, engine, timeout_s: float = 300.0):
        self.engine, self.timeout_s = engine, timeout_s
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._group: SyncGroup | None = None
        self._recv: torch.Tensor | None = None
        self._ipc_device: int | None = None
        # (model, its WeightNames), kept across syncs: the names remember every tensor name they mapped, and a trainer
        # pushes the same ones each time (18.9k for Qwen3-30B-A3B in the Hub layout)
        self._names: tuple[object, WeightNames] | None = None
        self._failed: tuple[str, str] | None = None  # (session, its first error): later calls repeat the cause
        self.discarded = 0  # sessions dropped without being applied (failed, aborted, replaced, expired)

    def begin(self, session_id: str, version: int, *, partial: bool = False, base_version: int | None = None,
              transport: str = "object_store", group: GroupSpec | None = None, join: bool = False,
              gpu_uuid: str | None = None) -> dict:
        with self._lock:
            self._drop()
        current = self.engine.weight_version
        if transport not in TRANSPORTS:
            raise WeightSyncError(f"sync transport {transport!r} is unknown; choose one of {TRANSPORTS}")
        if partial and base_version is not None and base_version != current:
            raise WeightSyncError(f"a partial update applies on top of version {base_version}, but this worker serves "
                                  f"version {current} (restarted?); push a full update")
        if transport == "cuda_ipc":
            device = self.engine.device
            if device.type != "cuda":
                raise WeightSyncError(f"sync transport cuda_ipc needs the engine on a GPU; it is on {device}")
            index = local_device(gpu_uuid)
            if index != (device.index if device.index is not None else torch.cuda.current_device()):
                raise WeightSyncError(f"cuda_ipc: the trainer's GPU is this process's cuda:{index}, the engine runs "
                                      f"on {device}; cuda_ipc needs both on one GPU")
            self._ipc_device = index
        if transport == "collective":
            if group is None:
                raise WeightSyncError("sync transport collective: begin needs the group to join")
            if self._group is None or self._group.spec != group:
                if not join:
                    raise WeightSyncError("this worker is not in this sync group (restarted?); the trainer rebuilds it")
                self.close_group()
                self._group = SyncGroup(group, device=self.engine.device)  # waits for every rank
        model = self.engine.model
        if self._names is None or self._names[0] is not model:
            self._names = (model, WeightNames.of(model))
        names = self._names[1]
        update = WeightUpdate(model, version, current, partial=partial, names=names)
        with self._lock:
            self._drop()
            self._session = _Session(session_id, update, time.monotonic())
        # The expert geometry lets the trainer pack per-expert tensors into fused ones (composer_rollout.sync.packing).
        return {"weight_version": current, "experts": (names.num_layers, names.E, names.I, names.H)}

    def _active(self, session_id: str) -> _Session:
        with self._lock:
            s = self._session
            if self._failed is not None and self._failed[0] == session_id:
                raise WeightSyncError(self._failed[1])
            if s is None or s.id != session_id:
                raise WeightSyncError(f"sync session {session_id} is not open on this worker: it was replaced by a "
                                      f"newer push, aborted, or expired after {self.timeout_s}s without a call")
            s.touched = time.monotonic()
            return s

    def _stage(self, session_id: str, items) -> int:
        s = self._active(session_id)
        n = 0
        try:
            n = s.update.add_many(items)  # the bucket at once: its experts are quantized in a launch or a few
            s.update.fence()
        except Exception as e:
            self._fail(s, e)
        return n

    def _fail(self, s: _Session, e: Exception):
        """Drop the session; raise its first error (a bucket staged concurrently fails as a consequence: it must not
        hide the cause)."""
        with self._lock:
            if s.error is None:
                s.error = str(e)
                self._failed = (s.id, s.error)
            if self._session is s:
                self._drop()
        raise WeightSyncError(s.error) from e

    def stage_packed(self, session_id: str, metas: list[TensorMeta], array: np.ndarray) -> int:
        """object_store: one bucket as a uint8 array (Ray hands it over zero-copy, read-only, from shared memory)."""
        with warnings.catch_warnings():  # read-only: we only read it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(array)
        if self.engine.device.type == "cuda":
            flat = flat.to(self.engine.device)  # one host-to-device copy per bucket, then views
        return self._stage(session_id, unpack(flat, metas))

    def stage_broadcast(self, session_id: str, metas: list[TensorMeta], nbytes: int) -> int:
        """collective: join the trainer's broadcast of one bucket into the preallocated buffer, then stage it.
        The broadcast comes first whatever the session's state: the trainer and the other workers wait on it."""
        if self._group is None:
            raise WeightSyncError("sync transport collective: this worker has not joined a sync group (restarted?)")
        if self._recv is None or self._recv.numel() < nbytes:
            self._recv = torch.empty(nbytes, dtype=torch.uint8, device=self._group.device)
        buf = self._recv[:nbytes]
        self._group.broadcast(buf)
        flat = buf.to(self.engine.device) if buf.device != self.engine.device else buf
        return self._stage(session_id, unpack(flat, metas))

    def probe(self, nbytes: int, count: int) -> None:
        """collective: join `count` raw broadcasts of `nbytes` into the receive buffer, staging nothing: the trainer
        times the wire alone (WeightSync.broadcast_ceiling)."""
        if self._group is None:
            raise WeightSyncError("sync transport collective: this worker has not joined a sync group (restarted?)")
        self.reserve(nbytes)
        for _ in range(count):
            self._group.broadcast(self._recv[:nbytes])

    def reserve(self, nbytes: int) -> None:
        """collective: preallocate the receive buffer (the trainer announces its bucket size at begin)."""
        if self._group is not None and (self._recv is None or self._recv.numel() < nbytes):
            self._recv = torch.empty(nbytes, dtype=torch.uint8, device=self._group.device)

    def stage_ipc(self, session_id: str, bucket: SharedBucket) -> int:
        """cuda_ipc: one bucket as the trainer's shared storages and its tensors' views of them; maps each storage
        once and stages the views."""
        s = self._active(session_id)
        if self._ipc_device is None:
            raise WeightSyncError(f"sync session {session_id} did not begin with transport cuda_ipc")
        with torch.cuda.device(self._ipc_device):
            try:
                storages = open_bucket(bucket, self._ipc_device)
            except ValueError as e:
                self._fail(s, e)
            s.mapped += storages
            return self._stage(session_id, as_views(storages, bucket.views))

    def prepare(self, session_id: str) -> dict:
        """Validate the whole update (this worker's vote); returns {"version", "tensors", "bytes"}."""
        s = self._active(session_id)
        try:
            info = s.update.finalize()
        except Exception as e:
            self._fail(s, e)
        s.mapped.clear()  # finalize waited for the staging stream: the trainer's memory is no longer read
        s.prepared = True
        return info

    def take(self, session_id: str) -> WeightUpdate:
        """The prepared update, for the engine loop to apply; the session closes."""
        s = self._active(session_id)
        if not s.prepared:
            raise WeightSyncError(f"sync session {session_id} was not prepared; commit follows prepare")
        with self._lock:
            self._session = None
        return s.update

    def abort(self, session_id: str | None = None) -> bool:
        with self._lock:
            if self._session is not None and session_id in (None, self._session.id):
                self._drop()
                return True
        return False

    def expire(self) -> bool:
        """Drop a session left without a call for timeout_s (its trainer died); the engine loop calls this."""
        with self._lock:
            s = self._session
            if s is not None and time.monotonic() - s.touched > self.timeout_s:
                self._drop()
                return True
        return False

    def _drop(self) -> None:  # under self._lock
        s, self._session = self._session, None
        if s is not None:
            s.update.discard()
            s.mapped.clear()
            self.discarded += 1

    def status(self) -> dict:
        with self._lock:
            s = self._session
            return {"session": s.id if s else None, "prepared": bool(s and s.prepared),
                    "staged_tensors": s.update.num_tensors if s else 0, "discarded": self.discarded,
                    "weight_version": self.engine.weight_version}

    def close_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._recv = None, None
