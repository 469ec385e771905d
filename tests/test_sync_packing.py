"""Per-expert (Hub-layout) tensors packed into the fused layout on the trainer (composer_rollout.sync.packing), staged
through a real WeightUpdate the way each transport hands a bucket over: the flat bucket buffer (object_store,
collective) and cuda_ipc's staging buffer plus storage views (on CPU tensors; a copy of each storage's bytes stands in
for the worker's mapping). The worker ends bit-exact with a push of the same weights under fused names, with the host
quantizer and with the kernel (Triton's interpreter); partial pushes, layers with some experts or a gate without its
up, tensors that do not fit a slot, and non-finite values are named as before. The Ray transports themselves:
tests/test_weight_sync.py."""

import pytest
import torch
from weight_sources import assert_bitwise_equal, expected, named, snapshot, source_model

from composer_rollout.model import Qwen3MoE, preset
from composer_rollout.sync.buckets import Packed, buckets, layout, pack, unpack
from composer_rollout.sync.channels import as_views, by_storage
from composer_rollout.sync.packing import ExpertPacker, materialize, staged_bytes
from composer_rollout.sync.update import WeightSyncError, WeightUpdate, live_weights

ARGS = preset("tiny")
GEOMETRY = (ARGS.num_hidden_layers, ARGS.num_experts, ARGS.moe_intermediate_size, ARGS.hidden_size)
E = ARGS.num_experts
PREFIX = "model.layers.{}.mlp.experts"


def engine_model():
    return Qwen3MoE(preset("tiny"), weight_dtype="mxfp8").init_random(0)


def push(model, named_tensors, *, transport="ipc", partial=False, kernel=False, bucket_bytes=1 << 16, version=1):
    """Pack, bucket and hand each bucket to a WeightUpdate as `transport` does; returns (update, packer)."""
    packer = ExpertPacker(GEOMETRY)
    update = WeightUpdate(model, version, version - 1, partial=partial, kernel=kernel)
    staging = [torch.empty(0, dtype=torch.uint8)] * 2
    for k, bucket in enumerate(buckets(packer.pack(named_tensors), bucket_bytes)):
        if transport == "flat":
            metas, total = layout(bucket)
            flat = torch.empty(total, dtype=torch.uint8)
            pack(bucket, flat)
            update.add_many(unpack(flat, metas))
        else:
            need = staged_bytes(bucket)
            if staging[k % 2].numel() < need:
                staging[k % 2] = torch.empty(need, dtype=torch.uint8)
            storages, views = by_storage(materialize(bucket, staging[k % 2]))
            update.add_many(as_views([s.clone() for s in storages], views))
        update.fence()
    return update, packer


def apply(model, named_tensors, **kw):
    update, packer = push(model, named_tensors, **kw)
    update.finalize()
    update.apply(model, kw.get("version", 1) - 1)
    return update, packer


def hub_of(w13, w2, layer):
    I = ARGS.moe_intermediate_size
    p = PREFIX.format(layer)
    return [item for e in range(E) for item in ((f"{p}.{e}.gate_proj.weight", w13[e, :I]),
                                                (f"{p}.{e}.up_proj.weight", w13[e, I:]),
                                                (f"{p}.{e}.down_proj.weight", w2[e]))]


def test_complete_layers_go_out_fused_and_tiled_views_are_not_copied():
    src = named(source_model(1), "hub")
    out = list(ExpertPacker(GEOMETRY).pack(src))
    experts = [(n, t) for n, t in out if ".experts." in n]
    assert [n for n, _ in experts] == [f"{PREFIX.format(L)}.{w}" for L in (0, 1) for w in ("gate_up_proj", "down_proj")]
    assert all(isinstance(t, Packed) for _, t in experts)  # one allocation per expert tensor: concatenated later
    fused = dict(named(source_model(1), "fused"))
    for name, t in experts:
        assert torch.equal(t.into(torch.empty(t.shape, dtype=t.dtype)), fused[name])
    w13, w2 = fused[f"{PREFIX.format(0)}.gate_up_proj"], fused[f"{PREFIX.format(0)}.down_proj"]
    views = list(ExpertPacker(GEOMETRY).pack(hub_of(w13, w2, 0)))
    assert [(n, t.data_ptr(), t.shape) for n, t in views] == [
        (f"{PREFIX.format(0)}.gate_up_proj", w13.data_ptr(), w13.shape),
        (f"{PREFIX.format(0)}.down_proj", w2.data_ptr(), w2.shape)]  # views of the fused memory: sent as they are


@pytest.mark.parametrize("transport,kernel,dtype", [("ipc", False, torch.bfloat16), ("flat", False, torch.float32),
                                                    ("ipc", True, torch.float32), ("flat", True, torch.bfloat16)])
def test_a_packed_hub_push_lands_exactly_as_a_fused_push(transport, kernel, dtype):
    hub, fused = named(source_model(2), "hub", dtype), named(source_model(2), "fused", dtype)
    a, b = engine_model(), engine_model()
    update, packer = apply(a, hub, transport=transport, kernel=kernel)
    apply(b, fused, transport=transport, kernel=kernel)
    assert update.num_tensors + packer.folded == len(hub) and update.nbytes == sum(t.nbytes for _, t in hub)
    assert_bitwise_equal(live_weights(a), live_weights(b))
    assert_bitwise_equal(live_weights(a), expected(hub, a))


def test_partial_pushes_pack_only_whole_groups_and_keep_the_rest():
    """Layer 0: every gate and up but no down (packed alone as gate_up_proj). Layer 1: experts 0-4 whole, expert 7's
    gate without its up, and a few downs (sent as they came). Everything else keeps its live value."""
    model = engine_model()
    base = named(source_model(3), "hub")
    apply(model, base)
    new = named(source_model(4), "hub")
    p0, p1 = PREFIX.format(0), PREFIX.format(1)
    carried = {n for n, _ in new if n.startswith(p0) and "down_proj" not in n}
    carried |= {f"{p1}.{e}.{proj}.weight" for e in range(5) for proj in ("gate_proj", "up_proj", "down_proj")}
    carried |= {f"{p1}.7.gate_proj.weight", f"{p1}.9.down_proj.weight", "model.norm.weight"}
    part = [(n, t) for n, t in new if n in carried]
    sent = [n for n, _ in ExpertPacker(GEOMETRY).pack(part)]
    assert f"{p0}.gate_up_proj" in sent and f"{p0}.down_proj" not in sent
    assert not any(n.startswith(p0 + ".") and n.endswith(".weight") for n in sent)
    assert sorted(n for n in sent if n.startswith(p1)) == sorted(n for n in carried if n.startswith(p1))
    apply(model, part, partial=True, version=2)
    want = dict(new)
    assert_bitwise_equal(live_weights(model), expected([(n, want[n] if n in carried else t) for n, t in base], model))


def test_a_tensor_that_fits_no_slot_is_named_by_the_worker_and_nothing_is_applied():
    """A wrong shape for expert 7 of layer 1 (mid-layer, after experts 0-6 were held): the layer goes out as it came,
    the worker refuses that tensor by name; the live weights are untouched."""
    model = engine_model()
    before = snapshot(model)
    bad = f"{PREFIX.format(1)}.7.up_proj.weight"
    src = [(n, torch.zeros(97, 128, dtype=torch.bfloat16) if n == bad else t) for n, t in named(source_model(5))]
    sent = [n for n, _ in ExpertPacker(GEOMETRY).pack(src)]
    assert f"{PREFIX.format(0)}.gate_up_proj" in sent and bad in sent and f"{PREFIX.format(1)}.gate_up_proj" not in sent
    with pytest.raises(WeightSyncError, match=rf"^{bad}: shape \(97, 128\), expected \(96, 128\)"):
        push(model, src)
    assert_bitwise_equal(live_weights(model), before)


@pytest.mark.parametrize("change", [
    lambda t: t.float(),  # another dtype than the layer's: the layer is sent as it came, staged exactly
    lambda t: t.t().contiguous().t(),  # a transposed view: concatenated whatever its strides
])
def test_odd_members_still_land_exactly(change):
    name = f"{PREFIX.format(1)}.4.down_proj.weight"
    src = [(n, change(t) if n == name else t) for n, t in named(source_model(6))]
    model = engine_model()
    apply(model, src, transport="flat")
    assert_bitwise_equal(live_weights(model), expected(src, model))


def test_a_duplicate_is_refused_as_a_duplicate():
    src = named(source_model(7))
    dup = next((n, t) for n, t in src if n == f"{PREFIX.format(0)}.3.gate_proj.weight")
    with pytest.raises(WeightSyncError, match=rf"^{dup[0]}: appears twice"):
        push(engine_model(), src[:40] + [dup] + src[40:])


@pytest.mark.parametrize("kernel", [False, True])
def test_a_nan_in_a_packed_expert_names_the_per_expert_tensor(kernel):
    model = engine_model()
    before = snapshot(model)
    bad = f"{PREFIX.format(1)}.5.up_proj.weight"
    src = named(source_model(8))
    src = [(n, t.clone().index_fill_(0, torch.tensor([3]), float("nan")) if n == bad else t) for n, t in src]
    fused = f"{PREFIX.format(1)}.gate_up_proj"
    with pytest.raises(WeightSyncError, match=rf"^{fused}: non-finite values \(inf or NaN\) in {bad}"):
        update, _ = push(model, src, kernel=kernel)
        update.finalize()
    assert_bitwise_equal(live_weights(model), before)
