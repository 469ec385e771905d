"""SamplingParams validation and the batched sampler: greedy rows, logprob definition (full-vocab
log_softmax(logits / T)), top-k and top-p filtering, the empirical distribution against softmax,
batch-position independence of (seed, step) draws, and the determinism of the Gumbel noise."""

import math

import pytest
import torch

from composer_rollout.engine.sampling import FINISH_REASONS, SamplingParams, gumbel_noise, sample


def rand_logits(seed: int, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def call(logits, temperature=1.0, top_k=0, top_p=1.0, seeds=None, steps=None):
    """sample() with scalar or per-row parameters broadcast to the batch."""
    B = logits.shape[0]

    def col(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.expand(B).clone() if t.dim() == 0 else t

    seeds = torch.arange(B, dtype=torch.int64) * 7919 + 3 if seeds is None else col(seeds, torch.int64)
    steps = torch.zeros(B, dtype=torch.int64) if steps is None else col(steps, torch.int64)
    return sample(logits, col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32),
                  seeds, steps)


# ----------------------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_tokens", 0), ("n", 0), ("seed", -1),
    ("stop_token_ids", [3, -2]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_stop_token_ids_that_is_not_a_list_names_the_field():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)


def test_valid_sampling_params_and_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.n, p.seed, p.stop_token_ids) == (1.0, 1.0, 0, 1, None, [])
    q = SamplingParams(temperature=0, top_p=1, top_k=5, max_tokens=1, n=8, seed=2**63 - 1, stop_token_ids=[0, 7])
    assert q.temperature == 0 and q.seed == 2**63 - 1 and q.stop_token_ids == [0, 7]
    assert set(FINISH_REASONS) == {"stop", "length", "abort"}


# ----------------------------------------------------------------------------------------- sampler


def test_greedy_rows_return_argmax_and_unscaled_logprobs():
    logits = rand_logits(0, 32, 300, scale=0.3)  # flat: a sampled row would rarely hit the argmax
    temps = torch.tensor([0.0, 0.7, 0.0, 1.3] * 8)
    top_k = torch.tensor([0, 0, 3, 0] * 8)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.3, 1.0, 1.0, 1.0] * 4)
    tokens, logprobs = call(logits, temperature=temps, top_k=top_k, top_p=top_p, steps=torch.arange(32))
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert (tokens[~greedy] != logits[~greedy].argmax(-1)).sum() > 10
    expected = torch.log_softmax(logits[greedy], -1).gather(1, tokens[greedy][:, None]).squeeze(1)
    torch.testing.assert_close(logprobs[greedy], expected, rtol=0, atol=1e-6)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32


def test_unfiltered_fast_path_gives_the_filtered_paths_tokens_when_no_row_filters():
    """The engine skips the sort when no row has top_k > 0 or top_p < 1: the same tokens and logprobs."""
    logits = rand_logits(1, 24, 1000)
    B = logits.shape[0]
    temps = torch.tensor([0.0, 0.6, 1.0, 1.7] * 6)
    args = (temps, torch.zeros(B, dtype=torch.int64), torch.ones(B), torch.arange(B) * 7 + 1, torch.arange(B) * 3)
    slow, fast = sample(logits, *args), sample(logits, *args, filtered=False)
    assert torch.equal(slow[0], fast[0]) and torch.equal(slow[1], fast[1])
    assert len(set(fast[0].tolist())) > 12  # sampled rows, not all argmax


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (0.5, 0, 0.6)])
def test_logprobs_are_full_vocab_log_softmax_of_scaled_logits(temperature, top_k, top_p):
    logits = rand_logits(1, 64, 50)
    tokens, logprobs = call(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                            steps=torch.arange(64) % 5)
    expected = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    assert (logprobs <= 0).all() and torch.isfinite(logprobs).all()


def test_top_k_one_is_argmax():
    logits = rand_logits(2, 200, 80)
    tokens, _ = call(logits, temperature=2.0, top_k=1, steps=torch.arange(200))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_only_yields_the_k_largest(k):
    logits = rand_logits(3, 8, 40, scale=0.5)  # flat: without the filter most tokens would appear
    seen = [set() for _ in range(8)]
    for step in range(150):
        tokens, _ = call(logits, temperature=1.0, top_k=k, seeds=torch.arange(8) * 1000 + 17,
                         steps=torch.full((8,), step))
        for row, t in enumerate(tokens.tolist()):
            seen[row].add(t)
    for row in range(8):
        allowed = set(logits[row].topk(k).indices.tolist())
        assert seen[row] <= allowed
        assert seen[row] == allowed  # 150 draws over k near-equal tokens reach them all


def test_small_top_p_keeps_only_the_top_token():
    logits = rand_logits(4, 300, 64, scale=0.3)
    tokens, _ = call(logits, temperature=1.0, top_p=1e-6, steps=torch.arange(300))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("top_p,kept", [(0.45, 1), (0.6, 2), (0.74, 2), (0.8, 3), (0.92, 4), (1.0, 5)])
def test_top_p_keeps_exactly_the_minimal_prefix(top_p, kept):
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])  # cumulative 0.5, 0.75, 0.9, 0.97, 1.0
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(5))
    logits = torch.log(probs)[perm][None].expand(4000, -1).contiguous()
    tokens, _ = call(logits, temperature=1.0, top_p=top_p, seeds=torch.arange(4000) + 11)
    expected_ids = set(perm.argsort()[:kept].tolist())  # positions of the `kept` largest probabilities
    counts = torch.bincount(tokens, minlength=5).float() / 4000
    assert {i for i in range(5) if counts[i] > 0} == expected_ids
    # What survives is sampled from the renormalised distribution.
    renorm = torch.zeros(5)
    renorm[perm.argsort()[:kept]] = probs[:kept] / probs[:kept].sum()
    assert (counts - renorm).abs().max() < 0.03


def test_temperature_one_matches_softmax_empirically():
    logits = torch.tensor([[1.2, -0.3, 0.4, 0.0, -1.5]])
    draws = []
    for step in range(100):  # 200 seeds x 100 steps = 20000 draws
        tokens, _ = call(logits.expand(200, -1), seeds=torch.arange(200) * 104729 + 1, steps=torch.full((200,), step))
        draws.append(tokens)
    freq = torch.bincount(torch.cat(draws), minlength=5).double() / 20000
    p = torch.softmax(logits[0].double(), -1)
    assert (freq - p).abs().max() < 0.012  # ~4 standard deviations at 20000 draws
    chi2 = (20000 * (freq - p) ** 2 / p).sum().item()
    assert chi2 < 20.5  # chi-square with 4 degrees of freedom, p ~ 4e-4


def test_temperature_scales_the_sampled_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0]]).expand(6000, -1)
    for temperature in (0.5, 2.0):
        tokens, _ = call(logits, temperature=temperature, seeds=torch.arange(6000) * 31 + 5)
        freq = torch.bincount(tokens, minlength=3).double() / 6000
        p = torch.softmax(logits[0].double() / temperature, -1)
        assert (freq - p).abs().max() < 0.025


def test_same_seed_and_step_give_same_token_wherever_the_row_sits():
    V = 97
    target = rand_logits(6, 1, V, scale=0.5)[0]
    seed, step = 123456789012, 7
    alone, lp_alone = call(target[None], temperature=0.9, top_k=20, top_p=0.95, seeds=[seed], steps=[step])
    for trial, position in enumerate([0, 3, 9]):
        others = rand_logits(100 + trial, 10, V, scale=0.5)
        others[position] = target
        temps = torch.rand(10, generator=torch.Generator().manual_seed(trial)) + 0.2
        temps[position] = 0.9
        top_k = torch.randint(0, 30, (10,), generator=torch.Generator().manual_seed(trial))
        top_k[position] = 20
        top_p = torch.full((10,), 0.8)
        top_p[position] = 0.95
        seeds = torch.randint(0, 2**62, (10,), generator=torch.Generator().manual_seed(50 + trial))
        seeds[position] = seed
        steps = torch.randint(0, 50, (10,), generator=torch.Generator().manual_seed(60 + trial))
        steps[position] = step
        tokens, logprobs = call(others, temperature=temps, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps)
        assert tokens[position] == alone[0]
        assert logprobs[position] == lp_alone[0]


def test_draws_depend_on_seed_and_step():
    logits = rand_logits(7, 1, 1000, scale=0.1).expand(64, -1)
    by_seed, _ = call(logits, seeds=torch.arange(64) + 1000, steps=torch.zeros(64))
    by_step, _ = call(logits, seeds=torch.full((64,), 1000), steps=torch.arange(64))
    assert len(set(by_seed.tolist())) > 55  # near-uniform over 1000 tokens: few collisions
    assert len(set(by_step.tolist())) > 55


def test_gumbel_noise_is_deterministic_and_varies_with_seed_and_step():
    seeds = torch.tensor([0, 1, 2**40 + 1, 2**62 + 5, 1, 1], dtype=torch.int64)
    steps = torch.tensor([0, 0, 0, 0, 1, 2], dtype=torch.int64)
    a = gumbel_noise(seeds, steps, 4096)
    b = gumbel_noise(seeds.clone(), steps.clone(), 4096)
    assert a.shape == (6, 4096) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert torch.isfinite(a).all()
    # A row depends on its own (seed, step) alone.
    assert torch.equal(gumbel_noise(seeds[3:4], steps[3:4], 4096)[0], a[3])
    for i in range(6):
        for j in range(i + 1, 6):
            assert not torch.equal(a[i], a[j]), (i, j)
            assert (a[i] == a[j]).float().mean() < 0.01
    # Seeds that differ only in their high 32 bits differ too.
    hi = gumbel_noise(torch.tensor([5, 5 + 2**33]), torch.zeros(2, dtype=torch.int64), 512)
    assert not torch.equal(hi[0], hi[1])
    # Gumbel(0, 1): mean is the Euler-Mascheroni constant, variance pi^2 / 6.
    many = gumbel_noise(torch.arange(64, dtype=torch.int64) * 977, torch.zeros(64, dtype=torch.int64), 4096).double()
    assert abs(many.mean().item() - 0.5772) < 0.01
    assert abs(many.var().item() - math.pi**2 / 6) < 0.03


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "max_tokens", "n", "seed"])
def test_bools_are_not_numbers(field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: True})
