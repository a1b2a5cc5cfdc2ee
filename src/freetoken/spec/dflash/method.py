"""Drives a DFlash draft through the spec protocol.

A DFlash draft reads the outputs of a few target layers (`target_layers`, the draft's taps): every
committed target row p becomes one context row of the draft, its K and V in each draft layer, a
function of (the row's taps, p) alone (`DFlashDraft.context_kv`). observe appends those rows;
propose runs one block per request, [anchor, mask x (B - 1)] at positions start .. start + B - 1
(start = the request's cached tokens, the anchor its last token, not yet run by the target), over
the context rows 0 .. start - 1, and takes the first k of the B - 1 slots' tokens as drafts (slot j
predicts the token at start + j): each slot's argmax for DFlash, the candidate selector's walk over
the slots' top-k tokens for DFlash2 (spec/dflash/dflash2.py). Every row the target commits (prefill
chunks, the anchor and the accepted drafts of a verify) is observed once, so a request's context is
always rows 0 .. start - 1, as in the dflash package's `dflash_generate` (reference/dflash.md §2).
The draft holds no state beyond those rows, so a preempted request rebuilds them from its new
prefill.

The context rows of all requests live in one preallocated pool (spec/dflash/context_pool.py): a
request takes a slot on its first observed row and gives it back on release; observe computes the
committed rows of all requests in one `context_kv` and writes them in place. propose runs the blocks
of all requests in one forward at a bucketed batch size and context length (spec/dflash/block_step.py),
reading the pool rows of the batch's slots under a validity mask. For a batch of greedy requests
without penalties that step (with the logits of the k slots and their argmax, or the DFlash2
selector's greedy walk) is replayed as a CUDA graph where the target's decode graphs are
(spec/dflash/draft_graph.py); other batches run the same step eagerly and sample outside it. On the
GPU the target's verify steps are CUDA graphs that export the taps (engine/cuda_graph.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from freetoken import sampling
from freetoken.engine.request import Request
from freetoken.engine.spec_protocol import CommittedRows, Proposal
from freetoken.errors import FreetokenError
from freetoken.spec.dflash.block_step import BlockInputs, BlockStep, batch_bucket
from freetoken.spec.dflash.context_pool import ContextPool
from freetoken.spec.dflash.draft_graph import DraftGraphs


def rows_held(request: Request) -> int:
    """Context rows the request's draft slot holds (0 before its first observed row)."""
    return 0 if request.draft_state is None else request.draft_state.num_rows


class DFlashMethod:
    pages_hold_draft_rows = False  # the context rows live in the method's own pool (exported per cached page)

    def __init__(self, model: torch.nn.Module, kv_pool, num_draft_tokens: int, device: torch.device, origin: str | None = None,
                 cuda_graphs: bool = False, max_blocks_per_seq: int | None = None):
        """cuda_graphs: draft greedy batches through CUDA graphs where supported; max_blocks_per_seq *
        kv_pool.block_size bounds a request's context rows (None: the whole KV pool's tokens)."""
        draft = model.draft_network("dflash")
        if draft is None:
            raise FreetokenError("the checkpoint has no DFlash draft (convert it with --dflash DRAFT_DIR); use --spec none", origin)
        block_size = draft.config.block_size
        if not 1 <= num_draft_tokens <= block_size - 1:
            raise FreetokenError(f"--spec dflash drafts 1 to {block_size - 1} tokens a step (its block holds {block_size}), not {num_draft_tokens}", origin)
        self.draft, self.device = draft, device
        self.num_draft_tokens = num_draft_tokens
        self.target_layers: tuple[int, ...] = tuple(draft.config.target_layer_ids)
        cfg = draft.config
        max_ctx = (max_blocks_per_seq or kv_pool.num_blocks) * kv_pool.block_size
        self.pool = ContextPool(cfg.num_hidden_layers, cfg.num_key_value_heads, max_ctx, cfg.head_dim, draft.norm.weight.dtype, device)
        self.step = BlockStep(draft, model.embed, model.compute_logits, self.pool, num_draft_tokens, device)
        self.inputs: dict[int, BlockInputs] = {}  # batch size -> its staging buffer (eager and graphed steps)
        self.graphs = DraftGraphs(self.step) if cuda_graphs and DraftGraphs.supported(model, device) else None

    def observe(self, rows: Sequence[CommittedRows]) -> None:
        """Write each request's committed rows (their K and V in every draft layer) into its context
        slot, taking a slot at its first row; the rows of all requests computed at once."""
        if not rows:
            return
        counts = [r.layer_hidden.shape[0] for r in rows]
        index = np.empty((2, sum(counts)), dtype=np.int64)  # positions, slots
        states, end = [], 0
        for r, m in zip(rows, counts):
            state, held = r.request.draft_state, rows_held(r.request)
            if r.first_position != held:
                raise RuntimeError(f"request {r.request.request_id}: committed rows start at {r.first_position}, its DFlash context holds {held}")
            if held + m > self.pool.max_ctx:
                raise RuntimeError(f"request {r.request.request_id}: {held + m} DFlash context rows, past the {self.pool.max_ctx} a context holds")
            if state is None:
                state = r.request.draft_state = self.pool.acquire()
            index[0, end : end + m] = np.arange(held, held + m)
            index[1, end : end + m] = state.slot
            states.append(state)
            end += m
        self.pool.reserve(max(s.num_rows + m for s, m in zip(states, counts)))
        index = torch.from_numpy(index).to(self.device)
        features = rows[0].layer_hidden if len(rows) == 1 else torch.cat([r.layer_hidden for r in rows])  # [sum(counts), n_taps * H]
        keys, values = self.draft.context_kv(self.draft.context(features), index[0])  # [L, kv, sum(counts), hd] each
        self.pool.write(index[1], index[0], keys, values)
        for state, m in zip(states, counts):
            state.num_rows += m

    def _load(self, requests: Sequence[Request]) -> tuple[BlockInputs, int]:
        """Upload the blocks' inputs at the batch's bucketed size -> (the staging buffer, the context bucket)."""
        starts = [r.num_cached_tokens for r in requests]
        slots = []
        for r, start in zip(requests, starts):
            held = rows_held(r)
            if held != start:
                raise RuntimeError(f"request {r.request_id}: its DFlash context holds {held} rows, its anchor is at {start}")
            slots.append(0 if r.draft_state is None else r.draft_state.slot)  # no context yet: any slot, none of its rows is read
        size = batch_bucket(len(requests))
        inputs = self.inputs.get(size)
        if inputs is None:
            inputs = self.inputs[size] = BlockInputs(size, self.device)
        inputs.load([r.last_token_id for r in requests], starts, slots)
        return inputs, self.step.context_bucket(max(starts))

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """k drafts per request from one draft block each; with sampled requests also their distributions q."""
        k, b = self.num_draft_tokens, len(requests)
        inputs, n = self._load(requests)
        if all(r.params.is_plain_greedy for r in requests):
            drafts = self.graphs.run(inputs, n) if self.graphs is not None else self.step.greedy_drafts(inputs.on_device, n)
            return Proposal(drafts[:b].cpu(), None)
        hidden = self.step.hidden(inputs.on_device, n)[:b]  # [b, k, H]
        logits = self.step.logits(hidden)  # [b, k, V] fp32
        if self.draft.candidate_selector is not None:
            return self._select(requests, hidden, logits, inputs.on_device["anchors"][:b])
        params = [r.params for r in requests]
        drafted: list[list[int]] = [[] for _ in requests]
        probs = []
        for j in range(k):  # slot j's history holds the drafts before it (penalties, sampling.verify)
            histories = [r.output_token_ids + d for r, d in zip(requests, drafted)]
            tokens = sampling.sample(logits[:, j], params, histories, [r.generator for r in requests])
            probs.append(sampling.probs(logits[:, j], params, histories))
            for d, t in zip(drafted, tokens.tolist()):
                d.append(t)
        greedy = all(p.is_greedy for p in params)  # penalised greedy: deterministic drafts, no q
        return Proposal(torch.tensor(drafted, dtype=torch.long), None if greedy else torch.stack(probs, dim=1))

    def _select(self, requests: Sequence[Request], hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> Proposal:
        """DFlash2: the candidate selector's walk from each request's anchor (hidden [b, k, H], logits
        [b, k, V] fp32, anchors [b] on the device)."""
        temperatures = [r.params.temperature for r in requests]
        tokens, probs = self.draft.candidate_selector.walk(hidden, logits, anchors, temperatures, [r.generator for r in requests])
        return Proposal(tokens.cpu(), probs)

    def release(self, request: Request) -> None:
        """Give the request's context slot back."""
        if request.draft_state is not None:
            self.pool.release(request.draft_state)
        request.draft_state = None

    def export_context(self, request: Request, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the context rows [start, stop) -> K, V [L, kv, stop - start, hd]."""
        if rows_held(request) < stop:
            raise RuntimeError(f"request {request.request_id}: DFlash context rows up to {stop} asked, {rows_held(request)} held")
        keys, values = request.draft_state.rows()
        return keys[:, :, start:stop].clone(), values[:, :, start:stop].clone()

    def import_context(self, request: Request, pages: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write the cached pages' context rows as the request's rows 0 .. n - 1 (a new slot)."""
        if request.draft_state is not None:
            raise RuntimeError(f"request {request.request_id}: DFlash context import over {rows_held(request)} held rows")
        keys = torch.cat([k for k, _ in pages], dim=2)  # [L, kv, n, hd]
        values = torch.cat([v for _, v in pages], dim=2)
        n = keys.shape[2]
        state = request.draft_state = self.pool.acquire()
        self.pool.reserve(n)
        positions = torch.arange(n, device=self.device)
        self.pool.write(torch.full((n,), state.slot, dtype=torch.long, device=self.device), positions, keys, values)
        state.num_rows = n
