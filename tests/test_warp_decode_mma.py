"""kernels/warp_decode_mma.py against moe_reference in FP32 on the same (dequantized) weights.

CPU: Triton's interpreter (its FP16 dots are exact products with FP32 sums; it gets BF16 dots wrong, which is
why this path uses FP16) at tiny irregular shapes: odd T, k = 1, E not a power of two, H and I multiples of 32
but not of 64, reduction chunks that do not divide H or I. GPU (marker `gpu`): the Qwen3-30B-A3B shape at
T = 1 and 64, MXFP8 and BF16 weights, batched and looped dots.
"""

import pytest
import torch

from kernels import mxfp8_quantize
from kernels.warp_decode_mma import MmaTiles, warp_decode_mma
from tests.test_warp_decode_moe import DEVICE, _check_small, _errors, _problem

# Interpreted programs cost milliseconds each: few, large tiles on the CPU.
CPU_TILES = MmaTiles(gate_up_rows=64, down_rows=64, bk=64)


def _run(args, **kw):
    out = torch.full_like(args[0], float("nan"))
    got = warp_decode_mma(*args, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "output elements left unwritten (NaN poison survived)"
    return out.float()


@pytest.mark.parametrize("batched", (True, False))
def test_mxfp8_odd_shapes(batched):
    # H = 96 and I = 160 are not multiples of bk = 64: masked chunks; 15 pairs over 6 experts.
    args = _problem(T=5, k=3, E=6, H=96, I=160, mx=True, seed=11)
    _check_small(args, _run(args, tiles=MmaTiles(gate_up_rows=64, down_rows=64, bk=64, batched=batched)))


def test_bf16_k1():
    args = _problem(T=3, k=1, E=5, H=160, I=96, mx=False, seed=12)
    _check_small(args, _run(args, tiles=CPU_TILES))


def test_leads_by_pair_and_more_pairs_than_one_tile():
    # 17 tokens on experts 0 and 2 (17 pairs each, > one 16-pair tile); fewer pairs than experts elsewhere.
    ids = torch.tensor([[0, 2], [2, 0]] * 8 + [[0, 2]])
    args = _problem(T=17, k=2, E=3, H=96, I=96, mx=True, ids=ids, seed=13)
    _check_small(args, _run(args, tiles=CPU_TILES))
    args = _problem(T=3, k=2, E=9, H=96, I=96, mx=True, ids=torch.tensor([[4, 1], [1, 6], [6, 4]]), seed=14)
    _check_small(args, _run(args, tiles=CPU_TILES))


@pytest.mark.parametrize("mx", (True, False))
def test_fp16_range(mx):
    # Tiny weights (act ~ 1e-10, under FP16's smallest subnormal unless rescaled) and hidden beyond 65504:
    # the per-(group, pair) power-of-two fit must keep both exact.
    hidden, weights, ids, w13, w2 = _problem(T=2, k=2, E=3, H=96, I=96, mx=False, seed=15)
    w13, w2 = w13 * 2.0**-14, w2 * 2.0**-14
    if mx:
        w13, w2 = mxfp8_quantize(w13), mxfp8_quantize(w2)
    for h in (hidden, hidden * 2.0**17):
        args = (h, weights, ids, w13, w2)
        _check_small(args, _run(args, tiles=CPU_TILES))


def test_errors():
    hidden, weights, ids, w13, w2 = _problem(T=3, k=2, E=5, H=96, I=96, mx=True)
    with pytest.raises(TypeError, match="hidden"):
        warp_decode_mma(hidden.float(), weights, ids, w13, w2)
    with pytest.raises(TypeError, match="both"):
        warp_decode_mma(hidden, weights, ids, w13, w2.dequantize(torch.bfloat16))
    with pytest.raises(ValueError, match="tiles"):
        warp_decode_mma(hidden, weights, ids, w13, w2, tiles=MmaTiles(bk=48))
    with pytest.raises(ValueError, match="out"):
        warp_decode_mma(hidden, weights, ids, w13, w2, out=torch.empty(3, 64, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("T", (1, 64))
@pytest.mark.parametrize("mx", (True, False))
def test_gpu_qwen3_30b_shape(T, mx):
    args = _problem(T=T, k=8, E=128, H=2048, I=768, mx=mx, device="cuda", seed=20 + T)
    for tiles in (MmaTiles(), MmaTiles(batched=True)):
        out = _run(args, tiles=tiles)
        assert torch.equal(out, _run(args, tiles=tiles)), "not deterministic"
        _, rel, rel_bf16 = _errors(args, out)
        assert rel <= 3e-3 and rel <= 0.7 * rel_bf16, (tiles, rel, rel_bf16)
