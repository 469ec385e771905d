"""RolloutWorker: a Ray actor that owns one RolloutEngine and keeps it busy.

The engine's loop (add_request / step) runs on a thread of its own inside the actor, so requests from the
driver join the running batch at the next step (continuous batching across calls) instead of waiting for
the batch in flight to drain. The actor is threaded (max_concurrency > 1): `submit` and `poll` run on Ray's
call threads and meet the loop thread only at a condition variable. `poll` is a long poll: it returns as soon
as some samples finish, or empty-handed after its timeout, which lets the driver `ray.wait` on all workers at
once and notice a dead one (its poll raises RayActorError).

Weight sync (the trainer's side is composer_rollout.rollout.weight_sync): the `sync_*` calls forward to a
SyncReceiver, which stages an update beside the live weights while the loop keeps generating; `sync_commit` hands
the prepared update to the loop, which swaps it in between two engine steps in the requested mode (drain: stop
admitting and let the live sequences finish first; abort: abort them; inflight: swap at once) and wakes the caller.

The class itself is plain; RolloutPool wraps it with ray.remote and the resources of its placement-group bundle.
"""

import dataclasses
import os
import threading
import time
from collections import deque

import torch

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, SyncConfig, SyncMode, build_engine
from composer_rollout.engine import RolloutResult, SamplingParams
from composer_rollout.model.moe import tuned_table
from composer_rollout.sync import SyncReceiver, WeightSyncError, WeightUpdate
from composer_rollout.sync.channels import device_uuid
from composer_rollout.sync.update import live_weights

# One request as it crosses the Ray boundary: (request id, prompt index, prompt token ids, sampling params).
Request = tuple[str, int, list[int], SamplingParams]
SYNC_MODES = tuple(m.value for m in SyncMode)


@dataclasses.dataclass
class _Swap:
    """A prepared update waiting for the engine loop; `done` once applied (or failed, with `error`)."""

    update: WeightUpdate
    mode: str
    aborted: int = 0
    done: bool = False
    error: BaseException | None = None


class RolloutWorker:
    def __init__(self, worker_id: int, model: ModelConfig, kernel: KernelConfig, engine: EngineConfig,
                 num_threads: int | None = None, sync: SyncConfig | None = None):
        if num_threads:
            # Ray gives each worker a share of the cores; torch would otherwise start one thread per core in every
            # worker and they would fight over them.
            torch.set_num_threads(num_threads)
        self.worker_id = worker_id
        self.engine = build_engine(model, kernel, engine)
        self.sync_cfg = sync or SyncConfig()
        self._sync = SyncReceiver(self.engine, self.sync_cfg.timeout_s)
        self._swap: _Swap | None = None
        self._cv = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._outbox: list[RolloutResult] = []
        self._error: BaseException | None = None
        self._completed = self._completion_tokens = 0
        self._busy_s = 0.0
        self._started = time.perf_counter()
        threading.Thread(target=self._loop, name=f"rollout-worker-{worker_id}", daemon=True).start()

    def info(self) -> dict:
        """Ready check and identity: the driver waits on this before routing work here."""
        gpu = self.engine.device.type == "cuda"
        return {"worker_id": self.worker_id, "pid": os.getpid(), "device": str(self.engine.device),
                "gpu_uuid": device_uuid(self.engine.device) if gpu else None,
                "max_num_seqs": self.engine.max_num_seqs, "weight_version": self.engine.weight_version,
                "graph_capture_s": self.engine.stats.graph_capture_s,
                "moe_tiles": tuned_table(self.engine.model.kernel, self.engine.device),
                "sync": dataclasses.asdict(self.sync_cfg)}

    def submit(self, requests: list[Request]) -> int:
        """Queue prompts; they are admitted at the loop's next step. Returns the queue length."""
        with self._cv:
            self._inbox.extend(requests)
            self._cv.notify_all()
            return len(self._inbox)

    def poll(self, timeout_s: float = 1.0) -> list[RolloutResult]:
        """Samples finished since the last poll; waits up to timeout_s for the first one."""
        with self._cv:
            self._cv.wait_for(lambda: self._outbox or self._error, timeout=timeout_s)
            if self._error is not None:
                raise RuntimeError(f"rollout worker {self.worker_id}: the engine loop failed") from self._error
            out, self._outbox = self._outbox, []
            return out

    def stats(self) -> dict:
        """Engine counters (since this process started; a restarted worker starts from zero) and occupancy."""
        s = self.engine.stats
        with self._cv:
            queued = len(self._inbox)
        return {"worker_id": self.worker_id, "pid": os.getpid(), "prefill_tokens": s.prefill_tokens,
                "prefill_s": s.prefill_s, "prefill_forwards": s.prefill_forwards, "prefill_rows": s.prefill_rows,
                "decode_tokens": s.decode_tokens, "decode_s": s.decode_s,
                "decode_steps": s.decode_steps, "decode_rows": s.decode_rows,
                # mean share of the KV slots holding a live sequence per decode step: how full the batch ran
                "occupancy": s.decode_tokens / (s.decode_steps * self.engine.max_num_seqs) if s.decode_steps else 0.0,
                "live": self.engine.num_live, "queued": queued, "completed_samples": self._completed,
                "completion_tokens": self._completion_tokens, "busy_s": self._busy_s,
                "uptime_s": time.perf_counter() - self._started, "weight_version": self.engine.weight_version}

    # Weight sync: the protocol lives in SyncReceiver (Ray-free); these are its Ray entry points.
    def sync_begin(self, session_id: str, version: int, **kw) -> dict:
        return self._sync.begin(session_id, version, **kw)

    def sync_reserve(self, nbytes: int) -> None:
        self._sync.reserve(nbytes)

    def sync_probe(self, nbytes: int, count: int) -> None:
        self._sync.probe(nbytes, count)

    def sync_stage_packed(self, session_id: str, metas, array) -> int:
        return self._sync.stage_packed(session_id, metas, array)

    def sync_stage_broadcast(self, session_id: str, metas, nbytes: int) -> int:
        return self._sync.stage_broadcast(session_id, metas, nbytes)

    def sync_stage_ipc(self, session_id: str, items) -> int:
        return self._sync.stage_ipc(session_id, items)

    def sync_prepare(self, session_id: str) -> dict:
        return self._sync.prepare(session_id)

    def sync_abort(self, session_id: str | None = None) -> bool:
        return self._sync.abort(session_id)

    def sync_status(self) -> dict:
        return self._sync.status()

    def weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The live weights in the engine's own layout (composer_rollout.sync.update.live_weights), all or `names`,
        copied to the CPU: for checks and debugging, e.g. that a sync landed bit for bit."""
        live = live_weights(self.engine.model)
        with torch.no_grad():
            return {name: live[name].detach().cpu().clone() for name in (live if names is None else names)}

    def sync_commit(self, session_id: str, mode: str | None = None) -> dict:
        """Swap the prepared update in between two engine steps; returns once it serves the new version."""
        mode = mode or str(self.sync_cfg.mode)
        if mode not in SYNC_MODES:
            raise WeightSyncError(f"sync mode {mode!r} is unknown; choose one of {SYNC_MODES}")
        swap = _Swap(self._sync.take(session_id), mode)
        start = time.perf_counter()
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"rollout worker {self.worker_id}: the engine loop failed") from self._error
            self._swap = swap
            self._cv.notify_all()
            self._cv.wait_for(lambda: swap.done or self._error is not None)
        if swap.error is not None or not swap.done:
            raise WeightSyncError(f"rollout worker {self.worker_id}: the swap to version {swap.update.version} "
                                  f"failed: {swap.error or self._error}")
        return {"weight_version": self.engine.weight_version, "swap_wait_s": time.perf_counter() - start,
                "aborted": swap.aborted}

    def _publish(self, finished: list[RolloutResult]) -> None:
        if finished:
            with self._cv:
                self._outbox.extend(finished)
                self._completed += len(finished)
                self._completion_tokens += sum(r.num_completion_tokens for r in finished)
                self._cv.notify_all()

    def _apply(self, swap: _Swap) -> None:
        try:
            self.engine.apply_update(swap.update)
        except Exception as e:  # a stale version (another push won): the caller hears it; the loop goes on
            swap.error = e
        with self._cv:
            swap.done, self._swap = True, None
            self._cv.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    # The timeout lets an idle worker notice a sync session its trainer abandoned.
                    self._cv.wait_for(lambda: self._inbox or self.engine.has_unfinished() or self._swap, timeout=1.0)
                    swap = self._swap
                    draining = swap is not None and swap.mode == "drain"
                    batch = [] if swap is not None else list(self._inbox)  # new prompts wait for the new weights
                    if swap is None:
                        self._inbox.clear()
                self._sync.expire()
                if swap is not None:
                    if swap.mode == "abort":
                        aborted = self.engine.abort_all()
                        swap.aborted = len(aborted)
                        self._publish(aborted)
                    if swap.mode != "drain" or self.engine.num_live == 0:
                        self._apply(swap)
                        continue
                start = time.perf_counter()
                for request_id, prompt_index, token_ids, sampling in batch:
                    # The engine seeds each sample from (sampling.seed, prompt_index, sample_index), so a prompt
                    # redone here after another worker died gives exactly the samples it would have given there.
                    self.engine.add_request(token_ids, sampling, prompt_index=prompt_index, request_id=request_id)
                if self.engine.has_unfinished():
                    self._publish(self.engine.step(admit=not draining))
                self._busy_s += time.perf_counter() - start
        except BaseException as e:  # surfaced to the driver by poll(); a silent dead loop would hang the job
            with self._cv:
                self._error = e
                self._cv.notify_all()
