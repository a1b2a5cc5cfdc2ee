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

The draft runs eagerly in torch, the blocks of all requests in one forward (each request's context
rows copied into one tensor padded to the longest, the padding masked) and the committed rows of
all requests in one `context_kv`; on the GPU the target's verify steps are CUDA graphs that export
the taps (engine/cuda_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from freetoken import sampling
from freetoken.engine.request import Request
from freetoken.engine.spec_protocol import CommittedRows, Proposal
from freetoken.errors import FreetokenError


@dataclass
class DFlashContext:
    """A request's draft context: K and V of its committed rows 0 .. num_rows - 1 in every draft layer."""

    keys: torch.Tensor  # [L, kv, capacity, hd]
    values: torch.Tensor  # [L, kv, capacity, hd]
    num_rows: int

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:  # [L, kv, m, hd] each
        """Add m rows after the held ones, doubling the capacity when full."""
        m = keys.shape[2]
        if self.num_rows + m > self.keys.shape[2]:
            capacity = max(2 * self.keys.shape[2], self.num_rows + m)
            self.keys, self.values = (_grown(t, self.num_rows, capacity) for t in (self.keys, self.values))
        self.keys[:, :, self.num_rows : self.num_rows + m] = keys
        self.values[:, :, self.num_rows : self.num_rows + m] = values
        self.num_rows += m

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # -> [L, kv, num_rows, hd] each
        """The held rows' K and V."""
        return self.keys[:, :, : self.num_rows], self.values[:, :, : self.num_rows]


def _grown(rows: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    out = rows.new_empty(rows.shape[:2] + (capacity,) + rows.shape[3:])
    out[:, :, :used] = rows[:, :, :used]
    return out


class DFlashMethod:
    def __init__(self, model: torch.nn.Module, kv_pool, num_draft_tokens: int, device: torch.device, origin: str | None = None,
                 cuda_graphs: bool = False, max_blocks_per_seq: int | None = None):
        """kv_pool, cuda_graphs and max_blocks_per_seq are unused: the draft keeps its own context rows."""
        draft = model.draft_network("dflash")
        if draft is None:
            raise FreetokenError("the checkpoint has no DFlash draft (convert it with --dflash DRAFT_DIR); use --spec none", origin)
        block_size = draft.config.block_size
        if not 1 <= num_draft_tokens <= block_size - 1:
            raise FreetokenError(f"--spec dflash drafts 1 to {block_size - 1} tokens a step (its block holds {block_size}), not {num_draft_tokens}", origin)
        self.draft, self.device = draft, device
        self.embed, self.compute_logits = model.embed, model.compute_logits
        self.num_draft_tokens = num_draft_tokens
        self.target_layers: tuple[int, ...] = tuple(draft.config.target_layer_ids)
        self.mask_token_id = draft.config.mask_token_id
        cfg = draft.config
        self._no_rows = torch.empty(cfg.num_hidden_layers, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=draft.norm.weight.dtype, device=device)

    def _context(self, request: Request) -> DFlashContext:
        """The request's draft context; an empty one (not stored) before its first committed row."""
        return request.draft_state or DFlashContext(self._no_rows, self._no_rows, 0)

    def observe(self, rows: Sequence[CommittedRows]) -> None:
        """Append each request's committed rows to its draft context (their K and V in every draft
        layer), the rows of all requests computed at once."""
        if not rows:
            return
        states = [self._context(r.request) for r in rows]
        for r, state in zip(rows, states):
            if r.first_position != state.num_rows:
                raise RuntimeError(f"request {r.request.request_id}: committed rows start at {r.first_position}, its DFlash context holds {state.num_rows}")
        counts = [r.layer_hidden.shape[0] for r in rows]
        positions = torch.cat([torch.arange(r.first_position, r.first_position + n) for r, n in zip(rows, counts)]).to(self.device)
        features = torch.cat([r.layer_hidden for r in rows])  # [sum(counts), n_taps * H]
        keys, values = self.draft.context_kv(self.draft.context(features), positions)  # [L, kv, sum(counts), hd] each
        for r, state, k, v in zip(rows, states, keys.split(counts, dim=2), values.split(counts, dim=2)):
            state.append(k, v)
            r.request.draft_state = state

    def _blocks_hidden(self, requests: Sequence[Request]) -> torch.Tensor:  # -> [b, B - 1, H]
        """The draft's output for slots 1 .. B - 1 of each request's next block, all blocks in one
        forward over the requests' context rows (padded to the longest)."""
        block_size, b = self.draft.config.block_size, len(requests)
        states = [self._context(r) for r in requests]
        starts = [r.num_cached_tokens for r in requests]
        for r, state, start in zip(requests, states, starts):
            if state.num_rows != start:
                raise RuntimeError(f"request {r.request_id}: its DFlash context holds {state.num_rows} rows, its anchor is at {start}")
        ids = torch.full((b, block_size), self.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([r.last_token_id for r in requests])
        positions = (torch.tensor(starts)[:, None] + torch.arange(block_size)).to(self.device)  # [b, B]
        longest = max(starts)
        layers, kv_heads, _, head_dim = self._no_rows.shape
        keys = self._no_rows.new_zeros(layers, b, kv_heads, longest, head_dim)  # [L, b, kv, n, hd]
        values = torch.zeros_like(keys)
        for i, state in enumerate(states):
            keys[:, i, :, : state.num_rows], values[:, i, :, : state.num_rows] = state.rows()
        # the rows past a shorter context are padding (None: every context is the longest)
        valid = None if min(starts) == longest else (torch.arange(longest)[None] < torch.tensor(starts)[:, None]).to(self.device)
        ctx_positions = torch.arange(longest, device=self.device).expand(b, longest)
        hidden = self.draft(self.embed(ids.view(-1).to(self.device)).view(b, block_size, -1), positions, keys, values, ctx_positions, valid)
        return hidden[:, 1:]

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """k drafts per request from one draft block each; with sampled requests also their distributions q."""
        k = self.num_draft_tokens
        hidden = self._blocks_hidden(requests)[:, :k]  # [b, k, H]
        logits = self.compute_logits(hidden.flatten(0, 1)).view(len(requests), k, -1)  # [b, k, V] fp32
        if self.draft.candidate_selector is not None:
            return self._select(requests, hidden, logits)
        if all(r.params.is_plain_greedy for r in requests):
            return Proposal(logits.argmax(dim=-1).cpu(), None)
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

    def _select(self, requests: Sequence[Request], hidden: torch.Tensor, logits: torch.Tensor) -> Proposal:
        """DFlash2: the candidate selector's walk from each request's anchor (hidden [b, k, H], logits [b, k, V] fp32)."""
        anchors = torch.tensor([r.last_token_id for r in requests], dtype=torch.long, device=self.device)
        temperatures = [r.params.temperature for r in requests]
        tokens, probs = self.draft.candidate_selector.walk(hidden, logits, anchors, temperatures, [r.generator for r in requests])
        return Proposal(tokens.cpu(), probs)

    def release(self, request: Request) -> None:
        """Drop the request's draft context."""
        request.draft_state = None
