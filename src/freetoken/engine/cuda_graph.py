"""CUDA graphs for the decode/verify step: one graph per (bucketed batch size, rows per request, mode, greedy).

A decode step is uniform (k+1 rows for every request), so its target forward and lm_head can be
captured once and replayed with new inputs. Batch sizes are rounded up to buckets (1, 2, 4, then
multiples of 8 up to max_num_seqs): the padding requests' rows read and write only a KV block and
a GDN state slot reserved for them, their results are ignored, and since every op is row-invariant
the real rows get the bits they would get in a batch of their own size. The per-step inputs (token ids, positions, KV slots,
state slots, cached lengths, context lengths, block tables) live in one staging buffer: the host fills one of its
two pinned twins (in turn, so it can fill the next step's while this step's copy is still queued)
with numpy and one asynchronous copy moves it to the device, where the captured kernels read them.
A replay computes exactly what the eager forward would (same kernels, same launch shapes). Capture
needs the Triton path (no host syncs).

Graphs built with `export_layers` (the spec method's target_layers, e.g. DFlash's taps) capture the
forward with those layers exported: their rows land in one more static output beside the hidden one,
`GraphStep.layer_hidden`. Without export_layers the captured forward is the plain one.

Greedy batches (every request greedy, no penalties) capture the whole step: forward, lm_head, the
greedy verify (argmax, accepted length, next token) and, for a verify, the commit of the accepted
rows into the GDN state. The host then reads back one [2, B] tensor per step and does nothing else
on the device. Other batches capture forward and lm_head; the sampler runs eagerly, and a verify
comes with a second graph for its commit, whose accepted row counts come from a static device
buffer filled from the sampler's result on the device (no host round trip).

Greedy one-row graphs (decode without drafts) feed their tokens forward for the engine's overlap
(engine.py): they end by writing their next tokens to `last_tokens`, one device buffer shared by
all of them (batch order), and start by replacing the input token of each row whose `fed_back_rows`
staging entry is j >= 0 with last_tokens[j]. So the engine launches step n+1 before reading step n
back, with step n's tokens as inputs; nothing else writes last_tokens between the two replays (a
capture in between restores it after its warm-up runs, as it restores the GDN state).

The eager warm-up before a capture runs the real step on the real pools; the linear state of the
batch's slots (GDN state and the model's extra states) is saved before and restored after, so the
step that follows sees untouched state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from freetoken import kernels, sampling
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.runner import RowGroup, build_context, run_target
from freetoken.forward_context import ForwardContext, ForwardMode
from freetoken.kernels.batched import SeqBatch, seq_batch


class StagingBuffer:
    """Integer inputs of a CUDA graph: two host buffers (pinned on CUDA) filled in turn, one device
    buffer, and typed views of them, one per field (name, dtype, shape). Fill the host views
    (`on_host`) with numpy, then `upload`.

    Two host buffers let the host fill step n+1's inputs while step n's copy may still be queued
    behind the step before it (the engine launches a greedy decode step before reading back the
    previous one). A host buffer is handed out again only after its last copy has run (a CUDA event
    recorded behind the copy); with at most one step in flight that wait is already over."""

    def __init__(self, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device):
        nbytes = [int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in fields]
        starts = [sum(-(-b // 16) * 16 for b in nbytes[:i]) for i in range(len(fields) + 1)]  # 16-byte aligned
        cuda = device.type == "cuda"
        self.hosts = [torch.zeros(starts[-1], dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]  # recorded behind each host buffer's last copy
        self.turn = 0  # the host buffer the next fill writes
        self.device = torch.zeros(starts[-1], dtype=torch.uint8, device=device)
        self.host_views: list[dict[str, np.ndarray]] = [{} for _ in range(2)]
        self.on_device: dict[str, torch.Tensor] = {}
        for (name, dtype, shape), start, size in zip(fields, starts, nbytes):
            for host, views in zip(self.hosts, self.host_views):
                views[name] = host[start : start + size].view(dtype).view(shape).numpy()
            self.on_device[name] = self.device[start : start + size].view(dtype).view(shape)

    @property
    def on_host(self) -> dict[str, np.ndarray]:
        """The views of the host buffer whose turn it is, once its previous copy has run."""
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        return self.host_views[self.turn]

    def upload(self) -> None:
        """Queue one copy of the host buffer just filled to the device; the next fill takes the other one."""
        self.device.copy_(self.hosts[self.turn], non_blocking=True)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].record()
        self.turn ^= 1


class _Staging(StagingBuffer):
    """The per-step inputs of one decode/verify graph."""

    def __init__(self, num_seqs: int, rows_per_seq: int, max_blocks: int, device: torch.device):
        n = num_seqs * rows_per_seq
        super().__init__([("input_ids", torch.int64, (n,)), ("positions", torch.int64, (n,)), ("slot_mapping", torch.int64, (n,)),
                          ("slots", torch.int32, (num_seqs,)), ("cached", torch.int32, (num_seqs,)), ("context_lens", torch.int32, (n,)),
                          ("block_table", torch.int32, (num_seqs, max_blocks)),
                          ("fed_back_rows", torch.int64, (n,))], device)
        self.rows_per_seq = rows_per_seq

    def load(self, groups: list[RowGroup], kv_pool: KVPool, fed_back_rows: list[int] | None = None) -> None:
        """Write the groups' per-step values to a host buffer and queue one copy to the device.

        fed_back_rows (one-row groups only): for each group, the row of the previous greedy step whose
        next token is its input (DecodeGraphs.last_tokens), or -1 for its own token id; None: all -1."""
        h, r = self.on_host, self.rows_per_seq
        h["fed_back_rows"][:] = -1
        if fed_back_rows is not None:
            assert r == 1
            h["fed_back_rows"][: len(fed_back_rows)] = fed_back_rows
        for i, group in enumerate(groups):
            rows, start = slice(i * r, (i + 1) * r), group.start
            h["input_ids"][rows] = group.token_ids
            h["positions"][rows] = range(start + group.rope_delta, start + group.rope_delta + r)  # decode rows: past any image
            h["slot_mapping"][rows] = kv_pool.slots(group.block_table, start, start + r)
            h["context_lens"][rows] = range(start + 1, start + r + 1)
            h["slots"][i] = -1 if group.state_slot is None else group.state_slot
            h["cached"][i] = start
            h["block_table"][i, : len(group.block_table)] = group.block_table
        self.upload()


@dataclass
class GraphStep:
    """One captured step; its output tensors are rewritten by every replay."""

    graph: torch.cuda.CUDAGraph
    staging: _Staging
    ctx: ForwardContext  # the captured context, kept alive with the graph: its input views and (VERIFY) the stash
    batch: SeqBatch  # the captured batch layout, kept alive with the graph: the device tensors its kernels read
    hidden: torch.Tensor  # [N, H] static output
    logits: torch.Tensor  # [N, V] static output (fp32; greedy graphs: the weights' dtype, and unread)
    layer_hidden: torch.Tensor | None = None  # [N, n * H] static output: the export_layers' outputs (None without them)
    result: torch.Tensor | None = None  # greedy only: [2, B] int64 (accepted drafts, next token)
    commit_graph: torch.cuda.CUDAGraph | None = None  # sampled VERIFY only: the replay of the accepted rows
    accepted_rows: torch.Tensor | None = None  # [B] int32: rows each sequence commits (VERIFY)


@dataclass
class StaticStep:
    """A decode/verify step over static inputs: what a graph captures, runnable eagerly too."""

    staging: _Staging  # the per-step inputs; load another step's groups, then call run
    ctx: ForwardContext  # its tensors are staging's views (and the outputs' stash)
    batch: SeqBatch  # its device tensors are fixed (starts, counts, row_seq) or staging's views
    run: Callable[[], tuple]  # -> (hidden, layer_hidden, logits, result), as GraphStep names them
    accepted_rows: torch.Tensor | None  # [B] int32: rows each sequence commits (VERIFY)
    replay: SeqBatch | None  # the commit's batch: batch's rows cut to accepted_rows (VERIFY)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured at: 1, 2, 4, then multiples of 8, the last one max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, state_pool: LinearStatePool | None, device: torch.device,
                 max_blocks_per_seq: int, max_num_seqs: int, export_layers: tuple[int, ...] = ()):
        """Takes one KV block and one state slot out of the pools for the padding rows (the engine sizes
        the pools with one spare of each). export_layers: decoder layers whose outputs every captured
        forward exports (the model forward's export_layers) into GraphStep.layer_hidden; () for none."""
        self.model, self.kv_pool, self.state_pool, self.device = model, kv_pool, state_pool, device
        self.export_layers = tuple(export_layers)
        self.max_blocks = max_blocks_per_seq
        self.buckets = batch_buckets(max_num_seqs)
        self.pad_block = kv_pool.reserve_block()
        self.pad_slot = state_pool.reserve_slot() if state_pool is not None else None
        self.graphs: dict[tuple[int, int, ForwardMode, bool], GraphStep] = {}
        self.pool = None
        self.last_tokens = torch.zeros(max(self.buckets), dtype=torch.int64, device=device)  # greedy one-row steps' next tokens, batch order

    def covers(self, groups: list[RowGroup]) -> bool:
        """Whether a graph may run these groups: any, unless the model's captured step cannot take rows of
        image prompts (`graphs_cover_image_prompts` False: qwen4_exp with QSA) and one of them has images."""
        return getattr(self.model, "graphs_cover_image_prompts", True) or all(g.images is None for g in groups)

    def bucket(self, num_seqs: int) -> int:
        """The captured batch size a batch of num_seqs requests runs at."""
        return next((b for b in self.buckets if b >= num_seqs), num_seqs)

    def _padded(self, groups: list[RowGroup]) -> list[RowGroup]:
        """groups and padding requests up to the bucket: rows at positions 0.. of the reserved block and slot."""
        rows = len(groups[0].token_ids)
        table = [self.pad_block] * -(-rows // self.kv_pool.block_size)
        pad = RowGroup(table, self.pad_slot, 0, [0] * rows)
        return groups + [pad] * (self.bucket(len(groups)) - len(groups))

    @staticmethod
    def supported(model: torch.nn.Module, device: torch.device) -> bool:
        from freetoken.kernels import use_triton

        probe = torch.empty(1, device=device)
        captured = getattr(model, "supports_cuda_graphs", True)  # False: a forward with host-side work per step (qwen4_exp, expert offload)
        return captured and device.type == "cuda" and getattr(model, "config", None) is not None and use_triton(probe)

    def run(self, groups: list[RowGroup], mode: ForwardMode, greedy: bool, fed_back_rows: list[int] | None = None) -> GraphStep:
        """Replay the step of these uniform row groups (captured on first use); read its outputs (hidden,
        logits, layer_hidden, result) from the returned step: the groups' rows come first, then the
        padding rows up to the bucket. They hold until the next replay of the same step.

        fed_back_rows (greedy one-row steps): group i's input token is the next token of row
        fed_back_rows[i] of the greedy one-row step replayed just before this one, taken on the device."""
        groups = self._padded(groups)
        key = (len(groups), len(groups[0].token_ids), mode, greedy)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(groups, mode, greedy, fed_back_rows)
        entry.staging.load(groups, self.kv_pool, fed_back_rows)
        entry.graph.replay()
        return entry

    def commit(self, entry: GraphStep, accepted_rows: torch.Tensor) -> None:
        """Replay the commit graph of a sampled verify; accepted_rows [B] on the device for the real
        requests. The padding requests keep whatever row counts their entries hold (all within the
        step's rows) and commit them into their own slot."""
        entry.accepted_rows[: accepted_rows.shape[0]].copy_(accepted_rows)
        entry.commit_graph.replay()

    # -- capture -------------------------------------------------------------------------------------
    def static_step(self, groups: list[RowGroup], mode: ForwardMode, greedy: bool, fed_back_rows: list[int] | None = None) -> StaticStep:
        """The step of these (padded) groups over static inputs, as a graph captures it: its staging is
        loaded with the groups, and `run` computes whatever step the staging holds when it is called
        (a CPU test loads another step's groups and runs it eagerly)."""
        num_seqs, rows = len(groups), len(groups[0].token_ids)
        device = self.device
        staging = _Staging(num_seqs, rows, self.max_blocks, device)
        staging.load(groups, self.kv_pool, fed_back_rows)  # the warm-up runs the real step
        first = build_context(groups, mode, self.kv_pool, self.state_pool, device)
        views = staging.on_device
        ctx = replace(first, input_ids=views["input_ids"], positions=views["positions"], slot_mapping=views["slot_mapping"], stash={})
        batch = SeqBatch.from_seqs(first.seqs, device)
        fixed = {name: getattr(batch, name).clone() for name in ("starts", "counts", "row_seq")}
        batch.__dict__.update(fixed, slots=views["slots"], cached=views["cached"], context_lens=views["context_lens"], block_table=views["block_table"])
        ctx.__dict__["_seq_batch"] = (ctx.seqs, batch)
        accepted_rows = batch.counts.clone() if mode is ForwardMode.VERIFY else None
        replay = None
        if accepted_rows is not None:
            replay = batch.accepted(list(batch.num_rows))
            replay.__dict__.update(starts=batch.starts, slots=batch.slots, cached=batch.cached, counts=accepted_rows)

        feeds_back = greedy and rows == 1  # reads and writes last_tokens

        def step():
            if feeds_back:
                kernels.take_fed_back(views["input_ids"], views["fed_back_rows"], self.last_tokens)
            hidden, layer_hidden = run_target(self.model, ctx, self.export_layers)
            logits = self.model.compute_logits(hidden, upcast=not (greedy and kernels.TRITON_STEP_GLUE))  # greedy: read by the argmax alone
            if not greedy:
                return hidden, layer_hidden, logits, None
            drafts = ctx.input_ids.view(num_seqs, rows)[:, 1:]
            result = sampling.greedy_verify_stacked(logits, drafts, self.last_tokens if feeds_back else None)
            if replay is not None:
                accepted_rows.copy_(result[0] + 1)
                self.model.commit(ctx, replay)
            return hidden, layer_hidden, logits, result

        return StaticStep(staging, ctx, batch, step, accepted_rows, replay)

    def _capture(self, groups: list[RowGroup], mode: ForwardMode, greedy: bool, fed_back_rows: list[int] | None) -> GraphStep:
        static = self.static_step(groups, mode, greedy, fed_back_rows)
        staging, ctx, batch, step, accepted_rows, replay = static.staging, static.ctx, static.batch, static.run, static.accepted_rows, static.replay
        restore = self._saver(batch)
        graph, (hidden, layer_hidden, logits, result) = record_graph(step, self.pool, restore)
        self.pool = graph.pool()
        assert seq_batch(ctx) is batch
        entry = GraphStep(graph, staging, ctx, batch, hidden, logits, layer_hidden, result, accepted_rows=accepted_rows)
        if replay is not None and not greedy:
            entry.commit_graph, _ = record_graph(lambda: self.model.commit(ctx, replay), self.pool, restore)
        return entry

    def _saver(self, batch: SeqBatch):
        """A function that puts the linear state of the batch's slots (GDN conv and recurrent state, the
        model's extra states such as qwen4_exp's PLE windows) and last_tokens back as they are now (a
        capture may come while the step whose tokens it feeds back is in flight)."""
        last_tokens = self.last_tokens.clone()
        state = self.state_pool.state if self.state_pool is not None else None
        if state is not None:
            slots = batch.slots.long().clone()
            pools = [state.conv, state.recurrent, *state.extra.values()]
            saved = [pool[:, slots].clone() for pool in pools]

        def restore() -> None:
            self.last_tokens.copy_(last_tokens)
            if state is not None:
                for pool, values in zip(pools, saved):
                    pool[:, slots] = values

        return restore


def record_graph(fn, pool, restore=lambda: None):
    """Run fn twice on a side stream (compiles every kernel, then settles the allocator), calling
    restore after each run, then capture fn into a CUDA graph in memory pool `pool` (None: a new one)
    -> (graph, fn's output of the capture, rewritten by every replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
            restore()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
