"""WeightSync into rollout workers on the tests' real local Ray cluster (two CPU workers, tiny model, MXFP8 experts):
every worker ends bit-exact with the source over object_store and collective (gloo), from Hub or fused names, BF16 or
FP32; partial updates; bad updates fail on the trainer's side naming the tensor and the worker while every worker
keeps serving its version (per-expert tensors packed into fused ones on the way, composer_rollout.sync.packing); a
trainer process killed mid-push leaves no worker on a new or mixed version and its staged buffers are dropped after
the timeout; drain / abort / inflight swaps during generation, with per-sample and per-token versions; the running
rollout job takes a sync from another process (WeightSync.connect)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest
import ray
import torch
from weight_sources import assert_bitwise_equal, expected, named, source_model

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, RolloutConfig, SyncConfig, WeightDtype
from composer_rollout.engine import SamplingParams
from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.prompts import load_prompts
from composer_rollout.rollout import RolloutPool, WeightSync, WeightSyncError

ROOT = Path(__file__).resolve().parents[1]
ENGINE = EngineConfig(max_num_seqs=8, max_model_len=96)
MODEL = ModelConfig(weight_dtype=WeightDtype.mxfp8)
REF = Qwen3MoE(preset("tiny"), weight_dtype="mxfp8")  # only its shape and layout: what `expected` maps onto
TIMEOUT_S = 4.0


def env():
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def cluster(ray_head):
    ray.init(address=ray_head)
    yield ray_head
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    p = RolloutPool(MODEL, KernelConfig(), ENGINE, RolloutConfig(num_workers=2, name="wsync-test"),
                    SyncConfig(timeout_s=TIMEOUT_S))
    yield p
    p.shutdown()


def versions(pool):
    return [i["weight_version"] for i in ray.get([w.info.remote() for w in pool.workers])]


def next_version(pool):
    return max(versions(pool)) + 1


def assert_workers_hold(pool, want):
    for w in pool.workers:
        assert_bitwise_equal(ray.get(w.weights.remote()), want)


def prompts(count, max_tokens, n=2, seed=5):
    ps, _ = load_prompts(f"builtin:random:{count}", sampling=SamplingParams(n=n, max_tokens=max_tokens, seed=seed),
                         vocab_size=512, max_model_len=ENGINE.max_model_len, max_num_seqs=ENGINE.max_num_seqs)
    return ps


@pytest.mark.parametrize("transport,layout,dtype", [("object_store", "hub", torch.bfloat16),
                                                    ("collective", "fused", torch.float32),
                                                    ("collective", "hub", torch.bfloat16)])
def test_full_sync_lands_exactly_on_every_worker(pool, transport, layout, dtype):
    src = named(source_model(11 + len(layout), tie_word_embeddings=False), layout, dtype)
    version = next_version(pool)
    sync = WeightSync(pool, transport=transport, bucket_mb=1)
    stats = sync.push(src, version)
    assert stats.version == version and stats.tensors == len(src) and stats.buckets >= 2 and not stats.shared_storages
    assert versions(pool) == [version, version]
    assert_workers_hold(pool, expected(src, REF))
    results = pool.generate(prompts(4, 4))
    assert {r.weight_version for r in results} == {version}
    assert all(r.weight_versions == [(version, r.num_completion_tokens)] for r in results)
    if transport == "collective":  # the wire alone, on the group the push built (issue 8 compares the two)
        assert sync.broadcast_ceiling(1 << 20, count=3) > 0
        assert versions(pool) == [version, version]


def test_partial_sync_and_a_restarted_worker_refuses_it(pool):
    sync = WeightSync(pool, transport="object_store")
    full = named(source_model(21), "hub")
    sync.push(full, next_version(pool))
    part = dict(named(source_model(22), "hub"))
    carried = ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.7.gate_proj.weight"]
    carried += [n for n in part if n.startswith("model.layers.0.mlp.experts.")]  # a whole layer: packed on the way
    sync.push([(n, part[n]) for n in carried], sync.version + 1, partial=True)
    want = expected([(n, part[n] if n in carried else t) for n, t in full], REF)
    assert_workers_hold(pool, want)
    stale = WeightSync(pool, transport="object_store")
    stale.version = sync.version - 1  # a trainer whose idea of the base version is wrong (a worker came back at 0)
    with pytest.raises(WeightSyncError, match=r"worker 0: a partial update applies on top of version"):
        stale.push([(carried[0], part[carried[0]])], sync.version + 1, partial=True)
    assert_workers_hold(pool, want)


SRC = named(source_model(31), "hub")
Q = "model.layers.1.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.experts.2.down_proj.weight"


@pytest.mark.parametrize("tensors,version,match", [
    (SRC + [("model.layers.0.mlp.experts.12.gate_proj.weight", torch.zeros(96, 128))], None,
     r"worker 0: model\.layers\.0\.mlp\.experts\.12\.gate_proj\.weight: expert 12 >= num_experts 12"),
    ([(n, torch.zeros(128, 64) if n == Q else t) for n, t in SRC], None, rf"worker 0: {Q}: shape \(128, 64\)"),
    ([(n, t.float().fill_(float("nan")) if n == DOWN else t) for n, t in SRC], None,
     rf"worker 0: {DOWN}: .*non-finite"),
    ([(n, t.clone().fill_(float("nan")) if n == DOWN else t) for n, t in SRC], None,  # packed into the fused one
     rf"worker 0: model\.layers\.0\.mlp\.experts\.down_proj: non-finite values \(inf or NaN\) in {DOWN}"),
    ([(n, torch.zeros(128, 95, dtype=torch.bfloat16) if n == DOWN else t) for n, t in SRC], None,
     rf"worker 0: {DOWN}: shape \(128, 95\), expected \(128, 96\)"),
    ([(n, t) for n, t in SRC if n != DOWN], None, rf"worker 0: missing tensor '{DOWN}'"),
    (SRC, 0, r"worker 0: weight version \d+ is not newer than the version being served"),
])
def test_bad_update_fails_on_the_trainer_and_every_worker_keeps_serving(pool, tensors, version, match):
    before = [ray.get(w.weights.remote()) for w in pool.workers]
    current = versions(pool)
    ref = pool.generate(prompts(2, 4))
    bad_version = current[0] if version == 0 else current[0] + 1
    with pytest.raises(WeightSyncError, match=match) as err:
        WeightSync(pool, transport="object_store", bucket_mb=1).push(tensors, bad_version)
    assert "worker 1:" in str(err.value)  # both workers refused; the trainer hears each
    assert versions(pool) == current
    for w, b in zip(pool.workers, before, strict=True):
        assert_bitwise_equal(ray.get(w.weights.remote()), b)
    assert all(s["session"] is None for s in ray.get([w.sync_status.remote() for w in pool.workers]))
    assert pool.generate(prompts(2, 4)) == ref


@ray.remote
def _staged(worker: int, fails: bool) -> int:
    if fails:
        raise ValueError(f"bad tensor seen by worker {worker}")
    return 1


def test_a_worker_failing_only_on_a_later_bucket_is_still_named(pool):
    """Workers stage buckets concurrently, so worker 0 can fail bucket 1 (its session gone, having failed bucket 2
    first) while worker 1 takes bucket 1 and fails only bucket 2: the trainer still hears both."""
    sync = WeightSync(pool, transport="object_store")
    pending = deque([[_staged.remote(0, True), _staged.remote(1, False)],
                     [_staged.remote(0, True), _staged.remote(1, True)]])
    with pytest.raises(WeightSyncError, match="worker 0: .*worker 1: .*bad tensor seen by worker 1"):
        sync._in_flight(pending, None)


def test_one_worker_refusing_keeps_every_worker_on_its_version(pool):
    """Worker 0 already serves version v + 1 (a push that reached it alone); a push of v + 1 to both fails there, so
    worker 1, which had staged and validated it, must not commit either."""
    v = next_version(pool) - 1
    WeightSync(pool.workers[:1]).push(named(source_model(35), "fused"), v + 1)
    worker1 = ray.get(pool.workers[1].weights.remote())
    with pytest.raises(WeightSyncError, match=rf"worker 0: weight version {v + 1} is not newer") as err:
        WeightSync(pool).push(named(source_model(36), "fused"), v + 1)
    assert "worker 1" not in str(err.value)
    assert versions(pool) == [v + 1, v]
    assert_bitwise_equal(ray.get(pool.workers[1].weights.remote()), worker1)
    src = named(source_model(37), "fused")
    WeightSync(pool).push(src, v + 2)  # a newer full push brings both to one version
    assert versions(pool) == [v + 2, v + 2]
    assert_workers_hold(pool, expected(src, REF))


def test_broadcast_ceiling_needs_the_collective_group(pool):
    with pytest.raises(WeightSyncError, match="push once with transport=collective"):
        WeightSync(pool, transport="collective").broadcast_ceiling(1 << 20)


def test_cuda_ipc_without_a_gpu_fails_before_any_work(pool):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="cuda_ipc .* no CUDA device"):
        WeightSync(pool, transport="cuda_ipc")


TRAINER = """
import sys, time, ray, torch
sys.path.insert(0, {tests!r})
from weight_sources import named, source_model
from composer_rollout.rollout import WeightSync
ray.init(address={address!r})
sync = WeightSync.connect("wsync-test", bucket_mb=1)
sync.push(named(source_model(41), "hub"), {version})
print("pushed", flush=True)

def slow():
    for i, item in enumerate(named(source_model(42), "hub")):
        if i == 60:
            print("staging", flush=True)
            time.sleep(600)  # killed here, mid-push
        yield item

sync.push(slow(), {version} + 1)
"""


def test_killed_trainer_leaves_no_worker_on_a_new_or_mixed_version(pool, cluster):
    version = next_version(pool)
    code = TRAINER.format(tests=str(ROOT / "tests"), address=cluster, version=version)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "pushed", proc.stderr.read()[-3000:]
        assert proc.stdout.readline().strip() == "staging", proc.stderr.read()[-3000:]
        deadline = time.monotonic() + 30  # wait until both workers hold a staged bucket of version + 1
        while not all(s["staged_tensors"] for s in ray.get([w.sync_status.remote() for w in pool.workers])):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    want = expected(named(source_model(41), "hub"), REF)
    assert versions(pool) == [version, version]
    assert_workers_hold(pool, want)
    assert {r.weight_version for r in pool.generate(prompts(2, 4))} == {version}
    deadline = time.monotonic() + TIMEOUT_S + 10  # the abandoned session goes after timeout_s without a call
    while any(s["session"] for s in ray.get([w.sync_status.remote() for w in pool.workers])):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert versions(pool) == [version, version]
    assert_workers_hold(pool, want)


def generate_during_push(pool, mode, src, version):
    """Long generations (two rounds of 64 tokens per worker), a push with `mode` once every worker is decoding, then
    a short generation after the push. Returns (results during, results after)."""
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("results", pool.generate(prompts(16, 64, seed=9))))
    worker.start()
    deadline = time.monotonic() + 60
    while not all(s and s["live"] for s in pool.stats()):  # every worker is decoding
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.02)
    WeightSync(pool, mode=mode).push(src, version)
    worker.join(120)
    after = pool.generate(prompts(2, 4, seed=11))
    assert {r.weight_version for r in after} == {version}
    return out["results"], after


def test_drain_lets_live_sequences_finish_on_the_old_weights(pool):
    old = next_version(pool) - 1
    reference = pool.generate(prompts(16, 64, seed=9))  # what the old weights give, undisturbed
    results, _ = generate_during_push(pool, "drain", named(source_model(51), "fused"), old + 1)
    assert any(r.weight_version == old for r in results)  # the sequences live at the push finished on old weights
    assert {r.weight_version for r in results} <= {old, old + 1}
    for r, ref in zip(results, reference, strict=True):
        assert r.weight_versions == [(r.weight_version, r.num_completion_tokens)]  # one version per sample
        if r.weight_version == old:
            assert r.token_ids == ref.token_ids  # finished exactly as without the sync
    assert all(r.finish_reason != "abort" for r in results)


def test_inflight_swaps_between_steps_and_records_per_token_versions(pool):
    old = next_version(pool) - 1
    results, _ = generate_during_push(pool, "inflight", named(source_model(52), "fused"), old + 1)
    spans = [r.weight_versions for r in results]
    assert any(s[0][0] == old and len(s) == 2 and s[1][0] == old + 1 for s in spans)  # swapped mid-sample
    for r in results:
        assert sum(n for _, n in r.weight_versions) == r.num_completion_tokens
        assert [v for v, _ in r.weight_versions] in ([old], [old + 1], [old, old + 1])
        assert r.weight_version == r.weight_versions[0][0]


def test_abort_returns_the_live_sequences_as_aborted(pool):
    old = next_version(pool) - 1
    results, _ = generate_during_push(pool, "abort", named(source_model(53), "fused"), old + 1)
    aborted = [r for r in results if r.finish_reason == "abort"]
    assert aborted and all(r.weight_versions in ([(old, r.num_completion_tokens)], []) for r in aborted)
    assert all(len(r.weight_versions) == 1 for r in results if r.finish_reason != "abort")


def test_the_rollout_job_takes_a_sync_from_another_process(tmp_path, cluster, sigint_deliverable):
    """jobs/rollout.py started with rollout.name takes a push from this process while it runs; once samples of the
    new version are in its output, Ctrl-C ends it (a long prompt set keeps it running until then)."""
    out = tmp_path / "rollouts.jsonl"
    args = [sys.executable, "jobs/rollout.py", f"hydra.run.dir={tmp_path}", f"ray.address={cluster}", "logger=none",
            "rollout.name=job-sync-test", "prompts=builtin:random:2000", "sampling.max_tokens=16", "sampling.n=2",
            "engine.max_model_len=96", "engine.max_num_seqs=8", "model.weight_dtype=mxfp8", f"output={out}"]
    job = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())

    def records():
        return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

    try:
        deadline = time.monotonic() + 120
        while len(records()) < 4:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.1)
        stats = WeightSync.connect("job-sync-test").push(named(source_model(61), "hub"), 1)
        assert stats.version == 1
        while not any(r["weight_version"] == 1 for r in records()[-8:]):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=120)
        assert "interrupted:" in err, err[-3000:]
    finally:
        job.kill()
    recs = records()
    assert {r["weight_version"] for r in recs} == {0, 1}  # the job went on serving, on the new weights
    assert all(r["weight_versions"] == [[r["weight_version"], r["num_completion_tokens"]]] for r in recs)  # drain
