"""One MoE layer's routed experts in host memory, read lazily from the checkpoint.

The store holds experts [first, E) of the layer: gate_up [E - first, 2I, H] and down [E - first, H, I]
in the model's dtype, allocated on first use (pinned when the model runs on CUDA, so copies to the
device are asynchronous DMA) and filled one expert at a time as the router first asks for it, from the
memory-mapped checkpoint (`get_slice`: only that expert's bytes are read). A filled expert is never
written again, so a copy in flight from it is always safe. With `checkpoint_ids` the store's ids are a
renumbering of the layer's experts (hybrid with a placement file): id e is checkpoint expert
checkpoint_ids[e].
"""

from __future__ import annotations

import torch

from freetoken.distributed.sharding import ShardSpec, read_shard


def expert_bytes(gate_up_shape: tuple[int, int], down_shape: tuple[int, int], dtype: torch.dtype) -> int:
    """One expert's gate_up [2I, H] and down [H, I] bytes in `dtype`."""
    (a, b), (c, d) = gate_up_shape, down_shape
    return (a * b + c * d) * dtype.itemsize


class HostExpertStore:
    def __init__(self, source, gate_up_name: str, down_name: str, first: int, num_experts: int,
                 gate_up_shape: tuple[int, int], down_shape: tuple[int, int], dtype: torch.dtype, pin: bool,
                 checkpoint_ids: tuple[int, ...] | None = None):
        self.source = source  # a TensorSource: get(name), and get_slice(name, dim, start, stop) when it has one
        self.gate_up_name, self.down_name = gate_up_name, down_name
        self.first, self.num_experts = first, num_experts
        self.gate_up_shape, self.down_shape = gate_up_shape, down_shape  # one expert's [2I, H], [H, I]
        self.dtype, self.pin = dtype, pin
        self._gate_up: torch.Tensor | None = None  # [E - first, 2I, H] once allocated
        self._down: torch.Tensor | None = None  # [E - first, H, I]
        self._loaded = [False] * (num_experts - first)
        self.checkpoint_ids = checkpoint_ids  # store id -> the checkpoint's expert index; None: the same

    @property
    def num_stored(self) -> int:
        return self.num_experts - self.first

    @property
    def expert_bytes(self) -> int:
        """One expert's gate_up and down bytes in the model dtype."""
        return expert_bytes(self.gate_up_shape, self.down_shape, self.dtype)

    @property
    def capacity_bytes(self) -> int:
        """Host bytes of this layer once every stored expert is loaded."""
        return self.num_stored * self.expert_bytes

    def ensure(self, experts: list[int]) -> None:
        """Load the experts (global ids in [first, E)) not loaded yet."""
        if self._gate_up is None:
            self._gate_up = torch.empty((self.num_stored, *self.gate_up_shape), dtype=self.dtype, pin_memory=self.pin)
            self._down = torch.empty((self.num_stored, *self.down_shape), dtype=self.dtype, pin_memory=self.pin)
        for expert in experts:
            local = expert - self.first
            if not self._loaded[local]:
                self._gate_up[local].copy_(self._read(self.gate_up_name, expert))
                self._down[local].copy_(self._read(self.down_name, expert))
                self._loaded[local] = True

    def _read(self, name: str, expert: int) -> torch.Tensor:  # -> [2I, H] or [H, I] in the checkpoint's dtype
        if self.checkpoint_ids is not None:
            expert = self.checkpoint_ids[expert]
        return read_shard(self.source, name, ShardSpec(0, ((expert, expert + 1),)))[0]

    def weights(self, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E - first, 2I, H], down [E - first, H, I]) with at least `experts` loaded (row e - first holds e)."""
        self.ensure(experts)
        return self._gate_up, self._down

    def expert(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert, loaded."""
        gate_up, down = self.weights([expert])
        return gate_up[expert - self.first], down[expert - self.first]
