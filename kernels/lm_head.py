"""LM head: logits = hidden @ weight^T returned in FP32 straight from the FP32 accumulator.

Why: F.linear(hidden, weight).float() on BF16 tensors accumulates in FP32 but rounds its output to BF16 before it
is widened: a quantum of 0.125 at logits near 20, logprobs off by several 1e-2. Here the accumulator is stored.

Shapes: T tokens (a decode batch, or 1: prefill's last token), H hidden (a multiple of 16), V vocabulary.
Layout (row-major, contiguous): hidden [T, H] bf16; weight [V, H] bf16 (the lm_head or the tied embedding);
out [T, V] fp32.
Program (t block, v block): BLOCK_V weight rows against BLOCK_T tokens over all of H, acc[v, t] in FP32 with one
tensor-core dot per BLOCK_K step (operands in mx_tiles.dot_dtype: BF16 on the GPU, FP32 under the interpreter).
Weights are the dot's left operand ("swap AB", as in kernels/moe_gate_up.py): the MMA's M dimension is
BLOCK_V = 128 weight rows, so sm_90 runs wgmma even at T = 1, where the token side (N = BLOCK_T >= 16, the dot's
minimum) is mostly padding: tensor-core slots this bandwidth-bound loop leaves idle anyway. The K loop is a
tl.range, which Triton software-pipelines: the next steps' tiles arrive by 16-byte cp.async while one is computed.
Tails: loads clamp rows past V and tokens past T to the last valid one (in bounds, so the hot loop's loads carry
no mask), and the store is masked: the duplicated rows and columns are computed and dropped.
T blocks (_config): T <= 128 is one t block, so each weight byte is read from HBM once. Larger T gets a second
grid dimension over t blocks, the fastest-varying one: the t blocks of a v block are launched together and read
its weight tiles within a short window, the later ones from L2. (A loop over t blocks inside the program would
re-read a program's whole slab, 512 KB at H = 2048, after each sweep over H; 132 SMs of such slabs overflow the
50 MB L2.) Large T is compute-bound anyway: 2 * T * V * H flops against V * H * 2 bytes.
Bytes: V * H * 2 weight (622 MB at V = 151936, H = 2048: the decode cost), T * H * 2 hidden (L2 after the first
programs), T * V * 4 out written.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_tensor
from kernels.mx_tiles import dot_dtype

_BLOCK_V = 128  # weight rows per program: two m64 wgmmas of one warpgroup; V = 151936 is 1187 blocks


class Config(NamedTuple):
    block_t: int
    block_k: int
    num_stages: int
    num_warps: int


def _config(T: int, H: int) -> Config:
    """Blocks for T tokens: BLOCK_T the next power of two >= T (>= 16, <= 128), so small batches pad little.
    Shared memory per stage: (128 + BLOCK_T) * BLOCK_K * 2 bytes, 36 KB at BLOCK_T = 16 (3 stages: 108 KB, two
    programs per SM) to 48 KB at 64 (3 stages: 144 KB, one program per SM with two tiles in flight, 96 KB: the
    SM's share of HBM bandwidth times latency is ~40 KB). At 128 a 128 x 128 FP32 accumulator takes 8 warps
    (64 registers per thread) and BLOCK_K = 64 keeps 4 stages within 128 KB. BLOCK_K divides H."""
    if T <= 64:
        cfg = Config(max(16, triton.next_power_of_2(T)), 128, 3, 4)
    else:
        cfg = Config(128, 64, 4, 8)
    return cfg._replace(block_k=min(cfg.block_k, H & -H))


@triton.jit
def _lm_head_kernel(h_ptr, w_ptr, out_ptr, T, V, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k = tl.arange(0, BLOCK_K)
    # Tails read the last valid row / token (see the module docstring); int64 rows: V * H and T * V may pass 2^31.
    v_rows = tl.minimum(v, V - 1).to(tl.int64)
    t_rows = tl.minimum(t, T - 1).to(tl.int64)
    w_tile = w_ptr + v_rows[:, None] * H + k[None, :]  # [BLOCK_V, BLOCK_K], K contiguous
    h_tile = h_ptr + t_rows[None, :] * H + k[:, None]  # [BLOCK_K, BLOCK_T], hidden^T: K contiguous (K-major B)
    acc = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        acc = tl.dot(tl.load(w_tile + k0).to(DOT), tl.load(h_tile + k0).to(DOT), acc)
    ok = (v < V)[:, None] & (t < T)[None, :]
    tl.store(out_ptr + t.to(tl.int64)[None, :] * V + v[:, None], acc, mask=ok)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t, v] = sum_k hidden[t, k] * weight[v, k], accumulated and returned in FP32; writes and returns `out`
    [T, V] fp32 (allocated when None). hidden [T, H] and weight [V, H]: contiguous bf16 on one device, H a
    multiple of 16 (the tensor-core dot's K step)."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    T, H = hidden.shape
    V = weight.shape[0]
    check_tensor("hidden", hidden, torch.bfloat16, (T, H), hidden.device)
    check_tensor("weight", weight, torch.bfloat16, (V, H), hidden.device)
    if H == 0 or H % 16:
        raise ValueError(f"hidden size H = {H} must be a positive multiple of 16")
    if out is None:
        out = torch.empty(T, V, dtype=torch.float32, device=hidden.device)
    check_tensor("out", out, torch.float32, (T, V), hidden.device)
    if T == 0 or V == 0:
        return out
    cfg = _config(T, H)
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(V, _BLOCK_V))
    if grid[1] > 65535:  # the grid's second dimension, a CUDA limit
        raise ValueError(f"weight has {V} rows, more than {65535 * _BLOCK_V}")
    _lm_head_kernel[grid](hidden, weight, out, T, V, H=H, BLOCK_T=cfg.block_t, BLOCK_V=_BLOCK_V, BLOCK_K=cfg.block_k,
                          NUM_STAGES=cfg.num_stages, DOT=dot_dtype(), num_warps=cfg.num_warps)
    return out


def lm_head_reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same logits in torch: FP32 operands holding the same BF16 values, FP32 out."""
    return hidden.float() @ weight.float().T
