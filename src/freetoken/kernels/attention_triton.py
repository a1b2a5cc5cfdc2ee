"""Paged causal attention with GQA over a whole batch of query rows (Triton), split over the keys.

A decode step has one query row per request: one program per (row, KV head) would leave most of the
GPU idle while it walks the whole context. So every row's keys are cut into fixed PARTITION-token
partitions counted from position 0. Program (r, h, p) runs an online softmax in fp32 over partition
p of row r for KV head h and its G query heads (padded to at least 16 for the dot), in BLOCK_N
steps, and writes (max, sum, unnormalised output) to a workspace. A second kernel, one program per
(row, query head), merges the row's partitions in order p = 0, 1, ..., divides, casts, and (when
given) multiplies by the sigmoid output gate.

Every row, in every step, goes through these two kernels; the partitions depend only on the row's
own context length. A row therefore gets the same bits in decode, extend and verify, whatever else
shares the launch. Rows are launched in groups of at most `rows_per_launch` (from the workspace
budget and the shapes alone), which changes no bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.batched import SeqBatch
from freetoken.kernels.compat_triton import INTERPRET

BLOCK_N = 64
PARTITION = 64  # keys per partition: a multiple of BLOCK_N
WORKSPACE_BYTES = 64 << 20


@triton.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr,
    row_seq_ptr, ctx_len_ptr, table_ptr,
    G, D, block_size, scale, num_parts,
    q_row, q_head, kv_slot, kv_head, table_row,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, DOT_F32: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2)
    ctx_len = tl.load(ctx_len_ptr + r)
    begin = p * PARTITION
    if begin < ctx_len:
        seq = tl.load(row_seq_ptr + r).to(tl.int64)
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
        end = tl.minimum(begin + PARTITION, ctx_len)
        for n0 in range(begin, end, BLOCK_N):
            pos = n0 + ns
            mn = pos < end
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
            e = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(e, axis=1)
            acc = acc * alpha[:, None] + tl.dot(e, v, input_precision="ieee")
            m_i = m_new
        ws = (r * (G * tl.num_programs(1)) + heads) * num_parts + p  # [G_PAD] workspace entries
        tl.store(m_ptr + ws, m_i, mask=mg)
        tl.store(l_ptr + ws, l_i, mask=mg)
        tl.store(acc_ptr + ws[:, None] * D + ds[None, :], acc, mask=mg[:, None] & md[None, :])


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, gate_ptr, o_ptr, ctx_len_ptr,
    D, num_parts, gate_row, gate_head, o_row, o_head,
    HAS_GATE: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    ds = tl.arange(0, D_PAD)
    md = ds < D
    parts = tl.cdiv(tl.load(ctx_len_ptr + r), PARTITION)
    base = (r * tl.num_programs(1) + hq) * num_parts
    m = tl.load(m_ptr + base)
    for p in range(1, parts):
        m = tl.maximum(m, tl.load(m_ptr + base + p))
    total = tl.zeros((D_PAD,), dtype=tl.float32)
    norm = 0.0
    for p in range(0, parts):
        w = tl.exp(tl.load(m_ptr + base + p) - m)
        norm += w * tl.load(l_ptr + base + p)
        total += w * tl.load(acc_ptr + (base + p) * D + ds, mask=md, other=0.0)
    out = (total / norm).to(o_ptr.dtype.element_ty)
    if HAS_GATE:
        gate = tl.load(gate_ptr + r * gate_row + hq * gate_head + ds, mask=md, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate).to(o_ptr.dtype.element_ty)  # torch.sigmoid rounds to the input dtype
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + r * o_row + hq * o_head + ds, out, mask=md)


def paged_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    batch: SeqBatch,
    block_size: int,
    scale: float,
    gate: torch.Tensor | None = None,  # [N, Hq, D]: the output is multiplied by sigmoid(gate)
) -> torch.Tensor:
    """Every row of q attends causally within its sequence (batch.context_lens) -> [N, Hq, D] in q.dtype."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    n, num_q_heads, d = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if n == 0:
        return out
    table = batch.block_table
    num_parts = triton.cdiv(table.shape[1] * block_size, PARTITION)  # covers the longest context the table can hold
    rows_per_launch = max(1, WORKSPACE_BYTES // (num_q_heads * num_parts * (d + 2) * 4))
    rows_ws = min(n, rows_per_launch)
    m_ws = torch.empty(rows_ws * num_q_heads * num_parts, dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty(rows_ws * num_q_heads * num_parts * d, dtype=torch.float32, device=q.device)
    g = gate if gate is not None else q
    d_pad = max(16, triton.next_power_of_2(d))
    for r0 in range(0, n, rows_per_launch):
        rows = min(rows_per_launch, n - r0)
        _partition_kernel[(rows, num_kv_heads, num_parts)](
            q[r0:], k_cache, v_cache, m_ws, l_ws, acc_ws, batch.row_seq[r0:], batch.context_lens[r0:], table,
            group, d, block_size, scale, num_parts,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
            G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad, BLOCK_N=BLOCK_N, PARTITION=PARTITION,
            DOT_F32=INTERPRET, num_warps=4,
        )
        _merge_kernel[(rows, num_q_heads)](
            m_ws, l_ws, acc_ws, g[r0:], out[r0:], batch.context_lens[r0:],
            d, num_parts, g.stride(0), g.stride(1), out.stride(0), out.stride(1),
            HAS_GATE=gate is not None, D_PAD=d_pad, PARTITION=PARTITION, num_warps=4,
        )
    return out
