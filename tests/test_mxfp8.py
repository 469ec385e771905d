"""The host MXFP8 quantizer: hand-checked blocks, the scale rule, and the error on random weights."""

import pytest
import torch

from kernels import MXFP8Tensor, mxfp8_dequantize, mxfp8_quantize


def one_block(values) -> torch.Tensor:
    block = torch.zeros(32)
    block[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return block[None]


def test_all_zero_block_gets_code_1_and_zeros():
    q = mxfp8_quantize(torch.zeros(2, 64))
    assert q.scales.tolist() == [[1, 1], [1, 1]]
    assert (q.data.float() == 0).all() and (q.dequantize() == 0).all()


def test_block_at_exactly_448_keeps_scale_one():
    q = mxfp8_quantize(one_block([448.0, -448.0, 1.0, 0.5]))
    assert q.scales.item() == 127  # 2^0
    assert q.dequantize()[0, :4].tolist() == [448.0, -448.0, 1.0, 0.5]


def test_ceil_rule_never_saturates():
    # amax 449 > 448: the ceil rule moves to scale 2^1 instead of clipping. 449 / 2 = 224.5 rounds to 224
    # (E4M3 step 16 in [128, 256)); 3 / 2 = 1.5 is exact; 3.3 / 2 = 1.65 rounds to 1.625 (step 0.125).
    q = mxfp8_quantize(one_block([449.0, 3.0, 3.3]))
    assert q.scales.item() == 128
    assert q.dequantize()[0, :3].tolist() == [448.0, 3.0, 3.25]
    big = mxfp8_quantize(one_block([1000.0, -1000.0]))
    assert big.scales.item() == 127 + 2  # 1000 / 448 = 2.23 -> 2^2
    assert big.dequantize()[0, :2].tolist() == [1024.0, -1024.0]  # 250 -> 256 (E4M3 step 32 above 256)


def test_mixed_signs_and_round_to_nearest_even():
    # scale 2^0 (amax 448); 1.0625 lies halfway between E4M3 neighbours 1.0 and 1.125: ties go to even (1.0);
    # 1.1875 is halfway between 1.125 and 1.25: ties to even mantissa (1.25).
    q = mxfp8_quantize(one_block([448.0, -1.0625, 1.1875, -3.3, 0.0]))
    assert q.dequantize()[0, :5].tolist() == [448.0, -1.0, 1.25, -3.25, 0.0]


def test_tiny_and_subnormal_values():
    # amax 2^-20: scale 2^(ceil(log2(2^-20 / 448))) = 2^-28; 2^-20 / 2^-28 = 256 exactly representable.
    q = mxfp8_quantize(one_block([2.0**-20, -(2.0**-21), 2.0**-40]))
    assert q.scales.item() == 127 - 28
    assert q.dequantize()[0, :3].tolist() == [2.0**-20, -(2.0**-21), 0.0]  # 2^-40 is below E4M3's smallest step
    # FP32 subnormal inputs: the scale clamps at code 1 (2^-126); the elements land in E4M3's subnormals:
    # 1e-40 / 2^-126 = 0.0085 -> 4 * 2^-9, and 3e-41 / 2^-126 = 0.00255 -> 2^-9.
    sub = mxfp8_quantize(one_block([1e-40, -3e-41]))
    assert sub.scales.item() == 1
    assert sub.dequantize()[0, :2].tolist() == [4 * 2.0**-135, -(2.0**-135)]


def test_block_whose_amax_over_448_underflows_gets_code_1():
    # amax <= 224 * 2^-149 divides by 448 to 0 in FP32; the block still clamps to code 1, as a zero block does.
    q = mxfp8_quantize(one_block([2.0**-149, -224 * 2.0**-149]))
    assert q.scales.item() == 1
    assert q.data.view(torch.uint8)[0, :2].tolist() == [0x00, 0x80]  # +0 and -0


def test_each_block_has_its_own_scale():
    w = torch.cat([one_block([1.0]), one_block([100.0])], dim=1)  # [1, 64], two blocks
    q = mxfp8_quantize(w)
    assert q.scales.tolist() == [[127 - 8, 127 - 2]]  # 1/448 -> 2^-8, 100/448 -> 2^-2
    # 100 / 2^-2 = 400, a tie between E4M3's 384 and 416: to even (384), so 96.
    assert q.dequantize()[0, [0, 32]].tolist() == [1.0, 96.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_weights_error_and_exact_dequantize(dtype):
    w = (torch.randn(6, 48, 160, generator=torch.Generator().manual_seed(0)) * 0.03).to(dtype)
    q = mxfp8_quantize(w)
    assert q.data.shape == w.shape and q.scales.shape == (6, 48, 5)
    deq = q.dequantize()
    rel = ((deq - w.float()).norm() / w.float().norm()).item()
    assert 0.01 < rel < 0.035, rel  # 3 mantissa bits: about 2.6% RMS on Gaussian blocks
    # Quantized values are a fixed point: re-quantizing them loses nothing. (The codes need not repeat: a
    # block whose amax rounded down to 224 * 2^e gets scale 2^(e-1) the second time.)
    assert torch.equal(mxfp8_quantize(deq).dequantize(), deq)
    # Every element within half an E4M3 step (1/16 relative) of its block scale's range.
    blocks = (deq - w.float()).abs().reshape(6, 48, 5, 32)
    step = torch.exp2(q.scales.float() - 127)[..., None] * 16  # largest E4M3 step (256..448) at this scale
    assert (blocks <= step).all()
    assert torch.equal(mxfp8_dequantize(q.data, q.scales, torch.bfloat16), deq.to(torch.bfloat16))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="non-finite"):
        mxfp8_quantize(one_block([1.0, float("nan")]))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize(torch.randn(4, 48))
    with pytest.raises(TypeError, match="scales must be uint8"):
        MXFP8Tensor(torch.randn(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="scales of shape"):
        MXFP8Tensor(torch.randn(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8))
