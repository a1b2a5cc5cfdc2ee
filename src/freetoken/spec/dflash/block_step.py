"""One DFlash draft step of a batch at static shapes: what the eager path runs and the graphs capture.

A batch of b requests runs at a bucketed batch size bb >= b (1, 2, 4, then multiples of 8) and a
bucketed context length n (the smallest of 256, 512, ... , max_ctx holding the longest context),
so the shapes of every op depend on (bb, n) alone and a CUDA graph captured at (bb, n) launches
the eager step's kernels at the eager step's shapes: the same bits. The attention over n context
rows costs what the longest context needs, up to a factor 2.

The step's inputs are three int64 [bb] device tensors, filled through one staging copy
(`BlockInputs`): each block's anchor token, its start (the anchor's position, which is also the
request's context length: its rows 0 .. start - 1 are valid) and its context pool slot. Padding
blocks have anchor 0, start 0 (no context row is seen) and slot 0; their results are dropped.
Everything else is built on the device: block ids [anchor, mask x (B - 1)], positions
start .. start + B - 1, the context rows gathered from the pool and their validity mask.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from freetoken.engine.cuda_graph import StagingBuffer
from freetoken.spec.dflash.context_pool import ContextPool, bucket_of
from freetoken.spec.dflash.draft import DFlashDraft


def batch_bucket(num_seqs: int) -> int:
    """The batch size a batch of num_seqs blocks runs at: 1, 2, 4, then the next multiple of 8."""
    return next((b for b in (1, 2, 4) if num_seqs <= b), -(-num_seqs // 8) * 8)


class BlockInputs(StagingBuffer):
    """The per-step inputs of bb blocks (anchors, starts, slots: int64 [bb] each)."""

    def __init__(self, num_blocks: int, device: torch.device):
        super().__init__([(name, torch.int64, (num_blocks,)) for name in ("anchors", "starts", "slots")], device)

    def load(self, anchors: Sequence[int], starts: Sequence[int], slots: Sequence[int]) -> None:
        """Fill the host views for len(anchors) blocks (the rest padding: 0) and queue one copy to the device."""
        h, b = self.on_host, len(anchors)
        for name, values in (("anchors", anchors), ("starts", starts), ("slots", slots)):
            h[name][:b] = values
            h[name][b:] = 0
        self.upload()


class BlockStep:
    """The draft's block forward over the context pool, and the greedy drafts from it."""

    def __init__(self, draft: DFlashDraft, embed: Callable, compute_logits: Callable, pool: ContextPool, num_draft_tokens: int, device: torch.device):
        """embed [N] -> [N, H] and compute_logits [M, H] -> [M, V] fp32 are the target's."""
        self.draft, self.embed, self.compute_logits, self.pool = draft, embed, compute_logits, pool
        self.k = num_draft_tokens
        cfg = draft.config
        self.block_size = cfg.block_size
        self.mask_ids = torch.full((1, cfg.block_size - 1), cfg.mask_token_id, dtype=torch.long, device=device)  # [1, B-1]
        self.offsets = torch.arange(cfg.block_size, device=device)[None]  # [1, B]
        self.ctx_positions = torch.arange(pool.max_ctx, device=device)  # [max_ctx]

    def context_bucket(self, longest: int) -> int:
        """The context length a step whose longest context has `longest` rows runs at (the pool's
        capacity is at least that: it is the bucket of the longest context written)."""
        return bucket_of(self.pool.buckets, longest)

    def hidden(self, inputs: dict[str, torch.Tensor], n: int) -> torch.Tensor:  # -> [bb, k, H]
        """The draft's normed output at slots 1 .. k of each block; inputs: BlockInputs.on_device
        (anchors, starts, slots [bb]); n: the context bucket (>= every start)."""
        anchors, starts, slots = inputs["anchors"], inputs["starts"], inputs["slots"]
        bb = anchors.shape[0]
        ids = torch.cat([anchors[:, None], self.mask_ids.expand(bb, -1)], dim=1)  # [bb, B]
        positions = starts[:, None] + self.offsets  # [bb, B]
        keys, values = self.pool.gather(slots, n)  # [L, bb, kv, n, hd] each
        ctx_positions = self.ctx_positions[:n].expand(bb, n)
        valid = ctx_positions < starts[:, None]  # [bb, n]
        out = self.draft(self.embed(ids.view(-1)).view(bb, self.block_size, -1), positions, keys, values, ctx_positions, valid)
        return out[:, 1 : 1 + self.k]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [b, k, H] -> [b, k, V] fp32
        """The target's logits of the drafted slots' hidden states."""
        return self.compute_logits(hidden.flatten(0, 1)).view(*hidden.shape[:2], -1)

    def greedy_drafts(self, inputs: dict[str, torch.Tensor], n: int) -> torch.Tensor:  # -> [bb, k] int64
        """Greedy drafts of every block: each slot's argmax (DFlash) or the candidate selector's greedy
        walk from the anchor (DFlash2). Device work alone."""
        hidden = self.hidden(inputs, n)
        logits = self.logits(hidden)
        selector = self.draft.candidate_selector
        if selector is not None:
            return selector.greedy_walk(hidden, logits, inputs["anchors"])
        return logits.argmax(dim=-1)
