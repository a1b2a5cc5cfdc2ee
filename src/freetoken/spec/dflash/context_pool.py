"""Every request's DFlash draft context in one preallocated pool.

A request's context is the K and V of its committed rows 0 .. n-1 in every draft layer
(spec/dflash/method.py). They live in keys, values [L, num_slots, kv, capacity, hd]: a request
holds one slot from its first observed row until it is released, and its row p sits at
(slot, p). The capacity is the smallest context bucket (`context_buckets`: 256, 512, ... ,
max_ctx) that holds the longest context written so far, so the pool's memory follows the contexts
the run has, not max_ctx; a draft step's bucket never exceeds it. observe writes new rows in place (`write`); a draft step reads the first n rows of the
batch's slots (`gather`, one gather each for K and V) and masks the rows at or past each request's
length, so no per-request tensor is grown or copied into a padded one.

The pool is zero-filled once: the rows past a request's length hold zeros or an earlier holder's
rows, finite either way, so masking them out (softmax weight 0) adds exactly nothing.

Slots are taken as requests arrive: when every slot is held, the slot count doubles; when a row
lands past the capacity, the capacity grows to the bucket holding it (the held rows copied over
either way). `generation` counts these reallocations; whoever keeps views of the tensors (the
draft graphs) rebuilds them when it changes. The count stops growing at the number of requests
running at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMALLEST_CONTEXT_BUCKET = 256


def context_buckets(max_ctx: int, smallest: int = SMALLEST_CONTEXT_BUCKET) -> tuple[int, ...]:
    """The context lengths a draft step runs at and the pool's capacities: powers of two from
    `smallest` below max_ctx, then max_ctx."""
    buckets, n = [], smallest
    while n < max_ctx:
        buckets.append(n)
        n *= 2
    return tuple(buckets) + (max_ctx,)


def bucket_of(buckets: tuple[int, ...], rows: int) -> int:
    """The smallest bucket holding `rows` rows."""
    return next(n for n in buckets if n >= rows)


@dataclass(eq=False)
class ContextSlot:
    """A request's draft context: its rows 0 .. num_rows - 1 at slot `slot` of `pool`."""

    pool: ContextPool
    slot: int
    num_rows: int = 0

    @property
    def keys(self) -> torch.Tensor:  # -> [L, kv, capacity, hd], a view of the pool
        """The slot's K rows (valid up to num_rows)."""
        return self.pool.keys[:, self.slot]

    @property
    def values(self) -> torch.Tensor:  # -> [L, kv, capacity, hd], a view of the pool
        """The slot's V rows (valid up to num_rows)."""
        return self.pool.values[:, self.slot]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # -> [L, kv, num_rows, hd] each
        """The held rows' K and V."""
        return self.keys[:, :, : self.num_rows], self.values[:, :, : self.num_rows]


class ContextPool:
    def __init__(self, num_layers: int, num_kv_heads: int, max_ctx: int, head_dim: int, dtype: torch.dtype, device: torch.device | str, num_slots: int = 1):
        """Room for num_slots contexts of the smallest bucket's rows (more slots and rows are added on
        demand, up to max_ctx rows a context)."""
        self.max_ctx = max_ctx
        self.buckets = context_buckets(max_ctx)
        shape = (num_layers, num_slots, num_kv_heads, self.buckets[0], head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self.generation = 0

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        """Rows each slot holds now."""
        return self.keys.shape[3]

    def reserve(self, rows: int) -> None:
        """Make room for contexts of `rows` rows (<= max_ctx): the capacity grows to the bucket holding them."""
        if rows > self.capacity:
            self._grow(self.num_slots, bucket_of(self.buckets, rows))

    def acquire(self) -> ContextSlot:
        """A free slot for a new context (no rows yet), doubling the slot count when none is free."""
        if not self.free:
            self._grow(2 * self.num_slots, self.capacity)
        return ContextSlot(self, self.free.pop())

    def release(self, slot: ContextSlot) -> None:
        """Give the slot back; its rows stay until a later holder overwrites them."""
        self.free.append(slot.slot)

    def _grow(self, num_slots: int, capacity: int) -> None:
        old, rows = self.num_slots, self.capacity
        for name in ("keys", "values"):
            t = getattr(self, name)
            grown = t.new_zeros(t.shape[:1] + (num_slots,) + t.shape[2:3] + (capacity,) + t.shape[4:])
            grown[:, :old, :, :rows] = t
            setattr(self, name, grown)
        self.free = list(range(num_slots - 1, old - 1, -1)) + self.free
        self.generation += 1

    def write(self, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store rows in place: row i of keys, values [L, kv, n, hd] at (slots[i], positions[i]) (int64 [n] each,
        on the pool's device; every position below the capacity: `reserve` first)."""
        self.keys[:, slots, :, positions] = keys.permute(2, 0, 1, 3)
        self.values[:, slots, :, positions] = values.permute(2, 0, 1, 3)

    def gather(self, slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0 .. n-1 (n <= capacity) of slots [b] (int64) -> K, V [L, b, kv, n, hd] each (new tensors)."""
        return self.keys[:, :, :, :n].index_select(1, slots), self.values[:, :, :, :n].index_select(1, slots)
