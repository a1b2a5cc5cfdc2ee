"""Which part of a checkpoint tensor a rank holds, and reading just that part.

A `ShardSpec` is a dimension and the ranges along it that this rank keeps, concatenated in order:
one range for a plain column or row split, several for fused tensors whose parts are split
separately (the GDN [q | k | v] projection and its convolution). Sharded modules publish their
specs as `module.shard_specs = {param_name: ShardSpec}`; a parameter without one is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


def read_shard(source, name: str, spec: ShardSpec) -> torch.Tensor:
    """The rank's part of tensor `name`: `source.get_slice` per range when the source has it (a
    memory-mapped checkpoint reads only those bytes), else a slice of `source.get(name)`."""
    if hasattr(source, "get_slice"):
        parts = [source.get_slice(name, spec.dim, start, stop) for start, stop in spec.ranges]
    else:
        whole = source.get(name)
        parts = [whole.narrow(spec.dim, start, stop - start) for start, stop in spec.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def shard_spec_of(model: torch.nn.Module, param_name: str) -> ShardSpec | None:
    """The ShardSpec a parameter's module declares for it, or None (replicated / unsharded)."""
    module_name, _, attr = param_name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return getattr(module, "shard_specs", {}).get(attr)
