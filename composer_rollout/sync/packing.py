"""Packing a layer's per-expert (Hub-layout) tensors into the fused layout on the trainer, before bucketing.

Why: a worker's host cost is per tensor, not per byte. Qwen3-30B-A3B in the Hub layout is 18,867 tensors
(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`), in transformers 5's fused layout 531, and on the H200 a
cuda_ipc sync of the same 61 GB took 0.742 s from Hub names against 0.323 s from fused ones (docs/perf.md, "Weight
sync"): ~23 µs of worker host time per extra tensor (Ray unpickling ~160 views per bucket, rebuilding them, the name
mapping and coverage checks, the quantizer's bookkeeping). A trainer with one allocation per expert tensor (an FSDP
gather, a Megatron export) also paid an IPC share and map per tensor (~70 µs). So the trainer sends each layer whose
experts all arrived as the two fused tensors the worker already takes fast: gate and up of every expert as
`model.layers.L.mlp.experts.gate_up_proj` [E, 2I, H] (expert e's gate rows, then its up rows) and down as
`....down_proj` [E, H, I]. The worker's bytes are those of a fused push of the same weights, bit for bit (MXFP8
scales run along a row, so a row quantizes alike wherever it sits).

What is packed, and what is not (sent as it came, so the worker checks and names it exactly as before):
- A layer is held until all of its 3E expert tensors arrived, then sent as its two fused tensors. At the end of the
  push, a layer with some experts missing (a partial push, an incomplete full one) goes out as it came, except that
  a projection group that is complete (every gate and up, or every down) while the other is absent is packed alone.
  Mixing the two layouts within a layer is what the worker refuses, so a layer is packed whole or not at all.
- A tensor that does not fit its slot (a wrong shape, a dtype or device other than the layer's first expert tensor,
  an expert out of range, a name already held) ends packing for its layer in this push: the layer's held tensors go
  out as they came, then it, then every later tensor of the layer. The worker then refuses it naming it, before
  anything is applied, as if nothing had been packed.
- Parts that already tile one storage in fused order (per-expert views of a fused tensor) are sent as a view of that
  storage, with no copy; the rest are concatenated where the transport writes them (`buckets.Packed`): into its
  flat buffer (object_store, collective), or into a staging buffer (cuda_ipc, `materialize`).
Holding a layer costs nothing for a state dict; a trainer that materialises tensors one by one holds a layer of
experts (1.2 GB for Qwen3-30B-A3B) instead of a bucket.
"""

from collections.abc import Iterable, Iterator

import torch

from composer_rollout.model.weight_names import expert_fields, hub_expert
from composer_rollout.sync.buckets import Packed, aligned, checked

Geometry = tuple[int, int, int, int]  # (layers, experts, moe intermediate size I, hidden size H), as the worker has it


class _Layer:
    """One layer's held expert tensors: w13 slots 2e (gate) and 2e + 1 (up), w2 slot e; and their arrival order."""

    __slots__ = ("w13", "w2", "n13", "n2", "order", "dtype", "device")

    def __init__(self, experts: int, first: torch.Tensor):
        self.w13: list[torch.Tensor | None] = [None] * (2 * experts)
        self.w2: list[torch.Tensor | None] = [None] * experts
        self.n13 = self.n2 = 0
        self.order: list[tuple[str, torch.Tensor]] = []
        self.dtype, self.device = first.dtype, first.device


class ExpertPacker:
    """`pack(named_tensors)` yields them with every complete layer of per-expert tensors replaced by its fused pair.
    After a pack, `folded` is the number of tensors that went into fused ones less the fused ones sent, so that a
    push reports the trainer's tensor count."""

    def __init__(self, geometry: Geometry):
        self.layers, self.E, self.I, self.H = geometry
        self.folded = 0

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | Packed]]:
        held: dict[int, _Layer] = {}
        done: set[int] = set()  # layers packed or given up on in this push: their later tensors pass as they are
        shapes = {"gate_proj": (self.I, self.H), "up_proj": (self.I, self.H), "down_proj": (self.H, self.I)}
        for name, t in checked(named_tensors):
            fields = expert_fields(name)
            if fields is None or not fields[1] or fields[0] in done or fields[0] >= self.layers:
                yield name, t
                continue
            layer, hub = fields[0], hub_expert(fields[1])
            state = held.get(layer)
            slots = None
            if hub is not None and hub[0] < self.E and t.shape == shapes[hub[1]]:
                expert, proj = hub
                if state is None:
                    state = held[layer] = _Layer(self.E, t)
                slots, i = (state.w2, expert) if proj == "down_proj" else (state.w13, 2 * expert + (proj == "up_proj"))
                if slots[i] is not None or t.dtype != state.dtype or t.device != state.device:
                    slots = None
            if slots is None:  # not a slot of this layer's fused pair: the layer goes out as it came
                done.add(layer)
                if state is not None:
                    yield from held.pop(layer).order
                yield name, t
                continue
            slots[i] = t
            state.order.append((name, t))
            if slots is state.w2:
                state.n2 += 1
            else:
                state.n13 += 1
            if state.n13 == 2 * self.E and state.n2 == self.E:
                done.add(layer)
                yield from self._fused(layer, held.pop(layer))
        for layer, state in held.items():  # incomplete at the end: pack only groups that are whole, alone
            if (state.n13 in (0, 2 * self.E)) and (state.n2 in (0, self.E)):
                yield from self._fused(layer, state)
            else:
                yield from state.order

    def _fused(self, layer: int, state: _Layer) -> Iterator[tuple[str, torch.Tensor | Packed]]:
        prefix = f"model.layers.{layer}.mlp.experts"
        groups = ((f"{prefix}.gate_up_proj", state.w13, state.n13, (self.E, 2 * self.I, self.H)),
                  (f"{prefix}.down_proj", state.w2, state.n2, (self.E, self.H, self.I)))
        for name, parts, n, shape in groups:
            if n:
                self.folded += n - 1
                view = tiled(parts, shape)
                yield name, view if view is not None else Packed(tuple(parts), shape)


def tiled(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """A row-major view of `shape` over the parts' memory when they are row-major and lie back to back, in order,
    inside the first one's storage (per-expert views of a fused tensor); else None."""
    first = parts[0]
    step = first.numel() * first.element_size()
    start = first.data_ptr()
    for k, p in enumerate(parts):
        if p.data_ptr() != start + k * step or not p.is_contiguous():
            return None
    storage = first.untyped_storage()
    if start + len(parts) * step > storage.data_ptr() + storage.nbytes():
        return None  # adjacent allocations, not one
    strides, n = [], 1
    for size in reversed(shape):
        strides.insert(0, n)
        n *= size
    return first.as_strided(shape, strides, first.storage_offset())


def staged_bytes(bucket: list[tuple[str, torch.Tensor | Packed]]) -> int:
    """Bytes a bucket's Packed items take in a staging buffer (each at an ALIGN boundary)."""
    return sum(aligned(t.numel() * t.element_size()) for _, t in bucket if isinstance(t, Packed))


def materialize(bucket: list[tuple[str, torch.Tensor | Packed]], buffer: torch.Tensor
                ) -> list[tuple[str, torch.Tensor]]:
    """The bucket with each Packed item written into `buffer` (uint8, at least `staged_bytes(bucket)`, on the parts'
    device; queued on the current stream) and replaced by its view there."""
    out, offset = [], 0
    for name, t in bucket:
        if isinstance(t, Packed):
            nbytes = t.numel() * t.element_size()
            t = t.into(buffer[offset:offset + nbytes].view(t.dtype).view(t.shape))
            offset += aligned(nbytes)
        out.append((name, t))
    return out
