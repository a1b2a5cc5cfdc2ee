"""Drives a family's MTP draft network through the spec protocol.

observe: every committed target row t (hidden h_t, next token x_{t+1}) goes through the MTP layer at
position t; this writes the MTP KV and leaves, per request, the MTP output of its last row, whose
logits give draft 1. propose: drafts 2..k chain the layer on its own output, one row per request
at the next position. The MTP KV rows written by the chain are speculative; the next observe
rewrites them with the accepted tokens.

With cuda_graphs on (and CUDA with the Triton path), a batch of greedy requests without penalties
drafts through a CUDA graph of the whole loop (draft_graph.py), with the same result; any other
batch runs the loop eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from freetoken import sampling
from freetoken.engine.request import Request
from freetoken.engine.runner import RowGroup, build_context
from freetoken.engine.spec_protocol import CommittedRows, Proposal
from freetoken.errors import FreetokenError
from freetoken.forward_context import ForwardMode
from freetoken.spec.mtp.draft_graph import DraftGraphs


@dataclass
class MTPDraftState:
    hidden: torch.Tensor  # [D] the MTP network's output of the last observed row (D: the family's hidden width, S*H for qwen4_exp)
    position: int  # that row's position


class MTPMethod:
    target_layers = ()  # reads the target's hidden alone
    pages_hold_draft_rows = True  # the MTP KV row at position t is written from (h_t, x_{t+1})

    def __init__(self, model: torch.nn.Module, kv_pool, num_draft_tokens: int, device: torch.device, origin: str | None = None,
                 cuda_graphs: bool = False, max_blocks_per_seq: int | None = None):
        """cuda_graphs: draft greedy batches through CUDA graphs where supported; max_blocks_per_seq: the
        graphs' padded block-table width (None: the whole pool), wider tables draft eagerly."""
        network = model.draft_network("mtp")
        if network is None:
            raise FreetokenError("the checkpoint has no MTP head; use --spec none", origin)
        if num_draft_tokens < 1:
            raise FreetokenError("--spec mtp needs --num-draft-tokens >= 1")
        self.network, self.kv_pool, self.device = network, kv_pool, device
        self.num_draft_tokens = num_draft_tokens
        self.graphs = None
        if cuda_graphs and DraftGraphs.supported(model, device):
            self.graphs = DraftGraphs(network, kv_pool, num_draft_tokens, max_blocks_per_seq or kv_pool.num_blocks)

    def _run(self, groups: list[RowGroup], hidden: torch.Tensor) -> torch.Tensor:
        ctx = build_context(groups, ForwardMode.EXTEND, self.kv_pool, None, self.device)
        return self.network(ctx, hidden)

    def observe(self, rows: Sequence[CommittedRows]) -> None:
        """Run the MTP layer over the committed (h_t, x_{t+1}) pairs; keep each request's last output."""
        rows = [r for r in rows if r.next_token_ids]
        if not rows:
            return
        # row t reads token t + 1: an image pad there enters as its feature; positions are the target's
        groups = [RowGroup(r.request.block_table, None, r.first_position, list(r.next_token_ids), images=r.request.images, token_offset=1) for r in rows]
        out = self._run(groups, torch.cat([r.hidden for r in rows]))
        end = 0
        for r in rows:
            end += len(r.next_token_ids)
            r.request.draft_state = MTPDraftState(out[end - 1], r.first_position + len(r.next_token_ids) - 1)

    def _pick(self, requests: Sequence[Request], hidden: torch.Tensor, drafted: list[list[int]]):
        logits = self.network.compute_logits(hidden)
        params = [r.params for r in requests]
        histories = [r.output_token_ids + d for r, d in zip(requests, drafted)]
        tokens = sampling.sample(logits, params, histories, [r.generator for r in requests])
        probs = None if all(p.is_greedy for p in params) else sampling.probs(logits, params, histories)
        return tokens, probs

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """k drafts per request: draft 1 from the last observed row, the rest by chaining."""
        k, b = self.num_draft_tokens, len(requests)
        states = [r.draft_state for r in requests]
        if any(s is None for s in states):
            # A request with a one-token prompt has no committed row yet: draft its last token.
            fallback = [[r.last_token_id] * k for r in requests]
            return Proposal(torch.tensor(fallback, dtype=torch.long), None)
        if self.graphs is not None and self.graphs.covers(requests) and all(r.images is None for r in requests):  # graphs: no rope_delta
            tokens = self.graphs.run([s.hidden for s in states], [r.block_table for r in requests], [s.position for s in states])
            return Proposal(tokens, None)
        hidden = torch.stack([s.hidden for s in states])
        drafted: list[list[int]] = [[] for _ in range(b)]
        probs: list[torch.Tensor] = []
        for step in range(k):
            if step > 0:
                groups = [RowGroup(r.block_table, None, s.position + step, [d[-1]], images=r.images) for r, s, d in zip(requests, states, drafted)]
                hidden = self._run(groups, hidden)
            tokens, q = self._pick(requests, hidden, drafted)
            for d, t in zip(drafted, tokens.tolist()):
                d.append(t)
            if q is not None:
                probs.append(q)
        tokens = torch.tensor(drafted, dtype=torch.long)
        return Proposal(tokens, torch.stack(probs, dim=1) if probs else None)

    def release(self, request: Request) -> None:
        """Drop the request's draft state."""
        request.draft_state = None

    def export_context(self, request: Request, start: int, stop: int) -> None:
        """Nothing outside the pages: the MTP KV rows are in them (cached with lookahead keys)."""

    def import_context(self, request: Request, pages: Sequence) -> None:
        """Nothing to restore: the first prefill piece after the hit writes the next draft state."""
