"""Hugging Face checkpoint directories in and out: config.json plus safetensors, single or sharded.

Two expert layouts exist and both load:
    Hub layout     model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight   [I, H], [I, H], [H, I]
    fused layout   model.layers.N.mlp.experts.gate_up_proj [E, 2I, H], ...down_proj [E, H, I]  (transformers 5)
Saving writes the Hub layout, which every tool reads.

Every tensor name is parsed once (composer_rollout.model.weight_names, the mapping weight sync
shares) and placed by dict lookup, so a load is linear in the number of tensors (Qwen3-30B-A3B has
about 18k expert tensors; a search over names per tensor is what made other loaders take a minute).
A layer's experts are assembled into one dense [E, 2I, H] / [E, H, I] pair and handed to the model
(which quantizes them when MXFP8) as soon as the last of them arrives, so at most the layers still
in flight are held dense.
Every problem (missing, unexpected, duplicate or misshapen tensor, bad config) raises naming it.
"""

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from composer_rollout.model.args import ModelArgs, from_hf_config
from composer_rollout.model.qwen3_moe import Qwen3MoE
from composer_rollout.model.weight_names import Dense, ExpertCoverage, Experts, WeightNames, check_shape
from kernels import as_dense


def read_args(path: str | Path) -> ModelArgs:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    args = from_hf_config(json.loads(config.read_text()), source=str(config))
    # Chat checkpoints list more end tokens in generation_config.json (Qwen3: <|im_end|> and <|endoftext|>).
    gen_config = Path(path) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        args = replace(args, eos_token_id=tuple(dict.fromkeys([*args.eos_token_id, *map(int, eos)])))
    return args


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: shard {missing[0]} is listed but not present")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


class _ExpertAssembler:
    """Collects one layer's expert tensors (either layout) into dense w13/w2; hands the layer over when complete."""

    def __init__(self, model: Qwen3MoE):
        self.model, a = model, model.args
        self.E, self.I, self.H = a.num_experts, a.moe_intermediate_size, a.hidden_size
        self.parts: dict[int, dict] = {}
        self.coverage: dict[int, ExpertCoverage] = {}

    def _layer(self, layer: int) -> dict:
        if layer not in self.parts:
            self.parts[layer] = {"w13": torch.empty(self.E, 2 * self.I, self.H, dtype=self.model.dtype,
                                                    device=self.model.device),
                                 "w2": torch.empty(self.E, self.H, self.I, dtype=self.model.dtype,
                                                   device=self.model.device)}
            self.coverage[layer] = ExpertCoverage(layer, self.E)
        return self.parts[layer]

    def add(self, name: str, target: Experts, tensor_fn) -> None:
        part = self._layer(target.layer)
        coverage = self.coverage[target.layer]
        coverage.add(name, target)
        t = tensor_fn()
        check_shape(name, t.shape, target.shape)
        experts = slice(None) if target.expert is None else target.expert
        part[target.which][experts, target.rows].copy_(t)
        if coverage.complete():
            self.model.set_experts(target.layer, part.pop("w13"), part.pop("w2"))

    def incomplete(self) -> list[int]:
        return [layer for layer in range(self.model.args.num_hidden_layers)
                if layer not in self.coverage or not self.coverage[layer].complete()]


def load_checkpoint(path: str | Path, *, dtype=torch.bfloat16, device="cpu", weight_dtype="bf16",
                    kernel="torch", dense="torch") -> Qwen3MoE:
    path = Path(path)
    args = read_args(path)
    model = Qwen3MoE(args, dtype=dtype, device=device, weight_dtype=weight_dtype, kernel=kernel, dense=dense)
    dense = model.hf_dense_weights()
    names = WeightNames.of(model)
    filled: set[str] = set()
    experts = _ExpertAssembler(model)
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in filled:
                    raise ValueError(f"{name}: appears twice in the checkpoint")
                filled.add(name)
                try:
                    target = names.target(name)
                except ValueError as e:
                    raise ValueError(f"{file.name}: {e}") from None
                if isinstance(target, Experts):
                    experts.add(name, target, lambda name=name: f.get_tensor(name))
                elif isinstance(target, Dense):
                    t = f.get_tensor(name)
                    check_shape(name, t.shape, target.shape)
                    dense[name].copy_(t)
                # else TiedHead: some exporters write the tied head anyway; the embedding is the weight
    missing = [n for n in dense if n not in filled]
    if missing:
        raise ValueError(f"{path}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if experts.incomplete():
        layer = experts.incomplete()[0]
        raise ValueError(f"{path}: missing expert tensors in layer {layer} "
                         f"(model.layers.{layer}.mlp.experts.*)")
    return model


def hub_state_dict(model: Qwen3MoE, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor under its Hub-layout name, on the CPU in `dtype` (MXFP8 experts dequantized exactly)."""
    out = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.hf_dense_weights().items()}
    I = model.args.moe_intermediate_size
    for layer in range(model.args.num_hidden_layers):
        w13, w2 = (as_dense(w, dtype).cpu() for w in model.experts(layer))
        for e in range(model.args.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            out[f"{prefix}.gate_proj.weight"] = w13[e, :I].clone()
            out[f"{prefix}.up_proj.weight"] = w13[e, I:].clone()
            out[f"{prefix}.down_proj.weight"] = w2[e].clone()
    return out


def save_checkpoint(model: Qwen3MoE, path: str | Path, *, dtype=torch.bfloat16, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and safetensors in the Hub layout, sharded with an index past max_shard_bytes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.args.to_hf_dict(), indent=2))
    state = hub_state_dict(model, dtype)
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
