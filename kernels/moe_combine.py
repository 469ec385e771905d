"""Combine: each token's k per-pair output rows summed into its [H] output, the last launch of the MoE paths that
compute one row per (token, expert) pair (warp decode's expert schedule, the expert-centric path).

Shapes: T tokens, H hidden, k routed experts per token, P = T * k pairs (pair p = t * k + j).
Layout: part [P, H] fp32 (row p already carries its routing weight) -> out [T, H] bf16.
One program per (block of H, token) sums the token's k rows in a fixed order (one tree reduction), so the result is
deterministic (no atomics), and the only rounding is the final one to BF16.
Bytes: P * H * 4 read, T * H * 2 written.
"""

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor

_BLOCK_H = 256


@triton.jit
def _combine_kernel(part_ptr, out_ptr, H: tl.constexpr, K_TOP: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # launched dependent on the kernel writing `part`: wait for it before reading
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(1)
    j = tl.arange(0, KP)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    m = (j < K_TOP)[:, None] & (h < H)[None, :]
    y = tl.sum(tl.load(part_ptr + (t * K_TOP + j)[:, None] * H + h[None, :], mask=m, other=0.0), axis=0)
    tl.store(out_ptr + t * H + h, y.to(tl.bfloat16), mask=h < H)


def moe_combine(part: torch.Tensor, out: torch.Tensor, top_k: int, *, pdl: bool = False) -> torch.Tensor:
    """out[t] = sum_j part[t * top_k + j] in BF16; writes and returns `out` [T, H]. `pdl`: launch as a programmatic
    dependent of the previous kernel (sm_90; not under Triton's interpreter, which cannot run griddepcontrol)."""
    T, H = out.shape
    check_tensor("part", part, torch.float32, (T * top_k, H), out.device)
    check_tensor("out", out, torch.bfloat16, (T, H), out.device)
    if T > 65535:  # the grid's second dimension, a CUDA limit
        raise ValueError(f"out has {T} tokens, more than 65535: split the batch")
    if T == 0:
        return out
    launch = dict(launch_pdl=True) if pdl else {}
    _combine_kernel[(triton.cdiv(H, _BLOCK_H), T)](part, out, H, K_TOP=top_k, KP=triton.next_power_of_2(top_k),
                                                   BH=_BLOCK_H, PDL=pdl, num_warps=4, **launch)
    return out


def moe_combine_reference(part: torch.Tensor, top_k: int) -> torch.Tensor:
    """The same sum in torch: FP32 over j, rounded once to BF16."""
    return part.view(-1, top_k, part.shape[-1]).sum(dim=1).bfloat16()
