"""Checkpoint I/O: our saves read back here and in transformers, and every bad checkpoint names its fault."""

import json

import pytest
import torch
from hf_models import hf_logits, make_hf_model
from safetensors.torch import load_file, save_file
from test_model_parity import our_logits, prompt, rel_err
from transformers import Qwen3MoeForCausalLM

from composer_rollout.model import Qwen3MoE, load_checkpoint, preset, save_checkpoint


@pytest.fixture
def hf_dir(tmp_path):
    hf = make_hf_model(seed=11)
    hf.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def rewrite(src, dst, edit_state=None, edit_config=None):
    """A copy of checkpoint `src` at `dst` with its tensors and/or config.json edited."""
    dst.mkdir()
    state = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_state:
        edit_state(state)
    if edit_config:
        edit_config(config)
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_save_then_load_here_and_in_transformers(tmp_path):
    ours = Qwen3MoE(preset("tiny"), dtype=torch.float32).init_random(seed=3)
    save_checkpoint(ours, tmp_path / "ck", dtype=torch.float32, max_shard_bytes=200_000)
    assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    names = set(json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.1.mlp.experts.11.down_proj.weight" in names  # the Hub layout, one tensor per expert
    again = load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    for (name, a), (_, b) in zip(ours.hf_dense_weights().items(), again.hf_dense_weights().items(), strict=True):
        assert torch.equal(a, b), name
    for layer in range(ours.args.num_hidden_layers):
        for a, b in zip(ours.experts(layer), again.experts(layer), strict=True):
            assert torch.equal(a, b)
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32, attn_implementation="eager")
    ids = prompt(7, 19, ours.args.vocab_size)
    assert rel_err(our_logits(ours, ids), hf_logits(hf, ids)) <= 1e-5


def test_mxfp8_model_saves_its_exact_values(tmp_path):
    ours = Qwen3MoE(preset("tiny"), dtype=torch.float32, weight_dtype="mxfp8").init_random(seed=4)
    save_checkpoint(ours, tmp_path / "ck")  # BF16 holds every MXFP8 value exactly
    again = load_checkpoint(tmp_path / "ck", dtype=torch.float32, weight_dtype="mxfp8")
    for layer in range(ours.args.num_hidden_layers):
        for a, b in zip(ours.experts(layer), again.experts(layer), strict=True):
            assert torch.equal(a.dequantize(), b.dequantize())


def test_missing_tensor_is_named(hf_dir, tmp_path):
    bad = rewrite(hf_dir, tmp_path / "bad", lambda s: s.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_checkpoint(bad)


def test_missing_expert_is_named(hf_dir, tmp_path):
    bad = rewrite(hf_dir, tmp_path / "bad", lambda s: s.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"layer 0"):
        load_checkpoint(bad)


def test_wrong_shape_is_named(hf_dir, tmp_path):
    def edit(s):
        s["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.randn(64, 31)

    with pytest.raises(ValueError, match=r"experts\.2\.down_proj\.weight: shape \(64, 31\), expected \(64, 32\)"):
        load_checkpoint(rewrite(hf_dir, tmp_path / "bad", edit))


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    def edit(s):
        s["model.layers.5.self_attn.q_proj.weight"] = torch.randn(4, 4)

    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.5\.self_attn\.q_proj\.weight'"):
        load_checkpoint(rewrite(hf_dir, tmp_path / "bad", edit))


def test_mixed_expert_layouts_are_rejected(hf_dir, tmp_path):
    def edit(s):
        s["model.layers.0.mlp.experts.down_proj"] = torch.randn(6, 64, 32)

    with pytest.raises(ValueError, match="mixes the Hub"):
        load_checkpoint(rewrite(hf_dir, tmp_path / "bad", edit))


@pytest.mark.parametrize("field,value,match", [
    ("architectures", ["LlamaForCausalLM"], "not Qwen3-MoE"),
    ("hidden_size", None, "hidden_size"),
    ("mlp_only_layers", [0], "mlp_only_layers"),
    ("num_experts_per_tok", 99, "num_experts_per_tok"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope type 'yarn'"),
])
def test_bad_config_is_named(hf_dir, tmp_path, field, value, match):
    def edit(c):
        if value is None:
            c.pop(field)
        else:
            c[field] = value
        if field == "architectures":
            c["model_type"] = "llama"

    with pytest.raises(ValueError, match=match) as err:
        load_checkpoint(rewrite(hf_dir, tmp_path / "bad", edit_config=edit))
    assert "config.json" in str(err.value)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


def test_eos_tokens_from_config_and_generation_config(hf_dir, tmp_path):
    ck = rewrite(hf_dir, tmp_path / "ck", edit_config=lambda c: c.update(eos_token_id=5))
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    assert load_checkpoint(ck).args.eos_token_id == (5, 7)
