"""The parallel context every sharded layer is given explicitly (no process-wide globals).

Collectives are written so that a result never depends on how many rows share the call and is
bitwise the same on every rank: a reduction gathers all ranks' partials and adds them in rank
order (x0 + x1 + ...), in fp32, instead of a ring all-reduce whose summation order per element
depends on the tensor size. With world_size 1 every collective is the identity and
torch.distributed is never called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from freetoken.errors import FreetokenError


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None means the default group

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's contiguous share [start, stop) of `total` items (heads, experts, rows)."""
        if total % self.world_size:
            raise FreetokenError(f"--tensor-parallel {self.world_size} does not divide {what} ({total})")
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] partial -> [N, H] sum over ranks
        """Sum of every rank's x, added in rank order in fp32; the same bits on every rank."""
        if not self.is_parallel:
            return x
        parts = self._gather(x)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [N, V/W] -> [N, V]
        """Every rank's x concatenated along the last dimension, in rank order."""
        if not self.is_parallel:
            return x
        return torch.cat(self._gather(x), dim=-1)


SINGLE = ParallelContext()
