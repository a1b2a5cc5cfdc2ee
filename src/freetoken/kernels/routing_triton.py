"""One token's MoE routing inside a Triton program: its router logits, softmax and top-k.

Shared by every launch that routes (moe_triton's route and expert GEMMs, moe_exit_triton), so that a
token's experts and weights have the same bits wherever they are computed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def top_k(logits, E, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's fp32 router logits [REP, BLOCK_E] (REP copies of the row; -inf past E) -> (ids
    [REP, TOP_K_POW2] int32, weights [REP, TOP_K_POW2] fp32 renormalised; slots past TOP_K 0), each row
    the same: softmax, then top_k by iterative max. Every reduction runs along a row, so with one copy
    per warp (REP = num_warps, `moe_triton.ROUTE_PER_WARP`) it stays inside the warp (shuffles, no barrier), and a
    row's sums take the same order as a one-warp launch's. (All eight picks in one tl.reduce with a
    bitonic top-8 merge measured slower in the 35B-A3B step: 2.346 against 2.332 ms,
    logs/variants-35b-topk-network-c5a2dae.jsonl.)"""
    cols = tl.arange(0, BLOCK_E)[None, :]
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    # One int64 key per expert, so that each pick is one reduction: a probability (>= +0) orders as its
    # fp32 bits, and the low word (BLOCK_E - 1 - id) makes the lowest id win among equal probabilities.
    # Padding (-1) never wins, even over probabilities that underflow to 0.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)
    key = tl.where(cols < E, key, -1)
    slots = tl.arange(0, TOP_K_POW2)[None, :]
    ids = tl.zeros((logits.shape[0], TOP_K_POW2), dtype=tl.int32)
    w = tl.zeros((logits.shape[0], TOP_K_POW2), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, 1)[:, None]
        e = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        ids = tl.where(slots == k, e, ids)
        w = tl.where(slots == k, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), w)
        key = tl.where(cols == e, -1, key)
    return ids, w / tl.sum(w, 1)[:, None]


@triton.jit
def router_logits(logits_ptr, token, stride_l, E, BLOCK_E: tl.constexpr, REP: tl.constexpr):
    """Token `token`'s router logits as top_k takes them: fp32 [REP, BLOCK_E], -inf past E."""
    cols = tl.arange(0, BLOCK_E)[None, :] + 0 * tl.arange(0, REP)[:, None]
    return tl.load(logits_ptr + token.to(tl.int64) * stride_l + cols, mask=cols < E, other=-float("inf")).to(tl.float32)
