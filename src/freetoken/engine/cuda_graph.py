"""CUDA graphs for the decode/verify forward: one graph per (batch size, rows per request).

A decode step is uniform (k+1 rows for every request), so its target forward and lm_head can be
captured once and replayed with new inputs copied into static buffers: token ids, positions, KV
slots, block tables, context lengths and state slots. The kernels read every per-step value from
those buffers, so a replay computes exactly what the eager forward would (same kernels, same
launch shapes). Capture needs the Triton path (no host syncs): dense CUDA models only; MoE and
CPU stay eager.

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


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_blocks_per_seq: int):
        self.model = model
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[tuple[int, int, ForwardMode], _Graph] = {}
        self.pool = None

    @staticmethod
    def supported(model: torch.nn.Module, device: torch.device) -> bool:
        from freetoken.kernels import use_triton

        cfg = getattr(model, "config", None)
        probe = torch.empty(1, device=device)
        return device.type == "cuda" and cfg is not None and not cfg.is_moe and use_triton(probe)

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
        return entry.hidden, entry.logits, commit_ctx

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
        return _Graph(graph, static_ctx, batch, hidden, logits)
