"""The FP32-output LM head (kernels/lm_head.py) against the exact logits of the same BF16 inputs.

Bound: a BF16 x BF16 product is exact in FP32 (8 + 8 significant bits), so the only error is in the H - 1
additions; each off by at most one FP32 ulp (2^-23 relative, allowing the round-toward-zero of tensor-core
accumulation), in any order: |got - exact| <= H * 2^-23 * S elementwise, S = sum_k |h[t, k]| |w[v, k]|. Exact:
FP64 (error ~H * 2^-53 * S). Observed (interpreter): max |got - exact| / S ~ 1e-7, against 1e-3 for the BF16-output
path (F.linear(h, w).float(), the model's old compute_logits), whose logprobs are off by several 1e-2 at logits
near 20 (BF16 quantum 0.125), where the kernel's are within 1e-5.
GPU (marker `gpu`): Qwen3's V = 151936, H = 2048, T = 1, 8, 64.
"""

import pytest
import torch
import torch.nn.functional as F
from linear_data import linear_data

from kernels.lm_head import _config, lm_head_logits, lm_head_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _data(T, N, K, seed=0):
    return linear_data(T, N, K, DEVICE, seed)


def _exact(h, w):
    """(exact logits, S) in FP64: see the module docstring."""
    return h.double() @ w.double().T, h.double().abs() @ w.double().abs().T


def _check(got, h, w):
    """got within the FP32-accumulation bound of the exact logits; returns the exact logits."""
    exact, s = _exact(h, w)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    err = (got.double() - exact).abs()
    rel = h.shape[1] * 2.0**-23
    assert (err <= rel * s).all(), f"worst err / S = {(err / s).max().item():.3g}, bound {rel:.3g}"
    return exact


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("V", [512, 1000, 77])  # 1000 and 77: a partial last block of 128 rows
def test_matches_exact(V, H, T):
    h, w = _data(T, V, H, seed=V + H + T)
    _check(lm_head_logits(h, w), h, w)
    _check(lm_head_reference(h, w), h, w)


def test_bf16_output_path_is_much_worse():
    """The same check fails for the BF16-rounded output, so it would catch a kernel that rounds; and the
    logprobs, what RL users consume, move by more than 0.01 there and by far less here."""
    h, w = _data(3, 1000, 128, seed=1)
    exact = _check(lm_head_logits(h, w), h, w)
    bf16 = F.linear(h, w).float()
    with pytest.raises(AssertionError, match="worst err"):
        _check(bf16, h, w)
    got = lm_head_logits(h, w)
    assert (bf16 - exact).abs().max() > 1000 * (got - exact).abs().max()
    lp_exact = torch.log_softmax(exact, dim=-1)
    assert (torch.log_softmax(got.double(), dim=-1) - lp_exact).abs().max() < 1e-4
    assert (torch.log_softmax(bf16.double(), dim=-1) - lp_exact).abs().max() > 0.01


def test_more_tokens_than_block_t():
    """T = 150 > BLOCK_T = 128: a second t block, partial."""
    T, V, H = 150, 77, 64
    assert _config(T, H).block_t < T
    h, w = _data(T, V, H, seed=2)
    _check(lm_head_logits(h, w), h, w)


def test_out_given_and_empty():
    h, w = _data(3, 77, 64, seed=3)
    out = torch.full((3, 77), float("nan"), device=DEVICE)
    assert lm_head_logits(h, w, out=out) is out
    _check(out, h, w)
    assert lm_head_logits(h[:0], w).shape == (0, 77)


def test_bad_inputs():
    h, w = _data(3, 77, 64)
    bad = [
        (TypeError, "hidden must be a torch.bfloat16", lambda: lm_head_logits(h.float(), w)),
        (TypeError, "weight must be a torch.bfloat16", lambda: lm_head_logits(h, w.half())),
        (ValueError, r"weight must have shape \(77, 64\)", lambda: lm_head_logits(h, w[:, :32].contiguous())),
        (ValueError, "hidden must be a 2-D tensor", lambda: lm_head_logits(h[0], w)),
        (ValueError, "weight must be a 2-D tensor", lambda: lm_head_logits(h, w[None])),
        (ValueError, "hidden must be contiguous", lambda: lm_head_logits(h.T.contiguous().T, w)),
        (ValueError, "weight must be contiguous", lambda: lm_head_logits(h, w.T.contiguous().T)),
        (ValueError, "multiple of 16", lambda: lm_head_logits(h[:, :40].contiguous(), w[:, :40].contiguous())),
        (TypeError, "out must be a torch.float32", lambda: lm_head_logits(h, w, out=torch.empty(3, 77).bfloat16())),
        (ValueError, r"out must have shape \(3, 77\)", lambda: lm_head_logits(h, w, out=torch.empty(3, 78))),
        (ValueError, "out must be contiguous", lambda: lm_head_logits(h, w, out=torch.empty(77, 3).T)),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_qwen3_shape_on_gpu(T):
    V, H = 151936, 2048
    h, w = _data(T, V, H, seed=T)
    got = lm_head_logits(h, w)
    exact = _check(got, h, w)
    assert (F.linear(h, w).float() - exact).abs().max() > 100 * (got - exact).abs().max()  # 860x measured
    out = torch.empty(T, V, device=DEVICE)
    torch.testing.assert_close(lm_head_logits(h, w, out=out), got, rtol=0, atol=0)  # deterministic
