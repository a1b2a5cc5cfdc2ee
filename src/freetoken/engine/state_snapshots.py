"""Snapshots of committed linear-attention state for the prefix cache, in a budgeted slot pool.

A snapshot is one request's whole per-request state (every GDN layer's conv window and recurrent
state, and the model's extra states) copied at a token boundary right after a prefill step, so it
is committed state (DESIGN.md invariant 4), never a verify row's. The pool has as many slots as
the byte budget holds (at most `max_slots`), allocated once; when it is full, the least recently
used snapshot is dropped to make room (its owner, a prefix-cache node, forgets it through the
`on_evict` callback it gave).
"""

from __future__ import annotations

from typing import Callable

import torch

from freetoken.engine.linear_state_pool import LinearStatePool, copy_slot
from freetoken.forward_context import LinearState


class SnapshotStore:
    def __init__(self, live: LinearStatePool, budget_bytes: int, max_slots: int):
        """live: the running requests' pool (the layout to copy); budget_bytes: what the snapshots may hold."""
        self.live = live
        self.slot_bytes = live.slot_bytes
        self.num_slots = min(max_slots, budget_bytes // self.slot_bytes)
        self.state = _state_like(live.state, self.num_slots) if self.num_slots else None
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.last_use: dict[int, int] = {}  # held slot -> its last use (a tick)
        self.on_evict: dict[int, Callable[[], None]] = {}
        self.clock = 0

    @property
    def num_held(self) -> int:
        return len(self.last_use)

    @property
    def held_bytes(self) -> int:
        return self.num_held * self.slot_bytes

    def take(self, live_slot: int, on_evict: Callable[[], None]) -> int | None:
        """Snapshot the live slot's state -> the snapshot's slot (None with a zero budget)."""
        if not self.num_slots:
            return None
        if not self.free_slots:
            self.drop(min(self.last_use, key=self.last_use.__getitem__))
        slot = self.free_slots.pop()
        copy_slot(self.state, slot, self.live.state, live_slot)
        self.on_evict[slot] = on_evict
        self.touch(slot)
        return slot

    def restore(self, slot: int, live_slot: int) -> None:
        """Overwrite a live slot with a snapshot."""
        copy_slot(self.live.state, live_slot, self.state, slot)
        self.touch(slot)

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_use[slot] = self.clock

    def drop(self, slot: int) -> None:
        """Free a snapshot slot and tell its owner."""
        del self.last_use[slot]
        self.on_evict.pop(slot)()
        self.free_slots.append(slot)


def _state_like(state: LinearState, num_slots: int) -> LinearState:
    """Zeroed tensors of the state's layout (every layer, dtype, device) with num_slots slots."""

    def like(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros((t.shape[0], num_slots, *t.shape[2:]))

    return LinearState(like(state.conv), like(state.recurrent), {name: like(t) for name, t in state.extra.items()})
