"""Every request's DFlash draft context in one preallocated pool.

A request's context is the K and V of its committed rows 0 .. n-1 in every draft layer
(spec/dflash/method.py). They live in keys, values [L, num_slots, kv, max_ctx, hd]: a request
holds one slot from its first observed row until it is released, and its row p sits at
(slot, p). observe writes new rows in place (`write`); a draft step reads the first n rows of the
batch's slots (`gather`, one gather each for K and V) and masks the rows at or past each request's
length, so no per-request tensor is grown or copied into a padded one.

The pool is zero-filled once: the rows past a request's length hold zeros or an earlier holder's
rows, finite either way, so masking them out (softmax weight 0) adds exactly nothing.

Slots are taken as requests arrive: when every slot is held, the slot count doubles (the held rows
copied over). `generation` counts these reallocations; whoever keeps views of the tensors (the
draft graphs) rebuilds them when it changes. The count stops growing at the number of requests
running at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class ContextSlot:
    """A request's draft context: its rows 0 .. num_rows - 1 at slot `slot` of `pool`."""

    pool: ContextPool
    slot: int
    num_rows: int = 0

    @property
    def keys(self) -> torch.Tensor:  # -> [L, kv, max_ctx, hd], a view of the pool
        """The slot's K rows (valid up to num_rows)."""
        return self.pool.keys[:, self.slot]

    @property
    def values(self) -> torch.Tensor:  # -> [L, kv, max_ctx, hd], a view of the pool
        """The slot's V rows (valid up to num_rows)."""
        return self.pool.values[:, self.slot]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # -> [L, kv, num_rows, hd] each
        """The held rows' K and V."""
        return self.keys[:, :, : self.num_rows], self.values[:, :, : self.num_rows]


class ContextPool:
    def __init__(self, num_layers: int, num_kv_heads: int, max_ctx: int, head_dim: int, dtype: torch.dtype, device: torch.device | str, num_slots: int = 1):
        """Room for num_slots contexts of up to max_ctx rows each (more slots are added on demand)."""
        self.max_ctx = max_ctx
        shape = (num_layers, num_slots, num_kv_heads, max_ctx, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self.generation = 0

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    def acquire(self) -> ContextSlot:
        """A free slot for a new context (no rows yet), doubling the slot count when none is free."""
        if not self.free:
            self._grow(2 * self.num_slots)
        return ContextSlot(self, self.free.pop())

    def release(self, slot: ContextSlot) -> None:
        """Give the slot back; its rows stay until a later holder overwrites them."""
        self.free.append(slot.slot)

    def _grow(self, num_slots: int) -> None:
        old = self.num_slots
        for name in ("keys", "values"):
            t = getattr(self, name)
            grown = t.new_zeros(t.shape[:1] + (num_slots,) + t.shape[2:])
            grown[:, :old] = t
            setattr(self, name, grown)
        self.free = list(range(num_slots - 1, old - 1, -1)) + self.free
        self.generation += 1

    def write(self, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store rows in place: row i of keys, values [L, kv, n, hd] at (slots[i], positions[i]) (int64 [n] each, on the pool's device)."""
        self.keys[:, slots, :, positions] = keys.permute(2, 0, 1, 3)
        self.values[:, slots, :, positions] = values.permute(2, 0, 1, 3)

    def gather(self, slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0 .. n-1 of slots [b] (int64) -> K, V [L, b, kv, n, hd] each (new tensors)."""
        return self.keys[:, :, :, :n].index_select(1, slots), self.values[:, :, :, :n].index_select(1, slots)
