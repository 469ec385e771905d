"""The fused unfiltered sampler (kernels/gumbel_sample.py) against its torch form: the same tokens row for row
(sampled rows at several temperatures, greedy rows, seeds past 2^32, several chunks of the vocabulary with a
ragged last one), logprobs within FP32 rounding, ties to the lower index, and bad arguments refused by name.
On the GPU the noise is bit-identical (libdevice's logf, as torch's), so the tokens match at the real vocabulary."""

import pytest
import torch

from kernels.gumbel_sample import gumbel_sample, gumbel_sample_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows(B, V, seed, scale=3.0):
    """Random logits and per-row params: temperatures mixed with greedy rows, 62-bit seeds, varied steps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * scale
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.7, 0.25])[torch.arange(B) % 5]
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    steps = torch.randint(0, 100_000, (B,), generator=g)
    return [t.to(DEVICE) for t in (logits, temperature, seeds, steps)]


@pytest.mark.parametrize("B,V", [(1, 700), (13, 2048), (6, 5001)])
def test_matches_the_torch_form(B, V):
    args = rows(B, V, seed=B * 7 + V)
    tokens, logprobs = gumbel_sample(*args)
    want_tokens, want_logprobs = gumbel_sample_reference(*args)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and tokens.shape == (B,)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=2e-6)


def test_draws_follow_seed_and_step_and_are_not_the_argmax():
    """Many draws of one row's logits: the tokens change with the seed and with the step and spread over the
    vocabulary (a kernel that ignored its noise, or hashed every row alike, would return the argmax or repeat)."""
    V, B = 64, 48
    logits = torch.linspace(0, 1, V, device=DEVICE).expand(B, V).contiguous()
    ones, count = torch.ones(B, device=DEVICE), torch.arange(B, device=DEVICE)
    for seeds, steps in ((count * 977, torch.zeros_like(count)), (torch.full_like(count, 5), count)):
        tokens, _ = gumbel_sample(logits, ones, seeds, steps)
        assert len(set(tokens.tolist())) > 16
        assert torch.equal(tokens, gumbel_sample_reference(logits, ones, seeds, steps)[0])


def test_greedy_ties_go_to_the_lower_index_across_chunks():
    """Equal maxima in two chunks of the vocabulary: the greedy token is the first, as torch.argmax's."""
    V = 5000
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits[:, [2100, 4500]] = 50.0
    logits[1, 40] = 50.0
    zeros = torch.zeros(2, device=DEVICE)
    tokens, logprobs = gumbel_sample(logits, zeros, torch.zeros(2, dtype=torch.long, device=DEVICE),
                                     torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert tokens.tolist() == [2100, 40]
    want = torch.log_softmax(logits, -1)[torch.arange(2), tokens]
    torch.testing.assert_close(logprobs, want, rtol=0, atol=2e-6)


def test_empty_batch_and_bad_arguments():
    logits, temperature, seeds, steps = rows(3, 300, seed=1)
    tokens, logprobs = gumbel_sample(logits[:0], temperature[:0], seeds[:0], steps[:0])
    assert tokens.shape == (0,) and logprobs.shape == (0,)
    with pytest.raises(TypeError, match="logits"):
        gumbel_sample(logits.bfloat16(), temperature, seeds, steps)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_sample(logits, temperature[:2], seeds, steps)
    with pytest.raises(TypeError, match="seeds"):
        gumbel_sample(logits, temperature, seeds.int(), steps)
    with pytest.raises(ValueError, match="logits"):
        gumbel_sample(logits[0], temperature, seeds, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_real_vocabulary_on_the_gpu(B):
    """Qwen3's 151,936-word vocabulary: every token as the torch form's (the noise is bit-identical there)."""
    for seed in range(4):
        args = rows(B, 151_936, seed=seed, scale=1.0 + seed)
        tokens, logprobs = gumbel_sample(*args)
        want_tokens, want_logprobs = gumbel_sample_reference(*args)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=5e-6)
