"""Hugging Face tensor names -> where each lives in Qwen3MoE: the one mapping checkpoint loading and weight sync share.

A name is parsed once, by splitting on dots and one dict lookup, into a target:
    Dense     a non-expert parameter (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, ...)
    Experts   rows of one layer's fused expert tensor, w13 [E, 2I, H] (gate rows, then up) or w2 [E, H, I]:
                Hub layout    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight   one expert's [I, H] / [H, I]
                fused layout  model.layers.N.mlp.experts.{gate_up_proj,down_proj}       every expert at once
    TiedHead  `lm_head.weight` of a model whose head is its embedding (some exporters write it anyway)
Anything else raises, naming the tensor. The fused layout is transformers 5's in-memory one; trainers export
either, so both the loader and the sync receiver take both, and `ExpertCoverage` keeps track of which rows of a
layer an update (or a checkpoint) has filled, refusing duplicates and a layer that mixes the two layouts.
Parsing is linear in the number of names: Qwen3-30B-A3B has about 18k expert tensors, and a search over names per
tensor is what makes other loaders and syncs take minutes. A WeightNames also remembers every name it has mapped, so
that a worker holding one across syncs (composer_rollout.sync.receiver) pays a dict lookup per tensor, not a parse:
the trainer pushes the same ~18.9k names every sync, and the parse was a few µs of each one's staging.
"""

from dataclasses import dataclass

from composer_rollout.model.args import ModelArgs

PROJS = ("gate_proj", "up_proj", "down_proj")
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_fields(name: str) -> tuple[int, list[str]] | None:
    """(layer, the fields after "experts") of a name under model.layers.L.mlp.experts, else None."""
    f = name.split(".")
    if f[:2] == ["model", "layers"] and f[3:5] == ["mlp", "experts"] and f[2].isdigit():
        return int(f[2]), f[5:]
    return None


def hub_expert(rest: list[str]) -> tuple[int, str] | None:
    """(expert, projection) of a per-expert (Hub-layout) tensor from expert_fields' rest ([e, proj, "weight"])."""
    if len(rest) == 3 and rest[0].isdigit() and rest[1] in PROJS and rest[2] == "weight":
        return int(rest[0]), rest[1]
    return None


@dataclass(frozen=True)
class Dense:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Experts:
    """Rows `rows` of expert `expert` (None: every expert) of layer `layer`'s `which` ("w13" or "w2")."""

    layer: int
    which: str
    expert: int | None
    rows: slice
    parts: tuple[str, ...]  # the projections this tensor fills
    shape: tuple[int, ...]  # the Hugging Face tensor's shape

    @property
    def layout(self) -> str:
        return "fused" if self.expert is None else "hub"


@dataclass(frozen=True)
class TiedHead:
    name: str


Target = Dense | Experts | TiedHead


class WeightNames:
    """The name -> target map of one model shape; `dense_shapes` maps every non-expert HF name to its shape."""

    def __init__(self, args: ModelArgs, dense_shapes: dict[str, tuple[int, ...]]):
        self.args, self.dense_shapes = args, dense_shapes
        self.E, self.I, self.H = args.num_experts, args.moe_intermediate_size, args.hidden_size
        self.num_layers = args.num_hidden_layers
        self._targets: dict[str, Target] = {}  # names mapped so far; a name that raises is not kept

    @classmethod
    def of(cls, model) -> "WeightNames":
        """The map of a Qwen3MoE (duck-typed: this module sits below the model's)."""
        return cls(model.args, {n: tuple(p.shape) for n, p in model.hf_dense_weights().items()})

    def target(self, name: str) -> Target:
        target = self._targets.get(name)
        if target is None:
            target = self._targets[name] = self._parse(name)
        return target

    def _parse(self, name: str) -> Target:
        if name in self.dense_shapes:
            return Dense(name, self.dense_shapes[name])
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return TiedHead(name)
        fields = expert_fields(name)
        if fields is not None:
            layer, rest = fields
            if layer >= self.num_layers:
                raise ValueError(f"{name}: layer {layer} >= num_hidden_layers {self.num_layers}")
            return self._experts(name, layer, rest)
        raise ValueError(f"unexpected tensor {name!r} for {self.num_layers} Qwen3-MoE layers")

    def _experts(self, name: str, layer: int, rest: list[str]) -> Experts:
        E, I, H = self.E, self.I, self.H
        if len(rest) == 1 and rest[0] in FUSED:
            if rest[0] == "gate_up_proj":
                return Experts(layer, "w13", None, slice(0, 2 * I), FUSED[rest[0]], (E, 2 * I, H))
            return Experts(layer, "w2", None, slice(0, H), FUSED[rest[0]], (E, H, I))
        hub = hub_expert(rest)
        if hub is not None:
            expert, proj = hub
            if expert >= E:
                raise ValueError(f"{name}: expert {expert} >= num_experts {E}")
            if proj == "down_proj":
                return Experts(layer, "w2", expert, slice(0, H), ("down_proj",), (H, I))
            rows = slice(0, I) if proj == "gate_proj" else slice(I, 2 * I)
            return Experts(layer, "w13", expert, rows, (proj,), (I, H))
        raise ValueError(f"{name}: unexpected expert tensor name")


def check_shape(name: str, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name}: shape {tuple(shape)}, expected {tuple(expected)}")


class ExpertCoverage:
    """Which (projection, expert) pairs of one layer have been filled, and in which layout."""

    def __init__(self, layer: int, num_experts: int):
        self.layer, self.E = layer, num_experts
        self.layout: str | None = None
        self.filled: set[tuple[str, int]] = set()

    def add(self, name: str, t: Experts) -> None:
        """Record `t`; a second layout in one layer, or a (projection, expert) filled twice, raises naming `name`."""
        if self.layout not in (None, t.layout):
            raise ValueError(f"{name}: layer {self.layer} mixes the Hub (per-expert) and fused expert layouts")
        self.layout = t.layout
        if t.expert is not None:  # one (projection, expert) pair, ~18k of them per sync: no set built per tensor
            key = (t.parts[0], t.expert)
            if key in self.filled:
                raise ValueError(f"{name}: appears twice in the update")
            self.filled.add(key)
            return
        keys = {(p, e) for p in t.parts for e in range(self.E)}
        if keys & self.filled:
            raise ValueError(f"{name}: appears twice in the update")
        self.filled |= keys

    def complete(self, which: str | None = None) -> bool:
        parts = PROJS if which is None else ("down_proj",) if which == "w2" else ("gate_proj", "up_proj")
        return all((p, e) in self.filled for p in parts for e in range(self.E))

    def missing(self) -> list[str]:
        """Names of the tensors still missing, in this layer's layout (the Hub layout when nothing came)."""
        prefix = f"model.layers.{self.layer}.mlp.experts"
        if self.layout == "fused":
            return [f"{prefix}.{fused}" for fused, parts in FUSED.items()
                    if not all((p, e) in self.filled for p in parts for e in range(self.E))]
        return [f"{prefix}.{e}.{p}.weight" for e in range(self.E) for p in PROJS if (p, e) not in self.filled]
