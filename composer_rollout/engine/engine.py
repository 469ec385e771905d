"""RolloutEngine: prompts in, sampled completions with logprobs out; the reference generation loop.

Shaped like vLLM's offline API (`from_pretrained`, `generate`, `SamplingParams`) so RL users know it.
The loop is continuous batching over a fixed set of KV-cache slots: a prompt group (its n samples)
is admitted when n slots are free, prefilled once into one slot and its KV copied to the others,
and every step decodes all live sequences together. A finished sequence frees its slot at once. Each step runs one
prefill forward filled up to the prefill budget, its pieces packed back to back in one row: the rest of the prompt in
progress, whole prompts in order, and the first that does not fit as a chunk (continued next step).

Weights change only between steps: `begin_update` stages a new version beside the live weights
(composer_rollout.sync.update: validated whole, MXFP8 re-quantized) and `apply_update` swaps it in; every
token records the version that produced it (RolloutResult.weight_versions).

It is kept in the shape a CUDA-graph runner needs: a decode step's tensors have a static shape per
batch bucket (padding rows write to the cache's scratch slot), sampling parameters live on the
device, and the only host synchronisation per step is reading the sampled tokens and logprobs (and, for
the sequences that asked, their routed expert ids: composer_rollout.engine.capture).

The number of KV slots is max_num_seqs; on CUDA it is checked at start-up against the memory budget
(gpu_memory_fraction), and an engine that would not fit fails there: composer_rollout.engine.memory.
"""

import math
import random
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from composer_rollout.engine.capture import ExpertCapture
from composer_rollout.engine.graphs import DecodeGraphs
from composer_rollout.engine.memory import kv_slots
from composer_rollout.engine.sampling import RolloutResult, SamplingParams, sample
from composer_rollout.engine.sequence import EngineStats, Prefill, Request, Sequence, batch_buckets, sample_seed
from composer_rollout.engine.step_io import HostReadout, StepInputs
from composer_rollout.model import PRESETS, ModelArgs, Packed, Qwen3MoE, load_checkpoint, preset
from composer_rollout.sync.update import WeightUpdate

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# A prefill forward's rows are padded to a multiple of this where the budget and the context allow. The Triton kernels
# specialise on whether their size arguments divide by 16, and the first use of each variant in a process costs a
# load from Triton's cache (a compilation on a fresh machine): rounded, prompts of any length meet one variant per
# tile bucket instead of three, for at most 15 padding rows a forward.
ROW_MULTIPLE = 16


def padded_len(n: int, budget: int, limit: int) -> int:
    """n rounded up to ROW_MULTIPLE when that fits both `budget` and `limit`; else n."""
    m = -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
    return m if m <= min(budget, limit) else n


def resolve_max_model_len(args: ModelArgs, requested: int | None) -> int:
    """The context an engine gets: `requested`, or min(max_position_embeddings, 4096) when None."""
    limit = args.max_position_embeddings
    max_len = min(limit, 4096) if requested is None else requested
    if not 2 <= max_len <= limit:
        raise ValueError(f"max_model_len {max_len} must be in [2, max_position_embeddings={limit}]")
    return max_len


class RolloutEngine:
    """Requests in (`add_request`), finished samples out (`step`); `generate` is both in one call."""

    def __init__(self, model: Qwen3MoE, *, max_num_seqs: int = 16, max_model_len: int | None = None, seed: int = 0,
                 gpu_memory_fraction: float = 0.9, max_prefill_tokens: int = 4096, cuda_graphs: bool | None = False):
        """cuda_graphs: True captures the decode steps (an error where that cannot run), None wherever it can run
        (a CUDA device and a Triton MoE path; the jobs' default), False never."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
        if cuda_graphs is None:
            cuda_graphs = model.device.type == "cuda" and model.kernel != "torch"
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError(f"engine.cuda_graphs needs a CUDA device; the model is on {model.device}")
        if cuda_graphs and model.kernel == "torch":
            raise ValueError("engine.cuda_graphs needs a Triton MoE path (kernel=warp_decode, expert_centric or auto): "
                             "the torch reference path reads routing back to the host and cannot be captured")
        self.max_model_len = resolve_max_model_len(model.args, max_model_len)
        self.max_prefill_tokens = max_prefill_tokens
        kv_slots(model, max_num_seqs, self.max_model_len, gpu_memory_fraction, max_prefill_tokens, cuda_graphs)
        self.model, self.max_num_seqs = model, max_num_seqs
        self.device = model.device
        self.cache = model.new_kv_cache(max_num_seqs, self.max_model_len)
        self.buckets = batch_buckets(max_num_seqs)
        self.inputs, self.readout = StepInputs(max(self.buckets), self.device), HostReadout(self.device)
        self.graphs = DecodeGraphs(model, self.cache, self.buckets, self.inputs) if cuda_graphs else None
        self.weight_version = 0
        self.stats = EngineStats(graph_capture_s=self.graphs.capture_s if self.graphs else 0.0)
        self._rng = random.Random(seed)
        self._waiting: deque[Request] = deque()
        self._live: dict[int, Sequence] = {}
        self._prefilling: Prefill | None = None
        self._free = list(range(max_num_seqs))[::-1]
        self._next_id = 0

    @classmethod
    def from_pretrained(cls, path_or_preset: str, *, kernel: str = "torch", dense: str = "torch",
                        weight_dtype: str = "bf16",
                        dtype: str = "bfloat16", device: str | None = None, seed: int = 0,
                        max_num_seqs: int = 16, max_model_len: int | None = None,
                        gpu_memory_fraction: float = 0.9, max_prefill_tokens: int = 4096,
                        cuda_graphs: bool | None = False) -> "RolloutEngine":
        """A checkpoint directory, or a preset name (random init seeded with `seed`)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is unknown; choose one of {sorted(DTYPES)}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        kw = dict(dtype=DTYPES[dtype], device=device, weight_dtype=weight_dtype, kernel=kernel, dense=dense)
        if Path(path_or_preset).is_dir():
            model = load_checkpoint(path_or_preset, **kw)
        elif path_or_preset in PRESETS:
            model = Qwen3MoE(preset(path_or_preset), **kw).init_random(seed)
        else:
            raise ValueError(f"model {path_or_preset!r} is neither a checkpoint directory nor a preset "
                             f"({sorted(PRESETS)})")
        return cls(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=seed,
                   gpu_memory_fraction=gpu_memory_fraction, max_prefill_tokens=max_prefill_tokens,
                   cuda_graphs=cuda_graphs)

    def _check_tokens(self, what: str, seqs: list[list[int]], allow_empty: bool = False) -> None:
        vocab = self.model.args.vocab_size
        if not isinstance(seqs, list | tuple):
            raise TypeError(f"{what} must be a list of token-id lists")
        for i, ids in enumerate(seqs):
            if not isinstance(ids, list | tuple) or (not ids and not allow_empty):
                raise ValueError(f"{what}[{i}] must be a non-empty list of token ids")
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what}[{i}] has token id {bad[0]!r} outside [0, vocab_size={vocab})")

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, *, prompt_index: int = 0,
                    request_id: str | None = None) -> str:
        """Queue one prompt's n samples. Everything is checked here, before any work; `prompt_index` names the
        prompt in results and, with the seed, fixes each sample's randomness (so a prompt gives the same samples
        whichever engine or batch runs it)."""
        self._check_tokens(f"prompt_token_ids (prompt {prompt_index})", [prompt_token_ids])
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt {prompt_index} has {len(prompt_token_ids)} tokens; max_model_len="
                             f"{self.max_model_len} leaves no room to generate")
        if sampling.n > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={sampling.n} exceeds the engine's max_num_seqs={self.max_num_seqs}")
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        stop = frozenset(self.model.args.eos_token_id) | frozenset(sampling.stop_token_ids)
        self._waiting.append(Request(request_id, prompt_index, list(prompt_token_ids), sampling, seed, stop,
                                      time.perf_counter()))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._live or self._prefilling)

    @property
    def num_waiting(self) -> int:
        """Requests queued and not admitted yet."""
        return len(self._waiting)

    @property
    def num_live(self) -> int:
        """Sequences holding a slot: decoding, or of the request being prefilled (admitted, so a drain waits for
        them)."""
        return len(self._live) + (len(self._prefilling.slots) if self._prefilling else 0)

    def _result(self, seq: Sequence, reason: str, now: float) -> RolloutResult:
        req = seq.request
        return RolloutResult(req.prompt_index, seq.sample_index, seq.token_ids, seq.logprobs, reason,
                             seq.versions[0][0] if seq.versions else self.weight_version, len(req.prompt),
                             len(seq.token_ids), request_id=req.request_id, latency_s=now - req.arrival,
                             ttft_s=(seq.first_token_time or now) - req.arrival,
                             weight_versions=[(v, n) for v, n in seq.versions], routed_experts=self._routing(seq))

    def _capture(self, num_tokens: int) -> ExpertCapture:
        a = self.model.args
        return ExpertCapture(a.num_hidden_layers, num_tokens, a.num_experts_per_tok, a.num_experts, self.device)

    def _routing(self, seq: Sequence) -> np.ndarray | None:
        if not seq.request.sampling.return_routed_experts:
            return None
        if seq.routing:
            return np.concatenate(seq.routing)
        return self._capture(0).all_rows()  # aborted before its prefill: no rows, the right shape and dtype

    def abort(self, request_id: str) -> list[RolloutResult]:
        """Stop a request: its samples come back now with what they have, finish_reason "abort"."""
        now, out = time.perf_counter(), []
        for req in [r for r in self._waiting if r.request_id == request_id]:
            self._waiting.remove(req)
            out += [self._result(Sequence(req, j, 0), "abort", now) for j in range(req.sampling.n)]
        return out + self._abort_live(request_id)

    def _abort_live(self, request_id: str) -> list[RolloutResult]:
        now, out = time.perf_counter(), []
        pre = self._prefilling
        if pre is not None and pre.request.request_id == request_id:
            out += [self._result(Sequence(pre.request, j, 0), "abort", now) for j in range(len(pre.slots))]
            self._free += pre.slots
            self._prefilling = None
        for slot, seq in list(self._live.items()):
            if seq.request.request_id == request_id:
                out.append(self._result(seq, "abort", now))
                del self._live[slot]
                self._free.append(slot)
        return out

    def abort_all(self) -> list[RolloutResult]:
        """Abort every live sequence (a weight swap in mode "abort"); waiting requests stay queued."""
        ids = [seq.request.request_id for seq in self._live.values()]
        ids += [self._prefilling.request.request_id] if self._prefilling else []
        return [r for rid in dict.fromkeys(ids) for r in self._abort_live(rid)]

    def begin_update(self, version: int, *, partial: bool = False) -> WeightUpdate:
        """A WeightUpdate to stage into while this engine keeps serving; `version` must exceed the served one."""
        return WeightUpdate(self.model, version, self.weight_version, partial=partial)

    def apply_update(self, update: WeightUpdate) -> None:
        """Swap a finalized update in, between steps, and serve its version from the next token on. Live sequences
        continue on the new weights with their KV cache as it is (computed by the old ones); each result's
        weight_versions records which tokens came from which version."""
        # Captured graphs read the weights where they were: copy into them rather than swapping pointers.
        update.apply(self.model, self.weight_version, in_place=self.graphs is not None)
        self.weight_version = update.version

    def _append(self, slots: list[int], tokens: list[int], logprobs: list[float]) -> list[RolloutResult]:
        now, finished = time.perf_counter(), []
        for slot, tok, lp in zip(slots, tokens, logprobs, strict=True):
            seq = self._live[slot]
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            if seq.versions and seq.versions[-1][0] == self.weight_version:
                seq.versions[-1][1] += 1
            else:
                seq.versions.append([self.weight_version, 1])
            seq.first_token_time = seq.first_token_time or now
            req = seq.request
            reason = ("stop" if tok in req.stop else
                      "length" if (len(seq.token_ids) >= req.sampling.max_tokens
                                   or len(req.prompt) + len(seq.token_ids) >= self.max_model_len) else None)
            if reason:
                finished.append(self._result(seq, reason, now))
                del self._live[slot]
                self._free.append(slot)
        return finished

    def _step_inputs(self, seqs: list[Sequence], rows: int, columns: dict[str, list] | None = None):
        """A step's per-row tensors on the device, sent in two copies that do not block
        (composer_rollout.engine.step_io): the sampling params (temperature, top_k, top_p, seeds, steps), whether
        any row filters (top-k or top-p), and the views of every row ({name: [rows] tensor}, `columns`' among them:
        the decode step's ids, positions and slots). Padding rows are greedy with seed 0."""
        pad = rows - len(seqs)
        v = self.inputs.load(rows, dict(
            top_k=[s.request.sampling.top_k for s in seqs], seeds=[s.seed for s in seqs],
            steps=[len(s.token_ids) for s in seqs], temperature=[float(s.request.sampling.temperature) for s in seqs],
            top_p=[float(s.request.sampling.top_p) for s in seqs] + [1.0] * pad, **(columns or {})))
        filtered = any(s.request.sampling.top_k > 0 or s.request.sampling.top_p < 1 for s in seqs)
        return (v["temperature"], v["top_k"], v["top_p"], v["seeds"], v["steps"]), filtered, v

    def _take_whole_prompts(self, budget: int) -> list[Prefill]:
        """Waiting groups, in order, whose whole prompts fit one forward of at most `budget` tokens together and whose
        n slots are free; empty when the first does not fit (it goes through the chunked path, or waits for slots)."""
        group, tokens, free = [], 0, len(self._free)
        for req in self._waiting:
            if req.sampling.n > free or tokens + len(req.prompt) > budget:
                break
            group.append(req)
            tokens, free = tokens + len(req.prompt), free - req.sampling.n
        for _ in group:
            self._waiting.popleft()
        return [Prefill(req, [self._free.pop() for _ in range(req.sampling.n)]) for req in group]

    def _prefill(self, pieces: list[tuple[Prefill, int]]) -> list[RolloutResult]:
        """The step's prefill in one forward: its pieces, (group, tokens from the group's `done` position) each (the
        rest or next chunk of the prompt in progress, whole prompts, the first chunk of the next one), packed back to
        back in one row (model.Packed: no piece is padded to another's length; attention keeps each to its own slot).
        The row rounds up to ROW_MULTIPLE where the budget and the last piece's context allow, by padding tokens at the
        positions after that piece (their keys land where its prompt's next chunk or first decode steps write theirs
        before reading them). One launch sequence instead of one per prompt: prefill of short prompts is per-launch
        latency, not bytes. Groups whose prompts are complete go live. Returns the finished samples."""
        start_time = time.perf_counter()
        lens = [size for _, size in pieces]
        real, (last, last_size) = sum(lens), pieces[-1]
        end = last.done + last_size
        T = padded_len(real, self.max_prefill_tokens, real + self.max_model_len - end)
        ids, positions = [], []
        for pre, size in pieces:
            ids += pre.request.prompt[pre.done:pre.done + size]
            positions += range(pre.done, pre.done + size)
        ids, positions = ids + [0] * (T - real), positions + list(range(end, end + T - real))
        slots = [pre.slots[0] for pre, _ in pieces]
        packed = Packed.of(lens[:-1] + [lens[-1] + T - real], slots, self.device)
        capture = self._capture(T) if any(pre.request.sampling.return_routed_experts for pre, _ in pieces) else None
        hidden = self.model(torch.tensor([ids], device=self.device), torch.tensor([positions], device=self.device),
                            torch.tensor(slots, device=self.device), self.cache, capture, packed)
        rows = capture.all_rows() if capture is not None else None
        complete, last_rows = [], []
        for (pre, size), start in zip(pieces, packed.starts, strict=False):
            pre.done += size
            if pre.request.sampling.return_routed_experts:
                pre.routing.append(rows[start:start + size])
            if not pre.remaining:
                complete.append(pre)
                last_rows.append(start + size - 1)
        finished = []
        if complete:
            routing = [np.concatenate(pre.routing) if pre.request.sampling.return_routed_experts else None
                       for pre in complete]
            finished = self._go_live(complete, hidden[0, torch.tensor(last_rows, device=self.device)], routing)
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so that prefill_s times the forward, as going live does (.tolist())
        self.stats.prefill_tokens += real
        self.stats.prefill_rows += T
        self.stats.prefill_forwards += 1
        self.stats.prefill_s += time.perf_counter() - start_time
        return finished

    def _go_live(self, group: list[Prefill], last: torch.Tensor, routing: list[np.ndarray | None]
                 ) -> list[RolloutResult]:
        """Prefilled groups go live: each prompt's KV is copied to its other slots and each sample draws its first
        token from its prompt's last hidden state (`last` [groups, H]), all groups in one sampling call."""
        seqs, slots, rows = [], [], []
        for b, (pre, prompt_routing) in enumerate(zip(group, routing, strict=True)):
            req = pre.request
            self.cache.copy_prefix(pre.slots[0], pre.slots[1:], len(req.prompt))
            new = [Sequence(req, j, sample_seed(req.seed, req.prompt_index, j)) for j in range(req.sampling.n)]
            if prompt_routing is not None:  # one prefill, so one prompt routing for the whole group
                for seq in new:
                    seq.routing.append(prompt_routing)
            self._live.update(zip(pre.slots, new, strict=True))
            seqs, slots, rows = seqs + new, slots + pre.slots, rows + [b] * len(new)
        params, filtered, _ = self._step_inputs(seqs, len(seqs))
        logits = self.model.compute_logits(last)[torch.tensor(rows, device=self.device)]
        tokens, logprobs = sample(logits, *params, filtered=filtered, fused=self.model.dense == "triton")
        return self._append(slots, *self.readout.read(tokens, logprobs, len(slots)))

    def _decode(self) -> list[RolloutResult]:
        start = time.perf_counter()
        slots = list(self._live)
        seqs = [self._live[s] for s in slots]
        rows = next(b for b in self.buckets if b >= len(slots))
        pad = rows - len(slots)
        params, filtered, v = self._step_inputs(seqs, rows, dict(
            ids=[s.token_ids[-1] for s in seqs], positions=[len(s.request.prompt) + len(s.token_ids) - 1 for s in seqs],
            slots=slots + [self.cache.scratch_slot] * pad))
        asked = [i for i, s in enumerate(seqs) if s.request.sampling.return_routed_experts]
        if self.graphs is not None:
            logits, tokens, logprobs, capture = self.graphs.replay(rows)
            capture = capture if asked else None
        else:
            capture = self._capture(rows) if asked else None
            hidden = self.model(v["ids"][:, None], v["positions"][:, None], v["slots"], self.cache, capture)
            logits = self.model.compute_logits(hidden[:, 0])
        if filtered or self.graphs is None:  # the graph's own sample is the unfiltered one
            tokens, logprobs = sample(logits, *params, filtered=filtered, fused=self.model.dense == "triton")
        tokens, logprobs = self.readout.read(tokens, logprobs, len(slots))
        if capture is not None:  # read after the tokens: the step has synchronised already
            for i, row in zip(asked, capture.rows(asked), strict=True):
                seqs[i].routing.append(row[None])
        finished = self._append(slots, tokens, logprobs)
        self.stats.decode_s += time.perf_counter() - start
        self.stats.decode_tokens += len(slots)
        self.stats.decode_rows += rows
        self.stats.decode_steps += 1
        return finished

    @torch.inference_mode()
    def step(self, admit: bool = True) -> list[RolloutResult]:
        """One prefill forward of up to max_prefill_tokens prompt tokens: the rest (or next chunk) of the request in
        progress, then waiting groups in order while their n slots are free, whole while they fit, the first that
        does not as a chunk in what is left (no new request when `admit` is False, as while draining for a weight
        swap; one already in progress is finished). Then one decode step over every live sequence. Returns the
        finished samples."""
        budget, pieces = self.max_prefill_tokens, []
        if self._prefilling is not None:
            pieces.append((self._prefilling, min(budget, self._prefilling.remaining)))
            budget -= pieces[-1][1]
        if admit and budget > 0:
            whole = self._take_whole_prompts(budget)
            pieces += [(pre, len(pre.request.prompt)) for pre in whole]
            budget -= sum(len(pre.request.prompt) for pre in whole)
            head = self._waiting[0] if self._waiting else None
            if budget > 0 and head is not None and len(self._free) >= head.sampling.n:
                # The next prompt's first chunk fills the rest: the forward runs anyway, so a step's prefill is
                # as many tokens as the budget allows, in one forward (docs/perf.md).
                self._waiting.popleft()
                pieces.append((Prefill(head, [self._free.pop() for _ in range(head.sampling.n)]), budget))
        # Only the last piece can be left incomplete: an earlier one was whole or the in-progress prompt's rest.
        self._prefilling = pieces[-1][0] if pieces and pieces[-1][1] < pieces[-1][0].remaining else None
        finished = self._prefill(pieces) if pieces else []
        if self._live:
            finished += self._decode()
        return finished

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResult]:
        """One RolloutResult per (prompt, sample), ordered by prompt then sample. All prompts are checked
        before any is queued."""
        self._check_tokens("prompt_token_ids", prompt_token_ids)
        for i, p in enumerate(prompt_token_ids):
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompt_token_ids[{i}] has {len(p)} tokens; max_model_len={self.max_model_len} "
                                 f"leaves no room to generate")
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drain add_request/step work first")
        for i, p in enumerate(prompt_token_ids):
            self.add_request(p, sampling, prompt_index=i)
        results = []
        while self.has_unfinished():
            results += self.step()
        return sorted(results, key=lambda r: (r.prompt_index, r.sample_index))

    @torch.inference_mode()
    def score(self, prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]],
              temperature: float = 1.0) -> list[list[float]]:
        """Teacher-forced logprobs of each completion token given the prompt and the completion before it,
        defined as RolloutResult.logprobs (log_softmax(logits / temperature); unscaled at temperature 0)."""
        self._check_tokens("prompt_token_ids", prompt_token_ids)
        self._check_tokens("completion_token_ids", completion_token_ids, allow_empty=True)
        if len(prompt_token_ids) != len(completion_token_ids):
            raise ValueError(f"score: {len(prompt_token_ids)} prompts but {len(completion_token_ids)} completions")
        if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"score: temperature={temperature!r} must be a finite number >= 0")
        scale = temperature if temperature > 0 else 1.0
        out = []
        for i, (prompt, completion) in enumerate(zip(prompt_token_ids, completion_token_ids, strict=True)):
            tokens = list(prompt) + list(completion)
            if len(tokens) > self.max_model_len:
                raise ValueError(f"score: sequence {i} has {len(tokens)} tokens > max_model_len={self.max_model_len}")
            if not completion:
                out.append([])
                continue
            ids = torch.tensor([tokens[:-1]], device=self.device)
            positions = torch.arange(len(tokens) - 1, device=self.device)[None]
            slot = torch.tensor([self.cache.scratch_slot], device=self.device)
            hidden = self.model(ids, positions, slot, self.cache)[0, len(prompt) - 1:]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden) / scale, dim=-1)
            target = torch.tensor(completion, device=self.device)[:, None]
            out.append(logprobs.gather(1, target).squeeze(1).tolist())
        return out
