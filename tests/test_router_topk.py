"""The fused router top-k kernel against `route`'s math (kernels/router_topk.py).

Ids are compared exactly on tie-free rows: FP32 logits drawn at random, BF16 logits a random permutation of
distinct representable values per row (BF16 has 128 values per binade: random rows of 128 would tie). Observed
(interpreter): weights within ~3e-7 relative of the reference.
"""

import pytest
import torch

from kernels.router_topk import router_topk, router_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tie_free_logits(T, E, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return (torch.randn(T, E, generator=g) * 2).to(device)
    # E distinct BF16 values, shuffled per row: multiples of 2^-5 in [-4, 4), where BF16's step is <= 2^-6.
    assert E <= 256
    values = (torch.arange(E, device=DEVICE) - E // 2).float() * 2**-5
    rows = torch.stack([values[torch.randperm(E, generator=g)] for _ in range(T)])
    logits = rows.bfloat16()
    assert all(len(set(row)) == E for row in logits.float().tolist())
    return logits.to(device)


@pytest.mark.parametrize("E", [12, 60, 128])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_reference(E, k, T, dtype, norm):
    logits = tie_free_logits(T, E, dtype, seed=E * 1000 + k * 100 + T)
    weights, ids = router_topk(logits, k, norm)
    want_w, want_ids = router_topk_reference(logits, k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T, device=DEVICE), rtol=1e-6, atol=0)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("norm", [False, True])
def test_ties_go_to_the_lower_index(k, norm):
    logits = torch.zeros(6, 24, device=DEVICE)
    logits[3, [5, 17]] = 1.0  # one row with a tied pair above the rest: 5 before 17, then 0, 1, ...
    weights, ids = router_topk(logits, k, norm)
    want = torch.arange(k, device=DEVICE).expand(6, k)
    assert torch.equal(ids[[0, 1, 2, 4, 5]], want[:5])
    assert ids[3].tolist() == ([5, 17] + [e for e in range(24) if e not in (5, 17)])[:k]
    flat = weights[[0, 1, 2, 4, 5]]
    torch.testing.assert_close(flat, torch.full_like(flat, 1 / k if norm else 1 / 24), rtol=1e-6, atol=0)


def test_probabilities_tied_by_underflow_keep_index_order():
    logits = torch.full((2, 16), -1000.0, device=DEVICE)
    logits[:, 9] = 0.0  # every other exp underflows to 0: p = 1 for expert 9, exact ties at 0 for the rest
    weights, ids = router_topk(logits, 4, False)
    assert ids.tolist() == [[9, 0, 1, 2]] * 2
    assert weights.tolist() == [[1.0, 0.0, 0.0, 0.0]] * 2


def test_given_buffers_empty_and_small_shapes():
    logits = tie_free_logits(7, 128, torch.float32, seed=2)
    w_out, i_out = torch.empty(7, 8, device=DEVICE), torch.empty(7, 8, dtype=torch.int64, device=DEVICE)
    weights, ids = router_topk(logits, 8, True, weights_out=w_out, ids_out=i_out)
    assert weights is w_out and ids is i_out
    assert torch.equal(ids, router_topk_reference(logits, 8, True)[1])
    weights, ids = router_topk(torch.empty(0, 128, device=DEVICE), 8, True)
    assert weights.shape == ids.shape == (0, 8)
    weights, ids = router_topk(torch.tensor([[0.5], [-3.0]], device=DEVICE), 1, False)  # E = 1
    assert ids.tolist() == [[0], [0]] and weights.tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_capture_out_gets_the_ids_in_its_own_type(dtype):
    """The routed-expert capture (ExpertCapture.ids[layer]) written by the same launch; other layers untouched."""
    logits = tie_free_logits(19, 128, torch.float32, seed=8)
    capture = torch.full((3, 19, 8), 99, dtype=dtype, device=DEVICE)
    weights, ids = router_topk(logits, 8, True, capture_out=capture[1])
    assert torch.equal(ids, router_topk_reference(logits, 8, True)[1])
    assert torch.equal(capture[1].long(), ids) and (capture[[0, 2]] == 99).all()


_LOGITS = torch.zeros(4, 16, device=DEVICE)
_BAD = {
    "logits dtype": (dict(logits=_LOGITS.half()), TypeError, "logits must be a bfloat16 or float32"),
    "logits rank": (dict(logits=_LOGITS[0]), ValueError, r"logits must be \[T, E\]"),
    "logits strided": (dict(logits=torch.zeros(16, 4, device=DEVICE).t()), ValueError, "logits must be contiguous"),
    "E too big": (dict(logits=torch.zeros(1, 513, device=DEVICE)), ValueError, "logits: E must be"),
    "k > E": (dict(top_k=17), ValueError, "top_k must be an int in 1..E=16"),
    "k < 1": (dict(top_k=0), ValueError, "top_k must be"),
    "k not int": (dict(top_k=2.0), ValueError, "top_k must be"),
    "weights_out dtype": (dict(weights_out=torch.empty(4, 2, dtype=torch.bfloat16, device=DEVICE)),
        TypeError, "weights_out must"),
    "weights_out shape": (dict(weights_out=torch.empty(4, 3, device=DEVICE)),
        ValueError, "weights_out must have shape"),
    "ids_out dtype": (dict(ids_out=torch.empty(4, 2, dtype=torch.int32, device=DEVICE)),
        TypeError, "ids_out must be a torch.int64"),
    "ids_out strided": (dict(ids_out=torch.empty(2, 4, dtype=torch.int64, device=DEVICE).t()),
        ValueError, "ids_out must be contig"),
    "capture_out dtype": (dict(capture_out=torch.empty(4, 2, dtype=torch.int64, device=DEVICE)),
        TypeError, "capture_out must be a uint8, int16 or int32"),
    "capture_out shape": (dict(capture_out=torch.empty(4, 3, dtype=torch.uint8, device=DEVICE)),
        ValueError, "capture_out must have shape"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_inputs_name_the_argument(case):
    override, error, message = _BAD[case]
    args = {"logits": _LOGITS, "top_k": 2, "norm_topk_prob": True, **override}
    with pytest.raises(error, match=message):
        router_topk(args.pop("logits"), args.pop("top_k"), args.pop("norm_topk_prob"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_30b_shape_on_gpu(T, dtype, norm):
    logits = tie_free_logits(T, 128, dtype, seed=T, device=DEVICE)
    weights, ids = router_topk(logits, 8, norm)
    want_w, want_ids = router_topk_reference(logits, 8, norm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)
