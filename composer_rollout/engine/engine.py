"""RolloutEngine: prompts in, sampled completions with logprobs out; the reference generation loop.

Shaped like vLLM's offline API (`from_pretrained`, `generate`, `SamplingParams`) so RL users know it.
The loop is continuous batching over a fixed set of KV-cache slots: a prompt group (its n samples)
is admitted when n slots are free, prefilled once into one slot and its KV copied to the others,
and every step decodes all live sequences together. A finished sequence frees its slot at once.

It is kept in the shape a CUDA-graph runner needs: a decode step's tensors have a static shape per
batch bucket (padding rows write to the cache's scratch slot), sampling parameters live on the
device, and the only host synchronisation per step is reading the sampled tokens and logprobs.
"""

import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from composer_rollout.engine.sampling import RolloutResult, SamplingParams, sample
from composer_rollout.model import PRESETS, Qwen3MoE, load_checkpoint, preset

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_MASK63 = (1 << 63) - 1


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes a step is padded to: 1, 2, 4, ..., 32, 48, 64, 96, 128, ..., capped at max_num_seqs."""
    sizes, m = [1, 2, 4, 8, 16, 32], 32
    while sizes[-1] < max_num_seqs:
        sizes += [m + m // 2, 2 * m]
        m *= 2
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def _sample_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed per sample, fixed by (base, prompt, sample): splitmix64's finaliser."""
    x = (base + 0x9E3779B97F4A7C15 * (prompt_index + 1) + 0xD1B54A32D192ED03 * (sample_index + 1)) % (1 << 64)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (x ^ (x >> 31)) & _MASK63


@dataclass
class _Sequence:
    prompt_index: int
    sample_index: int
    seed: int
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class RolloutEngine:
    def __init__(self, model: Qwen3MoE, *, max_num_seqs: int = 16, max_model_len: int | None = None, seed: int = 0):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        limit = model.args.max_position_embeddings
        self.max_model_len = max_model_len or min(limit, 4096)
        if not 2 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len {self.max_model_len} must be in [2, max_position_embeddings={limit}]")
        self.model, self.max_num_seqs = model, max_num_seqs
        self.device = model.device
        self.cache = model.new_kv_cache(max_num_seqs, self.max_model_len)
        self.buckets = batch_buckets(max_num_seqs)
        self.weight_version = 0
        self._rng = random.Random(seed)

    @classmethod
    def from_pretrained(cls, path_or_preset: str, *, kernel: str = "torch", weight_dtype: str = "bf16",
                        dtype: str = "bfloat16", device: str | None = None, seed: int = 0,
                        max_num_seqs: int = 16, max_model_len: int | None = None) -> "RolloutEngine":
        """A checkpoint directory, or a preset name (random init seeded with `seed`)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is unknown; choose one of {sorted(DTYPES)}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        kw = dict(dtype=DTYPES[dtype], device=device, weight_dtype=weight_dtype, kernel=kernel)
        if Path(path_or_preset).is_dir():
            model = load_checkpoint(path_or_preset, **kw)
        elif path_or_preset in PRESETS:
            model = Qwen3MoE(preset(path_or_preset), **kw).init_random(seed)
        else:
            raise ValueError(f"model {path_or_preset!r} is neither a checkpoint directory nor a preset "
                             f"({sorted(PRESETS)})")
        return cls(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=seed)

    def _check_tokens(self, what: str, seqs: list[list[int]], allow_empty: bool = False) -> None:
        vocab = self.model.args.vocab_size
        if not isinstance(seqs, list | tuple):
            raise TypeError(f"{what} must be a list of token-id lists")
        for i, ids in enumerate(seqs):
            if not isinstance(ids, list | tuple) or (not ids and not allow_empty):
                raise ValueError(f"{what}[{i}] must be a non-empty list of token ids")
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what}[{i}] has token id {bad[0]!r} outside [0, vocab_size={vocab})")

    def _forward_last(self, token_ids: list[int], slot: int, start: int = 0) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)[None]
        hidden = self.model(ids, positions, torch.tensor([slot], device=self.device), self.cache)
        return self.model.compute_logits(hidden[0, -1])

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResult]:
        """One RolloutResult per (prompt, sample), ordered by prompt then sample."""
        self._check_tokens("prompt_token_ids", prompt_token_ids)
        for i, p in enumerate(prompt_token_ids):
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompt_token_ids[{i}] has {len(p)} tokens; max_model_len={self.max_model_len} "
                                 f"leaves no room to generate")
        if sampling.n > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={sampling.n} exceeds the engine's max_num_seqs={self.max_num_seqs}")
        base = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        stop = set(self.model.args.eos_token_id) | set(sampling.stop_token_ids)
        dev, n = self.device, sampling.n
        results: list[RolloutResult] = []
        pending, free = deque(range(len(prompt_token_ids))), list(range(self.max_num_seqs))[::-1]
        live: dict[int, _Sequence] = {}

        def params(rows: int):
            return (torch.full((rows,), float(sampling.temperature), device=dev),
                    torch.full((rows,), sampling.top_k, device=dev, dtype=torch.int64),
                    torch.full((rows,), float(sampling.top_p), device=dev))

        def append(slots: list[int], tokens: list[int], logprobs: list[float]) -> None:
            for slot, tok, lp in zip(slots, tokens, logprobs, strict=True):
                seq = live[slot]
                seq.token_ids.append(tok)
                seq.logprobs.append(lp)
                length = seq.num_prompt_tokens + len(seq.token_ids)
                reason = ("stop" if tok in stop else
                          "length" if len(seq.token_ids) >= sampling.max_tokens or length >= self.max_model_len
                          else None)
                if reason:
                    results.append(RolloutResult(seq.prompt_index, seq.sample_index, seq.token_ids, seq.logprobs,
                                                 reason, self.weight_version, seq.num_prompt_tokens,
                                                 len(seq.token_ids)))
                    del live[slot]
                    free.append(slot)

        while pending or live:
            while pending and len(free) >= n:
                i = pending.popleft()
                prompt = list(prompt_token_ids[i])
                slots = [free.pop() for _ in range(n)]
                logits = self._forward_last(prompt, slots[0])
                self.cache.copy_prefix(slots[0], slots[1:], len(prompt))
                seeds = [_sample_seed(base, i, j) for j in range(n)]
                for j, slot in enumerate(slots):
                    live[slot] = _Sequence(i, j, seeds[j], len(prompt))
                first_step = torch.zeros(n, dtype=torch.int64, device=dev)
                tokens, logprobs = sample(logits.expand(n, -1), *params(n), torch.tensor(seeds, device=dev), first_step)
                append(slots, tokens.tolist(), logprobs.tolist())
            if not live:
                continue
            slots = list(live)
            rows = next(b for b in self.buckets if b >= len(slots))
            pad = rows - len(slots)
            seqs = [live[s] for s in slots]
            ids = torch.tensor([s.token_ids[-1] for s in seqs] + [0] * pad, device=dev)
            pos = torch.tensor([s.num_prompt_tokens + len(s.token_ids) - 1 for s in seqs] + [0] * pad, device=dev)
            slot_t = torch.tensor(slots + [self.cache.scratch_slot] * pad, device=dev)
            hidden = self.model(ids[:, None], pos[:, None], slot_t, self.cache)
            logits = self.model.compute_logits(hidden[:, 0])
            seeds = torch.tensor([s.seed for s in seqs] + [0] * pad, device=dev)
            steps = torch.tensor([len(s.token_ids) for s in seqs] + [0] * pad, device=dev)
            tokens, logprobs = sample(logits, *params(rows), seeds, steps)
            append(slots, tokens[: len(slots)].tolist(), logprobs[: len(slots)].tolist())
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
