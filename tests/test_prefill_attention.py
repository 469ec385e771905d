"""kernels/prefill_attention.py against cache_attention_reference (FP32, same BF16 inputs).

CPU: Triton's interpreter at tiny irregular shapes (S and L not multiples of the blocks, G = 2 and 8, D = 32 and 16);
on a GPU machine the same cases run natively. Tolerance per element: one BF16 eps (2^-7) of |ref| + sum_j p_j |v_j|:
the interpreter truncates the output to BF16 (< 1 eps relative), the GPU rounds it (1/2 eps) and rounds P to BF16
for the P @ V dot (1/2 eps of each p_j, at most 1/2 eps of sum_j p_j |v_j|). Each check also asserts that an
off-by-one causal mask and (G > 1) the wrong GQA head mapping miss this tolerance by 4x somewhere, so it can tell.
The interpreter runs the kernel's while loops, the GPU its pipelined for loops (same body): only GPU runs cover those.
GPU (marker `gpu`): the Qwen3-30B-A3B shape (Hq 32, Hkv 4, D 128), a prompt and a chunk after a 1024 prefix.
"""

from itertools import pairwise

import pytest
import torch

from kernels.attention_reference import cache_attention_reference, packed_attention_reference
from kernels.prefill_attention import prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = torch.finfo(torch.bfloat16).eps


def _problem(B, S, Hq, Hkv, D, N, L, starts, slots, seed=0, dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=gen).bfloat16()
    k = torch.randn(N, L, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(N, L, Hkv, D, generator=gen).bfloat16()
    positions = torch.tensor(starts)[:, None] + torch.arange(S)
    return [t.to(DEVICE) for t in (q, k, v)] + [torch.tensor(slots, dtype=dtype, device=DEVICE),
                                                positions.to(dtype).to(DEVICE)]


def _run(q, k, v, slots, positions):
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(q, k, v, slots, positions, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "output elements left unwritten (NaN poison survived)"
    return out


def _check(out, q, k, v, slots, positions, discriminate=True):
    ref = cache_attention_reference(q, k, v, slots, positions)
    tol = EPS * (ref.abs() + cache_attention_reference(q, k, v.abs(), slots, positions)) + 1e-5
    err = (out.float() - ref).abs()
    excess = (err - tol).max().item()
    assert excess <= 0, f"max error {err.max().item():.3g}, beyond BF16 rounding by up to {excess:.3g}"
    if not discriminate:
        return
    L, Hkv, Hq = k.shape[1], k.shape[2], q.shape[2]
    wrong = {"off-by-one mask": cache_attention_reference(q, k, v, slots, (positions + 1).clamp(max=L - 1))}
    if 1 < Hkv < Hq:  # otherwise h % Hkv and h // G are the same head
        heads = torch.arange(Hq, device=k.device) % Hkv
        wrong["GQA h % Hkv"] = cache_attention_reference(q, k[:, :, heads], v[:, :, heads], slots, positions)
    for name, w in wrong.items():
        assert ((w - ref).abs() > 4 * tol).any(), f"the tolerance cannot tell a kernel with a {name} apart"


CASES = {
    # name: (B, S, Hq, Hkv, D, N, L, starts, slots)
    "prompt": (1, 45, 4, 2, 32, 3, 77, [0], [1]),
    "chunk_after_prefix": (1, 7, 4, 2, 32, 3, 77, [38], [0]),
    "decode_like": (2, 1, 4, 2, 32, 3, 77, [40, 5], [2, 0]),
    "three_rows_g8": (3, 7, 8, 1, 16, 4, 61, [0, 20, 50], [2, 0, 3]),  # slot 3: the scratch slot (N - 1)
}


@pytest.mark.parametrize("case", CASES)
def test_against_reference(case):
    args = _problem(*CASES[case])
    _check(_run(*args), *args)


def test_padding_row_and_irregular_positions():
    """Row 1 is padding (every position 0); row 0's positions are not contiguous, row 2 runs past L (reads L - 1)."""
    q, k, v, slots, positions = _problem(3, 9, 4, 2, 32, 4, 45, [3, 0, 40], [0, 3, 1])
    positions[1] = 0
    positions[0] = torch.tensor([30, 2, 2, 17, 0, 44, 9, 8, 31])
    args = (q, k, v, slots, positions)
    out = _run(*args)
    _check(out, q, k, v, slots, positions.clamp(max=k.shape[1] - 1))


def test_no_leak_past_position():
    """Every cache entry no query may read (past each row's largest position, and unused slots) set to 1e4, then to
    NaN: the output is bit-identical to the clean cache's. NaN shows those entries never reach the arithmetic."""
    q, k, v, slots, positions = _problem(3, 7, 4, 2, 32, 5, 77, [0, 30, 60], [4, 1, 2])
    clean = _run(q, k, v, slots, positions)
    _check(clean, q, k, v, slots, positions)
    for poison in (1e4, float("nan")):
        kp, vp = k.clone(), v.clone()
        reach = torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)
        for b in range(q.shape[0]):
            reach[slots[b], : positions[b].max() + 1] = True
        kp[~reach], vp[~reach] = poison, poison
        assert torch.equal(_run(q, kp, vp, slots, positions), clean), f"cache entries set to {poison} leaked in"


@pytest.mark.parametrize("cut", [17, 40])
def test_chunked_prefill_equals_one_call(cut):
    """A 45-token prompt in one call vs chunks [0, cut) and [cut, 45): bit-identical (cut not block-aligned)."""
    q, k, v, slots, positions = _problem(1, 45, 4, 2, 32, 2, 50, [0], [1])
    whole = _run(q, k, v, slots, positions)
    parts = [_run(q[:, a:b].contiguous(), k, v, slots, positions[:, a:b].contiguous()) for a, b in ((0, cut),
                                                                                                   (cut, 45))]
    assert torch.equal(torch.cat(parts, dim=1), whole)


@pytest.mark.parametrize("G", [2, 8])
def test_packed_sequences_equal_one_call_each(G):
    """Three sequences back to back in one row (prefill_attention's `packed`): lengths 9, 1 and 20, one a chunk after
    a cached prefix, on their own slots; bit-identical to one call per sequence and within BF16 rounding of the
    reference. Output rows are NaN-poisoned first, so a token left unwritten shows."""
    Hkv = 2 if G == 2 else 1
    lens, firsts, slot_list = [9, 1, 20], [0, 7, 30], [2, 0, 1]
    T = sum(lens)
    q, k, v, _, _ = _problem(1, T, G * Hkv, Hkv, 32, 3, 61, [0], [0], seed=3)
    positions = torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, lens, strict=True)])[None].to(DEVICE)
    slots = torch.tensor(slot_list, device=DEVICE)
    starts = torch.tensor([0, 9, 10, 30], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k, v, slots, positions, out=out, packed=(starts, max(lens)))
    assert torch.isfinite(out).all(), "a packed token's output was left unwritten"
    alone = [_run(q[:, a:b].contiguous(), k, v, slots[i:i + 1], positions[:, a:b].contiguous())
             for i, (a, b) in enumerate(pairwise(starts.tolist()))]
    assert torch.equal(out, torch.cat(alone, dim=1))
    ref = packed_attention_reference(q, k, v, slots, positions, starts)
    tol = EPS * (ref.abs() + packed_attention_reference(q, k, v.abs(), slots, positions, starts)) + 1e-5
    assert ((out.float() - ref).abs() <= tol).all()
    with pytest.raises(ValueError, match="packed sequences come as one row"):
        prefill_attention(q.view(2, T // 2, G * Hkv, 32), k, v, slots, positions.view(2, T // 2),
                          packed=(starts, 20))
    with pytest.raises(ValueError, match="longest sequence"):
        prefill_attention(q, k, v, slots, positions, packed=(starts, T + 1))
    with pytest.raises(TypeError, match="seq_starts must be a torch.int32"):
        prefill_attention(q, k, v, slots, positions, packed=(starts.long(), 20))


def test_index_dtypes_and_determinism():
    args64 = _problem(2, 13, 8, 1, 16, 3, 40, [0, 21], [2, 1], dtype=torch.int64)
    args32 = args64[:3] + [t.to(torch.int32) for t in args64[3:]]
    out = _run(*args32)
    assert torch.equal(out, _run(*args32)), "two calls differ"
    assert torch.equal(out, _run(*args64)), "int32 and int64 indices differ"
    _check(out, *args64)


def test_scale():
    q, k, v, slots, positions = _problem(1, 5, 4, 2, 32, 2, 20, [3], [0])
    out = prefill_attention(q, k, v, slots, positions, scale=0.3)
    ref = cache_attention_reference(q, k, v, slots, positions, scale=0.3)
    tol = EPS * (ref.abs() + cache_attention_reference(q, k, v.abs(), slots, positions, scale=0.3)) + 1e-5
    assert ((out.float() - ref).abs() <= tol).all()


def test_bad_input():
    q, k, v, slots, positions = _problem(1, 4, 4, 2, 32, 2, 20, [0], [0])
    with pytest.raises(TypeError, match="q must be a torch.bfloat16"):
        prefill_attention(q.float(), k, v, slots, positions)
    with pytest.raises(TypeError, match="v_cache must be a torch.bfloat16"):
        prefill_attention(q, k, v.half(), slots, positions)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple"):
        prefill_attention(q[:, :, :3].contiguous(), k, v, slots, positions)
    with pytest.raises(ValueError, match="q must be contiguous"):
        prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, slots, positions)
    with pytest.raises(ValueError, match="out must have shape"):
        prefill_attention(q, k, v, slots, positions, out=torch.empty_like(q[:, :3]))
    with pytest.raises(ValueError, match="positions must be int32 or int64"):
        prefill_attention(q, k, v, slots, positions.float())
    with pytest.raises(ValueError, match="slots must be"):
        prefill_attention(q, k, v, slots[:0], positions)


@pytest.mark.gpu
@pytest.mark.parametrize("S, start", [(1000, 0), (2048, 1024)])
def test_qwen3_30b_shape(S, start):
    args = _problem(1, S, 32, 4, 128, 3, 4096, [start], [1])
    _check(_run(*args), *args, discriminate=False)
