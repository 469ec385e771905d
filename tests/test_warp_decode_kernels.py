"""Warp decode's two kernels one at a time (kernels/warp_decode_gate_up.py, kernels/warp_decode_down.py) against their
FP32 references on the same dequantized weights.

CPU: Triton's interpreter at tiny irregular shapes (H not a power of two, I and H not multiples of the row block or
the chunk, k = 3 and k = 1, E not a power of two), each mask both constant and not, with fewer persistent programs
than items so each program walks several items, and more programs than items. On a GPU machine the same cases run
natively.
"""

import pytest
import torch

from kernels import mxfp8_quantize
from kernels.moe_reference import weight_parts
from kernels.warp_decode_down import down_reference, warp_decode_down
from kernels.warp_decode_gate_up import gate_up_reference, warp_decode_gate_up

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(T, k, E, H, I, mx, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    weights, ids = torch.softmax(torch.randn(T, E, generator=gen), dim=-1).topk(k, dim=-1)
    if mx:
        w13, w2 = mxfp8_quantize(w13), mxfp8_quantize(w2)
    return tuple(a.to(DEVICE) for a in (hidden, weights, ids.to(torch.int32), w13, w2))


CASES = [  # T, k, E, H, I, mx, block, warps, stages, programs
    (5, 3, 6, 96, 160, True, 32, 4, 3, 2),
    (3, 1, 5, 160, 96, False, 16, 2, 2, 3),
    (2, 3, 7, 64, 96, True, 64, 4, 3, 50),  # more programs than items
    # Row blocks past I (gate_up) and past H (down: 64 rows of 160); one stage: gate_up's [256, 2, 256] FP8 tile is
    # 128 KB of shared memory a stage, more than an SM has for two.
    (4, 2, 9, 160, 64, True, 256, 4, 1, 3),
]


@pytest.mark.parametrize("T,k,E,H,I,mx,block,warps,stages,programs", CASES)
def test_gate_up_matches_fp32(T, k, E, H, I, mx, block, warps, stages, programs):
    hidden, weights, ids, w13, _ = _problem(T, k, E, H, I, mx, seed=T * 10 + k)
    act = torch.full((T * k, I), float("nan"), device=DEVICE)
    warp_decode_gate_up(hidden, weights, ids, weight_parts(w13, "w13", hidden.device), act, block_n=block,
                        num_warps=warps, num_stages=stages, programs=programs)
    ref = gate_up_reference(hidden, weights, ids, w13)
    assert torch.isfinite(act).all(), "act rows left unwritten"
    # FP32 throughout; only the summation order differs from the reference.
    torch.testing.assert_close(act, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("H,mx,chunk_h", [(160, True, 64), (160, False, 32), (96, True, 128), (256, True, 128)])
def test_gate_up_chunks_of_h_match_fp32(H, mx, chunk_h):
    """Lanes over chunk_h-wide chunks of H (H rounded up to a power of two): the last chunk partly or wholly past H,
    several chunks a row, gate and up rows on separate warps."""
    T, k, E, I = 3, 2, 5, 96
    hidden, weights, ids, w13, _ = _problem(T, k, E, H, I, mx, seed=H + chunk_h)
    act = torch.full((T * k, I), float("nan"), device=DEVICE)
    warp_decode_gate_up(hidden, weights, ids, weight_parts(w13, "w13", hidden.device), act, block_n=1,
                        num_warps=2, num_stages=3, programs=2 * T * k, chunk_h=chunk_h)
    ref = gate_up_reference(hidden, weights, ids, w13)
    assert torch.isfinite(act).all(), "act rows left unwritten"
    torch.testing.assert_close(act, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("T,k,E,H,I,mx,block,warps,stages,programs", CASES)
def test_down_matches_fp32(T, k, E, H, I, mx, block, warps, stages, programs):
    _, _, ids, _, w2 = _problem(T, k, E, H, I, mx, seed=T * 10 + k + 1)
    act = torch.randn(T * k, I, generator=torch.Generator().manual_seed(T + I)).to(DEVICE)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    warp_decode_down(act, ids, weight_parts(w2, "w2", act.device), out, block_h=block // 4, block_k=64,
                     num_warps=warps, num_stages=stages, programs=programs)
    ref = down_reference(act, ids, w2)
    assert torch.isfinite(out).all(), "output rows left unwritten"
    # One BF16 ulp per element (the interpreter truncates to BF16 where the GPU rounds to nearest).
    bound = torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-5 * ref.abs().max()
    assert ((out.float() - ref).abs() <= bound).all()


def test_launchers_name_bad_buffers_and_tiles():
    hidden, weights, ids, w13, w2 = _problem(2, 3, 5, 64, 96, True, seed=0)
    parts13, parts2 = weight_parts(w13, "w13", hidden.device), weight_parts(w2, "w2", hidden.device)
    with pytest.raises(TypeError, match="act must be a torch.float32"):
        warp_decode_gate_up(hidden, weights, ids, parts13, torch.empty(6, 96, dtype=torch.bfloat16, device=DEVICE),
                            block_n=4, num_warps=4, num_stages=3, programs=4)
    with pytest.raises(ValueError, match="chunk_h one in 32..64"):
        warp_decode_gate_up(hidden, weights, ids, parts13, torch.empty(6, 96, device=DEVICE), block_n=4,
                            num_warps=4, num_stages=3, programs=4, chunk_h=256)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        warp_decode_gate_up(hidden, weights, ids, parts13, torch.empty(6, 96, device=DEVICE), block_n=3,
                            num_warps=4, num_stages=3, programs=4)
    out = torch.empty(2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="act must have shape"):
        warp_decode_down(torch.empty(5, 96, device=DEVICE), ids, parts2, out, block_h=8, block_k=64, num_warps=4,
                         num_stages=3, programs=4)
    with pytest.raises(TypeError, match="out must be a torch.bfloat16"):
        warp_decode_down(torch.empty(6, 96, device=DEVICE), ids, parts2, out.float(), block_h=8, block_k=64,
                         num_warps=4, num_stages=3, programs=4)
    with pytest.raises(ValueError, match="block_k"):
        warp_decode_down(torch.empty(6, 96, device=DEVICE), ids, parts2, out, block_h=8, block_k=16, num_warps=4,
                         num_stages=3, programs=4)
