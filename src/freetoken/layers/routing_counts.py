"""Count which routed experts each MoE layer's router picks (for `freetoken experts-profile`).

`count_routing(model)` is a context manager: while open, every SparseMoE hands its routing's expert
ids to a counter (the block's `routing_observer`), one count per (token, pick); on exit the observers
are removed. The counts are on the host (one sync per MoE layer while counting). Layers are named as
placement files name them ("model.layers.0"; expert_placement.layer_name).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from freetoken.layers.expert_placement import layer_name
from freetoken.layers.moe import moe_blocks


class RoutingCounts:
    def __init__(self, layers: dict[str, int]):
        self.counts = {layer: [0] * num_experts for layer, num_experts in layers.items()}  # layer -> picks per expert id

    def observer(self, layer: str):
        def observe(experts: torch.Tensor) -> None:  # [N, top_k] expert ids
            picks = torch.bincount(experts.flatten().cpu(), minlength=len(self.counts[layer])).tolist()
            self.counts[layer] = [a + b for a, b in zip(self.counts[layer], picks)]
        return observe

    def top(self, layer: str, count: int) -> list[int]:
        """The layer's `count` most picked expert ids (ties to the lower id), ascending."""
        picks = self.counts[layer]
        return sorted(sorted(range(len(picks)), key=lambda e: (-picks[e], e))[:count])


@contextmanager
def count_routing(model: torch.nn.Module):
    """Yield a RoutingCounts that counts every routing of the model's SparseMoE blocks while open."""
    blocks = {layer_name(name): m for name, m in moe_blocks(model)}
    counts = RoutingCounts({layer: m.experts.count for layer, m in blocks.items()})
    for layer, block in blocks.items():
        block.routing_observer = counts.observer(layer)
    try:
        yield counts
    finally:
        for block in blocks.values():
            block.routing_observer = None
