"""Expert-centric MoE (the classical route) for prefill and large decode batches, and `auto`, which picks per T.

Shapes: T tokens, H hidden, I intermediate, E experts, k routed experts per token, P = T * k (token, expert) pairs
(pair p = t * k + j), S row slots = P + padding (kernels/moe_align.py), BLOCK_M rows per GEMM block.
Layout (as kernels/warp_decode_moe.py, whose argument checks this path shares):
    hidden [T, H] bf16   topk_ids [T, k] int32/64   topk_weights [T, k] float
    w13 [E, 2I, H] (gate rows, then up rows)   w2 [E, H, I]   BF16, or MXFP8Tensor (data fp8 e4m3 of that shape,
        scales uint8 E8M0 [..., in / 32])
    sorted_ids [S] int32, block_expert [S / BLOCK_M] int32   act [S, I] bf16   part [P, H] fp32   out [T, H] bf16
Four launches: align (sort pairs by expert, pad each expert to BLOCK_M rows; with dequant "fp8" it also splits the
hidden rows), gate_up (grouped GEMM, SiLU(gate) * up fused), down (grouped GEMM, routing weight applied), combine (each
token's k rows of `part` summed in a fixed order: deterministic, no atomics). No host sync and fixed buffer sizes
(the worst case over routings), so a layer captures in a CUDA graph. Tensor-core GEMMs (tl.dot, BF16 operands,
FP32 accumulate) with MXFP8 weights dequantized in the prologue; under Triton's interpreter (CPU tests) the dots
run in FP32 instead.
Bytes: each touched expert once (3 * H * I * (1 + 1/32) in MXFP8), hidden 2 * T * H, act 2 * 2 * S * I,
part 2 * 4 * P * H, out 2 * T * H. FLOPs: 2 * 3 * H * I per pair (useful; padding rows add up to
E * (BLOCK_M - 1) rows).

act_dtype "mxfp8" quantizes hidden and act to MXFP8 per 32 elements with the host quantizer
(kernels/mxfp8.py), as the classical MXFP8 GEMMs on Blackwell take their activations: an accuracy comparison,
not a fast path (the quantizer checks for non-finite values, a host sync, so it does not capture in a graph).

dequant "f16_rel" (MXFP8 weights only) runs both GEMMs' dots in FP16 on chunk-relative operands instead of BF16
(kernels/mx_tiles.py: cheaper MXFP8 dequantization, exact within the bounds documented there); opt-in (7% faster at
T = 64-128 on the H200, slower at prefill). dequant "fp8" (MXFP8 weights only) does no dequantization: FP8
tensor-core dots on the weights as stored, the activations split into hi + lo E4M3 terms (kernels/fp8_split.py:
hidden per token by the align launch, act per 32 by the gate_up epilogue), each 32-wide K group's dot promoted into
the FP32 accumulator times its scales (kernels/moe_gate_up_fp8.py, kernels/moe_down_fp8.py): 6-26% faster than
BF16 dots at T = 8-512 on the H200 and closer to FP32 (1.78e-3 against 2.35e-3), slower at prefill sizes; dequant
"auto" (the default) takes it up to FP8_MAX_TOKENS.

Tile sizes per T come from a table tuned on the GPU by jobs/tune_expert_centric.py (kernels/configs/
expert_centric_<device>.json, per shape and T bucket, as vLLM keeps its fused_moe configs), or on a GPU with the same
compute capability and SM count when this one has none (`table_device`: an H100 SXM takes the H200's), else from
`default_config`. The same file holds the measured crossover T at which `auto` leaves warp decode. The f16_rel
variant's tiles are tuned into expert_centric_<device>_f16_rel.json (same format); without it, it takes the
BF16 table's tiles.
"""

import functools
import glob
import json
import math
import os
from dataclasses import dataclass, field

import torch

from kernels.fp8_split import FP8Split
from kernels.moe_align import moe_align
from kernels.moe_combine import moe_combine
from kernels.moe_down import moe_down
from kernels.moe_down_fp8 import moe_down_fp8
from kernels.moe_gate_up import moe_gate_up
from kernels.moe_gate_up_fp8 import moe_gate_up_fp8
from kernels.moe_reference import check_kernel_args, check_tensor, weight_parts
from kernels.mx_tiles import DEQUANT_MODES
from kernels.mxfp8 import MXFP8Tensor, mxfp8_quantize
from kernels.warp_decode_moe import warp_decode_moe

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
# `auto` on a shape or device with no measured crossover: warp decode for T <= 2. From docs/perf.md run 3 and
# vLLM's fused_moe quoted in background.md: warp decode 37.4 µs vs 38.2 at T = 2, 61.4 vs 50.9 at T = 4.
DEFAULT_CROSSOVER_TOKENS = 2
# The GEMMs' operand modes: BF16 or FP16 dots on dequantized tiles (kernels/mx_tiles.py), or FP8 dots on MXFP8 weights
# as stored with split activations (kernels/moe_gate_up_fp8.py); "auto" picks per T (pick_dequant).
DEQUANTS = ("auto", *DEQUANT_MODES, "fp8")
# "auto" runs MXFP8 weights on FP8 dots up to this T: on the H200 they were 7-20% faster at T = 8-1024 and 2-13%
# slower from T = 2048 on, where the per-group promotion costs more than dequantizing (docs/perf.md).
FP8_MAX_TOKENS = 1024


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    tma_act: bool = False

    def __post_init__(self):
        # tl.dot needs every dimension >= 16; tiles load as [block_k / 32, 32] groups, a power of two of them.
        if not (_pow2(self.block_n) and self.block_n >= 16):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if not (self.block_k % 32 == 0 and _pow2(self.block_k // 32)):
            raise ValueError(f"block_k must be 32 times a power of two, got {self.block_k}")


@dataclass(frozen=True)
class ExpertCentricConfig:
    """block_m: rows (pairs) per GEMM block, shared by both GEMMs since it sets the alignment; block_n: weight
    rows per program (the MMA's M dimension); block_k: reduction step (a multiple of 32); tma (dequant "fp8" only):
    the weight tiles come by TMA (the copy engine, one instruction per box) instead of per-thread cp.async; tma_act
    (down with dequant "fp8" only): the activation tiles too (gate_up's are gathered token rows, which TMA cannot
    load on sm_90)."""

    block_m: int = 64
    gate_up: GemmConfig = field(default_factory=GemmConfig)
    down: GemmConfig = field(default_factory=GemmConfig)

    def __post_init__(self):
        if not (_pow2(self.block_m) and self.block_m >= 16):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertCentricConfig":
        return cls(d["block_m"], GemmConfig(**d["gate_up"]), GemmConfig(**d["down"]))


def shape_key(E: int, H: int, I: int, k: int) -> str:
    return f"E{E}_H{H}_I{I}_k{k}"


@functools.cache
def device_key(device: torch.device) -> str | None:
    """'h200' for an "NVIDIA H200"; None off CUDA (the interpreter), where only defaults apply. Cached: it is
    asked on every MoE call, and a device's name does not change."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device).lower().removeprefix("nvidia").strip().replace(" ", "_")


def _device_arch(device: torch.device) -> tuple[int, int, int]:
    """(major, minor, SM count): GPUs that agree on these run the same kernels on the same SMs."""
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor, props.multi_processor_count


def _table_meta(device: str, dequant: str = "bf16") -> dict:
    """A table file's header (device name, capability, SM count, provenance), {} when there is no file."""
    path = os.path.join(CONFIG_DIR, table_name(device, dequant))
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {k: v for k, v in json.load(f).items() if k != "shapes"}


@functools.cache
def table_device(device: torch.device) -> str | None:
    """The device key whose tables apply here: this GPU's own when kernels/configs/ has its table, else that of a GPU
    with the same compute capability and SM count (an H100 SXM takes the H200's: both sm_90 with 132 SMs, and the
    H200 table's prefill tiles were picked on an H100), else this GPU's key, which has no table (default tiles and
    crossover). None off CUDA. `table_source` says which one a run used."""
    own = device_key(device)
    if own is None or os.path.exists(os.path.join(CONFIG_DIR, table_name(own))):
        return own
    arch = [*_device_arch(device)]
    for path in sorted(glob.glob(os.path.join(CONFIG_DIR, table_name("*")))):
        key = os.path.basename(path)[len("expert_centric_"):-len(".json")]
        meta = _table_meta(key)
        if meta.get("dequant", "bf16") == "bf16" and [*meta.get("capability", ()), meta.get("multiprocessors")] == arch:
            return key
    return own


def table_source(device: torch.device) -> str:
    """Which tuned table the expert-centric path and `auto` use on this device, for start-up reports."""
    key = table_device(device)
    meta = _table_meta(key) if key is not None else {}
    if not meta:
        return f"no tuned table: default tiles, crossover_tokens {DEFAULT_CROSSOVER_TOKENS}"
    if key == device_key(device):
        return table_name(key)
    return (f"{table_name(key)} (tuned on {meta['device']}: same compute capability and SM count as this "
            f"{torch.cuda.get_device_name(device)})")


def table_name(device: str, dequant: str = "bf16") -> str:
    """The tuned table's file name: expert_centric_h200.json, expert_centric_h200_f16_rel.json."""
    return f"expert_centric_{device}{'' if dequant == 'bf16' else '_' + dequant}.json"


@functools.cache
def load_table(device: str | None, dequant: str = "bf16") -> dict:
    """The tuned table for a device and dequant mode ({} when none was measured): {shape_key:
    {"crossover_tokens": int, "configs": {T: config dict}}}."""
    path = os.path.join(CONFIG_DIR, table_name(device, dequant))
    if device is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)["shapes"]


def default_config(T: int, E: int, k: int) -> ExpertCentricConfig:
    """Untuned tiles: BLOCK_M the smallest of 16, 32, 64 that holds the mean rows per expert (T * k / E)."""
    rows = T * k / E
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return ExpertCentricConfig(block_m)


def tuned_config(T: int, E: int, H: int, I: int, k: int, device: torch.device,
                 dequant: str = "bf16") -> ExpertCentricConfig:
    """The table's entry for the nearest tuned T (on a log scale), else default_config. A dequant mode with no
    table of its own takes the BF16 table's tiles (the same kernels' tiles, tuned for the other operand dtype)."""
    key = shape_key(E, H, I, k)
    configs = load_table(table_device(device), dequant).get(key, {}).get("configs")
    if not configs and dequant != "bf16":
        configs = load_table(table_device(device)).get(key, {}).get("configs")
    if not configs:
        return default_config(T, E, k)
    nearest = min(configs, key=lambda t: abs(math.log2(int(t)) - math.log2(max(T, 1))))
    return ExpertCentricConfig.from_dict(configs[nearest])


def pick_dequant(dequant: str, T: int, weights_mx: bool) -> str:
    """The operand mode that runs: `dequant` itself, or for "auto" FP8 dots on MXFP8 weights up to FP8_MAX_TOKENS,
    BF16 dots otherwise."""
    if dequant != "auto":
        return dequant
    return "fp8" if weights_mx and T <= FP8_MAX_TOKENS else "bf16"


def crossover_tokens(E: int, H: int, I: int, k: int, device: torch.device, dequant: str = "bf16") -> int:
    """The largest T at which `auto` runs warp decode against the expert-centric path with that operand mode:
    measured per shape on the device (that mode's table, else the BF16 one's), else the default."""
    key, dev = shape_key(E, H, I, k), table_device(device)
    for table in (load_table(dev, dequant), load_table(dev)):
        if "crossover_tokens" in table.get(key, {}):
            return int(table[key]["crossover_tokens"])
    return DEFAULT_CROSSOVER_TOKENS


def expert_centric_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2, *,
                       act_dtype: str = "bf16", dequant: str = "auto", config: ExpertCentricConfig | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of T tokens, [T, H] bf16, written to `out` if given; `config` None: tuned_config.
    dequant: the GEMMs' operand mode, "bf16", "f16_rel" or "fp8" (these two with MXFP8 weights only), or "auto"
    (pick_dequant: "fp8" for MXFP8 weights up to FP8_MAX_TOKENS, else "bf16")."""
    check_kernel_args(hidden, topk_weights, topk_ids, w13, w2)
    _, _, mx13 = weight_parts(w13, "w13", hidden.device)
    _, _, mx2 = weight_parts(w2, "w2", hidden.device)
    if mx13 != mx2:
        raise TypeError("w13 and w2 must both be MXFP8Tensor or both bfloat16")
    if act_dtype not in ("bf16", "mxfp8"):
        raise ValueError(f"act_dtype must be 'bf16' or 'mxfp8', got {act_dtype!r}")
    if dequant not in DEQUANTS or (dequant in ("f16_rel", "fp8") and not mx13):
        raise ValueError(f"dequant must be one of {DEQUANTS} ('f16_rel' and 'fp8' with MXFP8 weights), got "
                         f"{dequant!r}")
    if act_dtype != "bf16" and dequant == "auto":  # MXFP8 activations are a BF16-dot comparison
        dequant = "bf16"
    dequant = pick_dequant(dequant, hidden.shape[0], mx13)
    if dequant == "fp8" and act_dtype != "bf16":
        raise ValueError(f"dequant 'fp8' splits the activations itself; act_dtype must be 'bf16', got {act_dtype!r}")
    (T, H), k, E, I = hidden.shape, topk_ids.shape[1], w13.shape[0], w2.shape[-1]
    out = torch.empty_like(hidden) if out is None else out
    check_tensor("out", out, torch.bfloat16, (T, H), hidden.device)
    if T == 0:
        return out
    if T > 65535:  # the combine grid's second dimension, a CUDA limit
        raise ValueError(f"hidden has {T} tokens, more than 65535: split the batch")
    cfg = config or tuned_config(T, E, H, I, k, hidden.device, dequant)
    if cfg.gate_up.tma_act:
        raise ValueError("tma_act is a tile option of down only: gate_up gathers its tokens' rows")
    if dequant == "fp8":
        _fp8_gemms(hidden, topk_weights, *moe_align(topk_ids, E, cfg.block_m, split=hidden), w13, w2, cfg, out)
        return out
    sorted_ids, block_expert = moe_align(topk_ids, E, cfg.block_m)
    S = sorted_ids.shape[0]
    if cfg.gate_up.tma or cfg.down.tma or cfg.down.tma_act:
        raise ValueError(f"tma and tma_act are tile options of dequant 'fp8' only, got dequant {dequant!r}")
    mx_act = act_dtype == "mxfp8"
    x = mxfp8_quantize(hidden) if mx_act else hidden
    # Zeros for the quantizer's sake: rows of blocks past the last expert are never written (nor read).
    act = (torch.zeros if mx_act else torch.empty)((S, I), dtype=torch.bfloat16, device=hidden.device)
    g = cfg.gate_up
    moe_gate_up(x, sorted_ids, block_expert, w13, act, num_pairs=T * k, top_k=k, block_m=cfg.block_m,
                block_n=g.block_n, block_k=g.block_k, num_warps=g.num_warps, num_stages=g.num_stages, dequant=dequant)
    part = torch.empty((T * k, H), dtype=torch.float32, device=hidden.device)
    d = cfg.down
    moe_down(mxfp8_quantize(act) if mx_act else act, sorted_ids, block_expert, topk_weights, w2, part,
             block_m=cfg.block_m, block_n=d.block_n, block_k=d.block_k, num_warps=d.num_warps,
             num_stages=d.num_stages, dequant=dequant)
    moe_combine(part, out, k)
    return out


def _fp8_gemms(hidden, topk_weights, sorted_ids, block_expert, hidden_split: FP8Split, w13, w2,
               cfg: ExpertCentricConfig, out) -> None:
    """dequant "fp8": both GEMMs on FP8 dots over the hidden rows split per token (by the align launch), act split
    per 32 between them, combine. The tiles' block_k is cut to a divisor of the reduction (the FP8 kernels take
    whole 32-wide groups per step)."""
    (T, H), k, I = hidden.shape, topk_weights.shape[1], w2.shape[-1]
    S, dev = sorted_ids.shape[0], hidden.device
    act = FP8Split.empty(S, I, I // 32, dev)
    g, d = cfg.gate_up, cfg.down
    moe_gate_up_fp8(hidden_split, sorted_ids, block_expert, w13, act, num_pairs=T * k, top_k=k,
                    block_m=cfg.block_m, block_n=g.block_n, block_k=math.gcd(g.block_k, H), num_warps=g.num_warps,
                    num_stages=g.num_stages, tma=g.tma)
    part = torch.empty((T * k, H), dtype=torch.float32, device=dev)
    moe_down_fp8(act, sorted_ids, block_expert, topk_weights, w2, part, block_m=cfg.block_m,
                 block_n=d.block_n, block_k=math.gcd(d.block_k, I), num_warps=d.num_warps, num_stages=d.num_stages,
                 tma=d.tma, tma_act=d.tma_act)
    moe_combine(part, out, k)


def auto_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2, *,
             crossover: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Warp decode (its own auto schedule) for T <= crossover, expert-centric (dequant "auto") above; `crossover`
    None: the one measured against the operand mode that runs just above it, FP8 dots for MXFP8 weights
    (crossover_tokens). T is a shape, so a CUDA graph captures one branch per batch size."""
    check_kernel_args(hidden, topk_weights, topk_ids, w13, w2)
    if crossover is None:
        mode = pick_dequant("auto", 1, isinstance(w13, MXFP8Tensor))
        crossover = crossover_tokens(w13.shape[0], hidden.shape[-1], w2.shape[-1], topk_ids.shape[-1], hidden.device,
                                     mode)
    if hidden.shape[0] <= crossover:
        return warp_decode_moe(hidden, topk_weights, topk_ids, w13, w2, out=out)
    return expert_centric_moe(hidden, topk_weights, topk_ids, w13, w2, out=out)
