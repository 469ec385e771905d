"""Our Qwen3-MoE against transformers' on the same checkpoint: FP32 logits and greedy generations.

transformers builds, initialises and saves random Qwen3MoeForCausalLM models; we load the files
and compare. Covers norm_topk_prob on and off, tied and untied embeddings, both expert layouts,
MXFP8 experts (against transformers running the dequantized weights), CPU and, when there is one,
CUDA; the BF16 error against FP32 is reported.
"""

import pytest
import torch
from hf_models import hf_greedy, hf_logits, make_hf_model
from safetensors.torch import save_file

from composer_rollout import RolloutEngine, SamplingParams
from composer_rollout.model import load_checkpoint
from kernels import mxfp8_quantize

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_kv_cache(1, len(ids))
    t = torch.tensor([ids], device=model.device)
    hidden = model(t, torch.arange(len(ids), device=model.device)[None], torch.tensor([0], device=model.device), cache)
    return model.compute_logits(hidden[0]).cpu()


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_topk_prob,tie", [(True, False), (False, True), (True, True), (False, False)])
def test_fp32_logits_and_greedy_match_transformers(tmp_path, device, norm_topk_prob, tie):
    hf = make_hf_model(seed=int(norm_topk_prob) * 2 + int(tie), norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float32, device=device)
    ids = prompt(1, 37, hf.config.vocab_size)
    err = rel_err(our_logits(ours, ids), hf_logits(hf, ids))
    assert err <= 1e-5, f"FP32 logits differ from transformers by {err:.2e}"

    engine = RolloutEngine(ours, max_num_seqs=2, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    got = engine.generate([ids[:9]], greedy)[0].token_ids
    assert got == hf_greedy(hf, ids[:9], 12)


def test_fused_expert_layout_loads(tmp_path):
    """transformers 5 holds experts fused in memory; a checkpoint written from that state dict loads too."""
    hf = make_hf_model(seed=5)
    hf.save_pretrained(tmp_path / "hub")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    ids = prompt(2, 21, hf.config.vocab_size)
    ref = hf_logits(hf, ids)
    for layout in ("hub", "fused"):
        err = rel_err(our_logits(load_checkpoint(tmp_path / layout, dtype=torch.float32), ids), ref)
        assert err <= 1e-5, f"{layout}: {err:.2e}"


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model(seed=6)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = prompt(3, 17, hf.config.vocab_size)
    assert rel_err(our_logits(load_checkpoint(tmp_path, dtype=torch.float32), ids), hf_logits(hf, ids)) <= 1e-5


def test_mxfp8_experts_match_transformers_on_dequantized_weights(tmp_path):
    hf = make_hf_model(seed=7)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float32, weight_dtype="mxfp8")
    with torch.no_grad():
        for layer in hf.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(mxfp8_quantize(p).dequantize())
    ids = prompt(4, 29, hf.config.vocab_size)
    assert rel_err(our_logits(ours, ids), hf_logits(hf, ids)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_error_against_fp32_is_reported(tmp_path, device, capsys):
    """BF16 error is reported per token: one near-tie in the router (top-k flips under BF16 rounding) moves a
    whole token, so the median over tokens is what is compared, against transformers' own BF16 run."""
    hf = make_hf_model(seed=8)
    hf.save_pretrained(tmp_path)
    ids = prompt(5, 48, hf.config.vocab_size)
    ref = hf_logits(hf, ids)
    ours = our_logits(load_checkpoint(tmp_path, dtype=torch.bfloat16, device=device), ids)
    theirs = hf_logits(hf.to(device=device, dtype=torch.bfloat16), ids).cpu()

    def per_token(x):
        return ((x.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).median().item()

    with capsys.disabled():
        print(f"\n[{device}] BF16 logits vs FP32 transformers, relative error: ours {rel_err(ours, ref):.2e} "
              f"(median per token {per_token(ours):.2e}), transformers in BF16 {rel_err(theirs, ref):.2e} "
              f"(median {per_token(theirs):.2e})")
    assert per_token(ours) < 3e-2
