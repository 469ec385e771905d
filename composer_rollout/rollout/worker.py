"""RolloutWorker: a Ray actor that owns one RolloutEngine and keeps it busy.

The engine's loop (add_request / step) runs on a thread of its own inside the actor, so requests from the
driver join the running batch at the next step (continuous batching across calls) instead of waiting for
the batch in flight to drain. The actor is threaded (max_concurrency > 1): `submit` and `poll` run on Ray's
call threads and meet the loop thread only at a condition variable. `poll` is a long poll: it returns as soon
as some samples finish, or empty-handed after its timeout, which lets the driver `ray.wait` on all workers at
once and notice a dead one (its poll raises RayActorError).

The class itself is plain; RolloutPool wraps it with ray.remote and the resources of its placement-group bundle.
"""

import os
import threading
import time
from collections import deque

import torch

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, build_engine
from composer_rollout.engine import RolloutResult, SamplingParams

# One request as it crosses the Ray boundary: (request id, prompt index, prompt token ids, sampling params).
Request = tuple[str, int, list[int], SamplingParams]


class RolloutWorker:
    def __init__(self, worker_id: int, model: ModelConfig, kernel: KernelConfig, engine: EngineConfig,
                 num_threads: int | None = None):
        if num_threads:
            # Ray gives each worker a share of the cores; torch would otherwise start one thread per core in every
            # worker and they would fight over them.
            torch.set_num_threads(num_threads)
        self.worker_id = worker_id
        self.engine = build_engine(model, kernel, engine)
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
        return {"worker_id": self.worker_id, "pid": os.getpid(), "device": str(self.engine.device),
                "max_num_seqs": self.engine.max_num_seqs, "weight_version": self.engine.weight_version}

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
                "prefill_s": s.prefill_s, "decode_tokens": s.decode_tokens, "decode_s": s.decode_s,
                "decode_steps": s.decode_steps, "decode_rows": s.decode_rows,
                # mean share of the KV slots holding a live sequence per decode step: how full the batch ran
                "occupancy": s.decode_tokens / (s.decode_steps * self.engine.max_num_seqs) if s.decode_steps else 0.0,
                "live": self.engine.num_live, "queued": queued, "completed_samples": self._completed,
                "completion_tokens": self._completion_tokens, "busy_s": self._busy_s,
                "uptime_s": time.perf_counter() - self._started}

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._inbox or self.engine.has_unfinished())
                    batch, self._inbox = list(self._inbox), deque()
                start = time.perf_counter()
                for request_id, prompt_index, token_ids, sampling in batch:
                    # The engine seeds each sample from (sampling.seed, prompt_index, sample_index), so a prompt
                    # redone here after another worker died gives exactly the samples it would have given there.
                    self.engine.add_request(token_ids, sampling, prompt_index=prompt_index, request_id=request_id)
                finished = self.engine.step()
                self._busy_s += time.perf_counter() - start
                if finished:
                    with self._cv:
                        self._outbox.extend(finished)
                        self._completed += len(finished)
                        self._completion_tokens += sum(r.num_completion_tokens for r in finished)
                        self._cv.notify_all()
        except BaseException as e:  # surfaced to the driver by poll(); a silent dead loop would hang the job
            with self._cv:
                self._error = e
                self._cv.notify_all()
