"""The model on the Triton dense backend (fused RMSNorm + residual, q/k-norm + RoPE + cache write, prefill and decode
attention, router top-k) against the torch one (the reference ops, math SDPA), on the same weights; and the engine's
decode steps replayed from CUDA graphs against eager steps (GPU only: graphs need CUDA).

On CPU the kernels run in Triton's interpreter: the tiny preset, the torch MoE path, short generations.
"""

import pytest
import torch

from composer_rollout import RolloutEngine, SamplingParams
from composer_rollout.config import EngineConfig
from composer_rollout.engine.capture import ExpertCapture
from composer_rollout.model import Packed, Qwen3MoE, preset
from composer_rollout.model.checkpoint import hub_state_dict
from jobs.bench_decode import fp32_twin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def model(dense: str, kernel: str = "torch", layers: int = 1, dtype=torch.bfloat16, seed: int = 5) -> Qwen3MoE:
    args = preset("tiny", num_hidden_layers=layers)
    m = Qwen3MoE(args, dtype=dtype, device=DEVICE, weight_dtype="mxfp8", kernel=kernel, dense=dense)
    return m.init_random(seed=seed, std=0.08)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("chunk", [2048, 5])
def test_triton_dense_backend_matches_torch(chunk):
    ps = prompts(3, [11, 4])
    fast = RolloutEngine(model("triton"), max_num_seqs=4, max_model_len=40, max_prefill_tokens=chunk)
    ref = RolloutEngine(model("torch"), max_num_seqs=4, max_model_len=40)
    results = fast.generate(ps, SamplingParams(temperature=0.9, max_tokens=3, n=2, seed=4))
    rows, completions = [ps[r.prompt_index] for r in results], [r.token_ids for r in results]
    got = torch.tensor([r.logprobs for r in results])
    want = torch.tensor(ref.score(rows, completions, temperature=0.9))
    # Teacher-forced on the same tokens the backends differ by BF16 rounding only (FP32 softmax and RoPE in the
    # kernels, BF16 scores in math SDPA, BF16 RoPE in torch).
    assert (got - want).abs().max() < 0.05, (got - want).abs().max()
    assert torch.allclose(torch.tensor(fast.score(rows, completions, temperature=0.9)), got, atol=0.02)


@pytest.mark.parametrize("dense", ["torch", "triton"])
def test_packed_prompts_equal_one_forward_each(dense):
    """Three prompts back to back in one row (model.Packed, as the engine prefills whole prompts) against one forward
    per prompt: the same final hidden states (to BF16 rounding: the MoE and projections see other token counts)
    and the same keys and values in each prompt's slot; a packing that does not tile the row is refused."""
    m = model(dense, layers=2)
    ps, slots = prompts(7, [6, 1, 9]), [2, 0, 1]
    alone_cache, packed_cache = m.new_kv_cache(3, 16), m.new_kv_cache(3, 16)
    with torch.inference_mode():
        alone = [m(torch.tensor([p], device=DEVICE), torch.arange(len(p), device=DEVICE)[None],
                   torch.tensor([s], device=DEVICE), alone_cache)[0] for p, s in zip(ps, slots, strict=True)]
        packed = Packed.of([len(p) for p in ps], slots, DEVICE)
        ids = torch.tensor([[t for p in ps for t in p]], device=DEVICE)
        positions = torch.tensor([[i for p in ps for i in range(len(p))]], device=DEVICE)
        got = m(ids, positions, torch.tensor(slots, device=DEVICE), packed_cache, packed=packed)[0]
        with pytest.raises(ValueError, match="must tile one row of 15 tokens"):
            m(ids[:, :15], positions[:, :15], torch.tensor(slots, device=DEVICE), packed_cache, packed=packed)
    want = torch.cat(alone).float()
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()
    for s, p in zip(slots, ps, strict=True):
        for a, b in ((alone_cache.k, packed_cache.k), (alone_cache.v, packed_cache.v)):
            assert torch.allclose(a[:, s, :len(p)].float(), b[:, s, :len(p)].float(), atol=2e-2, rtol=2e-2)
    assert not packed_cache.k[:, 3].any(), "the scratch slot was written"


@pytest.mark.parametrize("batch", [1, 2, 5, 12, 17])
def test_fused_add_norms_at_every_decode_batch(batch):
    """The triton backend runs each layer's add + RMSNorm inside the launch after it where the batch allows (the
    qkv projection's while it takes skinny_linear, from layer 1 on: up to 8 tokens at the tiny preset's 256 rows,
    2 at the 30B's; the router's, with its gate and top-k, up to moe.FUSED_ROUTER_MAX_T = 2; a separate rms_norm
    above, where the projections take skinny_gemm): a decode step at batches on each side of those limits, 3
    layers, against the FP32 twin of the same
    weights (jobs/bench_decode.fp32_twin) and the torch backend's BF16 numerics. A residual dropped or added twice
    moves the hidden states by O(1); the triton backend (FP32 stream, router logits and o_proj output) must also sit
    closer to FP32 than Hugging Face's numerics on average. (A token whose near-tied experts swap moves further: the
    max.)"""
    fast, ref = model("triton", layers=3), model("torch", layers=3)
    twin = fp32_twin(ref)
    ids = torch.randint(2, 512, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(DEVICE)
    pos = torch.zeros(batch, 1, dtype=torch.long, device=DEVICE)
    slots = torch.arange(batch, device=DEVICE)
    got, hf, exact = (m(ids, pos, slots, m.new_kv_cache(batch, 4)).float() for m in (fast, ref, twin))
    err, hf_err = (got - exact).abs(), (hf - exact).abs()
    assert err.max() < 0.1 * exact.abs().max(), (err.max(), exact.abs().max())
    assert err.mean() < hf_err.mean(), (err.mean(), hf_err.mean())


def test_triton_dense_backend_refuses_fp32_instead_of_falling_back():
    with pytest.raises(ValueError, match="dense backend 'triton' needs a bfloat16 model, got dtype torch.float32"):
        model("triton", dtype=torch.float32)
    fp32 = model("torch", dtype=torch.float32)
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        fp32.set_paths(dense="triton")
    assert fp32.dense == "torch" and not fp32.layers[0].fused


def test_unknown_dense_backend_and_cpu_graphs_are_refused():
    with pytest.raises(ValueError, match="dense backend 'flash' is unknown"):
        model("flash")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
            RolloutEngine(model("torch", kernel="warp_decode"), max_num_seqs=2, max_model_len=16, cuda_graphs=True)


@pytest.mark.gpu
def test_graphs_need_a_triton_moe_path():
    with pytest.raises(ValueError, match="cuda_graphs needs a Triton MoE path"):
        RolloutEngine(model("triton"), max_num_seqs=2, max_model_len=16, cuda_graphs=True)


@pytest.mark.parametrize("kernel", ["torch", "warp_decode"])
def test_graphs_by_default_wherever_they_can_run(kernel):
    """cuda_graphs=None (the jobs' default, EngineConfig): captured on a CUDA device with a Triton MoE path, eager
    on the CPU or with the torch path, never an error."""
    engine = RolloutEngine(model("triton", kernel=kernel, layers=1), max_num_seqs=2, max_model_len=16,
                           cuda_graphs=None)
    assert (engine.graphs is not None) == (DEVICE == "cuda" and kernel != "torch")
    assert EngineConfig().cuda_graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["warp_decode", "auto"])
def test_graph_replay_gives_the_eager_samples(kernel):
    ps = prompts(7, [30, 9, 17, 3, 12])
    sampling = SamplingParams(temperature=0.9, max_tokens=24, n=2, seed=3, return_routed_experts=True)
    eager = RolloutEngine(model("triton", kernel, layers=2), max_num_seqs=8, max_model_len=96)
    graphs = RolloutEngine(model("triton", kernel, layers=2), max_num_seqs=8, max_model_len=96, cuda_graphs=True)
    assert graphs.graphs.buckets == [1, 2, 4, 8] and graphs.graphs.capture_s > 0
    want, got = eager.generate(ps, sampling), graphs.generate(ps, sampling)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]  # the same kernels, replayed: bit-identical
    for a, b in zip(got, want, strict=True):
        assert (a.routed_experts == b.routed_experts).all()


@pytest.mark.gpu
def test_a_weight_update_reaches_the_captured_graphs():
    engine = RolloutEngine(model("triton", "auto", layers=2), max_num_seqs=4, max_model_len=64, cuda_graphs=True)
    new = model("triton", "auto", layers=2, seed=9)
    update = engine.begin_update(1)
    update.add_many(hub_state_dict(new).items())  # MXFP8 values survive BF16 and re-quantization exactly
    update.finalize()
    engine.apply_update(update)
    ps, sampling = prompts(8, [10, 6]), SamplingParams(temperature=0.0, max_tokens=12)
    want = RolloutEngine(new, max_num_seqs=4, max_model_len=64).generate(ps, sampling)
    assert [r.token_ids for r in engine.generate(ps, sampling)] == [r.token_ids for r in want]



@pytest.mark.parametrize("dense,tokens", [("torch", 5), ("triton", 2), ("triton", 5)])
def test_the_router_writes_the_capture_rows_of_its_layer(dense, tokens):
    """Every router fills ExpertCapture.layer(i) with the ids the experts were run with (the triton backend's in
    the top-k launch: router_gate_topk's with the add + norm up to moe.FUSED_ROUTER_MAX_T tokens, router_topk's
    above), and leaves the other layers' rows alone."""
    m = model(dense, layers=2)
    a, mlp = m.args, m.layers[1].mlp
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, a.hidden_size, generator=gen).bfloat16().to(DEVICE)
    capture = ExpertCapture(a.num_hidden_layers, tokens, a.num_experts_per_tok, a.num_experts, DEVICE)
    capture.ids.fill_(255)
    seen, run_experts = [], mlp.moe_fn

    def experts(flat, weights, ids, w13, w2):
        seen.append(ids.clone())
        return run_experts(flat, weights, ids, w13, w2)

    mlp.moe_fn = experts
    if dense == "triton":  # the decoder layer's call: the post-attention add + norm comes with the router
        residual = torch.randn(tokens, a.hidden_size, generator=gen).to(DEVICE)
        mlp.add_norm_forward(x, residual, m.layers[1].post_attention_layernorm, layer=1, capture=capture)
    else:
        mlp(x, layer=1, capture=capture)
    assert torch.equal(capture.layer(1).long(), seen[0]) and (capture.ids[0] == 255).all()
