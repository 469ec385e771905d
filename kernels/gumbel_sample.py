"""Sampling a decode step's tokens without top-k / top-p: temperature, Gumbel-max with counter-based noise, and the
FP32 logprob of the chosen token, in two launches instead of torch's ~30.

Shapes: B rows (a decode batch), V vocabulary. Layout: logits [B, V] fp32 row-major (kernels/lm_head.py's output);
temperature [B] fp32 (0: greedy); seeds, steps [B] int64 -> tokens [B] int64, logprobs [B] fp32.
Numerics, those of gumbel_sample_reference below (what composer_rollout.engine.sampling runs when no row filters):
    scaled = logits / t   (t = 1 for greedy rows; IEEE division)
    noise[v] = -log(-log(u)), u = (hash(row(seed, step), v) >> 9 + 0.5) / 2^23    (gumbel_noise)
    token = argmax(scaled + noise) (argmax(scaled) for greedy rows), ties to the lower index
    logprob = scaled[token] - max - log(sum(exp(scaled - max)))
The hash is 32-bit arithmetic, which the reference does on int64 with masks and the kernel on uint32 (multiplies
wrap mod 2^32 alike); log is libdevice's logf on the GPU, the function torch's CUDA log calls, and division is
correctly rounded in both, so the noise and the sampled tokens are bit-identical to the reference's on the GPU.
The logprob's sums run in another order (and exp is libdevice's expf): ~1e-7 relative.
Why two launches: torch's form materialises [B, V] int64 tensors for every hash step (~1 GB of traffic per step at
B = 64) and costs ~30 launches. Here pass 1 (program (b, chunk), BLOCK_V logits each) reads each logit once and
keeps per chunk the max, the sum of exp against it, and the best key with its index; pass 2 (a program per row)
merges the chunks and reads the chosen logit again.
Bytes: B * V * 4 read once, B * chunks * 20 between the passes, B * 12 written.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.moe_reference import check_tensor

_BLOCK_V = 2048  # 8 KB of logits per program: at B = 1 the 151,936-word vocabulary spreads over 75 SMs
_MASK32 = 0xFFFFFFFF


@triton.jit
def _hash32(x):
    """gumbel_noise's 32-bit mixer on uint32 (its int64 form masks every product to 32 bits: the same wrap)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _log(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # libdevice has no interpreter implementation; numpy's log is as accurate
        return tl.log(x)
    return libdevice.log(x)  # not tl.log: its lg2.approx differs from torch's logf in the last bits


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    return libdevice.exp(x)  # not tl.exp: its ex2.approx of x * log2(e) loses ~|x| * 2^-24 relative


@triton.jit
def _partials_kernel(logits_ptr, temp_ptr, seed_ptr, step_ptr, part_ptr, idx_ptr, V, n_chunks,
                     BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + b)
    greedy = t == 0.0
    seed = tl.load(seed_ptr + b)
    step = tl.load(step_ptr + b)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    row = _hash32(lo ^ _hash32(((step + 0x9E3779B9) & 0xFFFFFFFF).to(tl.uint32))) ^ _hash32(hi)
    v = c * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = v < V
    x = tl.load(logits_ptr + b.to(tl.int64) * V + v, mask=ok, other=float("-inf"))
    scaled = tl.math.div_rn(x, tl.where(greedy, 1.0, t))
    m = tl.max(scaled, axis=0)
    s = tl.sum(tl.where(ok, _exp(scaled - m, INTERPRET), 0.0), axis=0)
    bits = _hash32(row ^ _hash32(v.to(tl.uint32) * 0x27D4EB2F)) >> 9
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact: 24 significant bits, a power-of-two scale
    key = tl.where(greedy, scaled, scaled - _log(-_log(u, INTERPRET), INTERPRET))
    key = tl.where(ok, key, float("-inf"))
    best = tl.argmax(key, axis=0, tie_break_left=True)
    out = (b * n_chunks + c) * 3
    tl.store(part_ptr + out, m)
    tl.store(part_ptr + out + 1, s)
    tl.store(part_ptr + out + 2, tl.max(key, axis=0))
    tl.store(idx_ptr + b * n_chunks + c, c * BLOCK_V + best)


@triton.jit
def _merge_kernel(logits_ptr, temp_ptr, part_ptr, idx_ptr, tok_ptr, lp_ptr, V, n_chunks, CP: tl.constexpr,
                  INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    c = tl.arange(0, CP)
    ok = c < n_chunks
    base = (b * n_chunks + c) * 3
    m = tl.load(part_ptr + base, mask=ok, other=float("-inf"))
    s = tl.load(part_ptr + base + 1, mask=ok, other=0.0)
    key = tl.load(part_ptr + base + 2, mask=ok, other=float("-inf"))
    mx = tl.max(m, axis=0)
    total = tl.sum(tl.where(ok, s * _exp(m - mx, INTERPRET), 0.0), axis=0)
    # Chunks in index order, ties to the first: the lowest index among equal keys, as torch.argmax.
    token = tl.load(idx_ptr + b * n_chunks + tl.argmax(key, axis=0, tie_break_left=True))
    t = tl.load(temp_ptr + b)
    x = tl.math.div_rn(tl.load(logits_ptr + b.to(tl.int64) * V + token), tl.where(t == 0.0, 1.0, t))
    tl.store(tok_ptr + b, token.to(tl.int64))
    tl.store(lp_ptr + b, (x - mx) - _log(total, INTERPRET))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, logprobs [B] fp32) for logits [B, V] fp32, as gumbel_sample_reference; capturable in a
    CUDA graph (no host synchronisation)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    dev = logits.device
    if dev.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"logits is on {dev}: the kernel needs CUDA tensors (or Triton's interpreter)")
    check_tensor("logits", logits, torch.float32, (B, V), dev)
    check_tensor("temperature", temperature, torch.float32, (B,), dev)
    check_tensor("seeds", seeds, torch.int64, (B,), dev)
    check_tensor("steps", steps, torch.int64, (B,), dev)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tokens, logprobs
    block = min(_BLOCK_V, triton.next_power_of_2(V))
    n_chunks = triton.cdiv(V, block)
    parts = torch.empty(B, n_chunks, 3, dtype=torch.float32, device=dev)
    idx = torch.empty(B, n_chunks, dtype=torch.int32, device=dev)
    interpret = triton.knobs.runtime.interpret
    _partials_kernel[(B, n_chunks)](logits, temperature, seeds, steps, parts, idx, V, n_chunks, BLOCK_V=block,
                                    INTERPRET=interpret, num_warps=8)
    _merge_kernel[(B,)](logits, temperature, parts, idx, tokens, logprobs, V, n_chunks,
                        CP=triton.next_power_of_2(n_chunks), INTERPRET=interpret, num_warps=4)
    return tokens, logprobs


def _hash32_reference(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors; products stay below 2^63, so it is exact on any device."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] determined by each row's (seed, step) alone."""
    h = _hash32_reference
    row = h(seeds ^ h(steps + 0x9E3779B9)) ^ h(seeds >> 32)
    cols = h(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * 0x27D4EB2F)
    bits = h(row[:, None] ^ cols[None, :]) >> 9  # 23 uniform bits
    u = (bits.to(torch.float32) + 0.5) / float(1 << 23)  # exact in FP32: 24 significant bits
    return -torch.log(-torch.log(u))


def gumbel_sample_reference(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                            steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of gumbel_sample: (tokens [B] int64, logprobs [B] fp32)."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sampled = torch.argmax(scaled + gumbel_noise(seeds, steps, logits.shape[-1]), dim=-1)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)
