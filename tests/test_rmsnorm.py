"""The fused residual-add + RMSNorm kernel against the model's torch ops (kernels/rmsnorm.py).

On CPU it runs in Triton's interpreter, where the BF16 roundings are the kernel's own bit arithmetic.
Observed (interpreter, randn * 3 data): the residual sum always bit-identical; normed bit-identical for every
element at H = 128, 2048, 4096, and for all but ~1 in 10^5 at H = 96, 200 (sum order, and the CPU mean dividing
by H), those within 2 BF16 steps (a one-step flip of the normalised value, times a weight < 1, spans two steps of
a lower binade).
"""

import pytest
import torch

from kernels.rmsnorm import rms_norm, rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

EPS = 1e-6


def data(T, H, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 3).bfloat16()
    r = (torch.randn(T, H, generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    return x.to(device), r.to(device), w.to(device)


def steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many BF16 values apart a and b are (0 for -0 vs +0)."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def check(got, want, min_identical):
    d = steps(got, want)
    assert d.max().item() <= 2
    assert (d == 0).float().mean().item() >= min_identical


@pytest.mark.parametrize("H", [96, 128, 200, 2048])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_module_ops(H, T, with_residual):
    x, r, w = data(T, H, seed=H * 100 + T)
    got, got_sum = rms_norm(x, w, EPS, r if with_residual else None)
    want, want_sum = rms_norm_reference(x, w, EPS, r if with_residual else None)
    assert got.shape == (T, H) and got.dtype == torch.bfloat16
    if with_residual:
        assert torch.equal(got_sum, want_sum) and torch.equal(want_sum, x + r)
    else:
        assert got_sum is None
    check(got, want, min_identical=0.99)


@pytest.mark.parametrize("H", [96, 200, 2048])
def test_many_rows_mostly_bit_identical(H):
    x, r, w = data(2**16 // H, H, seed=H)  # ~65k elements
    got, got_sum = rms_norm(x, w, EPS, r)
    want, want_sum = rms_norm_reference(x, w, EPS, r)
    assert torch.equal(got_sum, want_sum)
    check(got, want, min_identical=0.999)


def test_error_is_bf16_rounding_against_fp32():
    # Two BF16 roundings (the normalised value, then the product), each <= 2^-8 relative (8-bit significand).
    x, r, w = data(17, 200, seed=3)
    got, s = rms_norm(x, w, EPS, r)
    sf = s.float()
    exact = w.float() * sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS)
    err = (got.float() - exact).abs()
    assert (err <= 2**-7 * 1.01 * exact.abs()).all()
    assert (err / exact.abs()).nan_to_num().max() > 2**-9  # not FP32-exact: the bound above is the one that binds


@pytest.mark.parametrize("H", [96, 200, 2048])
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_fp32_residual_stream(H, T, x_dtype):
    """An FP32 residual: the sum is exact FP32 (bit-identical to torch's), stored FP32, and the output is rounded
    once, so it sits within one BF16 rounding of the exact norm (two with the BF16 stream). x in FP32 too (the
    fast path's o_proj output), with bits past BF16's."""
    x, r, w = data(T, H, seed=H + T)
    noise = torch.randn(T, H, generator=torch.Generator().manual_seed(H)).to(DEVICE) * 1e-3
    r32 = r.float() + noise  # not BF16
    if x_dtype == torch.float32:
        x = x.float() * (1 + noise)
    got, got_sum = rms_norm(x, w, EPS, r32)
    want, want_sum = rms_norm_reference(x, w, EPS, r32)
    assert got.dtype == torch.bfloat16 and got_sum.dtype == torch.float32
    assert torch.equal(got_sum, x.float() + r32) and torch.equal(got_sum, want_sum)
    check(got, want, min_identical=0.99)
    if x_dtype == torch.float32:
        assert not torch.equal(got_sum, x.bfloat16().float() + r32)  # x's low bits reached the sum
    exact = w.double() * got_sum.double() * torch.rsqrt(got_sum.double().pow(2).mean(-1, keepdim=True) + EPS)
    err = (got.double() - exact).abs()
    assert (err <= 2**-8 * 1.01 * exact.abs()).all()
    out, res_out = torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(r32)
    got_out, got_res = rms_norm(x, w, EPS, r32, out=out, residual_out=res_out)
    assert got_out is out and got_res is res_out
    assert torch.equal(res_out, want_sum)


def test_given_buffers_are_written_and_returned():
    x, r, w = data(5, 256, seed=4)
    out, res_out = torch.full_like(x, 7), torch.full_like(x, 7)
    got, got_sum = rms_norm(x, w, EPS, r, out=out, residual_out=res_out)
    assert got is out and got_sum is res_out
    want, want_sum = rms_norm_reference(x, w, EPS, r)
    assert torch.equal(res_out, want_sum)
    check(out, want, min_identical=0.99)


def test_empty_and_nonfinite():
    x, r, w = data(0, 64, seed=5)
    got, got_sum = rms_norm(x, w, EPS, r)
    assert got.shape == (0, 64) and got_sum.shape == (0, 64)
    x, _, w = data(2, 64, seed=6)
    x[0, 3] = float("nan")  # the whole row becomes NaN, as in torch; not the -0 a careless rounding would give
    got, _ = rms_norm(x, w, EPS)
    assert got[0].isnan().all() and not got[1].isnan().any()


def _bad_cases():
    x, r, w = data(4, 64, seed=7)
    wide = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    return {
        "x dtype": (dict(x=x.half()), TypeError, "x must be a bfloat16 or float32"),
        "fp32 x, bf16 residual": (dict(x=x.float()), TypeError, "x is float32 but residual is not"),
        "fp32 x, no residual": (dict(x=x.float(), residual=None), TypeError, "x is float32 but residual is not"),
        "x rank": (dict(x=x[0]), ValueError, r"x must be \[T, H\]"),
        "x strided": (dict(x=wide[:, ::2], residual=None), ValueError, "x must be contiguous"),
        "H too big": (dict(x=torch.zeros(1, 8193, dtype=torch.bfloat16, device=DEVICE)), ValueError, "x: H must be"),
        "weight shape": (dict(weight=w[:32]), ValueError, "weight must have shape"),
        "weight dtype": (dict(weight=w.float()), TypeError, "weight must be a torch.bfloat16"),
        "residual shape": (dict(residual=r[:2]), ValueError, "residual must have shape"),
        "residual dtype": (dict(residual=r.half()), TypeError, "residual must be a torch.bfloat16"),
        "residual_out dtype, fp32 residual": (dict(residual=r.float(), residual_out=torch.empty_like(r)), TypeError,
                                              "residual_out must be a torch.float32"),
        "out shape": (dict(out=torch.empty(4, 32, dtype=torch.bfloat16, device=DEVICE)),
            ValueError, "out must have shape"),
        "residual_out dtype": (dict(residual_out=r.float()), TypeError, "residual_out must be a torch.bfloat16"),
        "residual_out alone": (dict(residual=None, residual_out=torch.empty_like(x)), ValueError, "residual is None"),
        "out aliases x": (dict(out=x), ValueError, "out overlaps x"),
        "residual_out aliases residual": (dict(residual_out=r), ValueError, "residual_out overlaps residual"),
        "outputs overlap": (dict(out=wide[:2].view(4, 64), residual_out=wide[1:3].view(4, 64)), ValueError,
                            "residual_out overlaps out"),
        "eps": (dict(eps=-1.0), ValueError, "eps must be"),
        "eps bool": (dict(eps=True), ValueError, "eps must be a non-negative number"),
    }, dict(x=x, weight=w, eps=EPS, residual=r)


@pytest.mark.parametrize("case", list(_bad_cases()[0]))
def test_bad_inputs_name_the_argument(case):
    cases, base = _bad_cases()
    override, error, message = cases[case]
    args = {**base, **override}
    with pytest.raises(error, match=message):
        rms_norm(args.pop("x"), args.pop("weight"), args.pop("eps"), args.pop("residual"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_qwen3_30b_shape_on_gpu(T, with_residual):
    x, r, w = data(T, 2048, seed=T, device=DEVICE)
    got, got_sum = rms_norm(x, w, 1e-6, r if with_residual else None)
    want, want_sum = rms_norm_reference(x, w, 1e-6, r if with_residual else None)
    if with_residual:
        assert torch.equal(got_sum, want_sum)
    check(got, want, min_identical=0.99)
