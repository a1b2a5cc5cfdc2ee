"""Paged causal attention with GQA (reference).

The KV pool stores keys and values per token slot: cache [num_slots, Hkv, D], slot = block * block_size
+ offset. Each query row attends to the first `context_len` tokens of its sequence, gathered through
the block table, and is computed on its own, so its bits do not depend on the other rows of the call.
"""

from __future__ import annotations

import torch


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, Hkv, D] into the caches [num_slots, Hkv, D] at slot_mapping [N]."""
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


def token_slots(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Slots [num_tokens] of a sequence's first num_tokens tokens; block_table [max_blocks]."""
    pos = torch.arange(num_tokens, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] queries of one sequence
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int
    context_lens: list[int],  # per query row: how many tokens it sees (its own included)
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's query rows -> [T, Hq, D] in q.dtype."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    slots = token_slots(block_table, max(context_lens), block_size)
    out = []
    for i, length in enumerate(context_lens):
        # Gathered afresh per row: the operands' shapes and strides depend on `length` alone.
        keys = k_cache[slots[:length]].float().repeat_interleave(group, dim=1).transpose(0, 1).contiguous()  # [Hq, L, D]
        values = v_cache[slots[:length]].float().repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
        scores = torch.matmul(keys, q[i].float()[:, :, None]).squeeze(-1) * scale  # [Hq, L]
        probs = torch.softmax(scores, dim=-1)
        out.append(torch.matmul(probs[:, None, :], values).squeeze(1))  # [Hq, D]
    return torch.stack(out).to(q.dtype)
