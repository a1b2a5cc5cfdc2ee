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

from freetoken.engine.linear_state_pool import LinearStatePool, copy_slot


class SnapshotStore:
    def __init__(self, live: LinearStatePool, budget_bytes: int, max_slots: int):
        """live: the running requests' pool (the layout to copy); budget_bytes: what the snapshots may hold."""
        self.live = live
        self.slot_bytes = live.slot_bytes
        self.num_slots = min(max_slots, budget_bytes // self.slot_bytes)
        conv, recurrent = live.state.conv, live.state.recurrent
        self.pool = LinearStatePool(
            conv.shape[0], self.num_slots, tuple(conv.shape[2:]), tuple(recurrent.shape[2:]), conv.dtype, conv.device,
            _specs_like(live),
        ) if self.num_slots else None
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
        copy_slot(self.pool.state, slot, self.live.state, live_slot)
        self.on_evict[slot] = on_evict
        self.touch(slot)
        return slot

    def restore(self, slot: int, live_slot: int) -> None:
        """Overwrite a live slot with a snapshot."""
        copy_slot(self.live.state, live_slot, self.pool.state, slot)
        self.touch(slot)

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_use[slot] = self.clock

    def drop(self, slot: int) -> None:
        """Free a snapshot slot and tell its owner."""
        del self.last_use[slot]
        self.on_evict.pop(slot)()
        self.free_slots.append(slot)


def _specs_like(live: LinearStatePool):
    from freetoken.forward_context import StateSpec

    return tuple(StateSpec(name, t.shape[0], tuple(t.shape[2:]), t.dtype) for name, t in live.state.extra.items())
