"""The engine's bookkeeping: requests (prompt groups), their sequences, a prefill in progress, counters, and the
decode batch buckets. Plain data, no tensors: the engine (composer_rollout.engine.engine) owns the device work.

A prompt group is prefilled once, in chunks of at most the engine's max_prefill_tokens, so one long prompt never
stalls the decode of the live sequences for more than a chunk; its n samples then share the prompt's KV (copied
from the first slot) and decode independently, each with a seed fixed by (request seed, prompt, sample).
"""

from dataclasses import dataclass, field

import numpy as np

from composer_rollout.engine.sampling import SamplingParams

_MASK63 = (1 << 63) - 1


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes a step is padded to: 1, 2, 4, ..., 32, 48, 64, 96, 128, ..., capped at max_num_seqs."""
    sizes, m = [1, 2, 4, 8, 16, 32], 32
    while sizes[-1] < max_num_seqs:
        sizes += [m + m // 2, 2 * m]
        m *= 2
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def sample_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed per sample, fixed by (base, prompt, sample): splitmix64's finaliser."""
    x = (base + 0x9E3779B97F4A7C15 * (prompt_index + 1) + 0xD1B54A32D192ED03 * (sample_index + 1)) % (1 << 64)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (x ^ (x >> 31)) & _MASK63


@dataclass
class Request:
    """A prompt group: n samples that share one prefill and one base seed."""

    request_id: str
    prompt_index: int
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    stop: frozenset[int]
    arrival: float


@dataclass
class Sequence:
    request: Request
    sample_index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)  # [weight version, tokens] spans
    first_token_time: float = 0.0
    routing: list[np.ndarray] = field(default_factory=list)  # [tokens, layers, k] chunks, when asked for


@dataclass
class Prefill:
    """A request admitted and being prefilled: its n slots are taken, the first `done` prompt tokens are in the
    first slot's cache. Its samples go live when the last chunk is done."""

    request: Request
    slots: list[int]
    done: int = 0
    routing: list[np.ndarray] = field(default_factory=list)  # the chunks' [tokens, layers, k], when asked for

    @property
    def remaining(self) -> int:
        return len(self.request.prompt) - self.done


@dataclass
class EngineStats:
    """Counters since the engine started; the rollout job turns them into throughput metrics."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_forwards: int = 0  # one per step that prefilled: its pieces packed in one row
    prefill_rows: int = 0  # prompt rows computed, padding included: prefill_tokens / prefill_rows were useful
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0  # rows computed, padding included; decode_tokens / decode_rows is the useful fraction
    graph_capture_s: float = 0.0  # start-up: capturing the decode graphs (engine.cuda_graphs)
