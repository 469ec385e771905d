"""The skinny GEMM (kernels/skinny_gemm.py) against the exact product of the same BF16 inputs.

Bounds (as for skinny_linear): BF16 x BF16 products are exact in FP32, so the FP32 output's only error is in the
K - 1 additions, each off by at most one FP32 ulp in any order or grouping (the tensor cores' included):
|got - exact| <= K * 2^-23 * S elementwise, S = sum_k |x[t, k]| |w[n, k]|, exact in FP64. The BF16 output is the
same launch's FP32 sums rounded to nearest even, bit for bit.
Shapes: T 3, 17, 33, 100 (padded to BT 16 / 32 / 64 / 128); N 37, 130, 200 (a partial last block); K 48, 208, 520
(masked last steps); splits of K 2, 3 and 4, one of them with splits that get no step at all.
GPU (marker `gpu`): Qwen3-30B-A3B's qkv 5120 x 2048, o_proj 2048 x 4096 and gate 128 x 2048 at T 3..128.
"""

import pytest
import torch
from linear_data import linear_data

from kernels.skinny_gemm import MAX_T, Config, _config, gemm_counter, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x, w, config=None, split_ok=True):
    """Both output dtypes against the bounds of the module docstring, out buffers starting as NaN, the counter
    checked to be left zeroed; returns the FP32 output."""
    s = x.double().abs() @ w.double().abs().T
    exact, bound = x.double() @ w.double().T, x.shape[1] * 2.0**-23 * s
    counter = gemm_counter(w.shape[0], DEVICE) if split_ok else None
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=dtype, device=DEVICE)
        assert skinny_gemm(x, w, out_dtype=dtype, out=buf, counter=counter, config=config) is buf
        out[dtype] = buf
        assert counter is None or not counter.any()
    err = (out[torch.float32].double() - exact).abs()
    assert (err <= bound).all(), f"worst err / bound = {(err / bound).max().item():.3g}"
    assert torch.equal(out[torch.bfloat16], out[torch.float32].bfloat16())
    return out[torch.float32]


@pytest.mark.parametrize("config, T, N, K", [
    (None, 3, 37, 48),
    (Config(16, 16, 1), 17, 37, 48),  # 3 steps, 3 n blocks (the last 5 of 16 rows)
    (Config(16, 32, 2), 3, 130, 208),  # 7 steps of 32, 4 and 3 per split, the last 16 columns masked
    (Config(32, 64, 3, stages=2), 33, 200, 520),  # a split count that is not a power of two
    (Config(64, 128, 4, num_warps=8), 100, 130, 200),  # 2 steps over 4 splits: splits 2 and 3 add zeros
    (Config(128, 16, 1), 17, 130, 48),  # 128-row blocks: the second holds 2 of N's rows
])
def test_matches_exact(config, T, N, K):
    x, w = linear_data(T, N, K, DEVICE, seed=T * 1000 + N + K)
    got = _check(x, w, config)
    truncated = (got.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert not torch.equal(skinny_gemm(x, w, config=config, counter=gemm_counter(N, DEVICE)), truncated)


def test_splits_agree_and_repeat():
    """The same product with and without a split, and a split launch repeated on one counter: each call within the
    bound and bit-identical to the previous call with the same config (the partials summed in split order)."""
    x, w = linear_data(5, 130, 520, DEVICE, seed=3)
    counter = gemm_counter(130, DEVICE)
    one = _check(x, w, Config(16, 64, 1), split_ok=False)
    first = skinny_gemm(x, w, out_dtype=torch.float32, counter=counter, config=Config(16, 64, 4))
    for _ in range(2):
        assert torch.equal(skinny_gemm(x, w, out_dtype=torch.float32, counter=counter, config=Config(16, 64, 4)),
                           first)
    torch.testing.assert_close(first, one, rtol=1e-5, atol=1e-4)


def test_strided_x_and_empty():
    T, N, K = 3, 37, 208
    x, w = linear_data(T, N, K, DEVICE, seed=5)
    buf = torch.randn(T, 300, device=DEVICE).bfloat16()
    view = buf[:, 8:8 + K]
    view.copy_(x)
    assert torch.equal(_check(view, w), skinny_gemm(x, w, out_dtype=torch.float32))
    assert skinny_gemm(x[:0], w).shape == (0, N)
    assert skinny_gemm(x, w[:0], out_dtype=torch.float32).shape == (T, 0)


def test_config_at_qwen3_shapes():
    assert _config(4, 5120, 2048, True) == Config(64, 256, 1)  # qkv: 80 blocks, no split
    assert _config(64, 5120, 2048, True) == Config(64, 128, 1)  # 64 tokens: shorter K steps (shared memory)
    assert _config(8, 2048, 4096, True) == Config(64, 256, 4)  # o_proj: 32 blocks x 4 splits
    assert _config(8, 2048, 4096, False).split == 1  # no counter, no split
    assert _config(32, 128, 2048, True) == Config(16, 256, 4)  # gate: 8 blocks of 16 rows x 4 splits


_X = torch.ones(3, 48, dtype=torch.bfloat16, device=DEVICE)
_W = torch.ones(37, 48, dtype=torch.bfloat16, device=DEVICE)
_C = gemm_counter(37, DEVICE)
_BAD = [
    (TypeError, "x must be a bfloat16 tensor", lambda: skinny_gemm(_X.float(), _W)),
    (ValueError, f"more than the kernel's {MAX_T}", lambda: skinny_gemm(_X[:1].expand(MAX_T + 1, 48), _W)),
    (ValueError, "multiple of 8", lambda: skinny_gemm(_X[:, :12], _W[:, :12].contiguous())),
    (TypeError, "weight must be a torch.bfloat16", lambda: skinny_gemm(_X, _W.half())),
    (TypeError, "out_dtype must be", lambda: skinny_gemm(_X, _W, out_dtype=torch.float16)),
    (ValueError, "out overlaps x", lambda: skinny_gemm(_X, _W, out=_X.view(-1)[:111].view(3, 37))),
    (ValueError, "counter must be a contiguous int32 vector of >= cdiv", lambda: skinny_gemm(_X, _W, counter=_C[:2])),
    (ValueError, "counter must be", lambda: skinny_gemm(_X, _W, counter=_C.long())),
    (ValueError, "splits K: pass a zeroed int32 counter", lambda: skinny_gemm(_X, _W, config=Config(16, 16, 2))),
    (ValueError, "config", lambda: skinny_gemm(_X, _W, config=Config(8, 16, 1))),
    (ValueError, "config", lambda: skinny_gemm(_X, _W, counter=_C, config=Config(16, 24, 1))),
]


@pytest.mark.parametrize("exc, match, call", _BAD, ids=[m for _, m, _ in _BAD])
def test_bad_inputs(exc, match, call):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 16, 33, 64, 128])
@pytest.mark.parametrize("N, K", [(5120, 2048), (2048, 4096), (128, 2048)])
def test_qwen3_shapes_on_gpu(T, N, K):
    x, w = linear_data(T, N, K, DEVICE, seed=T)
    got = _check(x, w)
    assert torch.equal(skinny_gemm(x, w, out_dtype=torch.float32, counter=gemm_counter(N, DEVICE)), got)
