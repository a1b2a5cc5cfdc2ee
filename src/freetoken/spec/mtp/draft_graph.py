"""CUDA graphs of the greedy MTP draft loop: one graph per batch size (k is fixed per method).

For a request whose last observed row sits at position p with MTP output h, draft 1 is the argmax
of the logits of h; draft i+1 is the argmax of the logits of the MTP layer run on (draft i, the
previous output) at position p+i. A graph captures this chain for B requests, each draft feeding the
next step on the device, and writes the drafts [B, k] to a static buffer. A call copies h [B, H]
and the integer inputs of the k-1 chained rows per request (positions, MTP KV slots, context
lengths, block tables padded to a fixed width) into static buffers, replays, and reads the drafts
back once.

The graph launches the eager path's kernels at the same shapes, so its drafts and the MTP KV rows it
writes are the eager path's bit for bit. Those rows are speculative (positions p+1 .. p+k-1, past the
committed tokens): the scheduler has grown every block table to hold them, as for the eager path,
and the next observe rewrites the accepted ones. Capture needs the Triton path (no host syncs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from freetoken import sampling
from freetoken.engine.cuda_graph import DecodeGraphs, StagingBuffer, record_graph
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.request import Request
from freetoken.forward_context import ForwardContext, ForwardMode, SeqRows
from freetoken.kernels.batched import SeqBatch
from freetoken.sampling import SamplingParams


class ChainInputs(StagingBuffer):
    """The integer inputs of one graph's chained rows. Entry (s, i) of a [k-1, B] field is request i's
    row at chained step s+1."""

    def __init__(self, num_seqs: int, steps: int, max_blocks: int, device: torch.device):
        super().__init__([("positions", torch.int64, (steps, num_seqs)), ("slot_mapping", torch.int64, (steps, num_seqs)),
                          ("context_lens", torch.int32, (steps, num_seqs)), ("block_table", torch.int32, (num_seqs, max_blocks))], device)

    def load(self, tables: Sequence[list[int]], positions: Sequence[int], kv_pool: KVPool) -> None:
        """Fill the host views for requests whose last observed row is at positions[i]; queue one copy
        to the device. The caller reads the graph's result back before the next load."""
        h = self.on_host
        steps = h["positions"].shape[0]
        for i, (table, p) in enumerate(zip(tables, positions)):
            h["positions"][:, i] = range(p + 1, p + 1 + steps)
            h["slot_mapping"][:, i] = kv_pool.slots(table, p + 1, p + 1 + steps)
            h["context_lens"][:, i] = range(p + 2, p + 2 + steps)
            h["block_table"][i, : len(table)] = table
        self.upload()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: ChainInputs
    hidden: torch.Tensor  # [B, H] static input: the MTP output of each request's last observed row
    drafts: torch.Tensor  # [B, k] int64 static output
    contexts: list[ForwardContext]  # the chained steps' contexts, kept alive with the graph: the device tensors its kernels read


class DraftGraphs:
    """The greedy draft loop of an MTP network, replayed as CUDA graphs."""

    def __init__(self, network: torch.nn.Module, kv_pool: KVPool, num_draft_tokens: int, max_blocks_per_seq: int):
        self.network, self.kv_pool, self.k = network, kv_pool, num_draft_tokens
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[int, _Graph] = {}  # batch size -> graph
        self.pool = None

    @staticmethod
    def supported(model: torch.nn.Module, device: torch.device) -> bool:
        """Where the decode graphs are (CUDA, Triton path), on one rank (no collectives in a graph)."""
        parallel = getattr(model, "parallel", None)
        return DecodeGraphs.supported(model, torch.device(device)) and (parallel is None or parallel.world_size == 1)

    def covers(self, requests: Sequence[Request]) -> bool:
        """Whether a graph computes these drafts: every request greedy without penalties (the draft is
        the plain argmax) and every block table within the padded width."""
        return all(r.params.is_plain_greedy and len(r.block_table) <= self.max_blocks for r in requests)

    @torch.no_grad()
    def run(self, hidden: Sequence[torch.Tensor], tables: Sequence[list[int]], positions: Sequence[int]) -> torch.Tensor:
        """Drafts [B, k] int64 on the host; request i's last observed row has MTP output hidden[i] [H]
        at positions[i], its block table is tables[i]. Captures the graph of batch size B on first use."""
        entry = self.graphs.get(len(hidden))
        if entry is None:
            entry = self.graphs[len(hidden)] = self._capture(hidden, tables, positions)
        torch.stack(list(hidden), out=entry.hidden)
        entry.inputs.load(tables, positions, self.kv_pool)
        entry.graph.replay()
        return entry.drafts.cpu()

    def _capture(self, hidden: Sequence[torch.Tensor], tables: Sequence[list[int]], positions: Sequence[int]) -> _Graph:
        b, k = len(hidden), self.k
        static_hidden = torch.stack(list(hidden))  # [B, H]
        device = static_hidden.device
        inputs = ChainInputs(b, k - 1, self.max_blocks, device)
        inputs.load(tables, positions, self.kv_pool)
        d = inputs.on_device
        # One row per request. The layout's host fields are not read on the Triton path; its device
        # fields are fixed (starts, counts, row_seq, slots) or the static buffers.
        seqs = [SeqRows(row_start=i, num_rows=1, num_cached_tokens=0, block_table=d["block_table"][i], state_slot=-1) for i in range(b)]
        layout = SeqBatch.from_seqs(seqs, device)
        fixed = {name: getattr(layout, name) for name in ("starts", "counts", "row_seq", "slots")}
        ctxs = []  # chained step s+1 reads ctxs[s]; its input_ids are set by the chain
        for s in range(k - 1):
            ctx = ForwardContext(ForwardMode.EXTEND, None, d["positions"][s], d["slot_mapping"][s], seqs, self.kv_pool.cache, None)
            batch = SeqBatch.from_seqs(seqs, device)
            batch.__dict__.update(fixed, context_lens=d["context_lens"][s], block_table=d["block_table"])
            ctx.__dict__["_seq_batch"] = (seqs, batch)
            ctxs.append(ctx)
        params, histories, generators = [SamplingParams()] * b, [()] * b, [None] * b  # greedy, no penalties

        def chain() -> torch.Tensor:
            x, drafts = static_hidden, []
            for step in range(k):
                if step > 0:
                    ctxs[step - 1].input_ids = drafts[-1]  # [B] the previous draft, on the device
                    x = self.network(ctxs[step - 1], x)  # [B, H]
                drafts.append(sampling.sample(self.network.compute_logits(x), params, histories, generators))
            return torch.stack(drafts, dim=1)  # [B, k]

        graph, drafts = self._record(chain)
        return _Graph(graph, inputs, static_hidden, drafts, ctxs)

    def _record(self, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """fn captured into this object's memory pool (shared by its graphs) -> (graph, fn's output)."""
        graph, out = record_graph(fn, self.pool)
        self.pool = graph.pool()
        return graph, out
