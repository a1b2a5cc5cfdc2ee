"""Which output features of a decode projection its launch leaves to a later launch (no torch, no Triton)."""

from __future__ import annotations

from typing import NamedTuple


class LateSpan(NamedTuple):
    """Output features of a projection left to a later launch: `runs` runs of `count` features, the
    first at `first`, each `period` features after the one before (one run: period unused)."""

    first: int
    count: int
    period: int = 0
    runs: int = 1

    def tiles(self, block_n: int) -> tuple[int, int, int, int]:
        """(first, count, period, runs) in feature tiles of block_n."""
        return self.first // block_n, self.count // block_n, max(self.period, self.count) // block_n, self.runs

    def num_tiles(self, block_n: int) -> int:
        """Feature tiles in all the runs."""
        return self.count // block_n * self.runs

    def fits(self, n: int, block_n: int, after: int = 0) -> bool:
        """Whether these are whole feature tiles of block_n inside N features, none before `after`, runs apart."""
        aligned = all(v % block_n == 0 for v in (self.first, self.count, self.period))
        period = max(self.period, self.count)
        return aligned and self.count > 0 and self.runs > 0 and self.first >= after and self.first + (self.runs - 1) * period + self.count <= n
