"""kernels/qk_norm_rope.py against its FP32 reference and against the model's BF16 torch ops.

CPU: Triton's interpreter (each program costs ~25 ms there, so B * S stays <= 15). Yardsticks (_check_values):
every output element is the FP32 reference correctly rounded to BF16 (within half a BF16 ulp) up to FP32 noise
(1e-5 of the tensor's largest value: rsqrt, the order of the sum of squares, cos/sin a float32 ulp apart), hence
within one ulp; and the mean absolute error, q and k together, is below that of the torch BF16 path the model ran
before (layers.RMSNorm then layers.apply_rope, which rounds after the norm, the weight, cos/sin and each RoPE op).
The cache: filled with random values, every row not targeted must stay bit-identical, v rows are copied bit-exactly.
GPU (marker `gpu`): the Qwen3-30B-A3B shape (Hq 32, Hkv 4, D 128) at B * S = 1, 64, 2048.
"""

import pytest
import torch
import triton

from kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _inv_freq(D, theta):  # layers.rope_inv_freq, repeated so that this test does not import the model package
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def _torch_bf16_path(q, k, q_weight, k_weight, inv_freq, positions):
    """The model's ops in BF16: layers.RMSNorm.forward, then layers.apply_rope."""
    def norm(x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        return w * xf.to(x.dtype)

    def rope(x):
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, :, None, :], emb.sin().to(x.dtype)[:, :, None, :]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rope(norm(q, q_weight)), rope(norm(k, k_weight))


def _problem(B, S, Hq, Hkv, D, L, theta=1e6, seed=0, idx_dtype=torch.int64, layout="contiguous"):
    """Inputs of one call: N = B + 2 slots (the last is the engine's scratch slot, always among `slots`), caches of
    random values, distinct positions per row including 0 and L - 1. layout: "contiguous" tensors, "fused" (q, k, v
    column slices of one [B, S, (Hq + 2 Hkv) D] projection) or "strided" (S-major rows, k heads 2D apart)."""
    gen = torch.Generator().manual_seed(seed)
    N, X = B + 2, (Hq + 2 * Hkv) * D

    def randn(*shape, scale=2.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().to(DEVICE)  # views stay views

    if layout == "contiguous":
        q, k, v = randn(B, S, Hq, D), randn(B, S, Hkv, D), randn(B, S, Hkv, D)
    elif layout == "fused":
        qkv = randn(B, S, X)
        q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    else:
        wide = randn(S, B, 2 * X).transpose(0, 1)
        q = wide[..., :Hq * D].unflatten(-1, (Hq, D))
        k = wide[..., X:X + 2 * Hkv * D].unflatten(-1, (Hkv, 2 * D))[..., D:]
        v = wide[..., -Hkv * D:].unflatten(-1, (Hkv, D))
    q_weight, k_weight = (1 + randn(D, scale=0.2).float()).bfloat16(), (1 + randn(D, scale=0.2).float()).bfloat16()
    positions = torch.stack([torch.randperm(L, generator=gen)[:S] for _ in range(B)])
    if not (positions[0] == 0).any():
        positions[0, 0] = 0
    if not (positions[-1] == L - 1).any():
        positions[-1, -1] = L - 1
    slots = torch.randperm(N, generator=gen)[:B]
    if not (slots == N - 1).any():
        slots[-1] = N - 1
    k_cache, v_cache = randn(N, L, Hkv, D), randn(N, L, Hkv, D)
    args = (q, k, v, q_weight, k_weight, EPS, _inv_freq(D, theta), positions.to(idx_dtype), slots.to(idx_dtype),
            k_cache, v_cache)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def _check_values(outs, refs, torch_outs):
    """Kernel outputs (bf16) against the FP32 reference: correctly rounded up to FP32 noise, and closer on average
    than the torch BF16 path's outputs. Returns (kernel, torch) mean abs errors."""
    err_sum = torch_sum = 0.0
    for out, ref, other in zip(outs, refs, torch_outs, strict=True):
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - 8)  # BF16 spacing at |ref|
        err = (out.float() - ref).abs()
        slack = 1e-5 * ref.abs().max()
        assert (err <= 0.5 * ulp + slack).all(), f"max err {(err - 0.5 * ulp).max().item():.3g} past half an ulp"
        assert (err <= ulp + 1e-6 * ref.abs().max()).all()
        err_sum += err.sum().item()
        torch_sum += (other.float() - ref).abs().sum().item()
    assert err_sum <= torch_sum, f"kernel error {err_sum:.4g} above the torch BF16 path's {torch_sum:.4g}"
    return err_sum, torch_sum


def _run_and_check(args, **kw):
    q, k, v, q_weight, k_weight, eps, inv_freq, positions, slots, k_cache, v_cache = args
    N, L = k_cache.shape[:2]
    k0, v0 = k_cache.clone(), v_cache.clone()
    out = qk_norm_rope(*args, **kw)
    q_ref, k_ref, _ = qk_norm_rope_reference(q, k, v, q_weight, k_weight, eps, inv_freq, positions)
    q_bf, k_bf = _torch_bf16_path(q, k, q_weight, k_weight, inv_freq, positions)

    pos, slot = positions.long(), slots.long()[:, None].expand_as(positions)
    valid = (pos >= 0) & (pos < L) & (slot >= 0) & (slot < N)
    rows = (slot[valid], pos[valid])
    written = torch.zeros(N, L, dtype=torch.bool, device=k_cache.device)
    written[rows] = True
    for cache, before in ((k_cache, k0), (v_cache, v0)):  # bit-identical outside the targeted rows
        assert torch.equal(cache[~written].view(torch.int16), before[~written].view(torch.int16))
    assert torch.equal(v_cache[rows].view(torch.int16), v[valid].view(torch.int16))
    _check_values((out, k_cache[rows]), (q_ref, k_ref[valid]), (q_bf, k_bf[valid]))
    return out


SHAPES = {"h4_kv2_d32": (4, 2, 32), "h8_kv1_d16": (8, 1, 16)}


@pytest.mark.parametrize("theta", [1e6, 1e4])
@pytest.mark.parametrize("S", [1, 5])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_reference(shape, B, S, theta):
    Hq, Hkv, D = SHAPES[shape]
    _run_and_check(_problem(B, S, Hq, Hkv, D, L=37, theta=theta, seed=B * 10 + S))


@pytest.mark.parametrize("B, S", [(1, 2), (2, 1)])
def test_head_dim_128(B, S):
    _run_and_check(_problem(B, S, 32, 4, 128, L=19, seed=3))


@pytest.mark.parametrize("theta", [1e6, 1e4])
def test_long_positions(theta):
    """Positions up to Qwen3's 40960: angles of thousands of radians, where cos/sin must stay precise."""
    args = list(_problem(2, 3, 8, 1, 16, L=40960, theta=theta, seed=5))
    args[7][:] = torch.tensor([[40959, 40000, 32768], [12345, 0, 40958]], device=DEVICE)
    _run_and_check(tuple(args))


@pytest.mark.parametrize("layout", ["fused", "strided"])
def test_strided_views(layout):
    """Column slices of one projection (and S-major rows, heads 2D apart): same bits as contiguous copies."""
    args = _problem(3, 2, 4, 2, 32, L=37, seed=7, layout=layout)
    assert not args[1].is_contiguous() and not args[2].is_contiguous()
    dense = tuple(a.clone(memory_format=torch.contiguous_format) if isinstance(a, torch.Tensor) else a for a in args)
    out = _run_and_check(args)
    assert torch.equal(out, qk_norm_rope(*dense))
    assert torch.equal(args[9], dense[9]) and torch.equal(args[10], dense[10])


def test_in_place_and_deterministic():
    args = _problem(3, 2, 4, 2, 32, L=37, seed=11)
    first = qk_norm_rope(*args)
    k1, v1 = args[9].clone(), args[10].clone()
    second = qk_norm_rope(*args)
    assert torch.equal(first, second) and torch.equal(args[9], k1) and torch.equal(args[10], v1)
    q = args[0].clone()
    assert qk_norm_rope(q, *args[1:], q_out=q) is q
    assert torch.equal(q, first)


def test_index_dtypes_agree():
    outs = []
    for idx_dtype in (torch.int32, torch.int64):
        args = _problem(3, 5, 8, 1, 16, L=37, seed=13, idx_dtype=idx_dtype)
        outs.append((_run_and_check(args), args[9], args[10]))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_out_of_range_rows_write_nothing():
    """Positions >= L or < 0 and slots >= N write no cache row (no crash); their q_out is still computed."""
    args = list(_problem(3, 2, 4, 2, 32, L=37, seed=17))
    args[7][:] = torch.tensor([[37, 5], [-1, 36], [200, 3]], device=DEVICE)
    args[8][:] = torch.tensor([0, 1, 5], device=DEVICE)  # N = 5: row 2's slot is past the cache
    _run_and_check(tuple(args))


def _bad(i, value):
    return lambda args: args[:i] + [value] + args[i + 1:]


BAD = {  # name: (mutation of the valid argument list, exception, match)
    "q_dtype": (lambda a: [a[0].float()] + a[1:], TypeError, "q must be a torch.bfloat16"),
    "q_rank": (lambda a: [a[0].flatten(2)] + a[1:], ValueError, r"q must be a \[B, S, Hq, D\]"),
    "q_stride": (lambda a: [a[0].transpose(2, 3)] + a[1:], ValueError, "q must have unit stride"),
    "head_dim": (lambda a: [t[..., :24] for t in a[:3]] + a[3:], ValueError, "head dim D = 24"),
    "k_shape": (lambda a: [a[0], a[1][:2]] + a[2:], ValueError, "k must have shape"),
    "v_shape": (lambda a: _bad(2, a[2][:, :, :1])(a), ValueError, "v must have shape"),
    "k_stride": (lambda a: _bad(1, torch.cat([a[1], a[1]], -1)[..., ::2])(a), ValueError, "k must have unit"),
    "q_weight": (lambda a: _bad(3, a[3][:16])(a), ValueError, "q_weight must have shape"),
    "k_weight": (lambda a: _bad(4, a[4].float())(a), TypeError, "k_weight must be a torch.bfloat16"),
    "eps": (lambda a: _bad(5, -1.0)(a), ValueError, "eps must be"),
    "inv_freq_dtype": (lambda a: _bad(6, a[6].double())(a), TypeError, "inv_freq must be a torch.float32"),
    "inv_freq_shape": (lambda a: _bad(6, torch.cat([a[6], a[6]]))(a), ValueError, "inv_freq must have shape"),
    "positions_dtype": (lambda a: _bad(7, a[7].float())(a), TypeError, "positions must be an int32 or int64"),
    "positions_shape": (lambda a: _bad(7, a[7][:, :1])(a), ValueError, "positions must have shape"),
    "positions_strided": (lambda a: _bad(7, a[7].t().contiguous().t())(a), ValueError, "positions must be contig"),
    "slots_dtype": (lambda a: _bad(8, a[8].short())(a), TypeError, "slots must be an int32 or int64"),
    "k_cache_rank": (lambda a: _bad(9, a[9][None])(a), ValueError, "k_cache must be one layer's"),
    "k_cache_heads": (lambda a: _bad(9, a[9][:, :, :1])(a), ValueError, "k_cache must have shape"),
    "k_cache_strided": (lambda a: _bad(9, a[9].transpose(0, 1).contiguous().transpose(0, 1))(a), ValueError,
                        "k_cache must be contiguous"),
    "v_cache_shape": (lambda a: _bad(10, a[10][:, :5])(a), ValueError, "v_cache must have shape"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case):
    mutate, exc, match = BAD[case]
    args = mutate(list(_problem(3, 2, 4, 2, 32, L=37, seed=19)))
    with pytest.raises(exc, match=match):
        qk_norm_rope(*args)


@pytest.mark.parametrize("q_out, match", [(torch.float32, "q_out must be a torch.bfloat16"),
                                          ("strided", "q_out must be contiguous")])
def test_bad_q_out(q_out, match):
    args = _problem(3, 2, 4, 2, 32, L=37, seed=23)
    buf = torch.empty(3, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE).transpose(2, 3) if q_out == "strided" \
        else torch.empty(3, 2, 4, 32, dtype=q_out, device=DEVICE)
    with pytest.raises((TypeError, ValueError), match=match):
        qk_norm_rope(*args, q_out=buf)


@pytest.mark.gpu
@pytest.mark.parametrize("B, S", [(1, 1), (64, 1), (4, 512)])
def test_qwen3_30b_shape(B, S):
    """Hq 32, Hkv 4, D 128 at B * S = 1, 64 (decode) and 2048 (prefill), natively compiled."""
    assert not triton.knobs.runtime.interpret
    _run_and_check(_problem(B, S, 32, 4, 128, L=1024, seed=29))
