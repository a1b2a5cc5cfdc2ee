"""One MoE layer's device slots for routed experts, filled from a HostExpertStore (LRU).

The slots are one gate_up [S (+1), 2I, H] and one down [S (+1), H, I] tensor on the device, so the
expert kernels read them as they read the resident experts, through `slot_of` [E (+1)] (expert id ->
slot, -1 absent; kernels.moe_experts). The optional last row is the shared expert, stacked as expert E
as the resident block stacks it (layers/moe.py), and never evicted.

`fetch(needed)` runs after the router and before the experts: it copies the missing experts of the
step into free or least recently used slots that the step does not need (on the current stream, from
pinned memory, so the copy is ordered after every earlier read of the slot and before the GEMMs), then
writes slot_of. A step whose experts outnumber the slots runs in groups of tokens (`token_groups`);
each token's result does not depend on its group (row invariance), so the bits are those of one call.

Slots are per layer rather than one pool for all layers: layers run in a fixed cycle, and a global LRU
smaller than the cycle's working set evicts exactly the experts the next layer is about to need.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from freetoken.layers.expert_store import HostExpertStore


@dataclass
class CacheStats:
    hits: int = 0  # needed experts already in a slot
    misses: int = 0  # needed experts copied in
    evictions: int = 0  # copies that replaced another expert
    bytes_copied: int = 0


class ExpertSlotCache:
    def __init__(self, store: HostExpertStore, num_slots: int, device: torch.device, with_shared_row: bool):
        self.store = store
        self.num_slots = num_slots
        rows = num_slots + int(with_shared_row)
        self.gate_up = torch.empty((rows, *store.gate_up_shape), dtype=store.dtype, device=device)
        self.down = torch.empty((rows, *store.down_shape), dtype=store.dtype, device=device)
        num_ids = store.num_experts + int(with_shared_row)
        self._slot_of_host = torch.full((num_ids,), -1, dtype=torch.int32)
        if with_shared_row:
            self._slot_of_host[-1] = num_slots
        self.slot_of = self._slot_of_host.to(device)  # [E (+1)] int32: expert id -> slot, -1 absent
        self._lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free = list(range(num_slots))
        self.stats = CacheStats()

    @property
    def device_bytes(self) -> int:
        return (self.gate_up.numel() + self.down.numel()) * self.gate_up.element_size()

    def token_groups(self, token_experts: list[list[int]]) -> list[list[int]]:
        """Consecutive tokens grouped so that each group's experts fit the slots -> token indices per group."""
        groups: list[list[int]] = []
        union: set[int] = set()
        for token, experts in enumerate(token_experts):
            joined = union | set(experts)
            if groups and len(joined) <= self.num_slots:
                groups[-1].append(token)
                union = joined
            else:
                groups.append([token])
                union = set(experts)
        return groups

    def fetch(self, needed: list[int]) -> None:
        """Make every expert in `needed` (at most num_slots distinct ids) resident and slot_of current."""
        needed_set = set(needed)
        assert len(needed_set) <= self.num_slots, f"{len(needed_set)} experts for {self.num_slots} slots"
        missing = sorted(e for e in needed_set if e not in self._lru)
        self.stats.hits += len(needed_set) - len(missing)
        for expert in sorted(needed_set - set(missing)):
            self._lru.move_to_end(expert)
        victims = (e for e in list(self._lru) if e not in needed_set)  # least recently used first
        for expert in missing:
            if self._free:
                slot = self._free.pop(0)
            else:
                evicted = next(victims)
                slot = self._lru.pop(evicted)
                self._slot_of_host[evicted] = -1
                self.stats.evictions += 1
            gate_up, down = self.store.expert(expert)
            self.gate_up[slot].copy_(gate_up, non_blocking=True)
            self.down[slot].copy_(down, non_blocking=True)
            self._lru[expert] = slot
            self._slot_of_host[expert] = slot
        self.stats.misses += len(missing)
        self.stats.bytes_copied += len(missing) * self.store.expert_bytes
        if missing:
            self.slot_of.copy_(self._slot_of_host)

    def resident_experts(self) -> list[int]:
        """The routed experts in a slot now, ascending."""
        return sorted(self._lru)
