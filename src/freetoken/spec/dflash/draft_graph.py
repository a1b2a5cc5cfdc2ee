"""CUDA graphs of the greedy DFlash draft step: one per (bucketed batch size, context bucket).

A graph captures `BlockStep.greedy_drafts` (block forward over the context pool, the logits of the
k drafted slots, their argmax or the DFlash2 selector's greedy walk) reading the step's static
inputs (`BlockInputs.on_device` of its batch size) and the pool's tensors, and writes the drafts
[bb, k] to a static output. A call uploads the inputs (the method does), replays and the method
reads the drafts back once. Graphs are captured on first use and share one memory pool; the step
writes nothing outside its own outputs, so the warm-up runs before a capture need no undoing.

The graph launches the eager step's kernels at the same shapes, so its drafts are the eager path's
bit for bit. When the context pool reallocates (more slots) the graphs, which read the old tensors,
are dropped and captured again on their next use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine.cuda_graph import DecodeGraphs, record_graph
from freetoken.spec.dflash.block_step import BlockInputs, BlockStep


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    drafts: torch.Tensor  # [bb, k] int64 static output


class DraftGraphs:
    """The greedy DFlash draft step, replayed as CUDA graphs."""

    def __init__(self, step: BlockStep):
        self.step = step
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (batch size, context bucket) -> graph
        self.generation = step.pool.generation
        self.pool = None

    @staticmethod
    def supported(model: torch.nn.Module, device: torch.device) -> bool:
        """On CUDA where the target's decode graphs are (its embedding and lm_head are captured too), on one rank."""
        parallel = getattr(model, "parallel", None)
        device = torch.device(device)
        return device.type == "cuda" and DecodeGraphs.supported(model, device) and (parallel is None or parallel.world_size == 1)

    @torch.no_grad()
    def run(self, inputs: BlockInputs, n: int) -> torch.Tensor:  # -> [bb, k] int64 on the device
        """Replay the greedy step of inputs' batch size at context bucket n (captured on first use); the
        inputs are uploaded already. The result holds until the next replay of the same graph."""
        if self.step.pool.generation != self.generation:
            self.graphs.clear()
            self.generation = self.step.pool.generation
        key = (inputs.on_device["anchors"].shape[0], n)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(inputs, n)
        entry.graph.replay()
        return entry.drafts

    def _capture(self, inputs: BlockInputs, n: int) -> _Graph:
        views = inputs.on_device
        graph, drafts = self._record(lambda: self.step.greedy_drafts(views, n))
        return _Graph(graph, drafts)

    def _record(self, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """fn captured into this object's memory pool (shared by its graphs) -> (graph, fn's output)."""
        graph, out = record_graph(fn, self.pool)
        self.pool = graph.pool()
        return graph, out
