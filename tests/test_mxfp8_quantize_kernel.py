"""The Triton MXFP8 quantizer against the host one, bit for bit (kernels/mxfp8_quantize_kernel.py).

CPU (Triton's interpreter, which runs the kernel's exact integer/FP32 arithmetic): random data at small
irregular shapes across magnitudes, every BF16 and FP16 bit pattern, the scale rule's binade edges, E4M3
rounding boundaries (ties, one ulp either side) at several scales, hand-made blocks (zeros, -0, carries into
the next binade, subnormal results, the largest and smallest inputs), preallocated and strided `out`,
non-finite input, and argument errors; on a GPU machine these run on CUDA. GPU only (marker `gpu`): every
finite amax, every FP32 value a block can scale to at three scale codes, every BF16 pattern at 150 shifts
below its block's max, random FP32 bit patterns, and Qwen3-30B-A3B's w13 and w2 shapes.
"""

import pytest
import torch

from kernels import MXFP8Tensor, mxfp8_quantize, mxfp8_quantize_triton, mxfp8_quantize_triton_many, raise_if_nonfinite
from kernels.mxfp8_quantize_kernel import mxfp8_quantize_into_rows

F32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max


def assert_same(q: MXFP8Tensor, x: torch.Tensor):
    ref = mxfp8_quantize(x.cpu())
    got, want = q.data.view(torch.uint8).cpu(), ref.data.view(torch.uint8)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} data bytes differ; first at {bad[0].tolist()}: x = "
                              f"{x.cpu()[tuple(bad[0])].item()!r}, kernel {got[tuple(bad[0])].item():#x}, "
                              f"host {want[tuple(bad[0])].item():#x}")
    assert torch.equal(q.scales.cpu(), ref.scales), "scales differ"


def blocks_of(values, dtype=torch.float32) -> torch.Tensor:
    """Values padded with zeros to whole blocks of 32, one block per row."""
    v = torch.tensor(values, dtype=torch.float64)
    pad = (-v.numel()) % 32
    return torch.cat([v, v.new_zeros(pad)]).reshape(-1, 32).to(dtype)


def bits_as(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns (int64) as `dtype`, non-finite ones replaced by 0."""
    raw = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    return finite(bits.to(raw).view(dtype))  # integer narrowing keeps the low bits


def finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def with_block_max(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x [B, 32] (as FP32) with element 0 of block i set to 2^shift[i] times the block's |max|, so the other
    elements scale down by 2^shift[i] into E4M3's subnormals and below (0 where that would overflow)."""
    x = x.clone().float()
    x[:, 0] = x.abs().amax(dim=1) * torch.exp2(shift.float())
    return finite(x)


def rounding_boundaries(codes) -> torch.Tensor:
    """For each scale code: every positive E4M3 value v, the midpoint m to the next one and the FP32 neighbours
    of m, signed both ways, times 2^(code - 127); each block's element 0 is 448 * 2^(code - 127) so the block
    gets exactly that code."""
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (e4m3[:-1] + e4m3[1:]) / 2
    vals = torch.cat([e4m3, mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(1e9))])
    vals = torch.cat([vals, -vals])
    vals = torch.cat([vals, vals.new_zeros((-vals.numel()) % 31)]).reshape(-1, 31)
    rows = []
    for code in codes:
        scale = 2.0 ** (code - 127)
        rows.append(torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1) * scale)
    return torch.cat(rows)


def edge_blocks(dtype) -> torch.Tensor:
    tiny = torch.finfo(dtype).smallest_normal
    sub = tiny * torch.finfo(dtype).eps  # smallest denormal
    blocks = [
        [0.0] * 32,                                    # all zero: code 1
        [-0.0, 0.0, -0.0],                             # signed zeros in a zero block keep their sign
        [448.0, -0.0, 1.0, -1.0625, 1.1875, 2**-10],   # scale 2^0; ties to even; half the smallest subnormal
        [449.0, 3.0, 3.3, -2**-9],                     # amax over 448 moves the scale up, never saturates
        [15.5, 15.75, -239.0, 3 * 2**-10, 7 * 2**-10],  # ties that carry into the next binade; subnormal ties
        [1000.0, -1000.0, 0.5],
        [448.0 * 2**20, 1.0, -(2.0**13)],              # small elements underflow to +-0
        [F32_MAX if dtype == torch.float32 else BF16_MAX, -1.0, 2.0**100],  # the largest finite input: code 247
        [1.75 * 2**-118, 1.0 * 2**-125],               # amax 448 * 2^-126: code 1 without clamping
        [1.75 * 2**-119, sub, -3 * sub],               # clamped to code 1; denormal inputs
        [tiny, -tiny / 2, sub, 5 * sub],               # smallest normal and denormals: E4M3 subnormal results
        [sub, -sub],                                   # amax / 448 underflows to 0 in FP32: code 1 still
        [224 * sub, 225 * sub],
    ]
    if dtype == torch.float16:
        blocks = [b for b in blocks if max(abs(v) for v in b) <= 65504]
    return torch.cat([blocks_of(b, dtype) for b in blocks])


def scale_rule_edges() -> torch.Tensor:
    """amax at 1.75 * 2^k (where ceil(log2(amax / 448)) steps) and its FP32 neighbours, for every binade."""
    k = torch.arange(-149, 128, dtype=torch.float64)
    edge = (1.75 * torch.exp2(k)).clamp(max=F32_MAX).float()
    amax = torch.cat([edge, torch.nextafter(edge, torch.tensor(0.0)), torch.nextafter(edge, torch.tensor(F32_MAX))])
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    x = torch.zeros(amax.numel(), 32)
    x[:, 0], x[:, 1], x[:, 2] = amax, -amax / 3, amax * 2**-9
    return x


def random_rows(shape, dtype, seed, spread):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=g)
    return (x * torch.exp2(rows.float())).to(dtype)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPREAD = {torch.bfloat16: 60, torch.float16: 8, torch.float32: 60}  # 2^±k row scales that stay finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 160), (1, 32)])
def test_random_rows_across_magnitudes(shape, dtype):
    x = random_rows(shape, dtype, seed=sum(shape), spread=SPREAD[dtype]).to(DEVICE)
    assert_same(mxfp8_quantize_triton(x), x)
    assert_same(mxfp8_quantize_triton(x, blocks_per_program=4), x)  # several programs and a ragged tail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_edge_blocks(dtype):
    x = edge_blocks(dtype).to(DEVICE)
    assert_same(mxfp8_quantize_triton(x), x)


def test_edge_block_values_spelled_out():
    q = mxfp8_quantize_triton(edge_blocks(torch.float32).to(DEVICE)).to("cpu")
    data, codes = q.data.view(torch.uint8), q.scales[:, 0].tolist()
    assert codes[:2] == [1, 1] and data[1, :3].tolist() == [0x80, 0x00, 0x80]
    assert data[2, :6].tolist() == [0x7E, 0x80, 0x38, 0xB8, 0x3A, 0x00]  # 448, -0, 1, -1.0 (tie), 1.25, 0
    assert data[4, :5].tolist() == [0x58, 0x58, 0xF7, 0x02, 0x04]  # 16, 16 (carries), -240, 2 and 4 * 2^-9
    assert codes[7] == 247 and data[7, 0].item() == 0x78  # F32_MAX / 2^120 rounds up to 256
    assert codes[8:13] == [1, 1, 1, 1, 1]


def test_every_bf16_and_fp16_pattern():
    bits = torch.arange(65536)
    for dtype in (torch.bfloat16, torch.float16):
        x = bits_as(bits, dtype).reshape(-1, 64)
        assert_same(mxfp8_quantize_triton(x.to(DEVICE)), x)
        perm = x.reshape(-1)[torch.randperm(65536, generator=torch.Generator().manual_seed(1))].reshape(-1, 32)
        assert_same(mxfp8_quantize_triton(perm.to(DEVICE)), perm)


def test_bf16_patterns_scaled_into_subnormals():
    x = bits_as(torch.arange(65536), torch.bfloat16).reshape(-1, 32)
    shift = torch.arange(x.shape[0]) % 24
    y = finite(with_block_max(x, shift).to(torch.bfloat16))
    assert_same(mxfp8_quantize_triton(y.to(DEVICE)), y)


def test_random_fp32_bit_patterns():
    g = torch.Generator().manual_seed(2)
    x = bits_as(torch.randint(-(2**31), 2**31, (2048, 32), generator=g), torch.float32)
    assert_same(mxfp8_quantize_triton(x.to(DEVICE)), x)
    y = with_block_max(x, torch.randint(0, 28, (2048,), generator=g))
    assert_same(mxfp8_quantize_triton(y.to(DEVICE)), y)


def test_scale_rule_at_every_binade_edge():
    x = scale_rule_edges()
    assert_same(mxfp8_quantize_triton(x.to(DEVICE)), x)


def test_rounding_boundaries_at_several_scales():
    x = rounding_boundaries([1, 2, 3, 60, 100, 127, 128, 200, 246])
    assert_same(mxfp8_quantize_triton(x.to(DEVICE)), x)


def test_out_is_filled_in_place():
    x = random_rows((4, 6, 128), torch.bfloat16, seed=3, spread=20).to(DEVICE)
    out = MXFP8Tensor(torch.full(x.shape, 7.0, device=DEVICE).to(torch.float8_e4m3fn),
                      torch.full((4, 6, 4), 9, dtype=torch.uint8, device=DEVICE))
    ptrs = (out.data.data_ptr(), out.scales.data_ptr())
    assert mxfp8_quantize_triton(x, out) is out
    assert (out.data.data_ptr(), out.scales.data_ptr()) == ptrs
    assert_same(out, x)


def test_strided_first_dim_writes_w13_halves_in_place():
    """Gate and up [E, I, H] straight into a fused w13 [E, 2I, H] buffer's halves, and a strided input."""
    E, I, H = 3, 40, 96
    gate = random_rows((E, I, H), torch.bfloat16, seed=4, spread=10).to(DEVICE)
    up = random_rows((E, I, H), torch.bfloat16, seed=5, spread=10).to(DEVICE)
    w13 = MXFP8Tensor(torch.zeros(E, 2 * I, H, device=DEVICE).to(torch.float8_e4m3fn),
                      torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8, device=DEVICE))
    mxfp8_quantize_triton(gate, w13[:, :I])
    mxfp8_quantize_triton(up, w13[:, I:], blocks_per_program=16)  # 8 programs per expert, ragged
    assert_same(w13, torch.cat([gate, up], dim=1))
    fused = torch.cat([gate, up], dim=1)
    assert_same(mxfp8_quantize_triton(fused[:, I:]), up)  # a strided input, row-major output


def test_empty_input():
    q = mxfp8_quantize_triton(torch.zeros(0, 64, device=DEVICE))
    assert q.data.shape == (0, 64) and q.scales.shape == (0, 2)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_checked_mode_raises_naming_the_tensor(bad):
    x = random_rows((4, 96), torch.bfloat16, seed=6, spread=3).to(DEVICE)
    x[2, 40] = bad
    with pytest.raises(ValueError, match=r"non-finite .* in layers\.3\.mlp\.experts\.w2 \(1 block of 32\)"):
        mxfp8_quantize_triton(x, name="layers.3.mlp.experts.w2")


def test_nonfinite_counts_without_a_sync_then_one_check():
    xs = [random_rows((2, 64), torch.float32, seed=i, spread=3).to(DEVICE) for i in range(3)]
    xs[1][0, 3], xs[1][1, 33], xs[1][1, 34] = float("nan"), float("inf"), float("inf")
    counts = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    outs = [mxfp8_quantize_triton(x, nonfinite=counts[i:i + 1]) for i, x in enumerate(xs)]  # no raise here
    assert counts.tolist() == [0, 2, 0]
    finite_codes = [mxfp8_quantize(xs[1][r:r + 1, c:c + 32].cpu()).scales.item() for r, c in ((0, 32), (1, 0))]
    assert outs[1].scales.tolist() == [[255, finite_codes[0]], [finite_codes[1], 255]]  # E8M0 NaN marks bad blocks
    assert_same(outs[0], xs[0])
    with pytest.raises(ValueError, match=r"in w13_b \(2 blocks of 32\)$"):
        raise_if_nonfinite(counts, ["w13_a", "w13_b", "w2"])
    raise_if_nonfinite(torch.zeros(2, dtype=torch.int32), ["a", "b"])


def test_bad_arguments_name_the_argument():
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(TypeError, match="w13 must be a bfloat16, float16 or float32"):
        mxfp8_quantize_triton(x.double(), name="w13")
    with pytest.raises(TypeError, match="x must be"):
        mxfp8_quantize_triton(x.to(torch.int32))
    with pytest.raises(ValueError, match="x: last dim must be a multiple of 32"):
        mxfp8_quantize_triton(torch.randn(4, 48, device=DEVICE))
    with pytest.raises(ValueError, match="x must be row-major"):
        mxfp8_quantize_triton(torch.randn(64, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="x must be row-major"):
        mxfp8_quantize_triton(torch.randn(2, 4, 128, device=DEVICE)[:, :, ::2])
    good = mxfp8_quantize_triton(x)
    with pytest.raises(ValueError, match=r"out must be \(4, 64\)"):
        mxfp8_quantize_triton(x, mxfp8_quantize_triton(torch.randn(2, 64, device=DEVICE)))
    with pytest.raises(TypeError, match="out must be an MXFP8Tensor"):
        mxfp8_quantize_triton(x, good.data)
    t = MXFP8Tensor(torch.zeros(64, 4, device=DEVICE).to(torch.float8_e4m3fn).t(), good.scales)
    with pytest.raises(ValueError, match="out.data must be row-major"):
        mxfp8_quantize_triton(x, t)
    with pytest.raises(ValueError, match="nonfinite must be a one-element int32 tensor"):
        mxfp8_quantize_triton(x, nonfinite=torch.zeros(1, dtype=torch.int64, device=DEVICE))


def per_expert_problem(E, I, H, dtype, seed, device=DEVICE):
    """Per-expert gate [I, H], up [I, H] and down [H, I] tensors (Hugging Face's per-expert names) with the views
    of fused MXFP8 w13 [E, 2I, H] and w2 [E, H, I] buffers each is quantized into, in arrival order."""
    g = torch.Generator().manual_seed(seed)
    gate, up, down = ([random_rows(s, dtype, seed=int(torch.randint(0, 1000, (1,), generator=g)), spread=12)
                       .to(device) for _ in range(E)] for s in ((I, H), (I, H), (H, I)))
    w13 = MXFP8Tensor(torch.zeros(E, 2 * I, H, device=device).to(torch.float8_e4m3fn),
                      torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8, device=device))
    w2 = MXFP8Tensor(torch.zeros(E, H, I, device=device).to(torch.float8_e4m3fn),
                     torch.zeros(E, H, I // 32, dtype=torch.uint8, device=device))
    xs = [t for e in range(E) for t in (gate[e], up[e], down[e])]
    outs = [o for e in range(E) for o in (w13[e, :I], w13[e, I:], w2[e])]
    ref13 = torch.stack([torch.cat([gate[e], up[e]]) for e in range(E)])
    return xs, outs, (w13, ref13), (w2, torch.stack(down))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_per_expert_tensors_in_one_launch(dtype):
    xs, outs, (w13, ref13), (w2, ref2) = per_expert_problem(E=3, I=64, H=96, dtype=dtype, seed=9)
    empty = (torch.zeros(0, 96, dtype=dtype, device=DEVICE), mxfp8_quantize_triton(torch.zeros(0, 96, device=DEVICE)))
    counts = torch.zeros(len(xs) + 1, dtype=torch.int32, device=DEVICE)
    # 192 blocks per tensor: 2 programs of 128 blocks each, the second half full; the empty one stores nothing.
    mxfp8_quantize_triton_many([*xs, empty[0]], [*outs, empty[1]], nonfinite=counts)
    assert_same(w13, ref13)
    assert_same(w2, ref2)
    assert counts.tolist() == [0] * (len(xs) + 1)
    assert mxfp8_quantize_triton_many([], []) == []


def test_many_nonfinite_counts_and_checked_mode():
    xs, outs, _, _ = per_expert_problem(E=2, I=32, H=64, dtype=torch.bfloat16, seed=10)
    xs[4][3, 5], xs[5][0, 0] = float("nan"), float("-inf")
    counts = torch.zeros(len(xs), dtype=torch.int32, device=DEVICE)
    mxfp8_quantize_triton_many(xs, outs, nonfinite=counts)
    assert counts.tolist() == [0, 0, 0, 0, 1, 1]
    names = [f"experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    with pytest.raises(ValueError, match=r"in experts\.1\.up_proj \(1 block of 32\), experts\.1\.down_proj"):
        mxfp8_quantize_triton_many(xs, outs, names=names)


def test_into_rows_of_one_buffer_bit_for_bit():
    """A staged fused buffer [E, R, C] filled by per-expert row blocks (a weight sync's Hub layout), one launch."""
    gen = torch.Generator().manual_seed(12)
    E, R, C = 3, 64, 96
    src = (torch.randn(E, R, C, generator=gen) * torch.exp2(torch.randint(-8, 8, (E, R, 1), generator=gen))).bfloat16()
    halves = [src[e, h * 32:(h + 1) * 32].contiguous().to(DEVICE) for e in range(E) for h in range(2)]
    halves[3][1, 2] = float("nan")
    out = MXFP8Tensor(torch.zeros(E, R, C, dtype=torch.float8_e4m3fn, device=DEVICE),
                      torch.zeros(E, R, C // 32, dtype=torch.uint8, device=DEVICE))
    counts = torch.zeros(len(halves), dtype=torch.int32, device=DEVICE)
    names = [f"experts.{e}.half{h}" for e in range(E) for h in range(2)]
    mxfp8_quantize_into_rows(halves, out, [32 * i for i in range(len(halves))], nonfinite=counts, names=names)
    assert counts.tolist() == [0, 0, 0, 1, 0, 0]
    ref = mxfp8_quantize(src.float().masked_fill(torch.isnan(torch.cat(halves).cpu().float().view(E, R, C)), 0))
    keep = torch.ones(E, R, C, dtype=torch.bool)
    keep[1, 32 + 1] = False  # the NaN row's block is unspecified; every other byte is the host's
    assert torch.equal(out.data.view(torch.uint8).cpu()[keep], ref.data.view(torch.uint8)[keep])
    assert torch.equal(out.scales.cpu()[keep[..., ::32]], ref.scales[keep[..., ::32]])
    with pytest.raises(ValueError, match="experts.2.half1: 3072 elements at row 190"):
        mxfp8_quantize_into_rows(halves[-1:], out, [190], nonfinite=counts[:1], names=names[-1:])
    with pytest.raises(ValueError, match="experts.0.half1 must be a row-major"):
        mxfp8_quantize_into_rows([halves[0], halves[1].t()], out, [0, 32], nonfinite=counts[:2], names=names[:2])
    with pytest.raises(ValueError, match="out must be a row-major"):
        mxfp8_quantize_into_rows(halves[:1], out[:, :32], [0], nonfinite=counts[:1], names=names[:1])


def test_many_bad_arguments_name_the_tensor():
    xs, outs, _, _ = per_expert_problem(E=1, I=32, H=64, dtype=torch.bfloat16, seed=11)
    names = ["gate", "up", "down"]
    with pytest.raises(TypeError, match="up must be a torch.bfloat16 tensor"):
        mxfp8_quantize_triton_many([xs[0], xs[1].float(), xs[2]], outs, names=names)
    with pytest.raises(ValueError, match="down must be row-major"):
        mxfp8_quantize_triton_many([xs[0], xs[1], xs[2].t().contiguous().t()], outs, names=names)
    flat = torch.zeros(32 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="gate must be row-major and 16-byte aligned"):
        mxfp8_quantize_triton_many([flat[1:].view(32, 64), xs[1], xs[2]], outs, names=names)
    with pytest.raises(ValueError, match=r"gate's out.data must be row-major"):
        mxfp8_quantize_triton_many(xs, [MXFP8Tensor(torch.zeros(64, 32, device=DEVICE).to(torch.float8_e4m3fn).t(),
                                                    outs[0].scales), outs[1], outs[2]], names=names)
    with pytest.raises(ValueError, match=r"out must be \(64, 32\)"):
        mxfp8_quantize_triton_many(xs, [outs[0], outs[1], outs[0]], names=names)
    with pytest.raises(ValueError, match="one entry per tensor"):
        mxfp8_quantize_triton_many(xs, outs[:2])
    with pytest.raises(ValueError, match="nonfinite must be a contiguous int32 tensor of 3 elements"):
        mxfp8_quantize_triton_many(xs, outs, nonfinite=torch.zeros(2, dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
def test_gpu_every_bf16_pattern_at_every_shift_below_the_block_max():
    x = bits_as(torch.arange(65536), torch.bfloat16).reshape(-1, 32)
    y = with_block_max(x.repeat(150, 1), torch.arange(0, 150).repeat_interleave(x.shape[0]))
    for dtype in (torch.float32, torch.bfloat16):
        z = finite(y.to(dtype))
        assert_same(mxfp8_quantize_triton(z.cuda()), z)


@pytest.mark.gpu
def test_gpu_random_fp32_bits():
    g = torch.Generator().manual_seed(7)
    x = bits_as(torch.randint(-(2**31), 2**31, (1 << 20, 32), generator=g), torch.float32)
    assert_same(mxfp8_quantize_triton(x.cuda()), x)
    y = with_block_max(x, torch.randint(0, 40, (1 << 20,), generator=g))
    assert_same(mxfp8_quantize_triton(y.cuda()), y)


def assert_same_on_gpu(x: torch.Tensor, what: str):
    q, ref = mxfp8_quantize_triton(x), mxfp8_quantize(x)
    assert torch.equal(q.scales, ref.scales), f"{what}: scales differ"
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), f"{what}: data differ"


@pytest.mark.gpu
def test_gpu_exhaustive_scale_codes():
    """Every finite positive FP32 amax (2^31 - 2^23 values), as element 0 of a block, on the hardware."""
    chunk = 1 << 24
    for start in range(0, 0x7F800000, chunk):
        amax = torch.arange(start, min(start + chunk, 0x7F800000), dtype=torch.int32, device="cuda")
        x = torch.zeros(amax.numel(), 32, device="cuda")
        x[:, 0] = amax.view(torch.float32)
        x[:, 1] = -x[:, 0] / 3
        assert_same_on_gpu(x, f"amax bits {start:#x}..")


@pytest.mark.gpu
@pytest.mark.parametrize("code", [127, 200, 1])
def test_gpu_exhaustive_rounding(code):
    """Every FP32 value in [-448, 448] times 2^(code - 127), 31 to a block under a 448 * 2^(code - 127) setter
    that fixes the block's code (with code 1 most inputs are FP32 denormals)."""
    top = int(torch.tensor(448.0).view(torch.int32))
    chunk = 31 << 24
    for start in range(0, top + 1, chunk):
        y = torch.arange(start, min(start + chunk, top + 1), dtype=torch.int32, device="cuda").view(torch.float32)
        y = torch.cat([y, y.new_zeros((-y.numel()) % 31)]).reshape(-1, 31)
        y[1::2] *= -1
        x = torch.cat([torch.full((y.shape[0], 1), 448.0, device="cuda"), y], dim=1) * 2.0 ** (code - 127)
        assert_same_on_gpu(x, f"code {code}, y bits {start:#x}..")


@pytest.mark.gpu
def test_gpu_many_qwen3_30b_layer_as_per_expert_tensors():
    xs, outs, (w13, ref13), (w2, ref2) = per_expert_problem(E=128, I=768, H=2048, dtype=torch.bfloat16, seed=12,
                                                            device="cuda")
    counts = torch.zeros(len(xs), dtype=torch.int32, device="cuda")
    mxfp8_quantize_triton_many(xs, outs, nonfinite=counts)
    for got, ref in ((w13, ref13), (w2, ref2)):
        want = mxfp8_quantize_triton(ref)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales, want.scales)
    assert int(counts.sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 1536, 2048), (128, 2048, 768)])  # Qwen3-30B-A3B w13, w2 per layer
def test_gpu_qwen3_30b_expert_shapes(shape):
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(shape, device="cuda", generator=g) * 0.02
    x *= torch.exp2(torch.randint(-20, 21, (*shape[:-1], 1), device="cuda", generator=g).float())
    x = x.to(torch.bfloat16)
    del g
    q = mxfp8_quantize_triton(x)
    ref = mxfp8_quantize(x)  # the host quantizer, on the GPU (its CPU run is checked above at small shapes)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(q.scales, ref.scales)
    counts = torch.zeros(1, dtype=torch.int32, device="cuda")
    again = mxfp8_quantize_triton(x, MXFP8Tensor(torch.empty_like(q.data), torch.empty_like(q.scales)),
                                  nonfinite=counts)
    assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8)) and counts.item() == 0
