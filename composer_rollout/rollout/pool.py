"""RolloutPool: the driver's side of the rollout job. Starts the workers, routes prompts, gathers samples.

- Placement: N workers, one placement-group bundle each ({CPU: cpus_per_worker, GPU: gpus_per_worker}), so the
  job either gets all its resources or waits for them, and a restarted worker comes back in its own bundle.
- Routing: least-loaded first (fewest samples in flight), one prompt's n samples always together (the engine
  prefills a prompt once and copies its KV cache to the n slots). Each worker holds at most `inflight_factor *
  max_num_seqs` samples, so fast workers take more of the set and a crash strands little work.
- Gathering: a long `poll` per worker, all waited on together (`ray.wait`), samples yielded as they finish.
- Weight sync: with `rollout.name` set the workers are named actors (`<name>.worker<i>` in the namespace
  "composer-rollout"), so a trainer in another process reaches the running job with WeightSync.connect(name); they
  carry the job's SyncConfig, which connect takes as its defaults.
- Faults: a worker whose poll raises RayActorError has died; Ray restarts it (max_restarts) while its unfinished
  prompts go back to the head of the queue for any live worker. Samples are deduplicated by (prompt index, sample
  index): a sample comes out exactly once, even when a prompt ran twice (seeds make both runs identical anyway).
"""

import time
from collections import deque
from collections.abc import Iterable, Iterator

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, RolloutConfig, SyncConfig
from composer_rollout.engine import RolloutResult
from composer_rollout.prompts import Prompt
from composer_rollout.rollout.worker import RolloutWorker

NAMESPACE = "composer-rollout"


def worker_name(job_name: str, index: int) -> str:
    return f"{job_name}.worker{index}"


class WorkersExhaustedError(RuntimeError):
    """Every worker is gone for good (restarts used up)."""


class RolloutPool:
    def __init__(self, model: ModelConfig, kernel: KernelConfig, engine: EngineConfig, rollout: RolloutConfig,
                 sync: SyncConfig | None = None, *, inflight_factor: int = 2, poll_s: float = 0.5,
                 ready_timeout_s: float = 600.0):
        if rollout.num_workers < 1:
            raise ValueError(f"rollout.num_workers must be >= 1, got {rollout.num_workers}")
        self.cfg, self.poll_s = rollout, poll_s
        bundle = {"CPU": rollout.cpus_per_worker}
        if rollout.gpus_per_worker:
            bundle["GPU"] = rollout.gpus_per_worker
        self.pg = placement_group([dict(bundle) for _ in range(rollout.num_workers)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=ready_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise RuntimeError(f"the cluster cannot place {rollout.num_workers} workers of {bundle} "
                               f"(cluster resources: {ray.cluster_resources()})")
        actor = ray.remote(RolloutWorker)
        threads = max(1, int(rollout.cpus_per_worker))
        names = {} if rollout.name is None else {"namespace": NAMESPACE}
        self.workers = []
        try:  # a bad checkpoint or kernel path fails here, in every worker, before any prompt is sent
            for i in range(rollout.num_workers):
                if rollout.name is not None:
                    names["name"] = worker_name(rollout.name, i)
                # max_concurrency: a long poll, submits, a sync's staging calls and a commit waiting on a drain
                self.workers.append(actor.options(
                    num_cpus=rollout.cpus_per_worker, num_gpus=rollout.gpus_per_worker,
                    max_restarts=rollout.max_restarts, max_concurrency=8, **names,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))
                    .remote(i, model, kernel, engine, threads, sync))
            self.info = ray.get([w.info.remote() for w in self.workers])
        except Exception:
            self.shutdown()
            raise
        self.capacity = inflight_factor * self.info[0]["max_num_seqs"]
        self.restarts = [0] * rollout.num_workers
        self.samples = [0] * rollout.num_workers
        self.tokens = [0] * rollout.num_workers
        self._run = 0  # runs are numbered so that a late sample of an earlier run is never taken for this one's

    def pids(self) -> list[int]:
        return [i["pid"] for i in ray.get([w.info.remote() for w in self.workers])]

    def stats(self, timeout_s: float = 5.0) -> list[dict | None]:
        """Each worker's own stats (None for one that does not answer in time, e.g. restarting)."""
        refs = [w.stats.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else None)
            except RayActorError:
                out.append(None)
        return out

    def run(self, prompts: Iterable[Prompt], done: set[tuple[int, int]] | None = None
            ) -> Iterator[tuple[int, RolloutResult]]:
        """(worker id, result) for every sample of `prompts` not in `done` ((prompt index, sample index) pairs),
        as they finish, each exactly once."""
        done = set() if done is None else set(done)
        self._run += 1
        tag = f"run{self._run}:"
        todo = {p.index: p for p in prompts if any((p.index, j) not in done for j in range(p.sampling.n))}
        queue = deque(todo.values())
        inflight: list[dict[int, Prompt]] = [{} for _ in self.workers]
        alive = [True] * len(self.workers)
        waits: dict = {w.poll.remote(self.poll_s): ("poll", i) for i, w in enumerate(self.workers)}

        def dispatch():
            # One prompt at a time to the least-loaded live worker with room, so the set spreads evenly; then one
            # submit call per worker.
            load = [sum(p.sampling.n for p in f.values()) if ok else None
                    for f, ok in zip(inflight, alive, strict=True)]
            batches: dict[int, list] = {}
            while queue:
                n = queue[0].sampling.n
                room = [i for i, x in enumerate(load) if x is not None and (x == 0 or x + n <= self.capacity)]
                if not room:
                    break
                i = min(room, key=lambda k: load[k])
                p = queue.popleft()
                batches.setdefault(i, []).append((f"{tag}{p.index}", p.index, p.token_ids, p.sampling))
                inflight[i][p.index] = p
                load[i] += n
            for i, batch in batches.items():
                self.workers[i].submit.remote(batch)  # if this fails, the worker's poll fails too

        dispatch()
        try:
            yield from self._gather(todo, done, tag, queue, inflight, alive, waits, dispatch)
        finally:
            # Long polls still out would swallow the next run's first samples; collect them (anything they hold
            # belongs to this run and is dropped as late).
            for ref in waits:
                try:
                    ray.get(ref)
                except RayError:
                    pass

    def _gather(self, todo, done, tag, queue, inflight, alive, waits, dispatch):
        while todo:
            ready, _ = ray.wait(list(waits), num_returns=1)
            kind, i = waits.pop(ready[0])
            try:
                value = ray.get(ready[0])
            except ActorUnavailableError:
                if kind == "ready":  # still restarting: ask again, it is the same death
                    time.sleep(0.2)
                    waits[self.workers[i].info.remote()] = ("ready", i)
                else:
                    self._lost(i, inflight, alive, queue, waits)
                dispatch()
                continue
            except RayActorError:
                self._lost(i, inflight, alive, queue, waits)
                dispatch()
                continue
            if kind == "ready":  # a restarted worker is back
                alive[i] = True
                waits[self.workers[i].poll.remote(self.poll_s)] = ("poll", i)
                dispatch()
                continue
            for r in value:
                key = (r.prompt_index, r.sample_index)
                if not r.request_id.startswith(tag) or key in done or r.prompt_index not in todo:
                    continue  # a late sample of an earlier run, or a duplicate from a prompt that ran twice
                done.add(key)
                p = todo[r.prompt_index]
                if all((p.index, j) in done for j in range(p.sampling.n)):
                    del todo[p.index]
                    for f in inflight:
                        f.pop(p.index, None)
                self.samples[i] += 1
                self.tokens[i] += r.num_completion_tokens
                yield i, r
            waits[self.workers[i].poll.remote(self.poll_s)] = ("poll", i)
            dispatch()

    def _lost(self, i, inflight, alive, queue, waits) -> None:
        """Worker i died (or failed to come back): requeue its prompts first in line, and wait for Ray to restart
        it unless its restarts are used up."""
        self.restarts[i] += 1
        alive[i] = False
        queue.extendleft(sorted(inflight[i].values(), key=lambda p: p.index, reverse=True))
        inflight[i].clear()
        if self.restarts[i] <= self.cfg.max_restarts:
            waits[self.workers[i].info.remote()] = ("ready", i)
        elif not any(alive) and not waits:
            raise WorkersExhaustedError(f"all {len(self.workers)} rollout workers died and used up max_restarts="
                             f"{self.cfg.max_restarts}")

    def generate(self, prompts: list[Prompt]) -> list[RolloutResult]:
        """Every sample of `prompts`, ordered by prompt index then sample index."""
        return sorted((r for _, r in self.run(prompts)), key=lambda r: (r.prompt_index, r.sample_index))

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w, no_restart=True)
        remove_placement_group(self.pg)

