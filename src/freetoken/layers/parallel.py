"""Linear and embedding layers holding one rank's shard, under the same parameter names (`.weight`).

- ColumnParallelLinear: splits the output features; each rank's output is its slice (no
  communication). `ranges` pick which output rows a rank keeps (several for fused projections).
- RowParallelLinear: splits the input features; each rank's product is a partial sum, added over
  ranks by `ParallelContext.all_reduce` (fixed rank order, the same bits on every rank).
- VocabParallelEmbedding: splits the vocabulary; a rank looks up the ids it holds, zeros the rest,
  and the all-reduce completes every row.

With world_size 1 each is exactly its plain parent class: the same parameters, the same op, and no
collective.
"""

from __future__ import annotations

import torch

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import ShardSpec
from freetoken.layers.basic import Embedding, Linear


def even_ranges(total: int, parallel: ParallelContext, what: str, unit: int = 1) -> tuple[tuple[int, int], ...]:
    """This rank's contiguous share of `total` items of `unit` features each, as feature ranges."""
    start, stop = parallel.split(total, what)
    return ((start * unit, stop * unit),)


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, parallel: ParallelContext = SINGLE, ranges: tuple[tuple[int, int], ...] | None = None):
        if parallel.is_parallel:
            ranges = ranges or even_ranges(out_features, parallel, "output features")
            out_features = ShardSpec(0, ranges).size
        super().__init__(in_features, out_features)
        self.shard_specs = {"weight": ShardSpec(0, ranges)} if parallel.is_parallel else {}


class RowParallelLinear(Linear):
    """input_is_parallel: x is already this rank's slice of the input features (the output of a
    column-parallel layer); otherwise x is whole and the rank takes its slice here."""

    def __init__(self, in_features: int, out_features: int, parallel: ParallelContext = SINGLE, ranges: tuple[tuple[int, int], ...] | None = None, input_is_parallel: bool = True):
        input_slice = None
        if parallel.is_parallel:
            ranges = ranges or even_ranges(in_features, parallel, "input features")
            if not input_is_parallel:
                if len(ranges) != 1:
                    raise ValueError("a whole input can only be sliced by one range")
                input_slice = slice(*ranges[0])
            in_features = ShardSpec(1, ranges).size
        super().__init__(in_features, out_features)
        self.parallel, self.input_slice = parallel, input_slice
        self.shard_specs = {"weight": ShardSpec(1, ranges)} if parallel.is_parallel else {}

    def forward(self, x: torch.Tensor, defer_sum: bool = False) -> torch.Tensor:  # [N, in/W] (or [N, in]) -> [N, out]
        """defer_sum (one rank only): the output may be a split-K linear's partials (`kernels.linear`),
        for a caller that hands it to the next residual add + norm."""
        if self.input_slice is not None:
            x = x[:, self.input_slice]
        if not self.parallel.is_parallel:
            return kernels.linear(x, self.weight, defer_sum=defer_sum)
        return self.parallel.all_reduce(kernels.linear(x, self.weight))


class VocabParallelEmbedding(Embedding):
    def __init__(self, num_embeddings: int, dim: int, parallel: ParallelContext = SINGLE):
        start, stop = parallel.split(num_embeddings, "the vocabulary")
        super().__init__(stop - start, dim)
        self.parallel, self.vocab_start = parallel, start
        self.shard_specs = {"weight": ShardSpec(0, ((start, stop),))} if parallel.is_parallel else {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, H]
        if not self.parallel.is_parallel:
            return self.weight[ids]
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = self.weight[local.clamp(0, self.weight.shape[0] - 1)]
        rows = rows.masked_fill(outside[:, None], 0.0)
        return self.parallel.all_reduce(rows)
