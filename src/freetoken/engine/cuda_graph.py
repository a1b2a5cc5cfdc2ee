"""CUDA graphs for the decode/verify forward: one graph per (batch size, rows per request).

A decode step is uniform (k+1 rows for every request), so its target forward and lm_head can be
captured once and replayed with new inputs copied into static buffers: token ids, positions, KV
slots, block tables, context lengths and state slots. The kernels read every per-step value from
those buffers, so a replay computes exactly what the eager forward would (same kernels, same
launch shapes). Capture needs the Triton path (no host syncs).

A verify graph comes with a second graph for its commit: the GDN replay of the accepted rows reads
the verify graph's static stash, and the per-sequence accepted row counts come from a static device
buffer filled from the sampler's result on the device, so the commit needs no host round trip.

The eager warm-up before a capture runs the real step on the real pools; the GDN state of the
batch's slots is saved before and restored after, so the step that follows sees untouched state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from freetoken.forward_context import ForwardContext, ForwardMode
from freetoken.kernels.batched import SeqBatch, seq_batch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ctx: ForwardContext  # the captured context: static input tensors and (VERIFY) the stash
    batch: SeqBatch  # the captured batch layout with its static device tensors
    hidden: torch.Tensor  # [N, H] static output
    logits: torch.Tensor  # [N, V] static output
    commit_graph: torch.cuda.CUDAGraph | None = None  # VERIFY only: the replay of the accepted rows
    accepted_rows: torch.Tensor | None = None  # [B] int32 static input of commit_graph


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_blocks_per_seq: int):
        self.model = model
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[tuple[int, int, ForwardMode], _Graph] = {}
        self.pool = None

    @staticmethod
    def supported(model: torch.nn.Module, device: torch.device) -> bool:
        from freetoken.kernels import use_triton

        probe = torch.empty(1, device=device)
        return device.type == "cuda" and getattr(model, "config", None) is not None and use_triton(probe)

    def _static_batch(self, ctx: ForwardContext) -> SeqBatch:
        """ctx's batch layout whose device tensors are fresh buffers of fixed shape (block table padded)."""
        batch = SeqBatch.from_seqs(ctx.seqs, ctx.input_ids.device)
        table = torch.zeros(len(ctx.seqs), self.max_blocks, dtype=torch.int32, device=ctx.input_ids.device)
        for i, t in enumerate(batch.block_tables):
            table[i, : t.shape[0]] = t
        tensors = {name: getattr(batch, name).clone() for name in ("starts", "counts", "slots", "row_seq", "context_lens")}
        batch.__dict__.update(tensors, block_table=table)
        return batch

    def _load(self, entry: _Graph, ctx: ForwardContext) -> SeqBatch:
        """Copy ctx's per-step values into the captured buffers; return ctx's own layout for the commit."""
        fresh = SeqBatch.from_seqs(ctx.seqs, ctx.input_ids.device)
        entry.ctx.input_ids.copy_(ctx.input_ids)
        entry.ctx.positions.copy_(ctx.positions)
        entry.ctx.slot_mapping.copy_(ctx.slot_mapping)
        for name in ("slots", "context_lens"):
            entry.batch.__dict__[name].copy_(getattr(fresh, name))
        entry.batch.__dict__["block_table"].zero_()
        for i, t in enumerate(fresh.block_tables):
            entry.batch.__dict__["block_table"][i, : t.shape[0]] = t
        return fresh

    def run(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """The forward of ctx through a graph -> (hidden [N, H], logits [N, V], the context to commit with)."""
        num_rows = ctx.seqs[0].num_rows
        key = (len(ctx.seqs), num_rows, ctx.mode)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(ctx)
            self.graphs[key] = entry
        fresh = self._load(entry, ctx)
        entry.graph.replay()
        commit_ctx = replace(entry.ctx, seqs=ctx.seqs, stash=entry.ctx.stash)
        commit_ctx.__dict__["_seq_batch"] = (ctx.seqs, fresh)
        commit_ctx.__dict__["_graph"] = entry
        return entry.hidden, entry.logits, commit_ctx

    def commit(self, ctx: ForwardContext, accepted_rows: torch.Tensor) -> None:
        """Replay the commit graph of the verify that produced ctx; accepted_rows [B] on the device."""
        entry: _Graph = ctx.__dict__["_graph"]
        entry.accepted_rows.copy_(accepted_rows)
        entry.commit_graph.replay()

    def _capture(self, ctx: ForwardContext) -> _Graph:
        static_ctx = replace(ctx, input_ids=ctx.input_ids.clone(), positions=ctx.positions.clone(), slot_mapping=ctx.slot_mapping.clone(), stash={})
        batch = self._static_batch(ctx)
        static_ctx.__dict__["_seq_batch"] = (static_ctx.seqs, batch)
        state = ctx.linear_state
        slots = batch.slots.long()
        saved = (state.conv[:, slots].clone(), state.recurrent[:, slots].clone()) if state is not None else None

        def restore() -> None:
            if saved is not None:
                state.conv[:, slots] = saved[0]
                state.recurrent[:, slots] = saved[1]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles every kernel, then a second run settles the allocator
                self.model.compute_logits(self.model(static_ctx))
                restore()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(static_ctx)
            logits = self.model.compute_logits(hidden)
        self.pool = graph.pool()
        restore()
        assert seq_batch(static_ctx) is batch
        entry = _Graph(graph, static_ctx, batch, hidden, logits)
        if ctx.mode is ForwardMode.VERIFY:
            self._capture_commit(entry, restore)
        return entry

    def _capture_commit(self, entry: _Graph, restore) -> None:
        """The commit of entry's verify as a graph over a replay batch whose row counts are a static buffer."""
        batch = entry.batch
        entry.accepted_rows = batch.counts.clone()
        replay = batch.accepted(list(batch.num_rows))
        replay.__dict__.update(starts=batch.starts, slots=batch.slots, counts=entry.accepted_rows)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model.commit(entry.ctx, replay)  # compiles the replay kernels
            restore()
        torch.cuda.current_stream().wait_stream(stream)
        entry.commit_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.commit_graph, pool=self.pool):
            self.model.commit(entry.ctx, replay)
        self.pool = entry.commit_graph.pool()
        restore()
