"""The prefix tree's leaves in least-recently-used order, for eviction without a scan of the tree.

A min-heap of [last_use, push number, node] entries. A node's latest entry is the only one that
counts (`node.heap_entry`): touching a leaf or a node turning into a leaf pushes a new entry, and
entries that are no longer current (the node was touched again, gained a child, or left the tree)
are dropped when they reach the top. When stale entries outnumber the live ones, the heap is rebuilt
from the live ones, so its size stays within a constant factor of the tree's leaves.
"""

from __future__ import annotations

import heapq
from typing import Any

MIN_REBUILD = 64  # never rebuild a heap smaller than this


class LeafHeap:
    def __init__(self):
        self.entries: list[list[Any]] = []  # [last_use, push number, node]
        self.pushes = 0
        self.rebuild_at = MIN_REBUILD

    def push(self, node: Any) -> None:
        """Make the node's current last_use its place in the order (it is a leaf now)."""
        self.pushes += 1
        entry = [node.last_use, self.pushes, node]
        node.heap_entry = entry
        heapq.heappush(self.entries, entry)
        if len(self.entries) > self.rebuild_at:
            self._rebuild()

    def peek_oldest(self) -> Any | None:
        """The least recently used leaf, left in the heap (None when there is none)."""
        while self.entries and not _current(self.entries[0]):
            heapq.heappop(self.entries)
        return self.entries[0][2] if self.entries else None

    def pop_oldest(self) -> Any | None:
        """Take the least recently used leaf out of the heap (None when there is none)."""
        node = self.peek_oldest()
        if node is not None:
            heapq.heappop(self.entries)
            node.heap_entry = None
        return node

    def _rebuild(self) -> None:
        self.entries = [e for e in self.entries if _current(e)]
        heapq.heapify(self.entries)
        self.rebuild_at = max(MIN_REBUILD, 2 * len(self.entries))


def _current(entry: list[Any]) -> bool:
    """Whether the entry still places its node: its latest, for a leaf in the tree."""
    node = entry[2]
    return node.heap_entry is entry and not node.children and not node.evicted
