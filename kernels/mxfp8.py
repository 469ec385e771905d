"""MXFP8 weights: the one type every part of the project uses for them, and the host quantizer.

OCP Microscaling v1.0, MXFP8 with E4M3 elements: a weight [..., out, in] is stored as
    data   float8_e4m3fn [..., out, in]       one byte per element
    scales uint8       [..., out, in // 32]   E8M0 bits (2^(code - 127)), one per 32 consecutive input elements
so that  weight[..., o, i] ~= float(data[..., o, i]) * 2^(scales[..., o, i // 32] - 127).
Blocks run along the input (reduction) dimension, so a kernel that streams a weight row meets
one scale byte per 32 elements it loads. Scales are plain uint8, not torch.float8_e8m0fnu,
because Triton 3.6 has no mapping for that dtype.

Scale rule (ceil-to-fit, torchao's RCEIL): for a block with absolute maximum amax the exponent
is e = ceil(log2(amax / 448)), so amax / 2^e <= 448 and nothing saturates; the elements
x / 2^e are then rounded to nearest-even in E4M3. The OCP rule (floor(log2(amax)) - 8) keeps one
more bit for some blocks but clips up to 12.5% off their largest values; clipping the largest
weights costs more than the bit. e is clamped to [-126, 127] (codes 1..254): code 0 would decode
to 0.0 through the bit-cast decoders kernels use, and 255 is NaN. All-zero blocks get code 1.
Non-finite weights raise: they cannot be represented and would poison a whole block.

Bytes: 1 per element + 1 per 32 elements (1.03 bytes per weight, against 2 for BF16).
"""

from dataclasses import dataclass

import torch

MXFP8_BLOCK = 32
E4M3_MAX = 448.0
_MIN_EXP, _MAX_EXP = -126, 127


@dataclass(frozen=True)
class MXFP8Tensor:
    """A weight quantized to MXFP8: `data` float8_e4m3fn [..., out, in], `scales` uint8 [..., out, in // 32]."""

    data: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        if self.data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"MXFP8Tensor.data must be float8_e4m3fn, got {self.data.dtype}")
        if self.scales.dtype != torch.uint8:
            raise TypeError(f"MXFP8Tensor.scales must be uint8 (E8M0 bits), got {self.scales.dtype}")
        expected = (*self.data.shape[:-1], self.data.shape[-1] // MXFP8_BLOCK)
        if self.data.shape[-1] % MXFP8_BLOCK or tuple(self.scales.shape) != expected:
            raise ValueError(
                f"MXFP8Tensor: data {tuple(self.data.shape)} needs a last dim divisible by {MXFP8_BLOCK} "
                f"and scales of shape {expected}, got scales {tuple(self.scales.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel()

    def __getitem__(self, index) -> "MXFP8Tensor":
        """Index leading dims (an expert, a slice of experts); the last two dims stay whole."""
        return MXFP8Tensor(self.data[index], self.scales[index])

    def to(self, device) -> "MXFP8Tensor":
        return MXFP8Tensor(self.data.to(device), self.scales.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mxfp8_dequantize(self.data, self.scales, dtype)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) in FP32, exact for codes 1..254 (the only codes the quantizer writes)."""
    return torch.exp2(scales.to(torch.float32) - 127.0)


def ceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The scale rule above: clamp(ceil(log2(amax / 448)), -126, 127) per element of amax (FP32, >= 0), int32."""
    # frexp gives amax/448 = m * 2^p with m in [0.5, 1): ceil(log2) is p, or p - 1 when m == 0.5.
    # It is exact where log2 on floats is not (log2(2^k * 448) must give exactly k).
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)
    exp = torch.where(mantissa == 0.5, exponent - 1, exponent)
    # Test the quotient, not amax: amax <= 224 * 2^-149 (FP32 denormals) divides to 0, and frexp(0) is
    # (0, 0), which would give scale 2^0 where the rule (clamped) gives 2^-126, as for a zero block.
    return torch.where(mantissa > 0, exp, torch.full_like(exp, _MIN_EXP)).clamp(_MIN_EXP, _MAX_EXP)


def mxfp8_quantize(weight: torch.Tensor) -> MXFP8Tensor:
    """Quantize [..., out, in] (any float dtype, in % 32 == 0) with the ceil-to-fit rule above."""
    if weight.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"mxfp8_quantize: last dim {weight.shape[-1]} is not a multiple of {MXFP8_BLOCK}")
    w = weight.to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("mxfp8_quantize: weight has non-finite values (inf or NaN)")
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)
    exp = ceil_exponent(blocks.abs().amax(dim=-1))
    # Dividing by a power of two in [2^-126, 2^127] is exact in FP32 (no double rounding).
    scaled = blocks * torch.exp2(-exp.to(torch.float32)).unsqueeze(-1)
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(weight.shape)
    scales = (exp + 127).to(torch.uint8)
    return MXFP8Tensor(data, scales)


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact value of each element, data * 2^(scale - 127), computed in FP32 and cast to `dtype`."""
    blocks = data.to(torch.float32).reshape(*data.shape[:-1], data.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)
    out = blocks * e8m0_to_float(scales).unsqueeze(-1)
    return out.reshape(data.shape).to(dtype)


def as_dense(weight: "torch.Tensor | MXFP8Tensor", dtype: torch.dtype) -> torch.Tensor:
    """A dense tensor of `dtype` for either form of expert weight (BF16/FP32 tensor or MXFP8)."""
    if isinstance(weight, MXFP8Tensor):
        return weight.dequantize(dtype)
    return weight.to(dtype)
