"""kernels/fp8_split.py: the hi + lo E4M3 split against its torch reference, bit for bit, and its exactness bounds.

CPU: Triton's interpreter (the kernel's rounding is integer and FP32-add arithmetic, which the interpreter runs as
the GPU does) at irregular row lengths, BF16 and FP32 rows over many binades, zero rows, -0, ties, values far
below their row's maximum, and non-finite rows; on a GPU machine the same cases run on CUDA.
"""

import pytest
import torch
from test_warp_decode_moe import DEVICE

from kernels.fp8_split import FP8Split, fp8_split_reference, fp8_split_rows, fp8_split_value


def _rows(R, N, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(R, N, generator=gen) * torch.exp2(torch.randint(-30, 30, (R, 1), generator=gen).float())
    x[0] = 0.0  # an all-zero row: code 1, every byte 0
    if R > 2:
        x[1, : N // 2] = -0.0
        x[2, 1] = x[2].abs().max() * 2.0**-14  # far below the row's maximum: lo reaches E4M3's subnormals
        x[2, 2] = -x[2, 3]
    return x.to(dtype)


def _bytes(t):
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("R,N,dtype", [(5, 96, torch.bfloat16), (3, 2048, torch.bfloat16), (4, 160, torch.float32),
                                       (1, 32, torch.float32), (6, 768, torch.bfloat16)])
def test_matches_reference_bit_for_bit(R, N, dtype):
    x = _rows(R, N, dtype, seed=N + R)
    got, want = fp8_split_rows(x.to(DEVICE)), fp8_split_reference(x)
    for name in ("hi", "lo"):
        g, w = _bytes(getattr(got, name)), _bytes(getattr(want, name))
        bad = (g != w).nonzero()
        assert bad.numel() == 0, (f"{name}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: x = "
                                  f"{x[tuple(bad[0])].item()!r}, kernel {g[tuple(bad[0])]:#x}, reference "
                                  f"{w[tuple(bad[0])]:#x}")
    assert torch.equal(got.scales.cpu(), want.scales)


def test_bf16_values_split_exactly_down_to_2_pow_minus_10_of_the_row_max():
    x = _rows(8, 1024, torch.bfloat16, seed=7)
    s = fp8_split_rows(x.to(DEVICE))
    v, xf = fp8_split_value(s).cpu(), x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    big = xf.abs() >= amax * 2.0**-10
    assert torch.equal(v[big], xf[big])
    # Below: at most 2^-10 in scaled units, and the scale puts the row maximum above 224 of them.
    assert ((v - xf).abs() <= amax * 2.0**-10 / 224).all()
    assert (v != xf).any(), "the test data should reach below 2^-10 of some row's maximum"


def test_fp32_values_keep_eight_bits():
    x = _rows(4, 256, torch.float32, seed=3)
    v = fp8_split_value(fp8_split_rows(x.to(DEVICE))).cpu()
    amax = x.abs().amax(dim=1, keepdim=True)
    assert ((v - x).abs() <= torch.maximum(x.abs() * 2.0**-8, amax * 2.0**-10 / 224)).all()


def test_non_finite_rows_get_code_255_and_decode_non_finite():
    x = _rows(3, 64, torch.float32, seed=1)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    s = fp8_split_rows(x.to(DEVICE))
    assert s.scales.cpu().flatten().tolist()[1:] == [255, 255]
    assert not torch.isfinite(fp8_split_value(s)[1:].cpu()).all(dim=1).any()


def test_preallocated_out_and_argument_errors():
    x = _rows(2, 64, torch.bfloat16, seed=2).to(DEVICE)
    out = FP8Split.empty(2, 64, 1, DEVICE)
    assert fp8_split_rows(x, out) is out
    assert torch.equal(_bytes(out.data), _bytes(fp8_split_reference(x.cpu()).data))
    with pytest.raises(TypeError, match="x must be"):
        fp8_split_rows(x.half())
    with pytest.raises(ValueError, match="contiguous"):
        fp8_split_rows(x.t())
    with pytest.raises(ValueError, match="out.scales"):
        fp8_split_rows(x, FP8Split(out.data, torch.empty(2, 2, dtype=torch.uint8, device=DEVICE)))
    with pytest.raises(ValueError, match="out.data"):
        fp8_split_rows(x, FP8Split(out.data[:, :, :32], out.scales))
