"""Re-quantizing a weight update's experts to MXFP8: batched per bucket by the Triton kernel, per tensor on the host.

Why batched: the Hugging Face Hub layout sends Qwen3-30B-A3B's experts as 18,432 tensors of ~1.5M weights, ~1 µs of
GPU work each, and a launch, a counter allocation and a flag per tensor made staging them host-bound (10.8 s per
sync on the H200, against 0.40 s for the whole sync in the fused layout). So `ExpertQuantizer.run` takes a bucket's
expert tensors at once and quantizes each group of the same dtype and size with one `mxfp8_quantize_into_rows`
launch (a table of addresses; same-size tensors, so no program of the grid idles), straight into the staged fused
buffers' rows. Non-finite blocks are counted into one int32 array per update, a slot per tensor (so that the
error still names it), zeroed once when the update begins and read once when it is finalized: no host sync per
tensor. A large source (a fused-layout tensor) or one the table cannot take (strided, not 16-byte aligned) gets a launch
of its own, counting into the same array.
On the host (a CPU engine), `mxfp8_quantize` per tensor: it raises on non-finite input, naming the tensor.
A fused tensor with inf or NaN is also named by the per-expert tensor holding the first of them (`where_nonfinite`):
a trainer's per-expert tensors reach the worker packed into fused ones (composer_rollout.sync.packing).

Why rows and not views: `mxfp8_quantize_triton_many` takes an MXFP8Tensor per tensor and checks each, and those
row views and checks cost ~10 µs of host time per expert tensor, a quarter of a second per Hub-layout sync; so a job
names its staged fused buffer and its first row, and `mxfp8_quantize_into_rows` checks the buffer once per group.
"""

import torch

from kernels import MXFP8Tensor, mxfp8_quantize
from kernels.mxfp8_quantize_kernel import mxfp8_quantize_into_rows, mxfp8_quantize_triton

# (Hugging Face name, source, the staged fused MXFP8 buffer, expert (None: all), rows of it the source fills)
Job = tuple[str, torch.Tensor, MXFP8Tensor, int | None, slice]
# A tensor this large (~12 µs of GPU time at the H200's HBM rate, more than a launch's host cost) keeps a launch of its
# own: the fused layout's path, as measured (0.40 s per 61 GB sync), with no table to copy.
_BATCH_MAX = 1 << 24


def requantize(src: torch.Tensor, out: MXFP8Tensor, name: str = "x") -> None:
    """Quantize one tensor into `out` with the host quantizer, bit for bit what the kernel writes; ValueError naming
    `name` (and for a fused expert tensor, the per-expert one) on non-finite input."""
    try:
        q = mxfp8_quantize(src)
    except ValueError as e:
        where = where_nonfinite(name, src) if src.dim() == 3 else ""
        raise ValueError(f"{name}: {'non-finite values (inf or NaN)' + where if where else e}") from None
    out.data.copy_(q.data)
    out.scales.copy_(q.scales)


def where_nonfinite(name: str, fused: "torch.Tensor | MXFP8Tensor | None") -> str:
    """' in <per-expert name>' for the first row of the fused expert tensor `name` ([E, R, C], as sent or as staged)
    holding inf or NaN, '' when there is none (or no tensor). A staged MXFP8 row is found by its scale byte 255
    (E8M0's NaN, what the kernel writes for a non-finite block). Runs only to word an error."""
    if fused is None:
        return ""
    bad = fused.scales == 255 if isinstance(fused, MXFP8Tensor) else ~torch.isfinite(fused)
    hit = bad.flatten(2).any(-1).nonzero() if bad.dim() == 3 else []
    if not len(hit):
        return ""
    expert, row = hit[0].tolist()
    prefix, fused_name = name.rsplit(".", 1)
    proj = "down_proj" if fused_name == "down_proj" else "gate_proj" if row < bad.shape[1] // 2 else "up_proj"
    return f" in {prefix}.{expert}.{proj}.weight"


def _rows(staged: MXFP8Tensor, expert: int | None, rows: slice) -> MXFP8Tensor:
    index = (slice(None) if expert is None else expert, rows)
    return MXFP8Tensor(staged.data[index], staged.scales[index])


class ExpertQuantizer:
    """One update's expert quantization: `kernel` (the Triton kernel, on a GPU or in Triton's interpreter) or the
    host quantizer; `slots` bounds the number of tensors the update can carry (one counter each)."""

    def __init__(self, device: torch.device, slots: int, kernel: bool):
        self.kernel = kernel
        self.counts = torch.zeros(slots, dtype=torch.int32, device=device) if kernel else None
        self.names: list[str] = []  # slot i counts names[i]'s non-finite blocks

    def _slots(self, names: list[str]) -> torch.Tensor:
        start = len(self.names)
        if start + len(names) > self.counts.numel():
            raise ValueError(f"{names[-1]}: more expert tensors than the model has ({self.counts.numel()})")
        self.names += names
        return self.counts[start:start + len(names)]

    def run(self, jobs: list[Job]) -> None:
        """Quantize every job's source into its rows of the staged buffer (queued on the current stream, no host sync
        with the kernel). ValueError naming the tensor: on the host, non-finite input; either way, an argument the
        kernel refuses."""
        if not self.kernel:
            for name, src, staged, expert, rows in jobs:
                requantize(src, _rows(staged, expert, rows), name)
            return
        groups: dict[tuple[int, torch.dtype, int], list] = {}  # (buffer, dtype, size) -> [(name, src, first row)]
        for name, src, staged, expert, rows in jobs:
            n, per_expert = src.numel(), staged.shape[-2]
            # Rows of a row-major [E, R, C] buffer are row-major when they are one expert's, or all of every expert.
            if (n <= _BATCH_MAX and (expert is not None or rows.stop - rows.start == per_expert)
                    and src.is_contiguous() and not src.data_ptr() % 16 and staged.data.dim() == 3
                    and staged.data.is_contiguous() and staged.scales.is_contiguous()):
                first = (expert or 0) * per_expert + rows.start
                groups.setdefault((id(staged), src.dtype, n), []).append((name, src, first, staged))
            else:  # large (a fused-layout tensor), strided or misaligned: a launch of its own
                self._one(name, src, _rows(staged, expert, rows))
        for group in groups.values():
            names = [g[0] for g in group]
            mxfp8_quantize_into_rows([g[1] for g in group], group[0][3], [g[2] for g in group],
                                     nonfinite=self._slots(names), names=names)

    def _one(self, name: str, src: torch.Tensor, out: MXFP8Tensor) -> None:
        mxfp8_quantize_triton(src, out, nonfinite=self._slots([name]), name=name)

    def nonfinite(self) -> tuple[list[str], torch.Tensor | None]:
        """(names, their counts of non-finite blocks on the device): the caller reads them with its other flags."""
        if not self.kernel:
            return [], None
        return self.names, self.counts[:len(self.names)]

