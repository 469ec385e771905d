"""Align (token, expert) pairs by expert for the grouped GEMMs, in one launch that never syncs with the host.

Shapes: T tokens, k routed experts per token, E experts, P = T * k pairs (pair p = t * k + j), BLOCK_M rows per
GEMM block. Layout:
    topk_ids [T, k] int32/int64 (read as [P])
    sorted_ids [S] int32 (out): the pair ids of expert 0, then expert 1, ..., ascending within an expert, each
        expert's group padded to a multiple of BLOCK_M with the sentinel P; slots past the last group hold P too.
    block_expert [S / BLOCK_M] int32 (out): the expert of each row block, -1 for blocks past the last group.
S = BLOCK_M * cdiv(P + min(P, E) * (BLOCK_M - 1), BLOCK_M), the worst case over routings (at most min(P, E)
experts are routed to, each wasting at most BLOCK_M - 1 slots): fixed sizes, so the whole MoE layer captures in a
CUDA graph and its grids are known on the host without reading the routing back.

Why this shape. One program per chunk of CH pairs, and more where the row blocks need them (below). Every program
histograms all of topk_ids (a loop over the chunks, tl.histogram), which gives each expert's padded start and the
number of its pairs in earlier chunks; then a chunk's program sorts its chunk by (expert, pair) (tl.sort on a
packed key) and writes each pair to start[e] + earlier[e] + its rank among the chunk's pairs of e. All programs
then stride over the row blocks, BB per step: expert of a block = number of experts whose padded group ends at or
before it; padding slots get P. At decode sizes one chunk holds every pair, and one program walking all the
blocks (136 at T = 32, BLOCK_M 16) took 6.9 µs per layer on the H200 (8.8 at T = 64): the grid has at least one
program per BB blocks, so each takes one step (3.9 µs at T = 32: docs/perf.md).
With `split` (the FP8 GEMMs' path), T more programs split the hidden rows into hi + lo E4M3 (kernels/fp8_split.py):
that work needs only the hidden rows, so it rides in this launch instead of a launch of its own (one kernel
boundary less per layer).
Chunks are disjoint and padding slots are disjoint from pair slots, so no atomics and the output is the same
every run. Redoing the histogram per program costs O(P^2 / CH) compares, small next to the GEMMs: one program
up to P = CH (T = 512 at k = 8), 16 programs at T = 8192.
Bytes: reads topk_ids (4 or 8 bytes per pair) once per program (from L2), writes 4 * S + 4 * S / BLOCK_M; with
`split`, reads T * H * 2 and writes T * (2 * H + 1).
"""

import torch
import triton
import triton.language as tl

from kernels.fp8_split import split_row, split_rows_args, split_rows_warps
from kernels.moe_reference import check_tensor

_MAX_CHUNK = 4096
_BLOCKS_PER_STEP = 32


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, n_chunks, n_blocks, n_align, x_ptr, xd_ptr, xs_ptr,
                  E: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr, BLOCK_M: tl.constexpr, BB: tl.constexpr,
                  SPLIT: tl.constexpr, N: tl.constexpr, BF16_BITS: tl.constexpr, BN: tl.constexpr):
    c = tl.program_id(0)
    if SPLIT:  # the programs past the align grid split a hidden row each
        if c >= n_align:
            split_row(x_ptr, xd_ptr, xs_ptr, c - n_align, N, BF16_BITS, BN)
            return
    i = tl.arange(0, CH)
    total = tl.zeros([EP], dtype=tl.int32)
    earlier = tl.zeros([EP], dtype=tl.int32)
    cc = c * 0
    while cc < n_chunks:  # a while loop: the interpreter cannot take range() over a runtime bound
        q = cc * CH + i
        h = tl.histogram(tl.load(ids_ptr + q, mask=q < P, other=0).to(tl.int32), EP, mask=q < P)
        total += h
        earlier += tl.where(cc < c, h, 0)
        cc += 1
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded

    if c < n_chunks:  # this chunk's pairs; the masked tail gets expert E, which sorts last and is not stored
        q = c * CH + i
        e = tl.load(ids_ptr + q, mask=q < P, other=E).to(tl.int32)
        h = tl.histogram(e, EP, mask=q < P)
        base = start + earlier - (tl.cumsum(h, axis=0) - h)  # + position in the sorted chunk = destination slot
        key = tl.sort(e * CH + i)
        e_sorted = key // CH
        dest = tl.gather(base, tl.minimum(e_sorted, EP - 1), axis=0) + i
        tl.store(sorted_ptr + dest, c * CH + key % CH, mask=e_sorted < E)

    # Row blocks, strided over the programs: their expert, and the sentinel in every slot no pair fills.
    rows_end = tl.sum(padded, axis=0)
    fill_from = start + total
    b0 = c * BB
    while b0 < n_blocks:
        b = b0 + tl.arange(0, BB)
        row0 = b * BLOCK_M
        eb = tl.sum((end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(row0 < rows_end, eb, -1), mask=b < n_blocks)
        r = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
        pad = r >= tl.gather(fill_from, tl.minimum(eb, EP - 1), axis=0)[:, None]
        tl.store(sorted_ptr + r, P, mask=pad & (b < n_blocks)[:, None])
        b0 += n_align * BB


def num_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """S: the slots sorted_ids needs for any routing of num_pairs pairs (see the module docstring)."""
    return block_m * triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)


def check_alignment(sorted_ids: torch.Tensor, block_expert: torch.Tensor, block_m: int) -> int:
    """The GEMM launchers' check of moe_align's outputs for `block_m` (dtypes, shapes, contiguity, one device); S."""
    S = sorted_ids.shape[0]
    check_tensor("sorted_ids", sorted_ids, torch.int32, (S,), sorted_ids.device)
    if S % block_m:
        raise ValueError(f"sorted_ids has {S} slots, not a multiple of block_m={block_m}")
    check_tensor("block_expert", block_expert, torch.int32, (S // block_m,), sorted_ids.device)
    return S


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, split: torch.Tensor | None = None):
    """(sorted_ids [S] int32, block_expert [S / block_m] int32) for topk_ids [T, k]; see the module docstring.
    split: hidden [T, H] to split into hi + lo E4M3 rows in the same launch (kernels/fp8_split.py, one scale per
    row), for the FP8 GEMMs; then the FP8Split is returned third."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be an int32 or int64 tensor, got {getattr(topk_ids, 'dtype', topk_ids)}")
    if topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T, k] tensor, got {tuple(topk_ids.shape)} "
                         f"strides {topk_ids.stride()}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    P = topk_ids.numel()
    S = num_slots(P, num_experts, block_m)
    sorted_ids = torch.empty(S, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(S // block_m, dtype=torch.int32, device=topk_ids.device)
    rows, ptrs, cx = 0, (topk_ids, topk_ids, topk_ids), dict(N=1, BF16_BITS=False, BN=1)
    if split is not None:
        if split.dim() != 2 or split.shape[0] != topk_ids.shape[0] or split.device != topk_ids.device:
            raise ValueError(f"split must be the [T, H] hidden rows of topk_ids' {topk_ids.shape[0]} tokens on "
                             f"{topk_ids.device}, got {tuple(split.shape)} on {split.device}")
        hidden_split, ptrs, cx = split_rows_args(split, None)
        rows = split.shape[0]
    if P:
        ch = min(triton.next_power_of_2(P), _MAX_CHUNK)
        n_chunks, n_blocks = triton.cdiv(P, ch), S // block_m
        n_align = max(n_chunks, triton.cdiv(n_blocks, _BLOCKS_PER_STEP))
        _align_kernel[(n_align + rows,)](
            topk_ids, sorted_ids, block_expert, P, n_chunks, n_blocks, n_align, *ptrs, E=num_experts,
            EP=triton.next_power_of_2(num_experts), CH=ch, BLOCK_M=block_m, BB=_BLOCKS_PER_STEP, SPLIT=rows > 0,
            **cx, num_warps=max(8 if ch >= 1024 else 4, split_rows_warps(cx["BN"])))
    if split is None:
        return sorted_ids, block_expert
    return sorted_ids, block_expert, hidden_split
