"""RolloutEngine on the tiny preset in FP32 on CPU: result count, order and fields; seeded
reproducibility across engines, batch compositions, slot counts and continuous batching; greedy
against a hand-written argmax loop; score() against generated logprobs; stop tokens, eos from the
model config, max_tokens and the context limit; input validation before any work; batch buckets;
and a BF16 engine."""

import math

import pytest
import torch

from composer_rollout.engine import RolloutEngine, SamplingParams, batch_buckets
from composer_rollout.model import Qwen3MoE, preset

VOCAB = 512
MAX_LEN = 64


def rand_prompts(seed: int, count: int, lo: int = 3, hi: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def tiny_model(**overrides) -> Qwen3MoE:
    """The same weights as from_pretrained("tiny", seed=0), with ModelArgs overrides (eos_token_id)."""
    return Qwen3MoE(preset("tiny", **overrides), dtype=torch.float32, device="cpu").init_random(0)


def spy_forward(monkeypatch, model) -> list[tuple[int, ...]]:
    """Record (sequences, tokens per sequence or, packed, in the row) of every model forward."""
    shapes, orig = [], model.forward

    def forward(input_ids, positions, slots, cache, capture=None, packed=None):
        shapes.append((slots.shape[0], input_ids.shape[1]))
        return orig(input_ids, positions, slots, cache, capture, packed)

    monkeypatch.setattr(model, "forward", forward)
    return shapes


def key(results):
    return [(r.prompt_index, r.sample_index, r.token_ids, r.finish_reason) for r in results]


def assert_same(a, b, atol=1e-5):
    """Same samples: identical tokens and finish reasons, logprobs within atol."""
    assert key(a) == key(b)
    for x, y in zip(a, b, strict=True):
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)), default=0.0) <= atol


def truncate_at(tokens: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="module")
def engine() -> RolloutEngine:
    return RolloutEngine.from_pretrained("tiny", device="cpu", dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def noeos() -> Qwen3MoE:
    """The tiny weights with no eos, so that only stop tokens and lengths end a sequence."""
    return tiny_model(eos_token_id=())


PROMPTS5 = rand_prompts(21, 5)
SAMPLING5 = SamplingParams(temperature=0.9, max_tokens=10, n=2, seed=2024)


@pytest.fixture(scope="module")
def reference5(engine):
    return engine.generate(PROMPTS5, SAMPLING5)


# ------------------------------------------------------------------------------------- results and fields


def test_results_count_order_and_fields(engine):
    prompts = rand_prompts(1, 4)
    results = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7))
    assert len(results) == 12
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(4) for j in range(3)]
    eos = set(engine.model.args.eos_token_id)
    assert eos == {1}
    for r in results:
        assert r.num_prompt_tokens == len(prompts[r.prompt_index])
        assert r.num_completion_tokens == len(r.token_ids) == len(r.logprobs)
        assert 1 <= len(r.token_ids) <= 8
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in r.token_ids)
        assert all(isinstance(lp, float) and math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
        assert r.weight_version == 0
        assert not eos & set(r.token_ids[:-1])
        if r.token_ids[-1] in eos:
            assert r.finish_reason == "stop"
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 8
    # The n samples of a prompt are different draws.
    for i in range(4):
        group = [tuple(r.token_ids) for r in results if r.prompt_index == i]
        assert len(set(group)) == 3


# ------------------------------------------------------------------------------------- reproducibility


def test_same_seed_reproduces_across_fresh_engines():
    prompts = rand_prompts(2, 3)
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=8, n=2, seed=99)
    a = RolloutEngine.from_pretrained("tiny", device="cpu", dtype="float32", max_model_len=MAX_LEN)
    b = RolloutEngine.from_pretrained("tiny", device="cpu", dtype="float32", max_model_len=MAX_LEN)
    ra, rb = a.generate(prompts, sampling), b.generate(prompts, sampling)
    assert ra == rb  # dataclass equality: tokens and logprobs bit for bit
    other = a.generate(prompts, SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=8, n=2, seed=100))
    assert [r.token_ids for r in other] != [r.token_ids for r in ra]


def test_prompt_alone_or_with_others_gives_the_same_samples(engine, reference5):
    alone = engine.generate(PROMPTS5[:1], SAMPLING5)
    assert_same(alone, reference5[:2])
    first3 = engine.generate(PROMPTS5[:3], SAMPLING5)
    assert_same(first3, reference5[:6])


@pytest.mark.parametrize("max_num_seqs", [3, 5])
def test_continuous_batching_matches_a_run_with_plenty_of_slots(monkeypatch, engine, reference5, max_num_seqs):
    """5 prompts x n=2 through 3 or 5 slots: groups wait for free slots, batches pad to other buckets."""
    small = RolloutEngine(engine.model, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN)
    shapes = spy_forward(monkeypatch, engine.model)
    results = small.generate(PROMPTS5, SAMPLING5)
    assert_same(results, reference5)
    prefills = [s for s in shapes if s[1] > 1]  # prompts have >= 3 tokens
    decodes = [s[0] for s in shapes if s[1] == 1]
    # Each prompt prefilled once (its n samples share the prompt's KV), whole prompts as many to a forward (packed
    # in one row) as have free slots (n = 2 each), decode batches are buckets.
    assert sum(s[0] for s in prefills) == len(PROMPTS5)
    assert max(s[0] for s in prefills) == max_num_seqs // 2
    # The counters the rollout summary prints: forwards, and rows computed (padding only to a multiple of 16).
    assert small.stats.prefill_forwards == len(prefills)
    assert small.stats.prefill_rows == sum(rows for _, rows in prefills)
    assert small.stats.prefill_tokens == sum(len(p) for p in PROMPTS5)
    assert set(decodes) <= set(small.buckets) and max(decodes) <= max_num_seqs
    assert len(shapes) == len(prefills) + len(decodes)


def test_seed_none_differs_per_call_and_follows_the_engine_seed(engine):
    prompts = rand_prompts(3, 2)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, n=2)
    e1, e2, e3 = (RolloutEngine(engine.model, max_num_seqs=4, max_model_len=MAX_LEN, seed=s) for s in (5, 5, 6))
    a1, a2 = e1.generate(prompts, sampling), e1.generate(prompts, sampling)
    b1, b2 = e2.generate(prompts, sampling), e2.generate(prompts, sampling)
    c1 = e3.generate(prompts, sampling)
    assert key(a1) == key(b1) and key(a2) == key(b2)
    assert [r.token_ids for r in a1] != [r.token_ids for r in a2]
    assert [r.token_ids for r in a1] != [r.token_ids for r in c1]


# ------------------------------------------------------------------------------------- greedy and score


def manual_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    cache = model.new_kv_cache(1, MAX_LEN)
    slot = torch.tensor([0])
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], slot, cache)[:, -1]
        for _ in range(max_tokens):
            logits = model.compute_logits(hidden)[0]
            tok = int(logits.argmax())
            tokens.append(tok)
            logprobs.append(torch.log_softmax(logits, -1)[tok].item())
            if tok in model.args.eos_token_id:
                break
            hidden = model(torch.tensor([[tok]]), torch.tensor([[len(ids)]]), slot, cache)[:, -1]
            ids.append(tok)
    return tokens, logprobs


def test_greedy_equals_a_manual_argmax_loop(engine):
    prompts = rand_prompts(4, 3)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, n=2))
    for r in results:
        tokens, logprobs = manual_greedy(engine.model, prompts[r.prompt_index], 12)
        assert r.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(r.logprobs, logprobs, strict=True)) < 1e-5
    for i in range(3):
        assert results[2 * i].token_ids == results[2 * i + 1].token_ids  # greedy: n samples agree


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_score_returns_the_generated_logprobs(engine, temperature):
    prompts = rand_prompts(5, 3)
    results = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=10, n=2, seed=3))
    scores = engine.score([prompts[r.prompt_index] for r in results], [r.token_ids for r in results],
                          temperature=temperature)
    assert [len(s) for s in scores] == [len(r.token_ids) for r in results]
    gap = max(abs(a - b) for r, s in zip(results, scores, strict=True) for a, b in zip(r.logprobs, s, strict=True))
    assert gap < 1e-5
    # A different temperature gives different logprobs: the definition really depends on it.
    other = engine.score([prompts[results[0].prompt_index]], [results[0].token_ids], temperature=temperature + 0.5)
    assert max(abs(a - b) for a, b in zip(other[0], results[0].logprobs, strict=True)) > 1e-3


def test_score_validation(engine):
    prompt = rand_prompts(6, 1)[0]
    assert engine.score([prompt], [[]]) == [[]]
    with pytest.raises(ValueError, match="2 completions"):
        engine.score([prompt], [[3], [4]])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.score([prompt], [[5] * MAX_LEN])
    with pytest.raises(ValueError, match=r"completion_token_ids\[0\]"):
        engine.score([prompt], [[VOCAB]])


# ------------------------------------------------------------------------------------- finishing


def test_stop_token_ends_each_sample_at_its_first_occurrence(noeos):
    eng = RolloutEngine(noeos, max_num_seqs=8, max_model_len=MAX_LEN)
    prompt = rand_prompts(7, 1)[0]
    sampling = dict(temperature=1.0, max_tokens=12, n=3, seed=17)
    base = eng.generate([prompt], SamplingParams(**sampling))
    first = base[0].token_ids
    cut = next(i for i in range(2, len(first)) if first[i] not in first[:i])  # the 3rd token unless it repeats
    stop = first[cut]
    stopped = eng.generate([prompt], SamplingParams(**sampling, stop_token_ids=[stop]))
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == first[: cut + 1] and stopped[0].token_ids[-1] == stop
    for b, s in zip(base, stopped, strict=True):  # the other samples stop at their own first `stop`, or run on
        assert s.token_ids == truncate_at(b.token_ids, {stop})
        torch.testing.assert_close(s.logprobs, b.logprobs[: len(s.token_ids)], rtol=0, atol=1e-5)
        assert s.finish_reason == ("stop" if stop in b.token_ids else "length")


def test_eos_from_the_model_config_stops(noeos):
    prompts = rand_prompts(8, 2)
    sampling = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=5)
    base = RolloutEngine(noeos, max_num_seqs=4, max_model_len=MAX_LEN).generate(prompts, sampling)
    first = base[0].token_ids
    eos = next(first[i] for i in range(2, len(first)) if first[i] not in first[:i])
    with_eos = tiny_model(eos_token_id=(eos,))
    results = RolloutEngine(with_eos, max_num_seqs=4, max_model_len=MAX_LEN).generate(prompts, sampling)
    assert results[0].finish_reason == "stop" and results[0].token_ids[-1] == eos
    for b, r in zip(base, results, strict=True):
        assert r.token_ids == truncate_at(b.token_ids, {eos})
        assert r.finish_reason == ("stop" if eos in b.token_ids else "length")


def test_max_tokens_gives_length_and_the_exact_count(noeos):
    eng = RolloutEngine(noeos, max_num_seqs=8, max_model_len=MAX_LEN)
    for max_tokens in (1, 5):
        results = eng.generate(rand_prompts(9, 3), SamplingParams(max_tokens=max_tokens, n=2, seed=1))
        assert all(r.finish_reason == "length" and r.num_completion_tokens == max_tokens for r in results)


def test_context_limit_ends_with_length(noeos):
    eng = RolloutEngine(noeos, max_num_seqs=4, max_model_len=16)
    prompts = rand_prompts(10, 2, lo=10, hi=10) + rand_prompts(11, 1, lo=15, hi=15)
    results = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=100, n=2, seed=4))
    assert [r.num_completion_tokens for r in results] == [6, 6, 6, 6, 1, 1]
    assert all(r.finish_reason == "length" for r in results)
    assert all(r.num_prompt_tokens + r.num_completion_tokens == 16 for r in results)


# ------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("prompt_len", [16, 17, 40])
def test_prompt_at_or_over_the_context_raises_before_any_work(monkeypatch, engine, prompt_len):
    eng = RolloutEngine(engine.model, max_num_seqs=4, max_model_len=16)
    shapes = spy_forward(monkeypatch, engine.model)
    prompts = rand_prompts(12, 1) + rand_prompts(13, 1, lo=prompt_len, hi=prompt_len)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]"):
        eng.generate(prompts, SamplingParams(max_tokens=4, seed=0))
    assert shapes == []
    assert not eng.cache.k.any() and not eng.cache.v.any()


@pytest.mark.parametrize("prompts,sampling,match", [
    ([[5, 6], []], SamplingParams(), r"prompt_token_ids\[1\]"),
    ([[5, VOCAB]], SamplingParams(), rf"prompt_token_ids\[0\].*{VOCAB}"),
    ([[7, 8], [9, -1]], SamplingParams(), r"prompt_token_ids\[1\].*-1"),
    ([[5, 6]], SamplingParams(n=5), r"SamplingParams\.n=5"),
])
def test_invalid_requests_raise_naming_the_field(monkeypatch, engine, prompts, sampling, match):
    eng = RolloutEngine(engine.model, max_num_seqs=4, max_model_len=16)
    shapes = spy_forward(monkeypatch, engine.model)
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, sampling)
    assert shapes == [] and not eng.cache.k.any()


def test_engine_construction_validation(engine):
    with pytest.raises(ValueError, match="max_num_seqs"):
        RolloutEngine(engine.model, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutEngine(engine.model, max_model_len=engine.model.args.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutEngine(engine.model, max_model_len=1)
    with pytest.raises(ValueError, match="dtype"):
        RolloutEngine.from_pretrained("tiny", device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="nope"):
        RolloutEngine.from_pretrained("nope", device="cpu")


def test_max_model_len_zero_raises(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutEngine(engine.model, max_model_len=0)


def test_score_rejects_a_negative_temperature(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.score([[3, 4, 5]], [[6, 7]], temperature=-1.0)


# ------------------------------------------------------------------------------------- buckets, BF16


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]
    assert batch_buckets(128) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
    assert batch_buckets(200) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 200]
    for n in range(1, 300):
        b = batch_buckets(n)
        assert b == sorted(set(b)) and b[-1] == n and b[0] == 1


@pytest.mark.parametrize("weight_dtype", ["bf16", "mxfp8"])
def test_bf16_engine_generates(weight_dtype):
    eng = RolloutEngine.from_pretrained("tiny", device="cpu", weight_dtype=weight_dtype, max_model_len=MAX_LEN)
    assert eng.model.dtype == torch.bfloat16 and eng.model.weight_dtype == weight_dtype
    prompts = rand_prompts(14, 2)
    sampling = SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=8)
    results = eng.generate(prompts, sampling)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r.num_completion_tokens == len(r.token_ids) == len(r.logprobs) >= 1
        assert r.finish_reason == "length" or r.token_ids[-1] == 1
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
    assert eng.generate(prompts, sampling) == results
