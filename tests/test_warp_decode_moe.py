"""kernels/warp_decode_moe.py against moe_reference in FP32 on the same (dequantized) weights.

CPU: Triton's interpreter at tiny irregular shapes (odd T, k = 1, E not a power of two, H and I multiples
of 32 but not of 64); on a GPU machine the same cases run natively. The interpreter casts FP32 to BF16 by
truncation, the GPU rounds to nearest, so these checks allow one BF16 ulp per element.
GPU (marker `gpu`): the Qwen3-30B-A3B shape at T = 1, 2, 8 and 64 (each T its own tiles), every schedule, MXFP8
and BF16 weights.
"""

import pytest
import torch

from kernels import MXFP8Tensor, moe_reference, mxfp8_quantize
from kernels.moe_combine import moe_combine, moe_combine_reference
from kernels.warp_decode_moe import INTERPRETER_TILES, warp_decode_moe

SCHEDULES = ("pair", "expert_gate_up", "expert")
# Larger pair tiles than the GPU's: the interpreter's cost is per program.
CPU_TILES = INTERPRETER_TILES
# The tiny cases run on the GPU too when there is one (no interpreter there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(T, k, E, H, I, mx, device=DEVICE, ids=None, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    probs = torch.softmax(torch.randn(T, E, generator=gen), dim=-1)
    weights, topk = probs.topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ids = topk if ids is None else ids.to(device)
    if mx:
        w13, w2 = mxfp8_quantize(w13), mxfp8_quantize(w2)
    return tuple(a.to(device) for a in (hidden, weights, ids.to(torch.int32), w13, w2))


def _run(args, **kw):
    hidden = args[0]
    out = torch.full_like(hidden, float("nan"))
    got = warp_decode_moe(*args, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "output elements left unwritten (NaN poison survived)"
    return out.float()


def _errors(args, out):
    # FP32 hidden in, so the reference output is not rounded to BF16.
    ref = moe_reference(args[0].float(), *args[1:], compute_dtype=torch.float32)
    ref_bf16 = moe_reference(*args, compute_dtype=torch.bfloat16).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    rel_bf16 = ((ref_bf16 - ref).norm() / ref.norm()).item()
    return ref, rel, rel_bf16


def _check_small(args, out):
    ref, rel, rel_bf16 = _errors(args, out)
    # One BF16 ulp of each element, plus a little of the largest for the expert path's TF32 act on the GPU
    # (the interpreter's dots are FP32).
    tol = torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-3 * ref.abs().max()
    assert ((out - ref).abs() <= tol).all(), "more than one BF16 ulp from the FP32 reference"
    # The interpreter's truncation doubles the output rounding error; on the GPU the bound is 0.7x (test_gpu_*).
    assert rel < 1e-2 and rel <= 1.5 * rel_bf16, (rel, rel_bf16)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mxfp8_odd_shapes(schedule):
    args = _problem(T=5, k=3, E=6, H=96, I=160, mx=True, seed=1)
    _check_small(args, _run(args, schedule=schedule, tiles=CPU_TILES))


@pytest.mark.parametrize("schedule", ("pair", "expert"))
def test_bf16_k1(schedule):
    args = _problem(T=3, k=1, E=5, H=160, I=96, mx=False, seed=2)
    _check_small(args, _run(args, schedule=schedule, tiles=CPU_TILES))


def test_default_tiles_auto_single_token():
    args = _problem(T=1, k=2, E=7, H=96, I=96, mx=True, seed=3)
    _check_small(args, _run(args))


def test_expert_leads_by_pair_with_shared_experts():
    # Fewer pairs than experts (one program per pair, the first pair of each expert leads), experts shared.
    ids = torch.tensor([[4, 1], [1, 6], [6, 4]])
    args = _problem(T=3, k=2, E=9, H=96, I=96, mx=True, ids=ids, seed=4)
    _check_small(args, _run(args, schedule="expert", tiles=CPU_TILES))


def test_expert_with_more_pairs_than_one_tile():
    # 17 tokens on experts 0 and 2: each expert gets 17 pairs, more than the expert schedule's 16-pair tile.
    ids = torch.tensor([[0, 2], [2, 0]] * 8 + [[0, 2]])
    args = _problem(T=17, k=2, E=3, H=96, I=96, mx=False, ids=ids, seed=5)
    _check_small(args, _run(args, schedule="expert", tiles=CPU_TILES))


def test_launcher_errors():
    hidden, weights, ids, w13, w2 = _problem(T=3, k=2, E=5, H=96, I=96, mx=True)
    with pytest.raises(TypeError, match="hidden"):
        warp_decode_moe(hidden.float(), weights, ids, w13, w2)
    with pytest.raises(TypeError, match="topk_ids"):
        warp_decode_moe(hidden, weights, ids.float(), w13, w2)
    with pytest.raises(TypeError, match="topk_weights"):
        warp_decode_moe(hidden, weights.to(torch.int32), ids, w13, w2)
    with pytest.raises(TypeError, match="w13"):
        warp_decode_moe(hidden, weights, ids, w13.dequantize(torch.float16), w2)
    with pytest.raises(TypeError, match="both"):
        warp_decode_moe(hidden, weights, ids, w13, w2.dequantize(torch.bfloat16))
    with pytest.raises(ValueError, match="w2"):
        warp_decode_moe(hidden, weights, ids, w13, w2[:, :64])
    with pytest.raises(ValueError, match="hidden must be contiguous"):
        warp_decode_moe(torch.empty(96, 3, dtype=torch.bfloat16, device=DEVICE).t(), weights, ids, w13, w2)
    strided = MXFP8Tensor(torch.empty(5, 192, 192, dtype=torch.float8_e4m3fn, device=DEVICE)[:, :, ::2],
                          torch.empty(5, 192, 6, dtype=torch.uint8, device=DEVICE)[:, :, ::2])
    with pytest.raises(ValueError, match="w13.data must be contiguous"):
        warp_decode_moe(hidden, weights, ids, strided, w2)
    with pytest.raises(ValueError, match="out"):
        warp_decode_moe(hidden, weights, ids, w13, w2, out=torch.empty(3, 64, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="schedule"):
        warp_decode_moe(hidden, weights, ids, w13, w2, schedule="sorted")


@pytest.mark.gpu
@pytest.mark.parametrize("T", (1, 2, 8, 64))
@pytest.mark.parametrize("mx", (True, False))
def test_gpu_qwen3_30b_shape(T, mx):
    args = _problem(T=T, k=8, E=128, H=2048, I=768, mx=mx, device="cuda", seed=10 + T)
    for schedule in ("auto", *SCHEDULES):
        out = _run(args, schedule=schedule)
        assert torch.equal(out, _run(args, schedule=schedule)), "not deterministic"
        _, rel, rel_bf16 = _errors(args, out)
        assert rel <= 3e-3 and rel <= 0.7 * rel_bf16, (schedule, rel, rel_bf16)


@pytest.mark.parametrize("T,k,H", [(5, 3, 96), (1, 8, 2048), (7, 1, 160)])
def test_combine_sums_each_tokens_rows(T, k, H):
    part = torch.randn(T * k, H, generator=torch.Generator().manual_seed(T * k + H)).to(DEVICE)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = moe_combine(part, out, k).float()
    ref = part.view(T, k, H).double().sum(1)
    # One BF16 ulp: the interpreter truncates to BF16 where the GPU rounds.
    assert ((got - ref).abs() <= torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-6).all()
    if DEVICE == "cuda":  # both round to nearest there; the interpreter truncates, checked by the bound above
        assert torch.equal(moe_combine_reference(part, k).float(), got)


def test_combine_names_a_bad_buffer():
    with pytest.raises(ValueError, match="part"):
        moe_combine(torch.zeros(5, 64, device=DEVICE), torch.empty(2, 64, dtype=torch.bfloat16, device=DEVICE), 3)
