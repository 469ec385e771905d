"""Prefill scheduling (engine.max_prefill_tokens): a long prompt is prefilled in chunks over several steps, each
followed by a decode step of the live sequences; shorter ones go whole, several to a forward packed in one row, in
arrival order; a forward's rows are padded to a multiple of 16 where that fits. The samples, logprobs and routed
experts are those of a one-chunk prefill; abort and drain see the request in progress."""

import numpy as np
import pytest
import torch

from composer_rollout.config import EngineConfig
from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.engine.engine import ROW_MULTIPLE, padded_len

ARGS = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=4)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(engine) -> list:
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return sorted(out, key=lambda r: (r.prompt_index, r.sample_index))


def record_shapes(monkeypatch, engine) -> list[tuple[int, int]]:
    """(sequences, rows) of every prefill forward the engine runs from now on."""
    shapes, forward = [], engine.model.forward

    def spy(ids, positions, slots, *args, **kwargs):
        if ids.shape[1] > 1:
            shapes.append((slots.shape[0], ids.shape[1]))
        return forward(ids, positions, slots, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", spy)
    return shapes


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_gives_the_samples_of_one_prefill(chunk):
    ps = [prompt(1, 50), prompt(2, 9), prompt(3, 33)]
    sampling = SamplingParams(temperature=0.9, max_tokens=5, n=2, seed=11, return_routed_experts=True)
    whole = RolloutEngine.from_pretrained("tiny", **ARGS).generate(ps, sampling)
    engine = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=chunk, **ARGS)
    chunked = engine.generate(ps, sampling)
    # No forward holds more than the budget (a prompt's last chunk shares its forward with the next prompts).
    assert engine.stats.prefill_forwards >= -(-sum(len(p) for p in ps) // chunk)
    assert engine.stats.prefill_rows <= chunk * engine.stats.prefill_forwards
    assert engine.stats.prefill_tokens == sum(len(p) for p in ps)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    for a, b in zip(chunked, whole, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert a.routed_experts.shape == (a.num_prompt_tokens + len(a.token_ids) - 1, 2, 4)
        # A near-tie of router logits may flip between chunkings (FP32 rounding); anything more is a bug.
        assert (a.routed_experts != b.routed_experts).mean() < 0.01


def test_each_step_prefills_one_forward_filled_to_the_budget():
    """A step's prefill is one forward of up to the budget: the rest of the prompt in progress, whole prompts in
    order, then the first that does not fit as a chunk, continued at the next step's start. Prompts never cost a
    forward of their own for a leftover (the schedule before packing split them into two forwards)."""
    ps = [prompt(8, 6), prompt(9, 6), prompt(10, 25), prompt(11, 4)]
    sampling = SamplingParams(temperature=0.8, max_tokens=3, seed=5)
    engine = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=10, **ARGS)
    for i, p in enumerate(ps):
        engine.add_request(p, sampling, prompt_index=i)
    forwards, got = [], []
    while engine.has_unfinished():
        before = engine.stats.prefill_forwards, engine.stats.prefill_tokens
        got += engine.step()
        forwards.append((engine.stats.prefill_forwards - before[0], engine.stats.prefill_tokens - before[1]))
    # 6 + 4 of the second 6; its 2 + 8 of the 25; 10 of it; its last 7 + 3 of the 4 (7 + 4 > 10); the 4's last 1.
    assert forwards[:5] == [(1, 10), (1, 10), (1, 10), (1, 10), (1, 1)]
    assert engine.stats.prefill_forwards == 5 and engine.stats.prefill_rows == engine.stats.prefill_tokens == 41
    whole = RolloutEngine.from_pretrained("tiny", **ARGS).generate(ps, sampling)
    assert [r.token_ids for r in sorted(got, key=lambda r: r.prompt_index)] == [r.token_ids for r in whole]


def test_prefill_rows_round_up_to_a_multiple_of_16_where_budget_and_context_allow(monkeypatch):
    """Packed whole prompts and chunks are padded to ROW_MULTIPLE rows (fewer kernel variants on the GPU) unless that
    would pass the budget or max_model_len; the samples are those of unpadded forwards."""
    assert ROW_MULTIPLE == 16
    assert [padded_len(n, budget, limit) for n, budget, limit in [
        (5, 64, 96), (16, 64, 96), (17, 64, 96), (33, 40, 96), (35, 64, 40), (7, 10, 96)]] == [
        16, 16, 32, 33, 35, 7]  # 48 > budget 40; 48 > the limit 40; 16 > budget 10
    ps = [prompt(12, 5), prompt(13, 17), prompt(14, 70)]
    sampling = SamplingParams(temperature=0.9, max_tokens=4, n=2, seed=3, return_routed_experts=True)
    unpadded = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=15, **ARGS)  # 16 never fits: no padding
    want = unpadded.generate(ps, sampling)
    assert unpadded.stats.prefill_rows == unpadded.stats.prefill_tokens
    engine = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=32, **ARGS)
    shapes = record_shapes(monkeypatch, engine)
    got = engine.generate(ps, sampling)
    # 5 and 17 packed (22 rows -> 32), then the 70 in chunks of 32, 32 and 6 -> 16 once their slots are free.
    assert shapes == [(2, 32), (1, 32), (1, 32), (1, 16)]
    assert engine.stats.prefill_rows == 112 and engine.stats.prefill_tokens == 92
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert a.routed_experts.shape == b.routed_experts.shape
        assert (a.routed_experts != b.routed_experts).mean() < 0.01  # near-ties only, as above


def test_whole_prompts_pack_into_one_row_in_arrival_order(monkeypatch):
    """10 + 30 fill the budget of 40 exactly (the 9 waits: 49 > 40; 40 rounds to 48 > 40, so no padding), then
    9 + 12 in 21 rows, rounded to 32; no row pads a prompt to another's length."""
    ps = [prompt(20 + i, n) for i, n in enumerate([10, 30, 9, 12])]
    sampling = SamplingParams(temperature=0.9, max_tokens=3, seed=4, return_routed_experts=True)
    engine = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=40, **ARGS)
    shapes = record_shapes(monkeypatch, engine)
    got = engine.generate(ps, sampling)
    assert shapes == [(2, 40), (2, 32)]
    assert engine.stats.prefill_rows == 72 and engine.stats.prefill_tokens == 61
    want = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=15, **ARGS).generate(ps, sampling)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert a.routed_experts.shape == b.routed_experts.shape
        assert (a.routed_experts != b.routed_experts).mean() < 0.01


def test_live_sequences_decode_while_a_long_prompt_is_prefilled():
    engine = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=8, **ARGS)
    short = SamplingParams(temperature=0.0, max_tokens=30)
    engine.add_request(prompt(4, 5), short, prompt_index=0, request_id="short")
    engine.step()  # the short prompt's whole prefill, then its first decode
    engine.add_request(prompt(5, 60), SamplingParams(temperature=0.0, max_tokens=3, n=2), prompt_index=1,
                       request_id="long")
    decoded = engine.stats.decode_tokens
    for i in range(1, 8):  # 60 tokens at 8 a step: the long prompt is in progress for 8 steps
        engine.step()
        assert engine.stats.decode_tokens == decoded + i  # the short sequence got a token every step
        assert engine.num_live == 3  # 1 decoding + the 2 slots of the request in progress
    done = drain(engine)
    assert {r.request_id for r in done} == {"short", "long"}
    alone = RolloutEngine.from_pretrained("tiny", **ARGS).generate([prompt(5, 60)],
                                                                  SamplingParams(temperature=0.0, max_tokens=3, n=2))
    assert [r.token_ids for r in done if r.request_id == "long"] == [r.token_ids for r in alone]


def test_abort_and_drain_see_the_request_being_prefilled():
    engine = RolloutEngine.from_pretrained("tiny", max_prefill_tokens=10, **ARGS)
    engine.add_request(prompt(6, 40), SamplingParams(max_tokens=4, n=3, seed=1), request_id="r")
    engine.add_request(prompt(7, 6), SamplingParams(max_tokens=4, n=2, seed=1), request_id="w")
    engine.step()
    assert engine.num_live == 3 and engine.has_unfinished()
    engine.step(admit=False)  # draining: the request in progress goes on, no new one starts
    assert engine.num_live == 3
    aborted = engine.abort("r")
    assert [(r.sample_index, r.finish_reason, r.token_ids) for r in aborted] == [(j, "abort", []) for j in range(3)]
    assert engine.num_live == 0
    rest = drain(engine)  # the freed slots take the waiting request
    assert [(r.request_id, len(r.token_ids)) for r in rest] == [("w", 4), ("w", 4)]


def test_max_prefill_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        RolloutEngine.from_pretrained("tiny", max_prefill_tokens=0, **ARGS)
    with pytest.raises(ValueError, match=r"engine\.max_prefill_tokens=0"):
        EngineConfig(max_prefill_tokens=0)
