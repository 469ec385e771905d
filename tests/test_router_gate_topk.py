"""The fused router (gate GEMM + top-k + capture, kernels/router_gate_topk.py) against its torch reference.

Ids are compared exactly on rows whose FP64 logits are tie-free: the first k + 1 sorted logits at least
_MARGIN apart, far above the ~1e-6 by which two FP32 accumulation orders differ (asserted per case: with random
data it always holds). Observed (interpreter): weights within ~7e-7 relative of the reference.
"""

import pytest
import torch
import torch.nn.functional as F

from composer_rollout.engine.capture import ExpertCapture
from kernels.router_gate_topk import router_gate_topk, router_gate_topk_reference
from kernels.router_topk import router_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_MARGIN = 1e-5


def router_inputs(T, H, E, seed, device=DEVICE):
    """hidden [T, H] and gate_weight [E, H] bf16 with logits ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    gate_weight = (torch.randn(E, H, generator=g) / H**0.5).bfloat16()
    return hidden.to(device), gate_weight.to(device)


def fp64_logits(hidden, gate_weight):
    return hidden.double() @ gate_weight.double().T


def tie_free_rows(hidden, gate_weight, k):
    """Rows whose k + 1 largest FP64 logits (k if k = E) are pairwise more than _MARGIN apart."""
    top = fp64_logits(hidden, gate_weight).topk(min(k + 1, gate_weight.shape[0]), dim=-1).values
    gaps = top[:, :-1] - top[:, 1:]
    return (gaps > _MARGIN).all(dim=-1) if gaps.shape[1] else torch.ones(len(top), dtype=torch.bool, device=DEVICE)


@pytest.mark.parametrize("E", [12, 60, 128])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("T", [1, 5, 19])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_reference(E, k, T, H, norm):
    hidden, gate_weight = router_inputs(T, H, E, seed=E * 1000 + k * 100 + T + H)
    assert tie_free_rows(hidden, gate_weight, k).all()
    weights, ids = router_gate_topk(hidden, gate_weight, k, norm)
    want_w, want_ids = router_gate_topk_reference(hidden, gate_weight, k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T, device=DEVICE), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_capture_out_and_given_buffers(dtype):
    T, H, E, k = 19, 128, 128, 8
    hidden, gate_weight = router_inputs(T, H, E, seed=7)
    capture = ExpertCapture(num_layers=3, num_tokens=T, top_k=k, num_experts=E, device=DEVICE)
    capture.ids = capture.ids.to(dtype).fill_(99)  # ExpertCapture's own dtype is uint8 (E <= 256)
    w_out, i_out = torch.empty(T, k, device=DEVICE), torch.empty(T, k, dtype=torch.int64, device=DEVICE)
    weights, ids = router_gate_topk(hidden, gate_weight, k, True, weights_out=w_out, ids_out=i_out,
                                    capture_out=capture.ids[1])
    assert weights is w_out and ids is i_out
    assert torch.equal(ids, router_gate_topk_reference(hidden, gate_weight, k, True)[1])
    assert capture.ids.dtype == dtype and torch.equal(capture.ids[1].long(), ids)
    assert (capture.ids[[0, 2]] == 99).all()  # the other layers' rows untouched


def test_ties_go_to_the_lower_index():
    hidden, gate_weight = router_inputs(6, 64, 24, seed=3)
    hidden[:, 0] = 8.0
    gate_weight[:, 0] = 0.0
    # logits 8 exactly, above the rest
    gate_weight[[17, 5]] = F.one_hot(torch.tensor([0, 0], device=DEVICE), 64).bfloat16()
    weights, ids = router_gate_topk(hidden, gate_weight, 3, False)
    assert ids[:, :2].tolist() == [[5, 17]] * 6
    assert torch.equal(ids[:, 2], router_gate_topk_reference(hidden, gate_weight, 3, False)[1][:, 2])
    zero = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)  # all logits 0: experts 0..k-1, p = 1/E
    weights, ids = router_gate_topk(zero, gate_weight, 4, False)
    assert ids.tolist() == [[0, 1, 2, 3]] * 4
    torch.testing.assert_close(weights, torch.full((4, 4), 1 / 24, device=DEVICE), rtol=1e-6, atol=0)


def test_empty_and_single_expert():
    hidden, gate_weight = router_inputs(3, 32, 1, seed=4)
    weights, ids = router_gate_topk(hidden, gate_weight, 1, False)  # E = 1: 16 MMA columns, 15 at -inf
    assert ids.tolist() == [[0]] * 3 and weights.tolist() == [[1.0]] * 3
    empty_capture = torch.empty(0, 1, dtype=torch.uint8, device=DEVICE)
    weights, ids = router_gate_topk(hidden[:0], gate_weight, 1, True, capture_out=empty_capture)
    assert weights.shape == ids.shape == (0, 1)


def test_fp32_logits_route_closer_to_fp64_than_bf16_logits():
    """A router whose experts share a large common logit component and differ by a small spread (as a trained
    router's top experts do): BF16 logits (step 2^-5 at |logit| ~ 4) tie or swap experts ~0.004 apart, FP32 ones
    do not. Counted: top-k set members missing against the FP64 routing."""
    T, H, E, k = 64, 256, 128, 8
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    common = torch.randn(H, generator=g) * 4 / H**0.5
    gate_weight = (common + torch.randn(E, H, generator=g) * 0.05 / H**0.5).bfloat16()
    want = fp64_logits(hidden, gate_weight).topk(k, dim=-1).indices

    def missing(ids):
        return sum(len(set(a) - set(b)) for a, b in zip(want.tolist(), ids.tolist(), strict=True))

    fused = missing(router_gate_topk(hidden, gate_weight, k, True)[1])
    torch_path = missing(router_topk_reference(F.linear(hidden, gate_weight), k, True)[1])
    assert torch_path > 10 * (fused + 1), (fused, torch_path)  # observed: 0 against 55-69 of 512 (seeds 11-13)


_H = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEVICE)
_W = torch.zeros(16, 32, dtype=torch.bfloat16, device=DEVICE)
_BAD = {
    "hidden dtype": (dict(hidden=_H.float()), TypeError, "hidden must be a bfloat16"),
    "hidden rank": (dict(hidden=_H[0]), ValueError, r"hidden must be \[T, H\]"),
    "hidden H": (dict(hidden=torch.zeros(4, 24, dtype=torch.bfloat16, device=DEVICE)), ValueError, "hidden: H must be"),
    "hidden strided": (dict(hidden=torch.zeros(32, 4, dtype=torch.bfloat16, device=DEVICE).t()), ValueError,
                       "hidden must be contiguous"),
    "gate_weight dtype": (dict(gate_weight=_W.half()), TypeError, "gate_weight must be a bfloat16"),
    "gate_weight H mismatch": (dict(gate_weight=torch.zeros(16, 48, dtype=torch.bfloat16, device=DEVICE)), ValueError,
                               r"gate_weight must be \[E, H=32\]"),
    "gate_weight strided": (dict(gate_weight=torch.zeros(32, 16, dtype=torch.bfloat16, device=DEVICE).t()), ValueError,
                            "gate_weight must be contiguous"),
    "E too big": (dict(gate_weight=torch.zeros(513, 32, dtype=torch.bfloat16, device=DEVICE)),
        ValueError, "gate_weight: E must"),
    "k > E": (dict(top_k=17), ValueError, "top_k must be an int in 1..E=16"),
    "k not int": (dict(top_k=True), ValueError, "top_k must be"),
    "weights_out dtype": (dict(weights_out=torch.empty(4, 2, dtype=torch.bfloat16, device=DEVICE)),
        TypeError, "weights_out must"),
    "ids_out shape": (dict(ids_out=torch.empty(4, 3, dtype=torch.int64, device=DEVICE)),
        ValueError, "ids_out must have shape"),
    "capture_out dtype": (dict(capture_out=torch.empty(4, 2, dtype=torch.int64, device=DEVICE)), TypeError,
                          "capture_out must be a uint8, int16 or int32"),
    "capture_out shape": (dict(capture_out=torch.empty(4, 3, dtype=torch.uint8, device=DEVICE)), ValueError,
                          "capture_out must have shape"),
    "capture_out strided": (dict(capture_out=torch.empty(2, 4, dtype=torch.int16, device=DEVICE).t()), ValueError,
                            "capture_out must be contiguous"),
    "capture_out uint8, E > 256": (dict(gate_weight=torch.zeros(300, 32, dtype=torch.bfloat16, device=DEVICE),
                                        capture_out=torch.empty(4, 2, dtype=torch.uint8, device=DEVICE)), TypeError,
                                   "capture_out: uint8 cannot hold"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_inputs_name_the_argument(case):
    override, error, message = _BAD[case]
    args = {"hidden": _H, "gate_weight": _W, "top_k": 2, "norm_topk_prob": True, **override}
    with pytest.raises(error, match=message):
        router_gate_topk(args.pop("hidden"), args.pop("gate_weight"), args.pop("top_k"), args.pop("norm_topk_prob"),
                         **args)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_30b_shape_on_gpu(T, norm):
    """Ids compared on tie-free rows (at T = 4096 a row or so may have two logits within _MARGIN); weights within
    1e-5: the GPU's MMA accumulation order differs from cuBLAS's by a few 1e-7 of logits ~ N(0, 1) over H 2048."""
    hidden, gate_weight = router_inputs(T, 2048, 128, seed=T, device=DEVICE)
    capture = torch.empty(T, 8, dtype=torch.uint8, device=DEVICE)
    weights, ids = router_gate_topk(hidden, gate_weight, 8, norm, capture_out=capture)
    want_w, want_ids = router_gate_topk_reference(hidden, gate_weight, 8, norm)
    clean = tie_free_rows(hidden, gate_weight, 8)
    assert clean.sum() >= 0.99 * T
    assert torch.equal(ids[clean], want_ids[clean]) and torch.equal(capture.long(), ids)
    torch.testing.assert_close(weights[clean], want_w[clean], rtol=1e-5, atol=0)
