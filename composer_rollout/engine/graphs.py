"""Decode steps as CUDA graphs: one graph per batch bucket, captured at engine start-up, replayed every step.

At small batch a decode step of an MoE model is hundreds of short kernels (per layer: norms, four projections,
RoPE, the cache write, attention, the router, two or three MoE launches); launched from Python one by one, the
host is the bottleneck. A graph launches them all in one call. What a graph needs, the engine already keeps:
a step's tensors have a static shape per bucket (padding rows decode on the scratch slot), and nothing inside
the forward reads back to the host.

What is captured: the model's forward of one token per row, the FP32 logits of the last hidden state, the rows'
tokens and logprobs sampled without top-k / top-p (temperature and per-row seeds are graph inputs; with the Triton
dense path the sampler is kernels/gumbel_sample.py's two launches), plus the routed-expert ids of every row (an
ExpertCapture of the bucket's rows, written by each layer's router, recorded always, read only for the sequences
that asked). A step whose rows filter samples again from the logits, eagerly: the sort it takes depends on the
rows' parameters. Sampled eagerly after the replay, the torch form cost a B = 1 step ~0.3 ms (docs/perf.md).

The graphs read the weights at the addresses they had at capture, so a weight update must be copied into the
live tensors (WeightUpdate.apply(..., in_place=True)), never swapped by pointer. Buckets are captured largest
first into one memory pool, which the smaller ones reuse.

The torch MoE path (kernels.moe_reference) reads routing back to the host and cannot be captured: the engine
refuses cuda_graphs with kernel=torch before any work.
"""

import time

import torch

from composer_rollout.engine.capture import ExpertCapture
from composer_rollout.engine.sampling import sample
from composer_rollout.engine.step_io import StepInputs


def decode_step(model, cache, ids, positions, slots, temperature, seeds, steps, capture=None):
    """One decode step as the graphs capture it: the forward of ids, positions [rows, 1] on slots [rows], the FP32
    logits, and the rows' tokens and logprobs sampled without top-k / top-p -> (logits, tokens, logprobs)."""
    hidden = model(ids, positions, slots, cache, capture)
    logits = model.compute_logits(hidden[:, 0])
    return logits, *sample(logits, temperature, None, None, seeds, steps, filtered=False,
                           fused=model.dense == "triton")


class DecodeGraphs:
    """Captured decode steps for each batch size in `buckets`; `replay` runs the one for a row count on the inputs
    already in `inputs` (a StepInputs the graphs read in place), `run` copies given inputs there first."""

    def __init__(self, model, cache, buckets: list[int], inputs: StepInputs | None = None, warmup: int = 2):
        if model.device.type != "cuda":
            raise ValueError(f"engine.cuda_graphs needs a CUDA device; the model is on {model.device}")
        start = time.perf_counter()
        self.model, self.cache, self.pool = model, cache, torch.cuda.graph_pool_handle()
        self.inputs = StepInputs(max(buckets), model.device) if inputs is None else inputs
        if self.inputs.max_rows < max(buckets):
            raise ValueError(f"inputs hold {self.inputs.max_rows} rows; the largest bucket is {max(buckets)}")
        self._graphs: dict[int, tuple] = {}
        a, dev = model.args, model.device
        for rows in sorted(buckets, reverse=True):
            # Padding rows: greedy, on the scratch slot (the captured values; every replay's come from `inputs`).
            views = self.inputs.load(rows, {"slots": [cache.scratch_slot] * rows})
            capture = ExpertCapture(a.num_hidden_layers, rows, a.num_experts_per_tok, a.num_experts, dev)
            # Warm-up outside the graph, on a side stream as torch requires: Triton compiles and autotunes, cuBLAS
            # makes its workspaces; none of that may happen during capture.
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._forward(views, capture)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._forward(views, capture)
            self._graphs[rows] = (graph, outputs, capture)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - start

    def _forward(self, v: dict[str, torch.Tensor], capture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return decode_step(self.model, self.cache, v["ids"][:, None], v["positions"][:, None], v["slots"],
                           v["temperature"], v["seeds"], v["steps"], capture)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def _graph(self, rows: int) -> tuple:
        if rows not in self._graphs:
            raise ValueError(f"no decode graph for {rows} rows; captured: {self.buckets}")
        return self._graphs[rows]

    def replay(self, rows: int):
        """The step of a captured bucket size on the inputs in `self.inputs.views(rows)` -> (logits [rows, V] fp32,
        tokens [rows] int64 and logprobs [rows] fp32 sampled without top-k / top-p, the ExpertCapture of the step).
        All are the graph's own buffers: read them before the next replay."""
        graph, (logits, tokens, logprobs), capture = self._graph(rows)
        graph.replay()
        return logits, tokens, logprobs, capture

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, temperature: torch.Tensor,
            seeds: torch.Tensor, steps: torch.Tensor):
        """`replay` on these inputs (ids, positions [rows, 1]; slots, temperature, seeds, steps [rows], on the
        device), copied into the graphs' input buffers first: for callers that hold their own tensors."""
        self._graph(ids.shape[0])
        views = self.inputs.views(ids.shape[0])
        for name, src in (("ids", ids[:, 0]), ("positions", positions[:, 0]), ("slots", slots),
                          ("temperature", temperature), ("seeds", seeds), ("steps", steps)):
            views[name].copy_(src)
        return self.replay(ids.shape[0])
