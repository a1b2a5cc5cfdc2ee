"""Paged causal attention with GQA over a whole batch of query rows (Triton).

Program (r, h) takes query row r and KV head h with its group of G query heads (padded to at least
16 for the dot), and walks keys 0..context_len[r]-1 of r's sequence in fixed BLOCK_N steps with an
online softmax in fp32, gathering each key's slot through the block table. Nothing about the
schedule depends on how many rows the launch has, so a row gets the same bits in decode, extend
and verify: only its own context length and its own cache entries matter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.batched import SeqBatch
from freetoken.kernels.compat_triton import INTERPRET

BLOCK_N = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    row_seq_ptr, ctx_len_ptr, table_ptr,
    G, D, block_size, scale,
    q_row, q_head, kv_slot, kv_head, o_row, o_head, table_row,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq = tl.load(row_seq_ptr + r).to(tl.int64)
    ctx_len = tl.load(ctx_len_ptr + r)
    gs = tl.arange(0, G_PAD)
    ds = tl.arange(0, D_PAD)
    mg = gs < G
    md = ds < D
    heads = h * G + gs
    q = tl.load(q_ptr + r * q_row + heads[:, None] * q_head + ds[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    ns = tl.arange(0, BLOCK_N)
    for n0 in range(0, ctx_len, BLOCK_N):
        pos = n0 + ns
        mn = pos < ctx_len
        block = tl.load(table_ptr + seq * table_row + pos // block_size, mask=mn, other=0).to(tl.int64)
        slot = block * block_size + pos % block_size
        kv_off = slot[:, None] * kv_slot + h * kv_head + ds[None, :]
        kv_mask = mn[:, None] & md[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BLOCK_N]
        s = tl.where(mn[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + r * o_row + heads[:, None] * o_head + ds[None, :], out.to(o_ptr.dtype.element_ty), mask=mg[:, None] & md[None, :])


def paged_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    batch: SeqBatch,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Every row of q attends causally within its sequence (batch.context_lens) -> [N, Hq, D] in q.dtype."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    n, num_q_heads, d = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if n == 0:
        return out
    table = batch.block_table
    _paged_attention_kernel[(n, num_kv_heads)](
        q, k_cache, v_cache, out, batch.row_seq, batch.context_lens, table,
        group, d, block_size, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1), table.stride(0),
        G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_N=BLOCK_N,
        DOT_F32=INTERPRET, num_warps=4,
    )
    return out
