"""The one interface between the engine and a speculative-decoding method.

Every decode step is a verify: each running request feeds k+1 rows (its last token and k drafts),
the same k for every request. `none` is the method with k = 0, so there is one decode path. A
method sees the target's committed rows through `observe` (with the outputs of the target layers it
names in `target_layers`, for drafts that read them) and proposes drafts through `propose`; it never
touches the scheduler or the pools beyond the block tables it is handed.

Every method is built as `Method(model, kv_pool, num_draft_tokens, device, origin=..., cuda_graphs=...,
max_blocks_per_seq=...)`; the last two say whether it may replay its drafting as CUDA graphs and the
padded block-table width of those graphs (methods with nothing to capture ignore them).

With the prefix cache (engine/prefix_cache.py) a request may start with pages another request
computed. A method that writes rows into the pages whose position p depends on token p + 1 says so
(`pages_hold_draft_rows`: the cache then keys pages with the token after them); a method that keeps
per-position state elsewhere exports it with every cached page and imports it on a hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from freetoken.engine.request import Request


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] int64 draft tokens
    probs: torch.Tensor | None  # [B, k, V] draft distributions q, or None for deterministic drafts


@dataclass
class CommittedRows:
    """Rows of one request that the target just committed (prefill chunk or accepted verify rows)."""

    request: Request
    first_position: int  # position of the first row
    hidden: torch.Tensor  # [m, D] the target's hidden of those rows (post-norm [m, H]; qwen4_exp: the wide residual [m, S*H])
    next_token_ids: list[int]  # [m] the token that follows each row (x_{t+1}); the last row's may be unknown yet
    layer_hidden: torch.Tensor | None = None  # [m, n * H] outputs of the method's target_layers, concatenated; None if it reads none


class SpecMethod(Protocol):
    num_draft_tokens: int
    target_layers: tuple[int, ...]  # decoder layers whose outputs observe reads (CommittedRows.layer_hidden); () for none
    pages_hold_draft_rows: bool  # it writes draft KV rows into the request's pages (row p depends on token p + 1)

    def observe(self, rows: Sequence[CommittedRows]) -> None:
        """Consume the target's committed rows: write draft caches and prepare the next proposal."""

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """Return num_draft_tokens drafts per request (their KV blocks are already allocated)."""

    def release(self, request: Request) -> None:
        """Forget a request's draft state (finished or preempted)."""

    def export_context(self, request: Request, start: int, stop: int) -> Any:
        """The method's state of the request's observed positions [start, stop) kept outside the KV pages
        (a copy, cached with the page); None when it keeps none."""

    def import_context(self, request: Request, pages: Sequence[Any]) -> None:
        """A request admitted on a prefix-cache hit: take the exports of its cached pages (positions 0 ..
        len(pages) * block_size - 1, in order) as if it had observed those rows."""


class NoSpec:
    """Plain decoding: zero drafts."""

    num_draft_tokens = 0
    target_layers = ()
    pages_hold_draft_rows = False

    def __init__(self, model=None, kv_pool=None, num_draft_tokens: int = 0, device=None, origin: str | None = None, cuda_graphs: bool = False, max_blocks_per_seq: int | None = None):
        assert num_draft_tokens == 0
        self._empty: dict[int, Proposal] = {}  # batch size -> its empty proposal, built once

    def observe(self, rows: Sequence[CommittedRows]) -> None:
        """Nothing to draft."""

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """An empty [B, 0] proposal."""
        b = len(requests)
        if b not in self._empty:
            self._empty[b] = Proposal(tokens=torch.zeros((b, 0), dtype=torch.long), probs=None)
        return self._empty[b]

    def release(self, request: Request) -> None:
        """No state to drop."""

    def export_context(self, request: Request, start: int, stop: int) -> None:
        """No state outside the pages."""

    def import_context(self, request: Request, pages: Sequence[Any]) -> None:
        """Nothing to restore."""
