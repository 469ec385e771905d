"""Buckets: named tensors packed into one flat byte buffer, so that a transport moves a few large messages.

Per-tensor transfers are what makes weight sync take minutes elsewhere (Qwen3-30B-A3B exports ~18k expert tensors in
the Hub layout); a bucket of `bucket_mb` costs one message whatever it holds. A bucket is a uint8 buffer plus a list
of `TensorMeta` (name, dtype, shape, byte offset); every tensor starts at a 64-byte boundary so that the receiver
views it in place, in its own dtype, without a copy. A tensor larger than the bucket size travels alone in a bucket
of its own size. Only floating weights are packed (bfloat16, float16, float32); anything else fails here, on the
trainer side, naming the tensor. A bucket item may also be `Packed`: tensors that are one tensor once concatenated (a
layer's per-expert tensors in the fused layout, composer_rollout.sync.packing), assembled only where a transport
writes it (the flat buffer here, a staging buffer for cuda_ipc).
"""

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class Packed:
    """`parts` (one dtype and device, each [rows, shape[-1]], any strides) concatenated along their first dim, in
    order, as one row-major tensor of `shape`. Answers what bucketing asks of a tensor (numel, element_size, dtype,
    shape, device) without being built."""

    parts: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.parts[0].element_size()

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """Write the parts into `out` (row-major, `shape`, the parts' dtype; non-blocking where the devices allow, the
        caller synchronises) and return it: one concatenation on the parts' device, else a copy per part."""
        rows = out.view(-1, self.shape[-1])
        with torch.no_grad():  # a trainer's parameters may require grad; cat(out=) refuses those under autograd
            if out.device == self.device:
                torch.cat(self.parts, out=rows)
            else:
                start = 0
                for part in self.parts:
                    rows[start:start + part.shape[0]].copy_(part, non_blocking=True)
                    start += part.shape[0]
        return out


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checked(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, each checked to be a named floating tensor, as they are produced."""
    for item in named_tensors:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(f"named_tensors must yield (hf_name, tensor) pairs, got {type(item).__name__}")
        name, t = item
        if isinstance(t, Packed):  # made from parts that came through here
            yield name, t
            continue
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"named_tensors must yield (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                            f"{type(t).__name__})")
        if t.dtype not in DTYPES.values():
            raise TypeError(f"{name}: dtype {t.dtype} is not a weight dtype ({', '.join(DTYPES)})")
        if t.numel() == 0:
            raise ValueError(f"{name}: empty tensor")
        yield name, t


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor | Packed]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor | Packed]]]:
    """Consecutive groups of (name, tensor) whose aligned sizes add up to at most bucket_bytes (a larger tensor
    alone). Lazy: a trainer that materialises tensors one by one (an FSDP gather) holds at most a bucket of them."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket size {bucket_bytes} bytes is too small (at least {ALIGN})")
    group, size = [], 0
    for name, t in checked(named_tensors):
        n = aligned(t.numel() * t.element_size())
        if group and size + n > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield group


def layout(items: list[tuple[str, torch.Tensor | Packed]]) -> tuple[list[TensorMeta], int]:
    """Each tensor's place in the flat buffer, and the buffer's size."""
    metas, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += aligned(nbytes)
    return metas, offset


def view(flat: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, as a view into the uint8 buffer `flat`."""
    return flat[meta.offset: meta.offset + meta.nbytes].view(DTYPES[meta.dtype]).view(meta.shape)


def pack(items: list[tuple[str, torch.Tensor | Packed]], out: torch.Tensor) -> list[TensorMeta]:
    """Copy `items` into the uint8 buffer `out` (non-blocking where the devices allow; the caller synchronises)."""
    metas, total = layout(items)
    if out.dtype != torch.uint8 or out.numel() < total:
        raise ValueError(f"pack: out must be a uint8 buffer of at least {total} bytes")
    for meta, (_, t) in zip(metas, items, strict=True):
        if isinstance(t, Packed):
            t.into(view(out, meta))
        else:
            view(out, meta).copy_(t, non_blocking=True)
    return metas


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    for meta in metas:
        yield meta.name, view(flat, meta)
