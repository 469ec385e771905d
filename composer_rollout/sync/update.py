"""WeightUpdate: one engine's side of one weight update, staged as tensors arrive, validated whole, swapped in one go.

Staging is double-buffered: every tensor an update carries is written into a new buffer in the model's own layout
(dense parameters in the model dtype; experts into new fused w13/w2 tensors, re-quantized to MXFP8 when the model
keeps them so), never into the live weights. The engine keeps serving from the live weights meanwhile; `apply`
then swaps references between two engine steps, which cannot fail halfway. That costs a second copy of the weights
an update touches for as long as it is staged, and buys atomicity: a bad tensor, a missing one, or a trainer that
dies mid-push leaves the live weights untouched, whatever had already arrived. (A runner that captures CUDA graphs
needs the weights' addresses to stay put: it would copy the staged tensors into the live ones at `apply` instead,
~15 ms of HBM time at the 30B shape, still between two steps.)

What `add_many` checks as each tensor of a bucket arrives (raising `WeightSyncError` naming it, before anything is
written): the name is one of the model's (composer_rollout.model.weight_names, the loader's mapping), the tensor is
not a duplicate, the dtype is bfloat16, float16 or float32, the shape is the Hugging Face one. The tensors before a
refused one are staged, as if each had come through `add`. What `finalize` checks over the whole update: it is
complete (unless partial), and every value is finite. Finiteness costs no host sync per tensor: each staged dense
tensor's (min, max) goes into a row of one per-update buffer (NaN and inf survive a min or max), experts count their
non-finite blocks as they are quantized (composer_rollout.sync.requant, one launch per bucket), and `finalize` reads
both at once (a fused expert tensor's error also names the per-expert one with the first inf or NaN). Dense tensors
are checked in the model's dtype: a finite FP32 value that overflows it is refused too.

Partial updates (`partial=True`) carry any set of whole Hugging Face tensors; the rest keep their current values.
Experts may come per expert and projection: a layer touched partially starts from a copy of its live fused tensor
and only the rows that arrived are overwritten. MXFP8 blocks run along a row's input dimension, so quantizing some
rows gives exactly the bytes quantizing the whole tensor would have given them. Experts are quantized from the source
tensor as sent (a float32 source is not rounded to bfloat16 first).
"""

import threading
from contextlib import nullcontext

import torch

from composer_rollout.model.weight_names import Dense, ExpertCoverage, Experts, TiedHead, WeightNames
from composer_rollout.sync.requant import ExpertQuantizer, where_nonfinite
from kernels import MXFP8Tensor

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class WeightSyncError(ValueError):
    """A weight update was refused; the message names the tensor, the version or the worker."""


class StaleVersionError(WeightSyncError):
    """The update's version is not newer than the one being served."""


def check_version(version, current: int) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise WeightSyncError(f"weight version must be an int, got {version!r}")
    if version <= current:
        raise StaleVersionError(f"weight version {version} is not newer than the version being served ({current}); "
                                f"versions only increase")


def live_weights(model) -> dict[str, torch.Tensor]:
    """Every live tensor in the model's own layout, for checks: dense ones under their Hugging Face names, experts as
    `model.layers.N.mlp.experts.{w13,w2}` (dense) or `....{w13,w2}.data` (float8 bits as uint8) and `.scales`."""
    out = dict(model.hf_dense_weights())
    for i in range(model.args.num_hidden_layers):
        for which, w in zip(("w13", "w2"), model.experts(i), strict=True):
            key = f"model.layers.{i}.mlp.experts.{which}"
            if isinstance(w, MXFP8Tensor):
                out[f"{key}.data"], out[f"{key}.scales"] = w.data.view(torch.uint8), w.scales
            else:
                out[key] = w
    return out


def _empty_like(w):
    return (MXFP8Tensor(torch.empty_like(w.data), torch.empty_like(w.scales)) if isinstance(w, MXFP8Tensor)
            else torch.empty_like(w))


def _copy_into(live, staged) -> None:
    if isinstance(live, MXFP8Tensor):
        live.data.copy_(staged.data)
        live.scales.copy_(staged.scales)
    else:
        live.copy_(staged)


def _clone(w):
    return MXFP8Tensor(w.data.clone(), w.scales.clone()) if isinstance(w, MXFP8Tensor) else w.clone()


class WeightUpdate:
    """Stage with `add_many(pairs)` / `add(name, tensor)` (thread-safe), check with `finalize()`, swap with
    `apply(model)`. `kernel`: quantize MXFP8 experts with the Triton kernel (default: when the model is on a GPU;
    True with a CPU model runs it in Triton's interpreter) rather than the host quantizer. `names`: the model's
    WeightNames, kept by a caller that stages many updates (it remembers the names it mapped)."""

    def __init__(self, model, version: int, current_version: int, *, partial: bool = False,
                 kernel: bool | None = None, names: WeightNames | None = None):
        check_version(version, current_version)
        self.model, self.version, self.partial = model, version, partial
        self.names = names if names is not None else WeightNames.of(model)
        self.mxfp8 = model.weight_dtype == "mxfp8"
        self.dense: dict[str, torch.Tensor] = {}
        self.experts: dict[tuple[int, str], torch.Tensor | MXFP8Tensor] = {}
        self.coverage = {layer: ExpertCoverage(layer, self.names.E) for layer in range(self.names.num_layers)}
        self.num_tensors = self.nbytes = 0
        self.tied_head = self._ok = False  # _ok: finalize passed
        self._broken: str | None = None  # a staging failure: rows marked as arrived may not have been written
        self._lock = threading.Lock()
        self.state = "staging"  # -> "finalized" -> applied, or -> "discarded"
        # Staging runs on a stream of its own so that it overlaps the engine's steps on a GPU; finalize waits for it.
        self.stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        # Duplicates are refused, so no update carries more tensors than the model has: one finiteness slot each,
        # allocated here once (on the staging stream, which is the one that writes them).
        expert_tensors = self.names.num_layers * self.names.E * 3
        use_kernel = model.device.type == "cuda" if kernel is None else kernel
        with torch.cuda.stream(self.stream) if self.stream else nullcontext():
            self._ranges = torch.zeros(len(self.names.dense_shapes) + expert_tensors * (not self.mxfp8), 2,
                                       dtype=model.dtype, device=model.device)
            self.quantizer = ExpertQuantizer(model.device, expert_tensors, use_kernel) if self.mxfp8 else None
        self._range_names: list[str] = []  # row i of _ranges is the (min, max) of _range_names[i] as staged

    def _fail(self, name: str, why: str):
        raise WeightSyncError(f"{name}: {why} (weight update to version {self.version})")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_many([(name, tensor)])

    def add_many(self, items) -> int:
        """Stage (name, tensor) pairs, e.g. one bucket: each is checked as it comes, then all are staged together (the
        experts quantized in a launch or a few). A refused tensor raises naming it, after the ones before it were
        staged. Returns the number of tensors staged."""
        # The sources were written on the caller's stream (a copy, a broadcast, an IPC event's wait): staging waits.
        caller = torch.cuda.current_stream(self.model.device) if self.stream is not None else None
        with self._lock, (torch.cuda.stream(self.stream) if self.stream else nullcontext()), torch.no_grad():
            plan, refused = [], None
            try:
                for name, tensor in items:
                    if (target := self._check(name, tensor)) is not None:
                        plan.append((name, target, tensor))
            except WeightSyncError as e:
                refused = e
            if plan:
                if caller is not None:
                    self.stream.wait_stream(caller)
                try:
                    self._stage(plan)
                except Exception as e:
                    self._broken = str(e)
                    raise
            if refused is not None:
                raise refused
            return len(plan)

    def _check(self, name: str, tensor: torch.Tensor) -> Dense | Experts | None:
        """The tensor's target, once every check passed and it was recorded (None: the tied head, nothing to stage)."""
        self._fail_if_frozen(name)
        try:
            target = self.names.target(name)
        except ValueError as e:
            raise WeightSyncError(f"{e} (weight update to version {self.version})") from None
        if tensor.dtype not in SOURCE_DTYPES:
            self._fail(name, f"dtype {tensor.dtype} is not a weight dtype ({', '.join(map(str, SOURCE_DTYPES))})")
        if isinstance(target, TiedHead):  # the embedding is the weight
            self.tied_head = True
            return None
        if tensor.shape != target.shape:  # a torch.Size equals the tuple of its dims
            self._fail(name, f"shape {tuple(tensor.shape)}, expected {target.shape}")
        if isinstance(target, Dense):
            if name in self.dense:
                self._fail(name, "appears twice in the update")
            self.dense[name] = None  # claimed; staged below, with the rest of its bucket
        else:
            try:
                self.coverage[target.layer].add(name, target)
            except ValueError as e:
                raise WeightSyncError(f"{e} (weight update to version {self.version})") from None
        self.num_tensors += 1
        self.nbytes += tensor.numel() * tensor.element_size()
        return target

    def _fail_if_frozen(self, name: str) -> None:
        if self._broken is not None:
            self._fail(name, f"arrived after staging failed: {self._broken}")
        if self.state != "staging":
            self._fail(name, f"arrived after the update was {self.state}")

    def _stage(self, plan: list[tuple[str, Dense | Experts, torch.Tensor]]) -> None:
        jobs = []
        for name, target, src in plan:
            if isinstance(target, Dense):
                out = torch.empty(target.shape, dtype=self.model.dtype, device=self.model.device)
                self.dense[name] = out.copy_(src, non_blocking=True)
                self._record_range(name, out)
                continue
            if src.device != self.model.device:  # the quantizer reads the source where it writes
                src = src.to(self.model.device, non_blocking=True)
            if self.mxfp8 and self.quantizer.kernel and not (src.is_contiguous() or src[0].is_contiguous()):
                src = src.contiguous()  # cuda_ipc maps the trainer's view (transposed, say); the kernel reads rows
            staged = self._staged_experts(target)
            if self.mxfp8:  # the quantizer addresses the rows itself: no views per tensor
                jobs.append((name, src, staged, target.expert, target.rows))
            else:
                index = (slice(None) if target.expert is None else target.expert, target.rows)
                self._record_range(name, staged[index].copy_(src))
        if jobs:
            try:
                self.quantizer.run(jobs)
            except ValueError as e:
                raise WeightSyncError(f"{e} (weight update to version {self.version})") from None

    def _record_range(self, name: str, staged: torch.Tensor) -> None:
        """(min, max) of a staged tensor into the next row of _ranges: one reduction, no allocation, no host sync."""
        row = self._ranges[len(self._range_names)]
        self._range_names.append(name)
        torch.aminmax(staged, out=(row[0], row[1]))

    def _staged_experts(self, target: Experts):
        key = (target.layer, target.which)
        if key not in self.experts:
            live = self.model.experts(target.layer)[0 if target.which == "w13" else 1]
            # A partial update keeps the live values of the rows it does not carry.
            self.experts[key] = _clone(live) if self.partial else _empty_like(live)
        return self.experts[key]

    def fence(self) -> None:
        """Wait (on the host) for the staging reads so far: call it before reusing or freeing a buffer that was passed
        to `add` (a receive buffer, a bucket copied to the GPU). A host wait, not a stream dependency: the engine's
        stream never waits for staging."""
        if self.stream is not None:
            self.stream.synchronize()

    def finalize(self) -> dict:
        """Check the whole update (complete unless partial, all values finite); after it no tensor is accepted.
        Returns {"version", "tensors", "bytes"}."""
        with self._lock:
            if self.state != "staging":
                raise WeightSyncError(f"weight update to version {self.version} was already {self.state}")
            self.state = "finalized"
            if self.stream is not None:
                self.stream.synchronize()
            if self._broken is not None:
                raise WeightSyncError(f"weight update to version {self.version} failed staging: {self._broken}")
            if not self.partial:
                missing = [n for n in self.names.dense_shapes if n not in self.dense]
                for cov in self.coverage.values():
                    missing += cov.missing()
                if missing:
                    raise WeightSyncError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all) in a full "
                                          f"weight update to version {self.version}; push every tensor, or "
                                          f"partial=True for a subset")
            elif self.tied_head and "model.embed_tokens.weight" not in self.dense:
                raise WeightSyncError("lm_head.weight: this model ties lm_head to model.embed_tokens.weight; push "
                                      f"the embedding (weight update to version {self.version})")
            if not self.num_tensors:
                raise WeightSyncError(f"weight update to version {self.version} carries no tensors")
            names = list(self._range_names)
            flags = [torch.isfinite(self._ranges[:len(names)]).all(dim=1).logical_not().to(torch.int32)]
            if self.quantizer is not None and self.quantizer.kernel:
                expert_names, counts = self.quantizer.nonfinite()
                names += expert_names
                flags.append(counts)
            bad = [name for name, n in zip(names, torch.cat(flags).tolist(), strict=True) if n]  # one host read
            if bad:
                t = self.names.target(bad[0])
                fused = self.experts[(t.layer, t.which)] if getattr(t, "expert", 0) is None else None
                more = f"; also {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
                raise WeightSyncError(f"{bad[0]}: non-finite values (inf or NaN){where_nonfinite(bad[0], fused)}{more}"
                                      f" (weight update to version {self.version})")
            self._ok = True
            return {"version": self.version, "tensors": self.num_tensors, "bytes": self.nbytes}

    def apply(self, model, current_version: int, *, in_place: bool = False) -> None:
        """Swap the staged tensors into `model` (between engine steps); nothing can fail after the version check.
        Dense tensors are always copied into the live ones (on the current stream, so ordered with the engine's
        work): q_proj, k_proj and v_proj are views of one fused weight (composer_rollout.model.layers), and the
        copy costs milliseconds. in_place: copy the experts too, rather than swapping them in, for an engine whose
        CUDA graphs read the weights at fixed addresses."""
        if self.state != "finalized" or not self._ok:
            raise WeightSyncError(f"weight update to version {self.version} was not finalized successfully")
        if model is not self.model:
            raise WeightSyncError(f"weight update to version {self.version} was staged for another model")
        check_version(self.version, current_version)
        live = model.hf_dense_weights()
        for name, t in self.dense.items():
            live[name].copy_(t)
        for (layer, which), t in self.experts.items():
            if in_place:
                _copy_into(getattr(model.layers[layer].mlp, which), t)
            else:
                setattr(model.layers[layer].mlp, which, t)
        self.dense.clear()
        self.experts.clear()
        self.state = "applied"

    def discard(self) -> None:
        """Drop the staged buffers (after any staging work in flight has finished with them)."""
        with self._lock:
            self.state = "discarded"
            if self.stream is not None:
                self.stream.synchronize()
            self.dense.clear()
            self.experts.clear()
