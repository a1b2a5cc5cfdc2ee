"""QSA sparse paged attention (Triton), split over each row's key list; the reference and the
layouts are qsa_ref.py.

A row's keys form one list in ascending position order: for t < count * c the token t % c of kept
block ids[t // c], then the tail (the last n mod c positions); at most budget + c - 1 keys. A decode
step has one row, so one program per (row, KV head) walking the whole list would leave the GPU idle.
The list is instead cut into fixed PARTITION-wide partitions counted from its start
(qsa_ref.PARTITION), and two launches follow qsa_ref.partitioned_attention step by step:

1. `_partition_kernel`, program (row, KV head h, partition p): the G query heads of h (the dot's M,
   padded to G_PAD = max(16, next_pow2(G))) against the partition's keys. The scores are fp32 from
   a dot of the cache-dtype q and K (tensor cores for bf16; bf16 products are exact in fp32), m_p
   is their max, l_p the fp32 sum of e = exp(s - m_p), and the partition's output is the dot of e
   rounded to the cache dtype (as torch's attention rounds the probabilities) with V, accumulated in
   fp32. m_p, l_p and the output go to a workspace [rows, Hq, partitions(, D)] fp32. A program whose
   partition starts past the row's list stores nothing.
2. `_merge_kernel`, program (row, query head): the weights w_p = exp(m_p - max m) of the row's
   partitions, then the sums of w_p * l_p and w_p * output over MERGE_PARTS partitions at a time,
   in order p = 0, 1, ...; the output is their quotient (IEEE division) in q's dtype, and (given the
   attention's output gate) times sigmoid(gate) rounded to that dtype, the product rounded again.

A row gets the same bits whichever rows share the launch (a decode step, a verify block, a prefill
chunk, other sequences): every program reads one row only, its steps are set by that row's count
and context length, and the shapes of its dots and sums are constants of the launch. The launch
shape is (rows, KV heads, cdiv(top_blocks * c + c - 1, PARTITION)) and (rows, query heads), from the
layer's shapes alone: no host read of a per-row value, so the pair can be captured in a CUDA graph.
Only slots of the row's own keys are loaded (others are masked), so unwritten cache slots are never
read. Rows go in launches of at most `rows_per_launch` (from the workspace budget and the shapes),
which changes no bits either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl, qsa_ref
from freetoken.kernels.batched import SeqBatch
from freetoken.kernels.compat_triton import INTERPRET

compat_triton.patch()  # the interpreter's fix-up (compat_triton), for the runtime loop bound

NUM_WARPS = 4
MERGE_WARPS = 4
WORKSPACE_BYTES = 64 << 20  # partition maxima, sums and outputs of one launch; more rows go in several launches


@triton.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, ids_ptr, count_ptr,
    row_seq_ptr, ctx_len_ptr, table_ptr,
    G, D, page_size, scale, num_parts, row0,
    q_row, q_head, kv_slot, kv_head, ids_row, table_row,
    RATIO: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    r = row0 + tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2)
    ctx_len = tl.load(ctx_len_ptr + r)
    count = tl.load(count_ptr + r)
    complete = ctx_len // RATIO
    in_blocks = count * RATIO
    num_keys = in_blocks + ctx_len - complete * RATIO
    begin = p * PARTITION
    if begin < num_keys:
        t = begin + tl.arange(0, PARTITION)
        mt = t < num_keys
        chosen = t < in_blocks
        block = tl.load(ids_ptr + r * ids_row + t // RATIO, mask=mt & chosen, other=0)
        pos = tl.where(chosen, block * RATIO + t % RATIO, complete * RATIO + t - in_blocks)
        seq = tl.load(row_seq_ptr + r).to(tl.int64)
        page = tl.load(table_ptr + seq * table_row + pos // page_size, mask=mt, other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        gs = tl.arange(0, G_PAD)
        mg = gs < G
        ds = tl.arange(0, D_PAD)
        md = ds < D
        heads = h * G + gs
        q = tl.load(q_ptr + r * q_row + heads[:, None] * q_head + ds[None, :], mask=mg[:, None] & md[None, :], other=0.0)
        kv_at = slot[:, None] * kv_slot + h * kv_head + ds[None, :]
        mkv = mt[:, None] & md[None, :]
        k = tl.load(k_ptr + kv_at, mask=mkv, other=0.0)
        v = tl.load(v_ptr + kv_at, mask=mkv, other=0.0)
        if DOT_F32:
            q, k = q.to(tl.float32), k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, PARTITION]
        s = tl.where(mt[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)  # finite: the partition holds a key
        e = tl.exp(s - m[:, None])
        total = tl.sum(e, axis=1)
        probs = e.to(v.dtype)  # the probabilities in the cache dtype, as torch's attention rounds them
        if DOT_F32:
            probs, v = probs.to(tl.float32), v.to(tl.float32)
        acc = tl.dot(probs, v, input_precision="ieee")  # [G_PAD, D_PAD]
        ws = ((r - row0) * (G * tl.num_programs(1)) + heads) * num_parts + p  # [G_PAD] workspace entries
        tl.store(m_ptr + ws, m, mask=mg)
        tl.store(l_ptr + ws, total, mask=mg)
        tl.store(acc_ptr + ws[:, None] * D + ds[None, :], acc, mask=mg[:, None] & md[None, :])


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, gate_ptr, o_ptr, count_ptr, ctx_len_ptr,
    D, num_parts, row0, gate_row, gate_head, o_row, o_head,
    RATIO: tl.constexpr, PARTITION: tl.constexpr, PARTS_PAD: tl.constexpr, MERGE_PARTS: tl.constexpr, D_PAD: tl.constexpr,
    HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    r = row0 + tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    ctx_len = tl.load(ctx_len_ptr + r)
    num_keys = tl.load(count_ptr + r) * RATIO + ctx_len % RATIO
    parts = tl.cdiv(num_keys, PARTITION)
    base = ((r - row0) * tl.num_programs(1) + hq) * num_parts
    ps = tl.arange(0, PARTS_PAD)
    m = tl.max(tl.load(m_ptr + base + ps, mask=ps < parts, other=float("-inf")), axis=0)
    ds = tl.arange(0, D_PAD)
    md = ds < D
    norm = 0.0
    total = tl.zeros((D_PAD,), dtype=tl.float32)
    for p0 in range(0, parts, MERGE_PARTS):
        pc = p0 + tl.arange(0, MERGE_PARTS)
        mine = pc < parts
        w = tl.exp(tl.load(m_ptr + base + pc, mask=mine, other=float("-inf")) - m)  # 0 past the row's partitions
        norm += tl.sum(w * tl.load(l_ptr + base + pc, mask=mine, other=0.0), axis=0)
        outs = tl.load(acc_ptr + (base + pc)[:, None] * D + ds[None, :], mask=mine[:, None] & md[None, :], other=0.0)
        total += tl.sum(w[:, None] * outs, axis=0)
    out = tl.div_rn(total, tl.full(total.shape, 1.0, tl.float32) * norm).to(o_ptr.dtype.element_ty)
    if HAS_GATE:  # qsa_ref: sigmoid(gate) rounded to the output dtype, then the product rounded
        gate = tl.load(gate_ptr + r * gate_row + hq * gate_head + ds, mask=md, other=0.0).to(tl.float32)
        sig = tl.div_rn(tl.full(gate.shape, 1.0, tl.float32), 1.0 + tl.exp(-gate)).to(o_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + r * o_row + hq * o_head + ds, out, mask=md)


def qsa_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_ids: torch.Tensor,  # [N, top_blocks] int32 (qsa_select's)
    counts: torch.Tensor,  # [N] int32
    batch: SeqBatch,
    page_size: int,
    ratio: int,
    scale: float,
    gate: torch.Tensor | None = None,  # [N, Hq, D]: the output is multiplied by sigmoid(gate) in the merge
) -> torch.Tensor:
    """As qsa_ref.qsa_attention: -> [N, Hq, D] in q.dtype."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and block_ids.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    g = gate if gate is not None else q  # a placeholder pointer without a gate
    n, num_q_heads, d = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if n == 0:
        return out
    partition, merge_parts = qsa_ref.PARTITION, qsa_ref.MERGE_PARTS
    num_parts = triton.cdiv(block_ids.shape[1] * ratio + ratio - 1, partition)  # the longest key list
    rows_per_launch = max(1, WORKSPACE_BYTES // (num_q_heads * num_parts * (d + 2) * 4))
    rows_ws = min(n, rows_per_launch)
    m_ws = torch.empty(rows_ws * num_q_heads * num_parts, dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty(rows_ws * num_q_heads * num_parts * d, dtype=torch.float32, device=q.device)
    table = batch.block_table
    d_pad = max(16, triton.next_power_of_2(d))
    dot_f32 = INTERPRET or q.dtype == torch.float32 or k_cache.dtype == torch.float32
    for r0 in range(0, n, rows_per_launch):
        rows = min(rows_per_launch, n - r0)
        _partition_kernel[(rows, num_kv_heads, num_parts)](
            q, k_cache, v_cache, m_ws, l_ws, acc_ws, block_ids, counts, batch.row_seq, batch.context_lens, table,
            group, d, page_size, scale, num_parts, r0,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_ids.stride(0), table.stride(0),
            RATIO=ratio, G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad, PARTITION=partition, DOT_F32=dot_f32,
            num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
        _merge_kernel[(rows, num_q_heads)](
            m_ws, l_ws, acc_ws, g, out, counts, batch.context_lens, d, num_parts, r0, g.stride(0), g.stride(1), out.stride(0), out.stride(1),
            RATIO=ratio, PARTITION=partition, PARTS_PAD=triton.next_power_of_2(num_parts), MERGE_PARTS=merge_parts, D_PAD=d_pad,
            HAS_GATE=gate is not None, num_warps=MERGE_WARPS, **pdl.launch_kwargs(),
        )
    return out
