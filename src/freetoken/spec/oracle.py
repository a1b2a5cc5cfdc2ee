"""Oracle drafts for benchmarking the runtime: drafts replay a known greedy continuation.

With the continuation of each request known (from a plain greedy run), the drafts are exactly what
the target will emit, so every draft is accepted; `corrupt_rate` replaces each draft independently
with a wrong token with that probability, which sets the per-token acceptance. This measures the
runtime's speculative speedup as a function of acceptance, independent of any draft network.
`OracleDFlash` runs a DFlash draft network in full on every step (so its cost is in the timing) and
then proposes the oracle's tokens instead of the draft's.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from freetoken.engine.request import Request
from freetoken.engine.spec_protocol import CommittedRows, Proposal
from freetoken.spec.dflash.method import DFlashMethod


class OracleDrafts:
    target_layers = ()
    pages_hold_draft_rows = False

    def __init__(self, model, kv_pool, num_draft_tokens: int, device, origin: str | None = None, cuda_graphs: bool = False, max_blocks_per_seq: int | None = None):
        self.num_draft_tokens = num_draft_tokens
        self.vocab_size = model.config.vocab_size
        self.continuations: dict[int, list[int]] = {}  # request_id -> greedy output without spec
        self.corrupt_rate = 0.0
        self.rng = random.Random(0)

    def set_continuations(self, continuations: dict[int, list[int]], corrupt_rate: float = 0.0, seed: int = 0) -> None:
        self.continuations, self.corrupt_rate, self.rng = continuations, corrupt_rate, random.Random(seed)

    def observe(self, rows: Sequence[CommittedRows]) -> None:
        """Nothing to learn: the continuation is known."""

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """The next k tokens of each request's known continuation, some corrupted on purpose."""
        drafts = []
        for r in requests:
            known = self.continuations.get(r.request_id, [])
            n = len(r.output_token_ids)
            row = []
            for i in range(self.num_draft_tokens):
                token = known[n + i] if n + i < len(known) else 0
                if self.rng.random() < self.corrupt_rate:
                    token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                row.append(token)
            drafts.append(row)
        return Proposal(torch.tensor(drafts, dtype=torch.long), None)

    def release(self, request: Request) -> None:
        """No per-request state."""

    def export_context(self, request: Request, start: int, stop: int) -> None:
        """No per-request state."""

    def import_context(self, request: Request, pages: Sequence) -> None:
        """No per-request state."""


class OracleDFlash(DFlashMethod):
    """A DFlash draft that does all its work (context rows, one block per request, the logits and their
    argmax or selector walk, read back to the host) and then proposes the oracle's drafts."""

    def __init__(self, model, kv_pool, num_draft_tokens: int, device, origin: str | None = None, cuda_graphs: bool = False, max_blocks_per_seq: int | None = None):
        super().__init__(model, kv_pool, num_draft_tokens, device, origin, cuda_graphs, max_blocks_per_seq)
        self.oracle = OracleDrafts(model, kv_pool, num_draft_tokens, device)

    def set_continuations(self, continuations: dict[int, list[int]], corrupt_rate: float = 0.0, seed: int = 0) -> None:
        """As OracleDrafts.set_continuations."""
        self.oracle.set_continuations(continuations, corrupt_rate, seed)

    def propose(self, requests: Sequence[Request]) -> Proposal:
        """The draft's own proposal is computed and dropped; the oracle's is returned."""
        super().propose(requests)
        return self.oracle.propose(requests)
