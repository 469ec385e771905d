"""kernels/decode_attention.py against cache_attention_reference (FP32, from the same BF16 inputs).

CPU: Triton's interpreter at tiny irregular shapes (L not a multiple of the 64-key block, G = 2, 8 and 16 query
heads per kv head, rows of one key, of the whole slot and in between, slots permuted, repeated and the scratch
slot, more splits than a row has blocks); the interpreter's dots run on FP32 operands, so the kernel's only
rounding beyond FP32 arithmetic is the final cast to BF16. On a GPU machine the same cases run natively.
Tolerance (_check): every element within one BF16 ulp of the reference (2^-7 |ref|) plus a sliver of the
output's scale, and a relative L2 error at most 1.5x that of casting the reference itself to BF16 the way the
device does. The interpreter truncates (its error is then 1.00x the truncated reference's, and 2x a
round-to-nearest cast's, so that is the wrong yardstick here); the GPU rounds to nearest and also rounds P to BF16
for the PV dot: a CPU emulation of that at the 30B shape gave 1.3-1.4x and needed 1.4e-3 of slack, so the GPU
bounds are 2x and 4e-3. Dropping or adding one key, or a missed rescale, fails both by far.
GPU (marker `gpu`): the Qwen3-30B-A3B shape (Hq 32, Hkv 4, D 128) and 235B's Hq 64, L = 4096, B = 1, 8, 64.
"""

import pytest
import torch
import triton

from kernels.attention_reference import cache_attention_reference
from kernels.decode_attention import (
    NewKV,
    active_splits,
    decode_attention,
    default_num_splits,
    default_num_stages,
    new_kv_pays,
    workspace_shape,
)
from kernels.qk_norm_rope import qk_norm_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = triton.knobs.runtime.interpret


def _problem(B, Hq, Hkv, D, N, L, positions, slots, seed=0, idx_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, Hq, D, generator=gen).bfloat16()
    k = torch.randn(N, L, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(N, L, Hkv, D, generator=gen).bfloat16()
    slots = torch.tensor(slots, dtype=idx_dtype)
    positions = torch.tensor(positions, dtype=idx_dtype).view(B, 1)
    return tuple(t.to(DEVICE) for t in (q, k, v, slots, positions))


def _cast_bf16(x):
    if INTERPRET:  # truncation toward zero, as the interpreter casts
        return (x.view(torch.int32) & -65536).view(torch.float32)
    return x.bfloat16().float()


def _check(out, ref):
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out, scale = out.float(), ref.abs().max().item()
    slack, factor = (1e-4, 1.5) if INTERPRET else (4e-3, 2.0)
    err = (out - ref).abs()
    assert (err <= 2**-7 * ref.abs() + slack * scale).all(), f"max err {err.max().item():.3g} at scale {scale:.3g}"
    rel = ((out - ref).norm() / ref.norm()).item()
    rel_cast = ((_cast_bf16(ref) - ref).norm() / ref.norm()).item()
    assert rel <= factor * rel_cast + 1e-5, f"relative L2 error {rel:.3g}, BF16 cast of the reference {rel_cast:.3g}"


CASES = {  # B, Hq, Hkv, D, N (last = scratch), L, positions, slots
    "g2_L37": (5, 4, 2, 32, 4, 37, [0, 36, 17, 5, 36], [2, 0, 3, 0, 3]),
    "g8_L100": (4, 8, 1, 16, 3, 100, [99, 0, 64, 63], [1, 0, 2, 1]),
    "g16_L100": (3, 16, 1, 16, 3, 100, [37, 99, 70], [0, 2, 1]),
    "g2_L300": (3, 4, 2, 32, 3, 300, [299, 150, 200], [1, 0, 2]),
}
SPLITS = {"g2_L37": [1, 2, 3, None], "g8_L100": [1, 4], "g16_L100": [2], "g2_L300": [1, 2, 3]}


@pytest.mark.parametrize("case,num_splits", [(c, s) for c in CASES for s in SPLITS[c]])
def test_matches_reference(case, num_splits):
    args = _problem(*CASES[case], seed=len(case) + (num_splits or 0))
    _check(decode_attention(*args, num_splits=num_splits), cache_attention_reference(*args))


def test_scale_and_position_edges():
    # positions >= L read the whole slot (as the reference does); a negative position has no keys: out is 0.
    q, k, v, slots, positions = _problem(3, 4, 2, 32, 3, 70, [75, 3, -1], [0, 2, 1], seed=3)
    out = decode_attention(q, k, v, slots, positions, scale=0.3, num_splits=2)
    _check(out[:2], cache_attention_reference(q[:2], k, v, slots[:2], positions[:2], scale=0.3))
    assert (out[2] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_garbage_past_length_does_not_leak(num_splits):
    B, Hq, Hkv, D, N, L = 4, 4, 2, 32, 5, 100
    pos = [0, 99, 63, 64]
    q, k, v, slots, positions = _problem(B, Hq, Hkv, D, N, L, pos, [3, 1, 4, 0], seed=7)
    past = torch.zeros(N, L, dtype=torch.bool, device=DEVICE)  # unused slot 2 is garbage throughout
    past[2] = True
    for s, p in zip(slots.tolist(), pos, strict=True):
        past[s, p + 1:] = True
    big_k, big_v = k.clone(), v.clone()
    big_k[past], big_v[past] = 1e4, -1e4
    ref = cache_attention_reference(q, big_k, big_v, slots, positions)
    _check(decode_attention(q, big_k, big_v, slots, positions, num_splits=num_splits), ref)
    k[past], v[past] = float("nan"), float("nan")
    _check(decode_attention(q, k, v, slots, positions, num_splits=num_splits), ref)


@pytest.mark.parametrize("slots_dtype,positions_dtype", [(torch.int32, torch.int32), (torch.int32, torch.int64),
                                                         (torch.int64, torch.int32)])
def test_index_dtypes(slots_dtype, positions_dtype):
    q, k, v, slots, positions = _problem(3, 4, 2, 32, 3, 40, [39, 0, 20], [2, 0, 1], seed=11)
    slots, positions = slots.to(slots_dtype), positions.to(positions_dtype)
    _check(decode_attention(q, k, v, slots, positions, num_splits=2),
           cache_attention_reference(q, k, v, slots, positions))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_buffers_reused_bit_identical(num_splits):
    args = _problem(3, 8, 1, 16, 3, 100, [99, 10, 64], [1, 2, 0], seed=13)
    q = args[0]
    out = torch.full_like(q, float("nan"))
    ws = torch.full(workspace_shape(3, 8, 16, num_splits), float("nan"), device=DEVICE)
    first = decode_attention(*args, num_splits=num_splits, out=out, workspace=ws)
    assert first.data_ptr() == out.data_ptr()
    first = first.clone()
    _check(first, cache_attention_reference(*args))
    second = decode_attention(*args, num_splits=num_splits, out=out, workspace=ws)
    assert torch.equal(first.view(torch.int16), second.view(torch.int16))
    assert torch.equal(first.view(torch.int16), decode_attention(*args, num_splits=num_splits).view(torch.int16))


def test_default_num_splits_is_a_function_of_shapes():
    assert default_num_splits(33, 4, 40960) == 1  # B * Hkv = 132 programs fill the SMs
    assert default_num_splits(64, 4, 40960) == 1
    assert default_num_splits(32, 4, 40960) == 1  # else at most one program per SM
    assert default_num_splits(1, 4, 40960) == 33
    assert default_num_splits(8, 4, 4096) == 4
    assert default_num_splits(1, 4, 1024) == 16  # capped: one block of 64 keys per split of a full slot
    assert default_num_splits(1, 4, 100) == 1
    assert default_num_splits(0, 4, 40960) == 132  # an empty batch: no division by zero, nothing launches


@pytest.mark.parametrize("num_splits", [3, 7])
def test_active_splits_are_the_splits_the_kernel_writes(num_splits):
    """The host count of splits holding partials matches the workspace rows the split kernel writes (the rest keep
    their NaN), at row lengths inside one block, across blocks and filling every split."""
    lengths = [5, 130, 300, 448]
    q, k, v, slots, positions = _problem(4, 2, 1, 16, 5, 448, [n - 1 for n in lengths], [0, 1, 2, 3], seed=num_splits)
    ws = torch.full(workspace_shape(4, 2, 16, num_splits), float("nan"), device=DEVICE)
    decode_attention(q, k, v, slots, positions, num_splits=num_splits, workspace=ws)
    written = (~ws[:, 0, :, 0].isnan()).sum(dim=1).tolist()
    assert written == [active_splits(n, num_splits) for n in lengths]
    assert active_splits(1025, 33) == 17 and active_splits(0, 4) == 1


def test_empty_batch_returns_empty_out():
    q, k, v, slots, positions = _problem(1, 4, 2, 32, 3, 40, [3], [0])
    out = decode_attention(q[:0], k, v, slots[:0], positions[:0])
    assert out.shape == (0, 1, 4, 32) and out.dtype == torch.bfloat16


def test_default_num_stages_deepens_grids_of_at_most_one_program_per_sm():
    assert default_num_stages(33, 4, 1) == 3 and default_num_stages(32, 4, 1) == 3
    assert default_num_stages(1, 4, 33) == 3 and default_num_stages(8, 4, 4) == 3
    assert default_num_stages(64, 4, 1) == 2  # 256 programs share SMs
    assert default_num_stages(32, 4, 5) == 2 and default_num_stages(1, 4, 132) == 2


def _fused_problem(B, Hq, Hkv, D, N, L, positions, slots, seed):
    """Raw projections (views of one qkv buffer, as the model's), q/k norm weights, RoPE table and a random cache."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, 1, Hq + 2 * Hkv, D, generator=gen) * 3).bfloat16()
    k_cache, v_cache = (torch.randn(N, L, Hkv, D, generator=gen).bfloat16() for _ in range(2))
    q_w, k_w = ((1 + 0.3 * torch.randn(D, generator=gen)).bfloat16() for _ in range(2))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    qkv, k_cache, v_cache, q_w, k_w, inv_freq = (t.to(DEVICE) for t in (qkv, k_cache, v_cache, q_w, k_w, inv_freq))
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=2)
    idx = (torch.tensor(slots, device=DEVICE), torch.tensor(positions, device=DEVICE).view(B, 1))
    return q, k, v, k_cache, v_cache, NewKV(k, v, q_w, k_w, 1e-6, inv_freq), idx


@pytest.mark.parametrize("case,num_splits", [("g2_L37", None), ("g2_L37", 3), ("g8_L100", 4), ("g16_L100", 2),
                                             ("g2_L300", 1)])
def test_fused_norm_rope_matches_the_two_launches(case, num_splits):
    """new_kv: the q/k norm + RoPE and the cache write inside the attention launch, against qk_norm_rope then
    decode_attention on the same raw projections. Rows on distinct slots (a decode batch's live sequences; the
    engine's padding rows share the scratch slot, and their outputs are discarded): the cache comes out identical
    (the new keys within one BF16 step, see the kernel's docstring; here none differed), and out within the
    reference tolerance, of keys at position 0 (only the new key), mid-slot and at L - 1."""
    B, Hq, Hkv, D, N, L, positions, _ = CASES[case]
    positions = [0, L - 1, L // 2, 5, 17][:B]
    slots = list(range(B))  # N = B + 1 or more in every case: the last slot untouched
    q, k, v, k_cache, v_cache, new_kv, (slots, positions) = _fused_problem(B, Hq, Hkv, D, max(N, B + 1), L,
                                                                              positions, slots, seed=len(case))
    k_two, v_two = k_cache.clone(), v_cache.clone()
    q_out = qk_norm_rope(q, k, v, new_kv.q_weight, new_kv.k_weight, new_kv.eps, new_kv.inv_freq, positions, slots,
                         k_two, v_two)
    want = cache_attention_reference(q_out, k_two, v_two, slots, positions)
    out = decode_attention(q, k_cache, v_cache, slots, positions, num_splits=num_splits, new_kv=new_kv)
    steps = (k_cache.view(torch.int16).int() - k_two.view(torch.int16).int()).abs()
    assert torch.equal(v_cache, v_two) and steps.max() <= 1 and steps.float().mean() < 1e-3
    _check(out, want)


def test_fused_norm_rope_edges_and_errors():
    """A negative position has no keys (out 0, nothing written); a position past L reads the whole slot and
    writes nothing, as qk_norm_rope; the raw views' strides and the norm arguments are checked."""
    q, k, v, k_cache, v_cache, new_kv, (slots, positions) = _fused_problem(3, 4, 2, 32, 4, 40, [-1, 45, 7],
                                                                           [0, 1, 2], seed=3)
    before = k_cache.clone()
    out = decode_attention(q, k_cache, v_cache, slots, positions, num_splits=2, new_kv=new_kv)
    assert (out[0] == 0).all()
    changed = (k_cache != before).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[2, 7]]  # slot 2, position 7: the only in-range new key
    k_two = k_cache.clone()
    q_out = qk_norm_rope(q, k, v, new_kv.q_weight, new_kv.k_weight, new_kv.eps, new_kv.inv_freq, positions, slots,
                         k_two, v_cache.clone())
    _check(out[1:], cache_attention_reference(q_out[1:], k_two, v_cache, slots[1:], positions[1:]))
    with pytest.raises(TypeError, match="new_kv.k must be a torch.bfloat16 tensor"):
        decode_attention(q, k_cache, v_cache, slots, positions, new_kv=new_kv._replace(k=k.float()))
    with pytest.raises(ValueError, match="new_kv.v's row stride"):
        decode_attention(q, k_cache, v_cache, slots, positions, new_kv=new_kv._replace(v=v.contiguous()))
    with pytest.raises(ValueError, match="new_kv.k_weight must have shape"):
        decode_attention(q, k_cache, v_cache, slots, positions, new_kv=new_kv._replace(k_weight=new_kv.k_weight[:4]))
    with pytest.raises(ValueError, match="new_kv.eps must be a non-negative number"):
        decode_attention(q, k_cache, v_cache, slots, positions, new_kv=new_kv._replace(eps=-1.0))
    with pytest.raises(ValueError, match="q must be a bfloat16 view with contiguous heads"):
        decode_attention(q.transpose(2, 3), k_cache, v_cache, slots, positions, new_kv=new_kv)


def test_new_kv_pays_up_to_about_two_programs_per_sm():
    assert new_kv_pays(1, 4, 1025) and new_kv_pays(4, 4, 1025)  # 64 programs (16 splits) and 128 (8)
    assert new_kv_pays(8, 4, 1025) and new_kv_pays(32, 4, 1025)  # 128 (4 splits) and 128 (1)
    assert new_kv_pays(64, 4, 1025) and not new_kv_pays(128, 4, 1025)  # one split: 256 and 512
    assert new_kv_pays(1, 4, 16385)  # 33 splits of a long slot


def _bad(**kw):
    args = dict(zip(("q", "k", "v", "slots", "positions"),
                    _problem(2, 4, 2, 32, 3, 40, [3, 5], [0, 1]), strict=True))
    args.update(kw)
    return args


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(q=a["q"].float()), TypeError, "q must be a torch.bfloat16"),
    (lambda a: a.update(v=a["v"].half()), TypeError, "v_cache must be a torch.bfloat16"),
    (lambda a: a.update(q=a["q"].expand(2, 2, 4, 32).contiguous(), positions=a["positions"].expand(2, 2)
                        .contiguous()), ValueError, "S = 1"),
    (lambda a: a.update(q=a["q"][:, :, :3].contiguous()), ValueError, "not a multiple"),
    (lambda a: a.update(q=torch.cat([a["q"], a["q"]], dim=-1)[..., :32]), ValueError, "q must be contiguous"),
    (lambda a: a.update(out=torch.empty(2, 4, 32, dtype=torch.bfloat16, device=DEVICE)), ValueError, "out must"),
    (lambda a: a.update(out=torch.empty(2, 1, 4, 32, device=DEVICE)), TypeError, "out must"),
    (lambda a: a.update(num_splits=0), ValueError, "num_splits"),
    (lambda a: a.update(num_stages=0), ValueError, "num_stages must be an int in 1..6"),
    (lambda a: a.update(num_stages=2.0), ValueError, "num_stages"),
    (lambda a: a.update(num_splits=2, workspace=torch.empty(2, 4, 2, 32, device=DEVICE)), ValueError, "workspace"),
    (lambda a: a.update(slots=a["slots"].float()), ValueError, "slots must be int32"),
])
def test_bad_inputs(change, error, match):
    args = _bad()
    change(args)
    q, k, v, slots, positions = (args.pop(n) for n in ("q", "k", "v", "slots", "positions"))
    with pytest.raises(error, match=match):
        decode_attention(q, k, v, slots, positions, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [32, 64])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_qwen3_shapes_on_gpu(B, Hq):
    L, Hkv, D = 4096, 4, 128
    gen = torch.Generator().manual_seed(B)
    pos = torch.randint(0, L, (B,), generator=gen)
    pos[0] = L - 1
    slots = torch.randperm(B + 1, generator=gen)[:B]  # N = B + 1: the last is the scratch slot
    args = _problem(B, Hq, Hkv, D, B + 1, L, pos.tolist(), slots.tolist(), seed=B)
    ref = cache_attention_reference(*args)
    for num_splits in (None, 1, 16):
        _check(decode_attention(*args, num_splits=num_splits), ref)
    for num_stages in (1, 3, 4):  # the pipeline depth changes the schedule, never the result
        assert torch.equal(decode_attention(*args, num_stages=num_stages), decode_attention(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_fused_norm_rope_qwen3_30b_on_gpu(B):
    """new_kv at the 30B shape (Hq 32, Hkv 4, D 128, L 4096), default and forced splits, against the two launches."""
    L = 4096
    gen = torch.Generator().manual_seed(B)
    pos = torch.randint(0, L, (B,), generator=gen)
    pos[0] = L - 1
    slots = torch.randperm(B + 1, generator=gen)[:B].tolist()
    for num_splits in (None, 1, 16):
        q, k, v, k_cache, v_cache, new_kv, (s, p) = _fused_problem(B, 32, 4, 128, B + 1, L, pos.tolist(), slots, B)
        k_two, v_two = k_cache.clone(), v_cache.clone()
        q_out = qk_norm_rope(q, k, v, new_kv.q_weight, new_kv.k_weight, new_kv.eps, new_kv.inv_freq, p, s, k_two,
                             v_two)
        out = decode_attention(q, k_cache, v_cache, s, p, num_splits=num_splits, new_kv=new_kv)
        steps = (k_cache.view(torch.int16).int() - k_two.view(torch.int16).int()).abs()
        assert torch.equal(v_cache, v_two) and steps.max() <= 1
        _check(out, cache_attention_reference(q_out, k_two, v_two, s, p))
