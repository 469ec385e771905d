"""The skinny linear (kernels/skinny_linear.py) against the exact product of the same BF16 inputs.

Bounds. A BF16 x BF16 product is exact in FP32, so the FP32 output's only error is in the K - 1 additions, each
off by at most one FP32 ulp in any order: |got - exact| <= K * 2^-23 * S elementwise, S = sum_k |x[t, k]|
|w[n, k]|; exact = FP64. The BF16 output must be the kernel's own FP32 accumulator rounded to nearest even (bit
for bit: the fp32 call computes the same sums), and equal to skinny_linear_reference's (FP32 matmul, rounded once)
except where the two FP32 sums fall on either side of a BF16 rounding midpoint: there one BF16 step apart, and
the midpoint within the FP32 bound of the exact value. Observed (interpreter): max |got - exact| / S ~ 3e-8.
Shapes: T 1, 3, 16 (BT 1, 4, 16: padded tokens); N 37, 130 and forced BLOCK_N 4 / 8 (a partial last block);
K 48, 208, 520 (not a power of two: masked columns), forced BLOCK_K chunks with a partial last one.
GPU (marker `gpu`): Qwen3-30B-A3B's qkv 5120 x 2048, o_proj 2048 x 4096 (bf16 out), gate 128 x 2048 (fp32 out).
"""

import pytest
import torch
import torch.nn.functional as F
from linear_data import linear_data

from kernels.rmsnorm import rms_norm_reference
from kernels.skinny_linear import (
    MAX_T,
    Config,
    _config,
    add_norm_linear,
    add_norm_linear_reference,
    skinny_linear,
    skinny_linear_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _data(T, N, K, seed=0):
    return linear_data(T, N, K, DEVICE, seed)


def _exact(x, w):
    """(exact product, S, the FP32 accumulation bound K * 2^-23 * S) in FP64."""
    s = x.double().abs() @ w.double().abs().T
    return x.double() @ w.double().T, s, x.shape[1] * 2.0**-23 * s


def _steps(a, b):
    """How many BF16 values apart a and b are (0 for -0 vs +0)."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def _check(x, w, config=None):
    """Both output dtypes of one problem against the bounds of the module docstring; returns (fp32, bf16)."""
    exact, scale, bound = _exact(x, w)
    got32 = skinny_linear(x, w, out_dtype=torch.float32, config=config)
    assert got32.dtype == torch.float32 and got32.shape == exact.shape
    err = (got32.double() - exact).abs()
    assert (err <= bound).all(), f"worst err / bound = {(err / bound).max().item():.3g}"
    got16 = skinny_linear(x, w, config=config)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, got32.bfloat16())
    ref = skinny_linear_reference(x, w)
    off = _steps(got16, ref)
    # Two FP32 sums in different orders (errors ~ sqrt(K) 2^-24 S, random walk) round to BF16 values at most one
    # step apart where a BF16 step (2^-8 relative) is 8x that walk's reach; near a cancellation (|exact| << S) they
    # may be several steps apart (13 seen on the H200 at qkv T = 16), and only the FP32 bound above applies.
    far = exact.abs() > 2**11 * x.shape[1] ** 0.5 * 2.0**-23 * scale
    assert (off[far] <= 1).all() and off.float().mean() <= 0.01
    midpoint = (got16.double() + ref.double()) / 2
    assert ((midpoint - exact).abs()[off == 1] <= bound[off == 1]).all()
    return got32, got16


@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("N, K", [(37, 48), (130, 208)])
def test_matches_exact(T, N, K):
    x, w = _data(T, N, K, seed=T * 1000 + N + K)
    got32, got16 = _check(x, w)
    truncated = (got32.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert not torch.equal(got16, truncated)  # the data does exercise round-to-nearest


@pytest.mark.parametrize("config, T, N, K", [
    (Config(4, 64, 1), 3, 37, 48),  # BLOCK_N 4: 37 = 9 * 4 + 1
    (Config(8, 64, 2), 16, 130, 208),  # 4 chunks of K, the last 16 of 64 columns
    (Config(4, 256, 1), 5, 37, 520),  # early loads, 3 chunks (the last 8 columns of 256)
    (Config(4, 256, 1, early_loads=False), 5, 37, 520),
    (Config(2, 1024, 4), 2, 9, 1024),  # early loads over 4 warps: the [BN, RK, LANES, 8] view with RK 1
    (Config(1, 512, 1), 1, 3, 1000),  # K = 1000: one chunk of 512, one masked to 488
])
def test_forced_configs(config, T, N, K):
    x, w = _data(T, N, K, seed=N + K)
    _check(x, w, config)


def test_strided_and_unaligned_x():
    """Rows of a wider buffer (row stride 2100 > K), and a view starting 1 element in (2-byte aligned)."""
    T, N, K = 3, 37, 208
    x, w = _data(T, N, K, seed=5)
    buf = torch.randn(T, 2100, device=DEVICE).bfloat16()
    for start in (16, 1):
        view = buf[:, start:start + K]
        view.copy_(x)
        assert view.stride() == (2100, 1)
        got32, got16 = _check(view, w)
        assert torch.equal(got32, skinny_linear(x, w, out_dtype=torch.float32))
        assert torch.equal(got16, skinny_linear(x, w))
    one = buf[1:2, 7:7 + K]  # T = 1: the row stride is never used
    torch.testing.assert_close(skinny_linear(one, w, out_dtype=torch.float32),
                               skinny_linear(one.contiguous(), w, out_dtype=torch.float32), rtol=0, atol=0)


def test_out_reused():
    T, N, K = 3, 37, 48
    x, w = _data(T, N, K, seed=6)
    x2, _ = _data(T, N, K, seed=7)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
        assert skinny_linear(x, w, out_dtype=dtype, out=out) is out
        assert torch.equal(out, skinny_linear(x, w, out_dtype=dtype))
        assert skinny_linear(x2, w, out_dtype=dtype, out=out) is out
        assert torch.equal(out, skinny_linear(x2, w, out_dtype=dtype))


def test_empty():
    x, w = _data(3, 37, 48)
    assert skinny_linear(x[:0], w).shape == (0, 37)
    assert skinny_linear(x, w[:0], out_dtype=torch.float32).shape == (3, 0)


def test_config_at_qwen3_shapes():
    """>= 2 programs per SM where N allows, 32 weights per row per thread, whole rows up to K = 8192."""
    assert _config(1, 5120, 2048) == Config(4, 2048, 2)  # qkv: 1280 programs
    assert _config(8, 2048, 4096) == Config(4, 4096, 4)  # o_proj: 512
    assert _config(16, 2048, 4096) == Config(2, 4096, 4)  # T > 8: fewer accumulator registers
    assert _config(1, 128, 2048) == Config(1, 2048, 2)  # gate: 128, one row each
    assert _config(8, 128, 2048) == Config(1, 2048, 4)  # from T = 4 twice the warps
    assert _config(1, 4096, 8192) == Config(4, 8192, 8)  # 235B o_proj
    assert _config(1, 64, 16384) == Config(1, 8192, 8)  # two chunks


@pytest.mark.parametrize("T, N, K", [(1, 37, 130 * 4), (3, 130, 208)])
def test_fp32_x(T, N, K):
    """An FP32 x (the o_proj output the router's norm prologue takes): each product rounded once, then the K - 1
    additions: |got - exact| <= (K + 1) * 2^-23 * S. A strided view."""
    x, w = _data(T, N, K, seed=5 * T)
    wide = torch.zeros(T, K + 8, device=DEVICE)
    wide[:, 8:] = x.float() * (1 + torch.rand(T, K, generator=torch.Generator().manual_seed(T)).to(DEVICE) / 64)
    xf = wide[:, 8:]
    exact, scale, bound = _exact(xf, w)
    got = skinny_linear(xf, w, out_dtype=torch.float32)
    assert ((got.double() - exact).abs() <= bound + 2.0**-23 * scale).all()
    assert ((x.double() @ w.double().T - exact).abs() > bound + 2.0**-23 * scale).any()  # x's bits past BF16 count


@pytest.mark.parametrize("T, N, K", [(1, 37, 48), (3, 130, 208), (8, 37, 1000)])
def test_add_norm_linear_matches_the_two_launches(T, N, K):
    """The norm prologue against rms_norm_reference (FP32 residual) then the product: the sum exact, the normed row
    within one BF16 step (a value on a rounding boundary may round the other way: the sums of squares run in
    another order), and the product of the FP32 normed row within the FP32 bound, widened by 8 ulps of each normed
    value (rsqrt and the order of the sum of squares), and 100x closer on average than the stored BF16 row's
    product would be. x is a strided view."""
    x, w = _data(T, N, K, seed=T + N)
    g = torch.Generator().manual_seed(K)
    wide = torch.zeros(T, K + 24, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 8:8 + K] = x
    residual = (torch.randn(T, K, generator=g) * 5).to(DEVICE)
    norm_weight = (1 + 0.3 * torch.randn(K, generator=g)).bfloat16().to(DEVICE)
    out = _check_add_norm(wide[:, 8:8 + K], residual, norm_weight, w)
    bf16 = add_norm_linear(x, residual, norm_weight, 1e-6, w)[0]
    assert torch.equal(bf16, out.bfloat16())


def _check_add_norm(x, residual, norm_weight, w):
    """add_norm_linear's three outputs against the references (see the test above); returns the FP32 out."""
    out, normed, summed = add_norm_linear(x, residual, norm_weight, 1e-6, w, out_dtype=torch.float32)
    want_out, want_normed, want_summed = add_norm_linear_reference(x, residual, norm_weight, 1e-6, w,
                                                                   out_dtype=torch.float32)
    assert torch.equal(summed, want_summed)
    assert _steps(normed, want_normed).max() <= 1 and _steps(normed, want_normed).float().mean() < 1e-3
    n = rms_norm_reference(x, norm_weight, 1e-6, residual, out_dtype=torch.float32)[0]
    exact, scale, bound = _exact(n, w)
    bound = bound + 8 * 2.0**-24 * scale
    assert ((out.double() - exact).abs() <= bound).all()
    assert ((want_out.double() - exact).abs() <= bound).all()
    # The product of the stored BF16 row would be ~2^-9 / sqrt(3) relatively off per term (random signs); the FP32
    # row's error is the sums' order, ~2^-15 of that.
    rounded = (normed.double() @ w.double().T - exact).abs().mean()
    assert 100 * (out.double() - exact).abs().mean() < rounded
    return out


def test_add_norm_linear_refuses_bad_norm_arguments():
    x, w = _data(2, 37, 48)
    res, nw = torch.zeros(2, 48, device=DEVICE), torch.ones(48, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="residual must be a torch.float32"):
        add_norm_linear(x, res.bfloat16(), nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(48,\)"):
        add_norm_linear(x, res, nw[:40], 1e-6, w)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        add_norm_linear(x, res, nw, -1.0, w)
    with pytest.raises(ValueError, match=r"in <= 64 chunks \(one chunk with the norm\)"):
        add_norm_linear(x, res, nw, 1e-6, w, config=Config(4, 16, 1))


_X = torch.ones(3, 48, dtype=torch.bfloat16, device=DEVICE)
_W = torch.ones(37, 48, dtype=torch.bfloat16, device=DEVICE)
_BAD = [
    (TypeError, "x must be a bfloat16 or float32 tensor", lambda: skinny_linear(_X.half(), _W)),
    (ValueError, "x must be a 2-D tensor", lambda: skinny_linear(_X[0], _W)),
    (ValueError, f"more than the kernel's {MAX_T}", lambda: skinny_linear(_X[:1].expand(MAX_T + 1, 48), _W)),
    (ValueError, "multiple of 8", lambda: skinny_linear(_X[:, :12], _W[:, :12].contiguous())),
    (ValueError, "x must have contiguous rows", lambda: skinny_linear(_X.T.contiguous().T, _W)),
    (TypeError, "weight must be a torch.bfloat16", lambda: skinny_linear(_X, _W.half())),
    (ValueError, r"weight must have shape \(37, 48\)", lambda: skinny_linear(_X, _W[:, :40].contiguous())),
    (ValueError, "weight must be contiguous", lambda: skinny_linear(_X, _W.T.contiguous().T)),
    (ValueError, "weight must be a 2-D tensor", lambda: skinny_linear(_X, _W[None])),
    (ValueError, "weight is on meta", lambda: skinny_linear(_X, _W.to("meta"))),
    (TypeError, "out_dtype must be", lambda: skinny_linear(_X, _W, out_dtype=torch.float16)),
    (TypeError, "out must be a torch.float32", lambda: skinny_linear(_X, _W, out_dtype=torch.float32,
                                                                      out=torch.empty_like(_X[:, :37]))),
    (ValueError, r"out must have shape \(3, 37\)", lambda: skinny_linear(_X, _W, out=torch.empty_like(_X))),
    (ValueError, "out must be contiguous", lambda: skinny_linear(_X, _W, out=torch.empty_like(_W[:, :3]).T)),
    (ValueError, "out overlaps x", lambda: skinny_linear(_X, _W, out=_X.view(-1)[:111].view(3, 37))),
    (ValueError, "config", lambda: skinny_linear(_X, _W, config=Config(3, 64, 1))),
    (ValueError, "config", lambda: skinny_linear(_X, _W, config=Config(4, 4, 1))),
]


@pytest.mark.parametrize("exc, match, call", _BAD, ids=[m for _, m, _ in _BAD])
def test_bad_inputs(exc, match, call):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("name, N, K, out_dtype", [("qkv", 5120, 2048, torch.bfloat16),
                                                   ("o_proj", 2048, 4096, torch.bfloat16),
                                                   ("gate", 128, 2048, torch.float32)])
def test_qwen3_shapes_on_gpu(T, name, N, K, out_dtype):
    x, w = _data(T, N, K, seed=T)
    got32, got16 = _check(x, w)
    exact = _exact(x, w)[0]
    if out_dtype == torch.float32:  # the router gate: FP32 logits, far closer than cuBLAS's BF16 ones
        assert (F.linear(x, w).double() - exact).abs().max() > 100 * (got32.double() - exact).abs().max()
    got = skinny_linear(x, w, out_dtype=out_dtype)
    assert torch.equal(got, got16 if out_dtype == torch.bfloat16 else got32)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8])
def test_add_norm_linear_qkv_shape_on_gpu(T):
    """The norm prologue at the 30B qkv shape (N 5120, K 2048), where the decoder layer uses it (T <= 2; 8 is the
    router's limit): as test_add_norm_linear_matches_the_two_launches."""
    x, w = _data(T, 5120, 2048, seed=T)
    residual = torch.randn(T, 2048, device=DEVICE) * 5
    norm_weight = (1 + 0.3 * torch.randn(2048, device=DEVICE)).bfloat16()
    _check_add_norm(x, residual, norm_weight, w)
