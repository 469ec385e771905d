"""Routed-expert capture: the expert ids each MoE layer picked for each token, for routing replay (R3).

A trainer that replays the rollout's routing needs, for every token it feeds through the model, the top-k
expert ids of every layer. The engine records them only when some live sequence asked
(SamplingParams.return_routed_experts); otherwise it passes no capture and the forward does nothing extra.

A capture belongs to one forward call: the engine makes one per step and passes it down through the model
(`Qwen3MoE.forward(..., capture=)`), so nothing is global and two engines in one process never share it.
Each MoE block's router writes its [T, k] ids into a preallocated [layers, T, k] buffer on the device (in the
fused router's own launch, or a plain copy; no host synchronisation, fixed shapes: what a CUDA graph needs), and
the engine reads the rows it wants at the step's one synchronisation, where it reads the sampled tokens.

Ids are stored in the smallest integer type that holds num_experts (uint8 up to 256 experts), so a sample's
routing is compact on the host: an array [tokens, layers, k].
"""

import numpy as np
import torch


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert id."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32


class ExpertCapture:
    """The top-k expert ids of one forward over T tokens, for every layer: `ids` [layers, T, k]."""

    def __init__(self, num_layers: int, num_tokens: int, top_k: int, num_experts: int, device):
        self.ids = torch.empty(num_layers, num_tokens, top_k, dtype=expert_id_dtype(num_experts), device=device)

    def layer(self, layer: int) -> torch.Tensor:
        """The [T, k] rows of `layer`, for the MoE block's router to write its expert ids into (the fused router
        writes them in its own launch, the torch one copies them)."""
        return self.ids[layer]

    def rows(self, index: list[int]) -> list[np.ndarray]:
        """The routing of tokens `index` (rows of the forward's flattened batch), one [layers, k] array each,
        copied to the host. Call it after the step has synchronised (the sampled tokens were read)."""
        host = self.ids[:, index].transpose(0, 1).cpu().numpy()
        return list(host)

    def all_rows(self) -> np.ndarray:
        """Every token's routing, [T, layers, k] on the host."""
        return self.ids.transpose(0, 1).cpu().numpy()
