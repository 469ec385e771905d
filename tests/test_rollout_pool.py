"""RolloutPool on a real local Ray cluster, two CPU workers on the tiny model: every sample comes back exactly once
and in order; a worker killed mid-job (SIGKILL to its process) is restarted by Ray, its prompts go to a live
worker, and the output is still every sample exactly once, with the same tokens as an undisturbed run."""

import os
import signal
import time

import pytest
import ray
from ray.exceptions import RayActorError

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, RolloutConfig
from composer_rollout.engine import SamplingParams
from composer_rollout.prompts import load_prompts
from composer_rollout.rollout import RolloutPool, WorkersExhaustedError

ENGINE = EngineConfig(max_num_seqs=8, max_model_len=96)


@pytest.fixture(scope="module")
def cluster(ray_head):
    ray.init(address=ray_head)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    p = RolloutPool(ModelConfig(), KernelConfig(), ENGINE, RolloutConfig(num_workers=2, max_restarts=2))
    yield p
    p.shutdown()


def prompts(n_prompts=12, n=2, max_tokens=24):
    ps, _ = load_prompts(f"builtin:random:{n_prompts}", sampling=SamplingParams(n=n, max_tokens=max_tokens, seed=7),
                         vocab_size=512, max_model_len=ENGINE.max_model_len, max_num_seqs=ENGINE.max_num_seqs)
    return ps


def live_pids(pool, attempts=120):
    """Worker pids once every worker answers; the job can end before Ray has finished restarting one."""
    for _ in range(attempts):
        try:
            return pool.pids()
        except RayActorError:
            time.sleep(0.5)
    raise TimeoutError("a rollout worker did not come back")


@pytest.fixture(scope="module")
def reference(pool):
    return pool.generate(prompts())


def test_results_complete_and_in_order(pool, reference):
    keys = [(r.prompt_index, r.sample_index) for r in reference]
    assert keys == [(i, j) for i in range(12) for j in range(2)]
    assert all(1 <= r.num_completion_tokens <= 24 and len(r.logprobs) == r.num_completion_tokens for r in reference)
    assert all(r.finish_reason in ("stop", "length") and r.weight_version == 0 for r in reference)
    assert all(r.latency_s >= r.ttft_s > 0 for r in reference)
    assert pool.samples[0] > 0 and pool.samples[1] > 0  # least-loaded routing used both workers
    # samples of one prompt differ (seeded per sample), and the same prompt gives the same samples on a rerun
    assert any(reference[2 * i].token_ids != reference[2 * i + 1].token_ids for i in range(12))
    again = pool.generate(prompts()[:3])
    assert [r.token_ids for r in again] == [r.token_ids for r in reference[:6]]


def test_done_samples_are_skipped(pool, reference):
    done = {(r.prompt_index, r.sample_index) for r in reference if r.prompt_index != 5}
    out = [r for _, r in pool.run(prompts(), done)]
    assert sorted((r.prompt_index, r.sample_index) for r in out) == [(5, 0), (5, 1)]


def test_killed_worker_exactly_once(pool, reference):
    pids = pool.pids()
    killed, seen = False, []
    for worker_id, r in pool.run(prompts()):
        seen.append((worker_id, r))
        if not killed:  # the first sample is back, so both workers hold prompts in flight: kill worker 0
            os.kill(pids[0], signal.SIGKILL)
            killed = True
    assert pool.restarts[0] == 1 and pool.restarts[1] == 0
    results = sorted((r for _, r in seen), key=lambda r: (r.prompt_index, r.sample_index))
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(12) for j in range(2)]
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]  # redone prompts reproduce exactly
    new_pids = live_pids(pool)  # Ray brought worker 0 back as a new process
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]


def test_a_pool_whose_workers_are_all_gone_says_so(cluster):
    """max_restarts=0 and the only worker killed: the job fails with WorkersExhaustedError, it does not hang."""
    lone = RolloutPool(ModelConfig(), KernelConfig(), ENGINE, RolloutConfig(num_workers=1, max_restarts=0))
    try:
        pid = lone.pids()[0]
        with pytest.raises(WorkersExhaustedError, match="max_restarts=0"):
            for i, _ in enumerate(lone.run(prompts())):
                if i == 0:
                    os.kill(pid, signal.SIGKILL)
    finally:
        lone.shutdown()
