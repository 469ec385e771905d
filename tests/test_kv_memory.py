"""KV-cache sizing from a memory budget (composer_rollout.engine.memory): the pure arithmetic against hand-computed
numbers for the real presets, the start-up error naming the fields, the validation of gpu_memory_fraction, and the
CPU engine keeping max_num_seqs slots."""

import pytest
import torch

from composer_rollout.config import EngineConfig
from composer_rollout.engine import RolloutEngine
from composer_rollout.engine.memory import kv_bytes_per_token_per_layer, kv_slots, plan_kv_slots
from composer_rollout.model import Qwen3MoE, preset

GiB = 1 << 30
A3B = preset("qwen3_30b_a3b")


def plan(**kw) -> int:
    # qwen3_30b_a3b in BF16, 4k context: 2 (K, V) * 4 kv heads * 128 * 2 bytes = 2 KiB per token per layer, so a
    # slot is 2 KiB * 48 layers * 4096 tokens = 0.375 GiB.
    args = dict(max_num_seqs=256, max_model_len=4096, gpu_memory_fraction=0.9, total_bytes=140 * GiB,
                weights_bytes=30 * GiB, reserve_bytes=6 * GiB, bytes_per_token_per_layer=2048, num_layers=48)
    return plan_kv_slots(**{**args, **kw})


def test_bytes_per_token_per_layer():
    assert kv_bytes_per_token_per_layer(A3B, torch.bfloat16) == 2048
    assert kv_bytes_per_token_per_layer(preset("qwen3_235b_a22b"), torch.float32) == 4096
    tiny = Qwen3MoE(preset("tiny"), dtype=torch.float32, device="cpu")
    per = kv_bytes_per_token_per_layer(tiny.args, tiny.dtype)
    assert tiny.new_kv_cache(3, 40).nbytes == (3 + 1) * 40 * tiny.args.num_hidden_layers * per  # + scratch slot


def test_slots_that_fit_the_budget():
    # 0.9 * 140 - 30 - 6 = 90 GiB = 240 slots of 0.375 GiB, one of them scratch.
    assert plan(max_num_seqs=239) == 239
    assert plan(max_num_seqs=64) == 64
    with pytest.raises(ValueError, match=r"engine.max_num_seqs=240 .*room for 239"):
        plan(max_num_seqs=240)
    assert plan(max_num_seqs=89, gpu_memory_fraction=0.5) == 89  # 34 GiB: 90 whole slots, less scratch
    with pytest.raises(ValueError, match=r"room for 89\. Lower engine.max_num_seqs"):
        plan(max_num_seqs=90, gpu_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"engine.max_model_len=32768 .*room for 29"):
        plan(max_num_seqs=30, max_model_len=32768)  # 3 GiB a slot: 30 fit, less scratch
    assert plan(max_num_seqs=3, reserve_bytes=6 * GiB + int(88.5 * GiB)) == 3  # 1.5 GiB left: 4 slots, less scratch


def test_the_smallest_budget_that_fits_one_sequence():
    two_slots = 30 * GiB + 6 * GiB + 2 * 3 * GiB // 8
    assert plan(max_num_seqs=1, total_bytes=two_slots, gpu_memory_fraction=1.0) == 1
    with pytest.raises(ValueError, match=r"engine.gpu_memory_fraction=1.0 .*engine.max_model_len=4096"):
        plan(max_num_seqs=1, total_bytes=two_slots - 1, gpu_memory_fraction=1.0)


def test_weights_over_the_budget_name_the_fields():
    with pytest.raises(ValueError, match=r"does not fit.*engine.max_model_len.*engine.gpu_memory_fraction"):
        plan(total_bytes=24 * GiB)  # the weights alone exceed 0.9 * 24 GiB


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, True, "0.9", float("nan")])
def test_fraction_must_be_in_0_1(fraction):
    with pytest.raises(ValueError, match="engine.gpu_memory_fraction"):
        plan(gpu_memory_fraction=fraction)
    with pytest.raises(ValueError, match="engine.gpu_memory_fraction"):
        EngineConfig(gpu_memory_fraction=fraction)


def test_cpu_engine_keeps_max_num_seqs_slots():
    model = Qwen3MoE(preset("tiny"), dtype=torch.float32, device="cpu").init_random(0)
    assert kv_slots(model, 5, 64, 0.01, 16) == 5  # the fraction budgets GPU memory only
    eng = RolloutEngine(model, max_num_seqs=5, max_model_len=64, gpu_memory_fraction=0.5)
    assert eng.max_num_seqs == 5 and eng.cache.num_slots == 5
    with pytest.raises(ValueError, match="engine.gpu_memory_fraction"):
        RolloutEngine(model, max_num_seqs=5, max_model_len=64, gpu_memory_fraction=1.2)
