"""The engine's side of weight sync, in-process (no Ray): every tensor kind lands bit-exact (BF16) or
quantization-exact (MXFP8) from Hub or fused names, BF16 or FP32 sources, tied or untied heads; partial updates touch
only what they carry; bad updates fail naming the tensor and leave the served weights and version as they were; an
in-flight swap keeps the KV cache and records per-token versions. The GPU's batched quantization path (a table launch
per bucket, one non-finite counter array per update) runs here in Triton's interpreter, against the host quantizer."""

import pytest
import torch
from weight_sources import assert_bitwise_equal, expected, named, snapshot, source_model

from composer_rollout.engine import RolloutEngine, SamplingParams
from composer_rollout.sync import StaleVersionError, WeightSyncError
from composer_rollout.sync.update import WeightUpdate, live_weights
from kernels import mxfp8_quantize


def engine(weight_dtype="mxfp8", dtype="bfloat16", **overrides):
    from composer_rollout.model import Qwen3MoE, preset

    model = Qwen3MoE(preset("tiny", **overrides), dtype=getattr(torch, dtype), weight_dtype=weight_dtype).init_random(0)
    return RolloutEngine(model, max_num_seqs=4, max_model_len=64)


def sync(eng, tensors, version, partial=False):
    update = eng.begin_update(version, partial=partial)
    for name, t in tensors:
        update.add(name, t)
    update.finalize()
    eng.apply_update(update)


@pytest.mark.parametrize("weight_dtype,dtype,layout,src_dtype,tied", [
    ("mxfp8", "bfloat16", "hub", torch.bfloat16, False),
    ("mxfp8", "bfloat16", "fused", torch.float32, False),  # experts quantized from FP32, not from a BF16 rounding
    ("mxfp8", "bfloat16", "hub", torch.float32, True),
    ("bf16", "bfloat16", "fused", torch.bfloat16, True),
    ("bf16", "float32", "hub", torch.float32, False),
])
def test_every_tensor_kind_lands_exactly(weight_dtype, dtype, layout, src_dtype, tied):
    eng = engine(weight_dtype, dtype, tie_word_embeddings=tied)
    src = named(source_model(7, tie_word_embeddings=tied), layout, src_dtype)
    if tied:  # exporters often write the tied head too; it is accepted and the embedding is the weight
        src.append(("lm_head.weight", dict(src)["model.embed_tokens.weight"].clone()))
    sync(eng, src, version=3)
    assert eng.weight_version == 3
    assert_bitwise_equal(live_weights(eng.model), expected(src, eng.model))
    kinds = {"embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "input_layernorm",
             "post_attention_layernorm", "mlp.gate", "model.norm"} | ({"lm_head"} if not tied else set())
    assert all(any(k in n for n, _ in src) for k in kinds)
    assert eng.generate([[3, 4, 5]], SamplingParams(max_tokens=3, seed=0))[0].weight_version == 3


@pytest.mark.parametrize("weight_dtype,partial", [("mxfp8", False), ("bf16", True)])
def test_in_place_apply_keeps_every_address_and_lands_the_same_values(weight_dtype, partial):
    """What an engine with CUDA graphs uses: the graphs read the weights at their captured addresses."""
    swapped, copied = engine(weight_dtype), engine(weight_dtype)
    src = named(source_model(9), "hub", torch.float32)
    src = src[::3] if partial else src
    addresses = {n: t.data_ptr() for n, t in live_weights(copied.model).items()}
    sync(swapped, src, version=1, partial=partial)
    update = copied.begin_update(1, partial=partial)
    update.add_many(src)
    update.finalize()
    update.apply(copied.model, 0, in_place=True)
    assert {n: t.data_ptr() for n, t in live_weights(copied.model).items()} == addresses
    assert_bitwise_equal(live_weights(copied.model), live_weights(swapped.model))


def test_q_k_v_stay_views_of_the_fused_projection_through_a_sync():
    """The triton backend projects with one [q + k + v rows, H] weight whose row views are q_proj, k_proj, v_proj:
    an update must land in that weight (copied into the views), not beside it."""
    eng = engine("mxfp8")
    src = dict(named(source_model(12), "hub", torch.float32))
    sync(eng, list(src.items()), version=1)
    for i, layer in enumerate(eng.model.layers):
        attn = layer.self_attn
        fused = torch.cat([src[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]).bfloat16()
        assert torch.equal(attn.qkv_weight, fused)
        assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()


def test_partial_update_touches_only_what_it_carries():
    eng = engine("mxfp8")
    before = snapshot(eng.model)
    src = dict(named(source_model(8), "hub", torch.float32))
    carried = ["model.layers.1.self_attn.q_proj.weight", "model.norm.weight",
               "model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.5.down_proj.weight"]
    sync(eng, [(n, src[n]) for n in carried], version=1, partial=True)
    after = live_weights(eng.model)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed == {"model.layers.1.self_attn.q_proj.weight", "model.norm.weight",
                       "model.layers.0.mlp.experts.w13.data", "model.layers.0.mlp.experts.w13.scales",
                       "model.layers.0.mlp.experts.w2.data", "model.layers.0.mlp.experts.w2.scales"}
    assert torch.equal(after["model.norm.weight"], src["model.norm.weight"].to(torch.bfloat16))
    w13, w2 = eng.model.experts(0)
    I = eng.model.args.moe_intermediate_size
    up = mxfp8_quantize(src["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(w13.data[3, I:].view(torch.uint8), up.data.view(torch.uint8))
    assert torch.equal(w13.scales[3, I:], up.scales)
    old13 = before["model.layers.0.mlp.experts.w13.data"]
    assert torch.equal(w13.data[3, :I].view(torch.uint8), old13[3, :I])  # expert 3's gate rows kept
    assert torch.equal(w13.data[:3].view(torch.uint8), old13[:3])
    down = mxfp8_quantize(src["model.layers.0.mlp.experts.5.down_proj.weight"])
    assert torch.equal(w2.data[5].view(torch.uint8), down.data.view(torch.uint8))


def _bad(src, name, value):
    return [(n, value if n == name else t) for n, t in src]


SRC = named(source_model(9), "hub", torch.bfloat16)
Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.experts.4.up_proj.weight"


@pytest.mark.parametrize("tensors,match", [
    (SRC + [("model.layers.0.mlp.shared_expert.weight", torch.zeros(4, 4))], r"unexpected tensor '.*shared_expert"),
    (SRC + [("model.layers.9.self_attn.q_proj.weight", torch.zeros(4, 4))], r"model\.layers\.9\.self_attn"),
    (_bad(SRC, Q, torch.zeros(128, 127, dtype=torch.bfloat16)), rf"{Q}: shape \(128, 127\), expected \(128, 128\)"),
    (_bad(SRC, UP, torch.full((96, 128), float("nan"), dtype=torch.bfloat16)), rf"{UP}: .*non-finite"),
    (_bad(SRC, Q, torch.full((128, 128), float("inf"))), rf"{Q}: non-finite"),
    (_bad(SRC, Q, torch.zeros(128, 128, dtype=torch.int32)), rf"{Q}: dtype torch.int32"),
    ([(n, t) for n, t in SRC if n != UP], rf"missing tensor '{UP}'"),
    ([(n, t) for n, t in SRC if n != "model.norm.weight"], r"missing tensor 'model\.norm\.weight'"),
    (SRC + [(Q, dict(SRC)[Q])], rf"{Q}: appears twice"),
    (SRC + [("model.layers.1.mlp.experts.down_proj", torch.zeros(12, 128, 96))], "mixes the Hub"),
])
def test_bad_update_names_the_tensor_and_changes_nothing(tensors, match):
    eng = engine("mxfp8")
    before = snapshot(eng.model)
    with pytest.raises(WeightSyncError, match=match):
        update = eng.begin_update(1)
        try:
            for name, t in tensors:
                update.add(name, t)
            update.finalize()
        except WeightSyncError:
            update.discard()
            raise
    assert eng.weight_version == 0
    assert_bitwise_equal(live_weights(eng.model), before)


def test_versions_only_increase():
    eng = engine("bf16")
    sync(eng, SRC, version=2)
    for stale in (2, 1):
        with pytest.raises(StaleVersionError, match=f"version {stale} is not newer than the version being served"):
            eng.begin_update(stale)
    update = eng.begin_update(4)
    other = eng.begin_update(3)  # two updates staged at once: the older one loses at apply
    for u in (update, other):
        for name, t in SRC:
            u.add(name, t)
        u.finalize()
    eng.apply_update(update)
    with pytest.raises(StaleVersionError):
        eng.apply_update(other)
    assert eng.weight_version == 4


def test_inflight_swap_keeps_the_sequences_and_records_per_token_versions():
    sampling = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=3)
    ref = engine("mxfp8").generate([[5, 6, 7, 8]], sampling)
    eng = engine("mxfp8")
    eng.add_request([5, 6, 7, 8], sampling)
    for _ in range(4):  # the first step prefills (1st token) and decodes (2nd): 5 tokens each on version 0
        assert not eng.step()
    sync(eng, named(source_model(10), "fused"), version=1)
    out = []
    while eng.has_unfinished():
        out += eng.step()
    out.sort(key=lambda r: r.sample_index)
    for r, base in zip(out, ref, strict=True):
        assert r.token_ids[:5] == base.token_ids[:5]  # the first tokens were made by the old weights
        assert r.weight_version == 0 and r.weight_versions == [(0, 5), (1, len(r.token_ids) - 5)]
        assert r.token_weight_versions() == [0] * 5 + [1] * (len(r.token_ids) - 5)
    assert [r.token_ids for r in out] != [r.token_ids for r in ref]  # the rest follow the new weights
    fresh = eng.generate([[5, 6, 7, 8]], sampling)
    assert all(r.weight_versions == [(1, len(r.token_ids))] for r in fresh)


def _staged(eng, tensors, version, chunk, kernel):
    update = WeightUpdate(eng.model, version, eng.weight_version, kernel=kernel)
    for i in range(0, len(tensors), chunk):  # buckets of `chunk` tensors, as the receiver stages them
        update.add_many(tensors[i:i + chunk])
    return update


@pytest.mark.parametrize("layout,src_dtype", [("hub", torch.bfloat16), ("hub", torch.float32),
                                              ("fused", torch.bfloat16)])
def test_batched_kernel_path_matches_the_host_quantizer(layout, src_dtype):
    """The GPU path (one table launch per bucket and dtype, one counter array per update), run by Triton's
    interpreter on CPU tensors: bit for bit the host quantizer's bytes, from per-expert or fused names."""
    src = named(source_model(11), layout, src_dtype)
    eng = engine("mxfp8")
    update = _staged(eng, src, 1, chunk=40, kernel=True)
    assert update.quantizer.kernel
    update.finalize()
    eng.apply_update(update)
    assert_bitwise_equal(live_weights(eng.model), expected(src, eng.model))


def test_batched_kernel_path_counts_a_nan_and_names_it():
    eng = engine("mxfp8")
    before = snapshot(eng.model)
    down = "model.layers.0.mlp.experts.7.down_proj.weight"
    nan = torch.zeros(128, 96, dtype=torch.bfloat16)
    nan[5, 40] = float("nan")
    update = _staged(eng, _bad(SRC, down, nan), 1, chunk=len(SRC), kernel=True)  # one bucket, one launch
    with pytest.raises(WeightSyncError, match=rf"^{down}: non-finite values \(inf or NaN\) \(weight update"):
        update.finalize()
    names, counts = update.quantizer.nonfinite()
    assert counts.tolist() == [int(n == down) for n in names] and sorted(names) == sorted(
        n for n, _ in SRC if ".experts." in n)
    assert eng.weight_version == 0
    assert_bitwise_equal(live_weights(eng.model), before)


def test_a_bucket_stages_the_tensors_before_a_refused_one():
    """add_many is add() per tensor: the prefix of a bucket is staged, the refused tensor raises naming it, and
    the rest of the bucket is not recorded (it can come again)."""
    eng = engine("mxfp8")
    update = eng.begin_update(1)
    bad = ("model.layers.0.mlp.experts.2.up_proj.weight", torch.zeros(3, 3, dtype=torch.bfloat16))
    cut = 50
    with pytest.raises(WeightSyncError, match=r"experts\.2\.up_proj\.weight: shape \(3, 3\)"):
        update.add_many(SRC[:cut] + [bad] + SRC[cut:])
    assert update.num_tensors == cut
    update.add_many(SRC[cut:])
    update.finalize()
    eng.apply_update(update)
    assert_bitwise_equal(live_weights(eng.model), expected(SRC, eng.model))


@pytest.mark.parametrize("kernel", [False, True])
def test_names_kept_across_updates_still_check_every_tensor(kernel):
    """A WeightNames passed to successive updates (SyncReceiver keeps one per model) remembers the names it mapped:
    a second sync lands the same bytes, a remembered name is still checked (shape, duplicates), a refused name is
    not remembered, and a model of another shape maps names by its own WeightNames, not this one's."""
    from composer_rollout.model.weight_names import WeightNames

    eng = engine("mxfp8")
    names = WeightNames.of(eng.model)
    for version in (1, 2):
        update = WeightUpdate(eng.model, version, eng.weight_version, kernel=kernel, names=names)
        update.add_many(SRC)
        update.finalize()
        eng.apply_update(update)
        assert_bitwise_equal(live_weights(eng.model), expected(SRC, eng.model))
    update = WeightUpdate(eng.model, 3, eng.weight_version, kernel=kernel, names=names)
    with pytest.raises(WeightSyncError, match=rf"{UP}: shape \(3, 3\), expected \(96, 128\)"):
        update.add(UP, torch.zeros(3, 3, dtype=torch.bfloat16))
    update.add(UP, dict(SRC)[UP])
    with pytest.raises(WeightSyncError, match=rf"{UP}: appears twice"):
        update.add(UP, dict(SRC)[UP])
    for _ in range(2):
        with pytest.raises(WeightSyncError, match="expert 12 >= num_experts 12"):
            update.add("model.layers.0.mlp.experts.12.up_proj.weight", torch.zeros(96, 128, dtype=torch.bfloat16))
    small = engine("mxfp8", num_experts=6)
    with pytest.raises(WeightSyncError, match="expert 7 >= num_experts 6"):
        WeightUpdate(small.model, 1, 0, kernel=kernel).add("model.layers.0.mlp.experts.7.up_proj.weight",
                                                            dict(SRC)["model.layers.0.mlp.experts.7.up_proj.weight"])
    assert names.target("model.layers.0.mlp.experts.7.up_proj.weight").expert == 7  # the first model's map is its own
