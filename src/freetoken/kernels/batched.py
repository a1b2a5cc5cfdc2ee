"""Batched forms of the per-sequence ops (reference), and the batch layout they share.

A step's rows are the concatenation of its sequences' rows. `SeqBatch` describes that layout once:
plain lists for these references, which loop over sequences calling the per-sequence references
(so the CPU path computes exactly what the per-sequence ops compute), and lazily built device
tensors for the Triton kernels, which cover the whole batch in one launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from freetoken.kernels.attention_ref import paged_attention
from freetoken.kernels.conv_ref import causal_conv1d
from freetoken.kernels.gdn_ref import gdn_recurrent


@dataclass(frozen=True)
class SeqBatch:
    """Where each sequence's rows are in the flat batch, and what state and KV it owns."""

    row_starts: tuple[int, ...]  # first row of each sequence
    num_rows: tuple[int, ...]  # rows of each sequence this step
    num_cached: tuple[int, ...]  # tokens already in the KV cache before this step
    state_slots: tuple[int, ...]  # linear-state pool row of each sequence (-1: none)
    block_tables: tuple[torch.Tensor, ...]  # per sequence: [max_blocks] int32 on the device
    device: torch.device
    chunkable_ends: tuple[int | None, ...] | None = None  # per sequence: positions below it may take the chunked GDN rule (None: any)

    @classmethod
    def from_seqs(cls, seqs, device: torch.device) -> SeqBatch:
        """From the engine's `SeqRows` list."""
        return cls(
            tuple(s.row_start for s in seqs), tuple(s.num_rows for s in seqs), tuple(s.num_cached_tokens for s in seqs),
            tuple(s.state_slot for s in seqs), tuple(s.block_table for s in seqs), device, tuple(s.chunkable_end for s in seqs),
        )

    def with_rows(self, num_rows: list[int]) -> SeqBatch:
        """The same sequences with the first num_rows[i] rows each, packed (the commit replay's batch)."""
        starts, total = [], 0
        for n in num_rows:
            starts.append(total)
            total += n
        return SeqBatch(tuple(starts), tuple(num_rows), self.num_cached, self.state_slots, self.block_tables, self.device)

    def accepted(self, num_rows: list[int]) -> SeqBatch:
        """The same sequences and row positions, each cut to its first num_rows[i] rows (the commit replay)."""
        return SeqBatch(self.row_starts, tuple(num_rows), self.num_cached, self.state_slots, self.block_tables, self.device)

    @property
    def num_seqs(self) -> int:
        return len(self.row_starts)

    def rows(self, i: int) -> slice:
        return slice(self.row_starts[i], self.row_starts[i] + self.num_rows[i])

    # -- device tensors for the kernels --------------------------------------------------------------
    @functools.cached_property
    def starts(self) -> torch.Tensor:  # [B] int32
        return torch.tensor(self.row_starts, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def counts(self) -> torch.Tensor:  # [B] int32
        return torch.tensor(self.num_rows, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def slots(self) -> torch.Tensor:  # [B] int32
        return torch.tensor(self.state_slots, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def cached(self) -> torch.Tensor:  # [B] int32: tokens each sequence has in the cache before this step
        return torch.tensor(self.num_cached, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def row_seq(self) -> torch.Tensor:  # [N] int32: the sequence of each row
        ids = [i for i, n in enumerate(self.num_rows) for _ in range(n)]
        return torch.tensor(ids, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def context_lens(self) -> torch.Tensor:  # [N] int32: keys each row attends to, itself included
        lens = [c + j + 1 for c, n in zip(self.num_cached, self.num_rows) for j in range(n)]
        return torch.tensor(lens, dtype=torch.int32, device=self.device)

    def row_groups(self, size: int) -> tuple[tuple[int, ...], torch.Tensor]:
        """Each sequence's rows cut into runs of at most `size` consecutive rows: the row count of each
        run, and [runs, 2] int32 (first row, row count) on the device. Built on first use for each size
        from the fixed row layout (in a CUDA graph, by the eager warm-up before the capture)."""
        key = f"row_groups_{size}"
        if key not in self.__dict__:
            runs = [(s + j, min(size, n - j)) for s, n in zip(self.row_starts, self.num_rows) for j in range(0, n, size)]
            groups = torch.tensor(runs, dtype=torch.int32, device=self.device).view(-1, 2)
            self.__dict__[key] = (tuple(c for _, c in runs), groups)
        return self.__dict__[key]

    @functools.cached_property
    def block_table(self) -> torch.Tensor:  # [B, max_blocks] int32, padded with 0
        width = max((t.shape[0] for t in self.block_tables), default=1)
        table = torch.zeros(max(self.num_seqs, 1), max(width, 1), dtype=torch.int32, device=self.device)
        for i, t in enumerate(self.block_tables):
            table[i, : t.shape[0]] = t
        return table


def paged_attention_batched(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    batch: SeqBatch,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention of every row over its own sequence's cache -> [N, Hq, D] in q.dtype."""
    out = torch.empty_like(q)
    for i in range(batch.num_seqs):
        rows, cached = batch.rows(i), batch.num_cached[i]
        lens = [cached + j + 1 for j in range(batch.num_rows[i])]
        if lens:
            out[rows] = paged_attention(q[rows], k_cache, v_cache, batch.block_tables[i], lens, block_size, scale)
    return out


def causal_conv1d_batched(
    windows: torch.Tensor,  # [slots, K-1, C] pool of windows, advanced in place when write_state
    rows: torch.Tensor,  # [N, C] raw pre-conv rows
    weight: torch.Tensor,  # [C, K]
    batch: SeqBatch,
    write_state: bool = True,
) -> torch.Tensor:
    """silu(causal conv) of every row over its sequence's window -> [N, C] in rows.dtype."""
    out = torch.empty_like(rows)
    for i in range(batch.num_seqs):
        if batch.num_rows[i] == 0:
            continue
        rows_i, window = batch.rows(i), windows[batch.state_slots[i]]
        out[rows_i], new_window = causal_conv1d(window, rows[rows_i], weight)
        if write_state:
            window.copy_(new_window)
    return out


def gdn_recurrent_batched(
    state: torch.Tensor,  # [slots, Hv, Dk, Dv] fp32 pool, advanced in place when write_state
    q: torch.Tensor,  # [N, Hv, Dk] fp32
    k: torch.Tensor,  # [N, Hv, Dk] fp32
    v: torch.Tensor,  # [N, Hv, Dv] fp32
    g: torch.Tensor,  # [N, Hv] fp32
    beta: torch.Tensor,  # [N, Hv] fp32
    batch: SeqBatch,
    write_state: bool = True,
    compute_output: bool = True,
) -> torch.Tensor | None:
    """The gated delta rule over each sequence's rows from its slot's state -> outputs [N, Hv, Dv] fp32.

    write_state=False (verify) runs on a scratch copy and leaves the pool untouched.
    """
    out = q.new_empty(v.shape) if compute_output else None
    for i in range(batch.num_seqs):
        if batch.num_rows[i] == 0:
            continue
        rows = batch.rows(i)
        s = state[batch.state_slots[i]]
        if not write_state:
            s = s.clone()
        o = gdn_recurrent(s, q[rows], k[rows], v[rows], g[rows], beta[rows], compute_output=compute_output)
        if compute_output:
            out[rows] = o
    return out


def seq_batch(ctx) -> SeqBatch:
    """The batch layout of a ForwardContext, built on first use and kept on the context for its other layers."""
    seqs, batch = ctx.__dict__.get("_seq_batch", (None, None))
    if seqs is not ctx.seqs:
        batch = SeqBatch.from_seqs(ctx.seqs, ctx.input_ids.device)
        ctx.__dict__["_seq_batch"] = (ctx.seqs, batch)
    return batch
