"""Paged KV pool for the full-attention layers (target and draft) and its block allocator.

Keys and values of every attention layer live in [num_blocks * block_size, Hkv, D] tensors; a
request owns a list of blocks (its block table). Token p of a request sits in slot
block_table[p // block_size] * block_size + p % block_size. A model may keep more per-token rows in
the same slots (`extra_shapes`, e.g. a sparse-attention indexer's keys): one [num_slots, *shape]
tensor each.

Blocks are reference-counted: a block of a cached prompt prefix is held by the prefix cache and by
every request whose table shares it, and goes back to the free list when the last holder lets go.
When the free list is short, the allocator first asks its `reclaimer` (the prefix cache) to let go
of blocks nobody else holds, and only if that makes enough room: a request that will not fit anyway
costs the cache nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from freetoken.forward_context import KVCache


class Reclaimer(Protocol):
    def reclaim(self, num_blocks: int) -> bool:
        """Release num_blocks blocks that only the reclaimer holds (least recently used first) if it has
        that many to release, else release none -> whether it released them."""


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 extra_shapes: tuple[tuple[int, ...], ...] = ()):
        self.num_blocks, self.block_size = num_blocks, block_size
        num_slots = num_blocks * block_size
        shape = (num_slots, num_kv_heads, head_dim)
        self.cache = KVCache(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            block_size=block_size,
            extra=[torch.zeros((num_slots, *s), dtype=dtype, device=device) for s in extra_shapes],
        )
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks  # holders of each block (request tables, the prefix cache)
        self.reclaimer: Reclaimer | None = None

    def reserve_block(self) -> int:
        """Take one free block out of circulation for good; num_blocks counts only the others."""
        self.num_blocks -= 1
        return self.free_blocks.pop()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def _make_room(self, num_blocks: int) -> bool:
        """Whether num_blocks blocks are free, the reclaimer's released first when that makes enough of them."""
        short = num_blocks - len(self.free_blocks)
        return short <= 0 or (self.reclaimer is not None and self.reclaimer.reclaim(short))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether block_table can grow to num_tokens tokens; reclaims cached blocks only if that makes it fit."""
        return self._make_room(self.blocks_needed(block_table, num_tokens))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to block_table (in place) until it holds num_tokens tokens."""
        needed = self.blocks_needed(block_table, num_tokens)
        self._make_room(needed)
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            block_table.append(block)

    def share(self, block: int) -> None:
        """One more holder of an allocated block."""
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One holder less; the block is free again when none is left."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def trim(self, block_table: list[int], num_tokens: int) -> None:
        """Release the blocks past the first num_tokens tokens (in place)."""
        keep = -(-num_tokens // self.block_size)
        while len(block_table) > keep:
            self.release(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        self.trim(block_table, 0)

    def slots(self, block_table: list[int], start: int, stop: int) -> list[int]:
        """Slots of token positions [start, stop)."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, stop)]
