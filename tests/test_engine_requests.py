"""The engine's request API (add_request / step / abort), which the rollout workers drive: requests that
arrive while others decode, per-request sampling, timing fields, and abort."""

import pytest
import torch

from composer_rollout.engine import RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def engine_args():
    return dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)


def prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 10, (count,), generator=gen)]


def drain(engine) -> list:
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return out


def test_late_arrivals_get_the_same_samples_as_a_batch_run(engine_args):
    ps = prompts(1, 4)
    sampling = SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=7)
    batch = RolloutEngine.from_pretrained("tiny", **engine_args).generate(ps, sampling)
    live = RolloutEngine.from_pretrained("tiny", **engine_args)
    live.add_request(ps[0], sampling, prompt_index=0)
    got = live.step() + live.step()  # prompt 0 is decoding when the others arrive
    for i in range(1, 4):
        live.add_request(ps[i], sampling, prompt_index=i, request_id=f"p{i}")
    got = sorted(got + drain(live), key=lambda r: (r.prompt_index, r.sample_index))
    assert [(r.prompt_index, r.sample_index, r.token_ids) for r in got] == \
        [(r.prompt_index, r.sample_index, r.token_ids) for r in batch]
    for x, y in zip(got, batch, strict=True):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert {r.request_id for r in got if r.prompt_index > 0} == {"p1", "p2", "p3"}
    for r in got:
        assert 0 < r.ttft_s <= r.latency_s


def test_each_request_keeps_its_own_sampling(engine_args):
    engine = RolloutEngine.from_pretrained("tiny", **engine_args)
    p = prompts(2, 1)[0]
    engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=3), prompt_index=0)
    engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=9, n=2, seed=3), prompt_index=1)
    done = {(r.prompt_index, r.sample_index): r for r in drain(engine)}
    assert len(done[0, 0].token_ids) == 3 and len(done[1, 0].token_ids) == 9
    greedy = RolloutEngine.from_pretrained("tiny", **engine_args).generate([p], SamplingParams(temperature=0.0,
                                                                                             max_tokens=3))
    assert done[0, 0].token_ids == greedy[0].token_ids


def test_abort_returns_partial_samples_and_frees_their_slots(engine_args):
    engine = RolloutEngine.from_pretrained("tiny", **engine_args)
    ps = prompts(3, 3)
    sampling = SamplingParams(temperature=1.0, max_tokens=40, n=2, seed=5)
    for i, p in enumerate(ps):
        engine.add_request(p, sampling, prompt_index=i, request_id=f"r{i}")
    engine.step()
    engine.step()  # r0 and r1 hold all 4 slots; r2 waits
    aborted = engine.abort("r0") + engine.abort("r2")
    assert sorted((r.request_id, r.sample_index) for r in aborted) == [("r0", 0), ("r0", 1), ("r2", 0), ("r2", 1)]
    assert all(r.finish_reason == "abort" for r in aborted)
    # Each step admits (prefill: token 1) and then decodes every live sequence: 3 tokens after two steps.
    assert [len(r.token_ids) for r in aborted if r.request_id == "r0"] == [3, 3]
    assert [len(r.token_ids) for r in aborted if r.request_id == "r2"] == [0, 0]  # never admitted
    assert engine.num_live == 2 and engine.abort("nope") == []
    rest = drain(engine)
    assert sorted((r.request_id, r.finish_reason) for r in rest) == [("r1", "length"), ("r1", "length")]


def test_add_request_checks_before_queueing(engine_args):
    engine = RolloutEngine.from_pretrained("tiny", **engine_args)
    with pytest.raises(ValueError, match="prompt 7 has 64 tokens"):
        engine.add_request([5] * 64, SamplingParams(), prompt_index=7)
    with pytest.raises(ValueError, match="n=5 exceeds"):
        engine.add_request([5, 6], SamplingParams(n=5))
    assert not engine.has_unfinished()
    engine.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([[5, 6]], SamplingParams())
