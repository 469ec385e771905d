"""KV-cache sizing from a memory budget (composer_rollout.engine.memory): the pure arithmetic against hand-computed
numbers for the real presets, the start-up error naming the fields, the validation of gpu_memory_fraction, the
CPU engine keeping max_num_seqs slots, and the shape of the reserve probe's prefill."""

from itertools import pairwise

import pytest
import torch

from composer_rollout.config import EngineConfig
from composer_rollout.engine import RolloutEngine
from composer_rollout.engine.memory import kv_bytes_per_token_per_layer, kv_slots, largest_prefill, plan_kv_slots
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


@pytest.mark.parametrize("budget, max_len, seqs, sequences", [
    (40, 16, 4, [15, 15, 10]), (12, 64, 4, [12]), (30, 16, 4, [15, 15]), (40, 16, 2, [15, 15])])
def test_the_reserve_probe_runs_the_largest_prefill_a_step_can(monkeypatch, budget, max_len, seqs, sequences):
    """The GPU reserve probe's prefill (run here on the CPU): max_prefill_tokens rows in one forward, packed as
    whole prompts of at most max_model_len - 1 tokens and at most max_num_seqs of them, each ending at the last
    position, one hidden state each. A budget above one prompt's length used to be probed as one prompt
    (max_model_len - 1 rows): too few."""
    model = Qwen3MoE(preset("tiny"), dtype=torch.float32, device="cpu").init_random(0)
    seen, forward = [], model.forward

    def spy(ids, positions, slots, cache, capture=None, packed=None):
        seen.append((ids.shape[1], packed.starts, positions[0].tolist()))
        return forward(ids, positions, slots, cache, capture, packed)

    monkeypatch.setattr(model, "forward", spy)
    hidden = largest_prefill(model, model.new_kv_cache(1, max_len), budget, max_len, seqs)
    ((rows, starts, positions),) = seen
    assert rows == sum(sequences) and [b - a for a, b in pairwise(starts)] == sequences
    assert hidden.shape == (len(sequences), model.args.hidden_size)
    assert [positions[b - 1] for b in starts[1:]] == [max_len - 2] * len(sequences)
