"""Weight sync with GPU workers (marked gpu; skipped on CPU): one worker on a GPU (tiny model, BF16 with MXFP8
experts re-quantized by the Triton kernel), the trainer's tensors on the same GPU. cuda_ipc and object_store land
bit-exact (the kernel's bytes equal the host quantizer's), cuda_ipc also from Hub-layout tensors that are all views
of one allocation (a trainer's flat buffer), sharing it once per bucket; a NaN found on the GPU fails naming the
tensor and changes nothing; collective refuses NCCL between ranks that share a GPU, and runs NCCL when there are two
GPUs.
Uses a Ray instance of its own (ray.init): the GPU image carries ray as wheels, without the dashboard's needs."""

import pytest
import ray
import torch
from test_ipc_views import carve
from weight_sources import assert_bitwise_equal, expected, named, source_model

from composer_rollout.config import EngineConfig, KernelConfig, ModelConfig, RolloutConfig, SyncConfig, WeightDtype
from composer_rollout.engine import SamplingParams
from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.prompts import Prompt
from composer_rollout.rollout import RolloutPool, WeightSync, WeightSyncError
from composer_rollout.sync.channels import local_device

pytestmark = pytest.mark.gpu
REF = Qwen3MoE(preset("tiny"), weight_dtype="mxfp8")


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=4, include_dashboard=False)
    p = RolloutPool(ModelConfig(weight_dtype=WeightDtype.mxfp8), KernelConfig(),
                    EngineConfig(max_num_seqs=8, max_model_len=64),
                    RolloutConfig(num_workers=1, gpus_per_worker=1, cpus_per_worker=1), SyncConfig(timeout_s=30))
    torch.cuda.set_device(local_device(p.info[0]["gpu_uuid"]))  # the trainer on the worker's GPU
    yield p
    p.shutdown()
    ray.shutdown()


def on_gpu(tensors):
    return [(n, t.cuda()) for n, t in tensors]


def version_of(pool):
    return ray.get(pool.workers[0].info.remote())["weight_version"]


def generate(pool):
    sampling = SamplingParams(max_tokens=4, n=2, seed=1)
    return pool.generate([Prompt(0, "p0", [3, 4, 5], sampling)])


@pytest.mark.parametrize("transport,layout,dtype", [("cuda_ipc", "fused", torch.bfloat16),
                                                    ("cuda_ipc", "hub", torch.float32),
                                                    ("object_store", "fused", torch.bfloat16)])
def test_sync_lands_bit_exact_on_a_gpu_worker(pool, transport, layout, dtype):
    src = named(source_model(71 + len(layout)), layout, dtype)
    version = version_of(pool) + 1
    stats = WeightSync(pool, transport=transport, bucket_mb=1).push(on_gpu(src), version)
    assert stats.version == version and stats.tensors == len(src)
    if transport != "cuda_ipc":
        assert stats.shared_storages == 0
    elif layout == "fused":
        assert stats.shared_storages == len(src)  # each tensor an allocation of its own
    else:  # each layer's per-expert tensors go packed through a staging buffer, shared once per bucket
        assert stats.shared_storages < len(src)
    assert_bitwise_equal(ray.get(pool.workers[0].weights.remote()), expected(src, REF))
    assert {r.weight_version for r in generate(pool)} == {version}


@pytest.mark.parametrize("bucket_mb", [1, 64])
def test_cuda_ipc_shares_one_allocation_once_per_bucket(pool, bucket_mb):
    """Every Hub-layout tensor a view of one CUDA allocation (BF16 and FP32 mixed, misaligned, some transposed or
    row-padded): one IPC share per bucket, and the worker holds the source (its MXFP8 experts the host quantizer's
    bytes)."""
    src = [(n, t.float() if "layers.1." in n else t) for n, t in named(source_model(75), "hub")]
    transposed = {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
                  "model.layers.1.mlp.experts.4.down_proj.weight"}
    padded = {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"}
    pairs, _ = carve(src, "cuda", transposed, padded)
    version = version_of(pool) + 1
    stats = WeightSync(pool, transport="cuda_ipc", bucket_mb=bucket_mb).push(pairs, version)
    # The carved allocation and the packing's staging buffer (for per-expert tensors that do not tile a fused
    # tensor in place) are each shared at most once per bucket.
    assert stats.tensors == len(src) and stats.shared_storages <= 2 * stats.buckets
    assert (stats.buckets == 1) == (bucket_mb == 64)
    assert_bitwise_equal(ray.get(pool.workers[0].weights.remote()), expected(src, REF))
    assert {r.weight_version for r in generate(pool)} == {version}


def test_a_nan_found_on_the_gpu_names_the_tensor_and_changes_nothing(pool):
    before = ray.get(pool.workers[0].weights.remote())
    version = version_of(pool)
    up = "model.layers.1.mlp.experts.gate_up_proj"
    src = [(n, t.float().fill_(float("nan")) if n == up else t) for n, t in named(source_model(81), "fused")]
    with pytest.raises(WeightSyncError, match=rf"worker 0: {up}: non-finite"):
        WeightSync(pool, transport="cuda_ipc").push(on_gpu(src), version + 1)
    assert version_of(pool) == version
    assert_bitwise_equal(ray.get(pool.workers[0].weights.remote()), before)


def test_collective_refuses_nccl_on_a_shared_gpu(pool):
    with pytest.raises(WeightSyncError, match="one GPU per rank"):
        WeightSync(pool, transport="collective").push(on_gpu(named(source_model(82), "fused")), version_of(pool) + 1)


def test_collective_over_nccl_with_two_gpus(pool):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: the trainer on one, the worker on the other")
    other = RolloutPool(ModelConfig(weight_dtype=WeightDtype.mxfp8), KernelConfig(),
                        EngineConfig(max_num_seqs=8, max_model_len=64),
                        RolloutConfig(num_workers=1, gpus_per_worker=1, cpus_per_worker=1))
    mine = torch.cuda.current_device()
    try:
        theirs = local_device(other.info[0]["gpu_uuid"])
        torch.cuda.set_device(next(i for i in range(torch.cuda.device_count()) if i != theirs))
        src = named(source_model(83), "fused")
        WeightSync(other, transport="collective", bucket_mb=1).push(on_gpu(src), 1)
        assert_bitwise_equal(ray.get(other.workers[0].weights.remote()), expected(src, REF))
    finally:
        torch.cuda.set_device(mine)
        other.shutdown()
