"""The fused decode router ((add + RMSNorm,) gate GEMM + top-k + capture in one launch, kernels/router_gate_topk.py)
against its torch reference.

Ids are compared exactly on rows whose FP64 logits are tie-free: the first k + 1 sorted logits at least
_MARGIN apart, far above the ~1e-6 by which two FP32 accumulation orders differ (asserted per case: with random
data it always holds). Observed (interpreter): weights within ~7e-7 relative of the reference.
"""

import pytest
import torch
import torch.nn.functional as F

from composer_rollout.engine.capture import ExpertCapture
from kernels.router_gate_topk import router_gate_topk as _router_gate_topk
from kernels.router_gate_topk import router_gate_topk_reference
from kernels.router_topk import router_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_MARGIN = 1e-5


def router_gate_topk(*args, counter=None, **kwargs):
    """The launcher with a fresh zeroed counter, which every launch must leave zeroed."""
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE) if counter is None else counter
    out = _router_gate_topk(*args, counter, **kwargs)
    assert counter.item() == 0
    return out


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
@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_reference(E, k, T, H, norm):
    hidden, gate_weight = router_inputs(T, H, E, seed=E * 1000 + k * 100 + T + H)
    assert tie_free_rows(hidden, gate_weight, k).all()
    weights, ids, normed, summed = router_gate_topk(hidden, gate_weight, k, norm)
    assert normed is None and summed is None
    want_w, want_ids, _, _ = router_gate_topk_reference(hidden, gate_weight, k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T, device=DEVICE), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_capture_out(dtype):
    T, H, E, k = 13, 128, 128, 8
    hidden, gate_weight = router_inputs(T, H, E, seed=7)
    capture = ExpertCapture(num_layers=3, num_tokens=T, top_k=k, num_experts=E, device=DEVICE)
    capture.ids = capture.ids.to(dtype).fill_(99)  # ExpertCapture's own dtype is uint8 (E <= 256)
    weights, ids = router_gate_topk(hidden, gate_weight, k, True, capture_out=capture.ids[1])[:2]
    assert torch.equal(ids, router_gate_topk_reference(hidden, gate_weight, k, True).ids)
    assert capture.ids.dtype == dtype and torch.equal(capture.ids[1].long(), ids)
    assert (capture.ids[[0, 2]] == 99).all()  # the other layers' rows untouched


@pytest.mark.parametrize("T, H, E", [(1, 96, 60), (3, 200, 128), (16, 64, 12)])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
def test_add_norm_routes_the_normed_sum(T, H, E, hidden_dtype):
    """With add_norm the launch also returns rms_norm(hidden + residual) and the sum, as kernels/rmsnorm.py would
    (one BF16 step apart at most where the two sums of squares round rsqrt differently), and routes the normed
    rows. A strided hidden (a view of a wider buffer; FP32 too, as the fast path's o_proj writes it) and a
    residual of another scale than hidden."""
    g = torch.Generator().manual_seed(T + H)
    wide, gate_weight = router_inputs(T, 2 * H, E, seed=T + H)
    if hidden_dtype == torch.float32:
        wide = wide.float() * (1 + torch.rand(wide.shape, generator=g).to(DEVICE) / 64)
    hidden, gate_weight = wide[:, :H], gate_weight[:, :H].contiguous() * 4
    residual = (torch.randn(T, H, generator=g) * 3).to(DEVICE)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).bfloat16().to(DEVICE)
    add_norm = (residual, norm_weight, 1e-6)
    got = router_gate_topk(hidden, gate_weight, 4, True, add_norm=add_norm)
    want = router_gate_topk_reference(hidden, gate_weight, 4, True, add_norm=add_norm)
    assert torch.equal(got.residual, want.residual)
    steps = (got.normed.view(torch.int16).int() - want.normed.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and steps.float().mean() < 1e-3
    clean = tie_free_rows(got.normed, gate_weight, 4)
    assert clean.sum() >= T - 1
    assert torch.equal(got.ids[clean], want.ids[clean])
    torch.testing.assert_close(got.weights[clean], want.weights[clean], rtol=1e-5, atol=0)


def test_counter_left_zero_over_repeated_launches():
    """The last program resets the counter: launches that share it (a layer's router in every decode step) keep
    routing correctly; a counter left non-zero would make no program, or the wrong one, run the top-k."""
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for seed in range(3):
        hidden, gate_weight = router_inputs(2, 64, 20, seed=seed)
        ids = router_gate_topk(hidden, gate_weight, 3, False, counter=counter).ids
        assert torch.equal(ids, router_gate_topk_reference(hidden, gate_weight, 3, False).ids)


def test_ties_go_to_the_lower_index():
    hidden, gate_weight = router_inputs(6, 64, 24, seed=3)
    hidden[:, 0] = 8.0
    gate_weight[:, 0] = 0.0
    # logits 8 exactly, above the rest
    gate_weight[[17, 5]] = F.one_hot(torch.tensor([0, 0], device=DEVICE), 64).bfloat16()
    weights, ids = router_gate_topk(hidden, gate_weight, 3, False)[:2]
    assert ids[:, :2].tolist() == [[5, 17]] * 6
    assert torch.equal(ids[:, 2], router_gate_topk_reference(hidden, gate_weight, 3, False).ids[:, 2])
    zero = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)  # all logits 0: experts 0..k-1, p = 1/E
    weights, ids = router_gate_topk(zero, gate_weight, 4, False)[:2]
    assert ids.tolist() == [[0, 1, 2, 3]] * 4
    torch.testing.assert_close(weights, torch.full((4, 4), 1 / 24, device=DEVICE), rtol=1e-6, atol=0)


def test_empty_and_single_expert():
    hidden, gate_weight = router_inputs(3, 32, 1, seed=4)
    weights, ids = router_gate_topk(hidden, gate_weight, 1, False)[:2]  # E = 1: 15 of 16 columns at -inf
    assert ids.tolist() == [[0]] * 3 and weights.tolist() == [[1.0]] * 3
    empty_capture = torch.empty(0, 1, dtype=torch.uint8, device=DEVICE)
    weights, ids = router_gate_topk(hidden[:0], gate_weight, 1, True, capture_out=empty_capture)[:2]
    assert weights.shape == ids.shape == (0, 1)


def test_fp32_logits_route_closer_to_fp64_than_bf16_logits():
    """A router whose experts share a large common logit component and differ by a small spread (as a trained
    router's top experts do): BF16 logits (step 2^-5 at |logit| ~ 4) tie or swap experts ~0.004 apart, FP32 ones
    do not. Counted: top-k set members missing against the FP64 routing."""
    T, H, E, k = 16, 256, 128, 8
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    common = torch.randn(H, generator=g) * 4 / H**0.5
    gate_weight = (common + torch.randn(E, H, generator=g) * 0.05 / H**0.5).bfloat16()
    want = fp64_logits(hidden, gate_weight).topk(k, dim=-1).indices

    def missing(ids):
        return sum(len(set(a) - set(b)) for a, b in zip(want.tolist(), ids.tolist(), strict=True))

    fused = missing(router_gate_topk(hidden, gate_weight, k, True)[1])
    torch_path = missing(router_topk_reference(F.linear(hidden, gate_weight), k, True)[1])
    assert torch_path > 5 * (fused + 1), (fused, torch_path)


_H = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEVICE)
_W = torch.zeros(16, 32, dtype=torch.bfloat16, device=DEVICE)
_NORM = (torch.zeros(4, 32, device=DEVICE), torch.ones(32, dtype=torch.bfloat16, device=DEVICE), 1e-6)
_BAD = {
    "hidden dtype": (dict(hidden=_H.half()), TypeError, "hidden must be a bfloat16 or float32"),
    "hidden rank": (dict(hidden=_H[0]), ValueError, r"hidden must be a 2-D tensor \[T, K\]"),
    "hidden H": (dict(hidden=torch.zeros(4, 20, dtype=torch.bfloat16, device=DEVICE)), ValueError,
                 "hidden: K = 20 must be a positive multiple of 8"),
    "hidden T": (dict(hidden=torch.zeros(17, 32, dtype=torch.bfloat16, device=DEVICE)), ValueError,
                 "hidden has T = 17 tokens, more than the kernel's 16"),
    "hidden strided": (dict(hidden=torch.zeros(32, 4, dtype=torch.bfloat16, device=DEVICE).t()), ValueError,
                       "hidden must have contiguous rows"),
    "gate_weight dtype": (dict(gate_weight=_W.half()), TypeError, "gate_weight must be a torch.bfloat16"),
    "gate_weight H mismatch": (dict(gate_weight=torch.zeros(16, 48, dtype=torch.bfloat16, device=DEVICE)), ValueError,
                               r"gate_weight must have shape \(16, 32\)"),
    "gate_weight strided": (dict(gate_weight=torch.zeros(32, 16, dtype=torch.bfloat16, device=DEVICE).t()), ValueError,
                            "gate_weight must be contiguous"),
    "E too big": (dict(gate_weight=torch.zeros(513, 32, dtype=torch.bfloat16, device=DEVICE)),
        ValueError, "gate_weight: E must"),
    "k > E": (dict(top_k=17), ValueError, "top_k must be an int in 1..E=16"),
    "k not int": (dict(top_k=True), ValueError, "top_k must be"),
    "counter dtype": (dict(counter=torch.zeros(1, dtype=torch.int64, device=DEVICE)), TypeError,
                      "counter must be a torch.int32"),
    "counter shape": (dict(counter=torch.zeros(2, dtype=torch.int32, device=DEVICE)), ValueError,
                      r"counter must have shape \(1,\)"),
    "capture_out dtype": (dict(capture_out=torch.empty(4, 2, dtype=torch.int64, device=DEVICE)), TypeError,
                          "capture_out must be a uint8, int16 or int32"),
    "capture_out shape": (dict(capture_out=torch.empty(4, 3, dtype=torch.uint8, device=DEVICE)), ValueError,
                          "capture_out must have shape"),
    "capture_out strided": (dict(capture_out=torch.empty(2, 4, dtype=torch.int16, device=DEVICE).t()), ValueError,
                            "capture_out must be contiguous"),
    "capture_out uint8, E > 256": (dict(gate_weight=torch.zeros(300, 32, dtype=torch.bfloat16, device=DEVICE),
                                        capture_out=torch.empty(4, 2, dtype=torch.uint8, device=DEVICE)), TypeError,
                                   "capture_out: uint8 cannot hold"),
    "residual dtype": (dict(add_norm=(_NORM[0].bfloat16(), *_NORM[1:])), TypeError, "residual must be a torch.float32"),
    "norm_weight shape": (dict(add_norm=(_NORM[0], _NORM[1][:16], 1e-6)), ValueError,
                          r"norm_weight must have shape \(32,\)"),
    "eps": (dict(add_norm=(*_NORM[:2], -1.0)), ValueError, "eps must be a non-negative number"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_inputs_name_the_argument(case):
    override, error, message = _BAD[case]
    args = {"hidden": _H, "gate_weight": _W, "top_k": 2, "norm_topk_prob": True,
            "counter": torch.zeros(1, dtype=torch.int32, device=DEVICE), **override}
    with pytest.raises(error, match=message):
        _router_gate_topk(args.pop("hidden"), args.pop("gate_weight"), args.pop("top_k"), args.pop("norm_topk_prob"),
                          args.pop("counter"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 16])
@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_30b_shape_on_gpu(T, norm):
    """The 30B router at decode sizes, with the add + norm: ids on tie-free rows, weights within 1e-5 (FP32 sums in
    another order than torch's over H 2048), 100 launches on one counter."""
    hidden, gate_weight = router_inputs(T, 2048, 128, seed=T, device=DEVICE)
    residual = torch.randn(T, 2048, device=DEVICE) * 4
    norm_weight = (1 + 0.1 * torch.randn(2048, device=DEVICE)).bfloat16()
    capture = torch.empty(T, 8, dtype=torch.uint8, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(100):
        got = _router_gate_topk(hidden, gate_weight, 8, norm, counter, capture_out=capture,
                                add_norm=(residual, norm_weight, 1e-6))
    want = router_gate_topk_reference(hidden, gate_weight, 8, norm, add_norm=(residual, norm_weight, 1e-6))
    assert counter.item() == 0 and torch.equal(got.residual, want.residual)
    assert (got.normed.float() - want.normed.float()).abs().max() <= 2 ** -7 * want.normed.float().abs().max()
    clean = tie_free_rows(got.normed, gate_weight, 8)
    assert clean.sum() >= T - 1
    assert torch.equal(got.ids[clean], want.ids[clean]) and torch.equal(capture.long(), got.ids)
    torch.testing.assert_close(got.weights[clean], want.weights[clean], rtol=1e-5, atol=0)
