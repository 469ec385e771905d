"""cuda_ipc's bucket format, on CPU tensors: the trainer shares each distinct storage once and sends every tensor as
(name, storage, offset, shape, stride, dtype); the worker rebuilds the views from the storage's bytes. A copy of each
storage's bytes stands in for the worker's mapping (no GPU here), so a view that leaned on the trainer's memory or
metadata beyond what is sent would not come out equal. Views at any offset, slices, transposes, strided and
broadcast views, dtypes mixed in one allocation: bit-exact. A Hub-layout update carved out of one allocation
stages through WeightUpdate exactly as the plain tensors do (host quantizer, and the kernel in Triton's
interpreter, which reads transposed sources only after a copy). The GPU path itself: tests/test_weight_sync_gpu.py."""

import pickle

import pytest
import torch
from weight_sources import assert_bitwise_equal, expected, named, source_model

from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.sync.buckets import buckets
from composer_rollout.sync.channels import as_views, by_storage, share_bucket
from composer_rollout.sync.update import WeightUpdate, live_weights


def carve(named_tensors, device="cpu", transposed=(), padded=()):
    """The tensors copied into one uint8 allocation and handed back as views of it, the way a trainer's flat buffer
    holds its parameters: each starts a few bytes past the previous one (aligned to its element size, not to 16
    bytes); names in `transposed` are held as the transpose's rows (a view with strides (1, rows)); names in
    `padded` as rows of a wider buffer (row-major under a strided first dim). Returns (pairs, the allocation)."""
    layouts, end = [], 0
    for name, t in named_tensors:
        rows, cols = t.shape[0], t.numel() // t.shape[0]
        held = (cols, rows) if name in transposed else (rows, cols + 32) if name in padded else tuple(t.shape)
        size = t.element_size()
        start = (end + 6 + size - 1) // size * size
        layouts.append((name, t, held, start))
        end = start + size * torch.Size(held).numel()
    buf = torch.zeros(end, dtype=torch.uint8, device=device)
    out = []
    for name, t, held, start in layouts:
        region = buf[start:start + t.element_size() * torch.Size(held).numel()].view(t.dtype).view(held)
        view = region.t() if name in transposed else region[:, :t.shape[-1]] if name in padded else region
        view.copy_(t)
        out.append((name, view))
    return out, buf


def roundtrip(named_tensors):
    """What a worker rebuilds: the views, pickled as Ray sends them, over copies of the storages' bytes."""
    storages, views = by_storage(named_tensors)
    return dict(as_views([s.clone() for s in storages], pickle.loads(pickle.dumps(views)))), storages


def assert_same_view(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))  # bits


def test_views_of_one_allocation_share_it_once_and_rebuild_bit_exact():
    base = torch.randn(64, 48, dtype=torch.float32)
    base[3, 5], base[7, 1] = float("nan"), float("-inf")  # bits, not values: NaN payloads survive too
    raw = base.view(torch.uint8).view(-1)  # the same bytes seen as bfloat16 and float16 further down
    pairs = [("whole", base), ("rows", base[10:20]), ("cols", base[:, 7:19]), ("t", base.t()),
             ("every_other", base[1::2, ::3]), ("element", base[63, 47:]), ("broadcast", base[5].expand(4, 48)),
             ("bf16_at_offset", raw[2:2 + 2 * 300].view(torch.bfloat16).view(20, 15)),
             ("fp16_t", raw[1000:1000 + 2 * 64].view(torch.float16).view(8, 8).t()),
             ("param", torch.nn.Parameter(base[30:40, 8:40]))]
    other = torch.randn(5, 7, dtype=torch.bfloat16)
    pairs.append(("other", other[:, 1:]))
    got, storages = roundtrip(pairs)
    assert len(storages) == 2 and [s.numel() for s in storages] == [64 * 48 * 4, 5 * 7 * 2]
    assert all(s.dtype == torch.uint8 and s.data_ptr() == t.untyped_storage().data_ptr()
               for s, t in zip(storages, (base, other), strict=True))
    for name, t in pairs:
        assert_same_view(got[name], t.detach())


def test_separate_allocations_are_separate_storages():
    pairs = [(f"t{i}", torch.full((3, 4), float(i), dtype=torch.bfloat16)) for i in range(5)]
    storages, views = by_storage(pairs)
    assert len(storages) == 5 and [v[1] for v in views] == list(range(5))
    got, _ = roundtrip(pairs)
    for name, t in pairs:
        assert_same_view(got[name], t)


def test_a_view_that_does_not_fit_its_storage_is_refused_naming_it():
    storages, views = by_storage([("a", torch.zeros(4, 4)), ("b", torch.zeros(2, 8))])
    name, i, offset, shape, stride, dtype = views[1]
    bad = [views[0], (name, i, offset + 1, shape, stride, dtype)]
    got = as_views(storages, bad)
    assert next(got)[0] == "a"
    with pytest.raises(ValueError, match=r"^b: a view at offset 1 with shape \(2, 8\) .* 16 float32 elements"):
        next(got)


def test_sharing_names_the_tensor_it_cannot_share():
    base = torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^b: cuda_ipc shares this process's cuda:0 memory; the tensor is on cpu"):
        share_bucket([("b", base[2:])], torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"^c: cuda_ipc could not share its storage: .*CUDA tensors"):
        share_bucket([("c", base[4:]), ("d", base[:4])], torch.device("cpu"))


def test_a_carved_hub_update_shares_one_storage_per_bucket():
    src = named(source_model(3), "hub")
    pairs, buf = carve(src)
    counts = [len(by_storage(b)[0]) for b in buckets(pairs, 1 << 16)]
    assert len(counts) >= 3 and counts == [1] * len(counts)
    assert all(t.untyped_storage().data_ptr() == buf.data_ptr() for _, t in pairs)


@pytest.mark.parametrize("kernel", [False, True])
def test_a_carved_update_stages_exactly(kernel):
    """Dense and expert tensors of mixed dtypes, carved out of one allocation (transposed, row-padded, misaligned),
    shared as the trainer does, rebuilt as the worker does, staged through WeightUpdate in buckets."""
    src = named(source_model(5), "hub")
    src = [(n, t.float() if ("layers.1." in n or "norm" in n) else t) for n, t in src]
    transposed = {"model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.4.down_proj.weight",
                  "model.layers.0.mlp.experts.0.gate_proj.weight", "lm_head.weight"}
    padded = {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
              "model.layers.1.mlp.experts.11.gate_proj.weight"}
    pairs, _ = carve(src, transposed=transposed, padded=padded)
    assert all(not t.is_contiguous() for n, t in pairs if n in transposed | padded)
    model = Qwen3MoE(preset("tiny"), weight_dtype="mxfp8").init_random(0)
    update = WeightUpdate(model, 1, 0, kernel=kernel)
    for bucket in buckets(pairs, 1 << 16):
        storages, views = by_storage(bucket)
        assert update.add_many(as_views([s.clone() for s in storages], views)) == len(bucket)
    update.finalize()
    update.apply(model, 0)
    assert_bitwise_equal(live_weights(model), expected(src, model))
