"""What a rollout request asks for (SamplingParams), what comes back (RolloutResult), and the sampler.

Both dataclasses are plain and picklable: with token-id lists they are the only types that cross a
process boundary. The sampler is batched and keeps everything on the device: per-row temperature,
top-k and top-p are tensors, and randomness is a counter-based hash of (sample seed, step, vocab
index) fed through the Gumbel-max trick. A sample's tokens therefore depend only on its own seed
and logits, not on which other samples share its batch, the batch order, or the device, and no
generator state has to be carried between steps or engines.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.gumbel_sample import gumbel_noise, gumbel_sample, gumbel_sample_reference

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; n samples per prompt (a GRPO group); top_k 0 and top_p 1 disable
    those filters; seed None draws one from the engine's seed; eos from the model config always stops,
    and so does any of stop_token_ids. return_routed_experts: fill RolloutResult.routed_experts (for
    routing replay); off, the engine records nothing."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    return_routed_experts: bool = False

    def __post_init__(self):
        def bad(name, why):
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        for name in ("temperature", "top_p", "top_k", "max_tokens", "n", "seed"):
            if isinstance(getattr(self, name), bool):  # bool is an int to isinstance, never a valid value here
                raise bad(name, "must be a number, not a bool")

        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise bad("temperature", "must be a finite number >= 0")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise bad("n", "must be an integer >= 1")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise bad("seed", "must be None or an integer in [0, 2^63)")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.return_routed_experts, bool):
            raise bad("return_routed_experts", "must be a bool")


@dataclass
class RolloutResult:
    """One sample. `logprobs[i]` is the FP32 log_softmax(logits / temperature)[token_ids[i]] over the
    full vocabulary (before top-k/top-p filtering); at temperature 0 the logits are not scaled.
    finish_reason: "stop" (eos or a stop token, which is kept as the last token), "length"
    (max_tokens or the context limit), "abort" (cancelled before it finished). latency_s and ttft_s run
    from the request's arrival at the engine to its last and first token. weight_version is the version of
    the weights that generated the first token; weight_versions the run-length spans (version, tokens) over
    token_ids in order: one span unless the weights were swapped while the sample was in flight (sync mode
    "inflight"), e.g. [(3, 17), (4, 9)]. `token_weight_versions()` expands them per token.

    routed_experts (only with SamplingParams.return_routed_experts, else None): the top-k expert ids every MoE
    layer chose for every token the engine fed through the model, one array over prompt and completion,
    [num_prompt_tokens + num_completion_tokens - 1, layers, k] (uint8 up to 256 experts). Row i is the token at
    position i of prompt + completion; the last completion token is never fed, so it has no row. The prompt's
    rows come from its one prefill (shared by the group's n samples), and row num_prompt_tokens - 1 + j is the
    forward that sampled completion token j: exactly what a trainer replays (R3) when it teacher-forces the
    sequence to score the completion."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    num_prompt_tokens: int
    num_completion_tokens: int
    # Bookkeeping, not part of a result's identity: engine-local ids and wall-clock times.
    request_id: str = field(default="", compare=False)
    latency_s: float = field(default=0.0, compare=False)
    ttft_s: float = field(default=0.0, compare=False)
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    # Left out of ==: a numpy array's == is elementwise, which a dataclass comparison cannot use.
    routed_experts: np.ndarray | None = field(default=None, compare=False)

    def token_weight_versions(self) -> list[int]:
        return [v for v, n in self.weight_versions for _ in range(n)]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, steps: torch.Tensor, *, filtered: bool = True,
           fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 and per-row params [B] -> (tokens [B] int64, logprobs [B] fp32). filtered=False skips the
    top-k / top-p machinery (a sort of every row over the vocabulary): the caller knows from the host-side params
    that no row has top_k > 0 or top_p < 1, and the result is then the same. That case runs kernels/gumbel_sample.py
    with `fused` (two launches; the tokens bit-identical on the GPU) and its torch form without."""
    if not filtered:
        return (gumbel_sample if fused else gumbel_sample_reference)(logits, temperature, seeds, steps)
    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / scale[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    V = logits.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    # top_p >= 1 keeps everything outright: in FP32 the mass before a far-tail token can round to exactly 1.
    keep &= ((probs.cumsum(dim=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1)
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits.masked_fill(~keep, float("-inf")))
    sampled = torch.argmax(filtered + gumbel_noise(seeds, steps, V), dim=-1)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)
