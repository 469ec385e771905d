"""Combine: each token's k per-pair output rows summed into its [H] output, the last launch of the MoE paths that
compute one row per (token, expert) pair (warp decode's expert schedule, the expert-centric path).

Shapes: T tokens, H hidden, k routed experts per token, P = T * k pairs (pair p = t * k + j).
Layout: part [P, H] fp32 (row p already carries its routing weight) -> out [T, H] bf16.
One program per (block of H, token) sums the token's k rows in j order (`sum_pair_rows`), so the result is
deterministic (no atomics), and the only rounding is the final one to BF16.
Bytes: P * H * 4 read, T * H * 2 written.

`PairRows` is the same sum not yet taken: an expert-centric MoE asked for `combine=False` returns its rows, and the
next residual add + RMSNorm (kernels/rmsnorm.py) sums them in its own launch, with the same `sum_pair_rows` and the
same BF16 rounding, so the decode step loses the combine's launch (its boundary cost ~2 µs per layer,
docs/perf.md) and keeps its bits.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.bf16_bits import round_bf16
from kernels.moe_reference import check_tensor

_BLOCK_H = 256


@dataclass(frozen=True)
class PairRows:
    """A MoE block's output [*shape] as its per-pair rows `part` [T * top_k, H] fp32 (T tokens: the product of
    shape[:-1]), each row already times its routing weight; `combined()` is the [*shape] BF16 tensor."""
    part: torch.Tensor
    top_k: int
    shape: tuple

    def __post_init__(self):
        tokens = self.part.shape[0] // self.top_k if self.top_k > 0 else -1
        check_tensor("part", self.part, torch.float32, (tokens * self.top_k, self.shape[-1]), self.part.device)
        if tokens != int(torch.Size(self.shape[:-1]).numel()):
            raise ValueError(f"part {tuple(self.part.shape)} holds {tokens} tokens of top_k={self.top_k} rows, "
                             f"not the {tuple(self.shape)} it stands for")

    @property
    def device(self) -> torch.device:
        return self.part.device

    def view(self, *shape) -> "PairRows":
        """The same rows standing for another shape of the same tokens (-1 allowed, as Tensor.view)."""
        return PairRows(self.part, self.top_k, tuple(torch.empty(self.shape, device="meta").view(*shape).shape))

    reshape = view

    def combined(self) -> torch.Tensor:
        """The sum as moe_combine writes it: [*shape] bf16."""
        out = torch.empty(self.part.shape[0] // self.top_k, self.shape[-1], dtype=torch.bfloat16, device=self.device)
        return moe_combine(self.part, out, self.top_k).view(self.shape)


@triton.jit
def sum_pair_rows(part_ptr, tok, col, mask, H: tl.constexpr, K_TOP: tl.constexpr):
    """sum over j of part[tok * K_TOP + j, col] in FP32, added in j order (0 first): every kernel that sums pair rows
    sums them so, for the same bits. `tok` and `col` broadcast against each other (int64 where P * H may pass
    2^31)."""
    y = tl.load(part_ptr + (tok * K_TOP) * H + col, mask=mask, other=0.0)
    for j in tl.static_range(1, K_TOP):
        y += tl.load(part_ptr + (tok * K_TOP + j) * H + col, mask=mask, other=0.0)
    return y


@triton.jit
def _combine_kernel(part_ptr, out_ptr, H: tl.constexpr, K_TOP: tl.constexpr, BH: tl.constexpr, INTERPRET: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # launched dependent on the kernel writing `part`: wait for it before reading
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(1).to(tl.int64)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    y = sum_pair_rows(part_ptr, t, h, h < H, H, K_TOP)
    tl.store(out_ptr + t * H + h, round_bf16(y, INTERPRET), mask=h < H)


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
    _combine_kernel[(triton.cdiv(H, _BLOCK_H), T)](part, out, H, K_TOP=top_k, BH=_BLOCK_H,
                                                   INTERPRET=triton.knobs.runtime.interpret, PDL=pdl, num_warps=4,
                                                   **launch)
    return out


def moe_combine_reference(part: torch.Tensor, top_k: int) -> torch.Tensor:
    """The same sum in torch: FP32, added in j order, rounded once to BF16."""
    rows = part.view(-1, top_k, part.shape[-1])
    y = rows[:, 0].clone()
    for j in range(1, top_k):
        y += rows[:, j]
    return y.bfloat16()
