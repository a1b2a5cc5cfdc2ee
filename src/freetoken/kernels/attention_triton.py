"""Paged causal attention with GQA over a whole batch of query rows (Triton), split over the keys.

A decode step has one query row per request: one program per (row, KV head) would leave most of the
GPU idle while it walks the whole context. So the keys are cut into fixed PARTITION-token partitions
counted from position 0, and a first kernel computes, for each partition separately, a softmax in
fp32 (max, sum, unnormalised output) into a workspace; the scores are fp32, and the probabilities
are rounded to the cache dtype for the dot with V, as torch's attention rounds them, so both dots run
on tensor cores. A second kernel, one program per (row, query
head), merges the row's partitions in order p = 0, 1, ..., divides, casts, and (when given)
multiplies by the sigmoid output gate.

The first kernel's program (g, h, p) takes partition p of a *row group* for KV head h: up to
R = G_PAD // G consecutive rows of one sequence (G_PAD = max(16, next_pow2(G)), the dot's M), whose G
query heads each fill one tile of G entries of the dot: the row at position pos of its sequence
always takes tile pos % R (entry i: tile i // G, query head h * G + i % G); entries of empty tiles are
masked off. The K/V block is read once for the whole group, so a verify step of k+1 rows costs
about what a decode step costs. Each entry is masked by its own row's context length; a partition
runs when it starts before the group's longest context.

A row gets the same bits whether it is alone (decode), with its verify siblings, in a prefill chunk,
or next to any other sequences:
- The dots are always [G_PAD, D] x [D, PARTITION] and [G_PAD, PARTITION] x [PARTITION, D], and a
  row sits in the same entries of them in every case (its tile depends on its position only). An
  output row of a dot depends only on that row of the left operand and on the right operand, so the
  other tiles' contents do not matter; the row max, sum and softmax are per entry too.
- PARTITION == BLOCK_N: a partition is one key block, so every entry takes the same steps.
- Keys are loaded up to the group's longest context; those past an entry's own length are set to
  -inf in its scores, so e = exp(-inf - m) = 0 exactly, and their values (written this step, hence
  finite) add 0 * v = 0 (at most the sign of a zero differs, and the merge's sum, which starts at
  +0, drops it). Slots past the group's longest context (unwritten, maybe NaN) are never loaded.
  An entry with no key in the partition uses m = 0, so its e is 0, not NaN.
- Only entries whose row has a key in the partition are stored, and the merge reads a row's
  partitions p < cdiv(ctx_len, PARTITION) only: exactly those.
Up to MERGE_IN_PARTITION_MAX_GROUPS row groups (decode and verify batches) the merge runs in the
partition launch instead: the last program of a (row group, KV head) to store its partition (an
arrival counter, as in the split-K linear) merges that group's rows for the head's G query heads,
with the merge kernel's steps entry by entry, so the same bits as the merge launch.
Rows are launched in runs of whole groups of at most `rows_per_launch` rows (from the workspace
budget and the shapes alone), which changes no bits either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.batched import SeqBatch
from freetoken.kernels import linear_triton, pdl
from freetoken.kernels.compat_triton import INTERPRET

BLOCK_N = 64
PARTITION = 64  # keys per partition: exactly one BLOCK_N block
NUM_WARPS = 8  # bench/attention_speed.py on the H200 (partition + merge, 576 keys): 6.46 us a call, 7.45 with 4 warps, 6.77 at 32-key partitions
WORKSPACE_BYTES = 64 << 20
# The merge in the partition launch up to this many row groups (0: always its own launch). Off: slower
# in the 35B-A3B decode step cut to 24 layers on an H100, 1.871 / 1.869 ms at 64 against 1.855 / 1.848
# (logs/variants-35b-l24-switches-e0ac495-h100.jsonl).
MERGE_IN_PARTITION_MAX_GROUPS = 0
MERGE_WARPS = 8  # 4 or 2 the same within noise in the 35B-A3B step (logs/variants-35b-small-kernels.jsonl)


@triton.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr,
    group_ptr, row_seq_ptr, ctx_len_ptr, table_ptr,
    G, D, block_size, scale, num_parts, row0,
    q_row, q_head, kv_slot, kv_head, table_row,
    # MERGE: the merge of the (group, KV head) by its last program (arrival counters), into o (and the gate)
    count_ptr, gate_ptr, o_ptr, gate_row, gate_head, o_row, o_head,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr, DOT_F32: tl.constexpr,
    MERGE: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    g = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    # The row groups, context lengths and block table are host copies: this dependent chain of loads
    # runs before the wait (pdl.py), down to each key's cache slot; only the q / K / V loads follow it.
    first = tl.load(group_ptr + 2 * g).to(tl.int64)
    count = tl.load(group_ptr + 2 * g + 1)
    R = G_PAD // G
    es = tl.arange(0, G_PAD)
    tile = es // G  # [G_PAD]: the row at position pos of its sequence takes tile pos % R
    pos0 = tl.load(ctx_len_ptr + first) - 1
    j = (tile + R - pos0 % R) % R  # row of the group in each tile
    me = (tile < R) & (j < count)
    rows = first + j  # [G_PAD]
    ctx_len = tl.load(ctx_len_ptr + rows, mask=me, other=0)  # [G_PAD]: keys of each entry's row
    group_len = tl.max(ctx_len, axis=0)
    begin = p * PARTITION
    seq = tl.load(row_seq_ptr + first).to(tl.int64)
    pos = begin + tl.arange(0, PARTITION)
    mn = pos < group_len  # keys written for some row of the group (none: the partition is skipped)
    block = tl.load(table_ptr + seq * table_row + pos // block_size, mask=mn, other=0).to(tl.int64)
    slot = block * block_size + pos % block_size
    pdl.sync(PDL)
    if begin < group_len:
        heads = h * G + es % G
        ds = tl.arange(0, D_PAD)
        md = ds < D
        q = tl.load(q_ptr + rows[:, None] * q_row + heads[:, None] * q_head + ds[None, :], mask=me[:, None] & md[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        kv_off = slot[:, None] * kv_slot + h * kv_head + ds[None, :]
        kv_mask = mn[:, None] & md[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, PARTITION]
        s = tl.where(pos[None, :] < ctx_len[:, None], s, float("-inf"))  # each entry: its own row's keys
        m = tl.max(s, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # an entry without keys here: e = 0 rather than NaN
        e = tl.exp(s - m[:, None])
        l = tl.sum(e, axis=1)
        probs = e.to(v.dtype)  # the probabilities in the cache dtype, as torch's attention rounds them: a tensor-core dot
        if DOT_F32:
            probs, v = probs.to(tl.float32), v.to(tl.float32)
        acc = tl.dot(probs, v, input_precision="ieee")  # [G_PAD, D_PAD]
        ws = ((rows - row0) * (G * tl.num_programs(1)) + heads) * num_parts + p  # [G_PAD] workspace entries
        mw = me & (begin < ctx_len)
        tl.store(m_ptr + ws, m, mask=mw)
        tl.store(l_ptr + ws, l, mask=mw)
        tl.store(acc_ptr + ws[:, None] * D + ds[None, :], acc, mask=mw[:, None] & md[None, :])
    if MERGE:
        tl.debug_barrier()  # every thread's part of the partition is stored before the counter moves
        arrived = tl.atomic_add(count_ptr + g * tl.num_programs(1) + h, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(2) - 1:  # the group's last partition for this KV head
            tl.debug_barrier()
            _merge_entries(m_ptr, l_ptr, acc_ptr, gate_ptr, o_ptr, rows, h * G + es % G, me, ctx_len, group_len, row0,
                           G * tl.num_programs(1), D, num_parts, gate_row, gate_head, o_row, o_head, HAS_GATE, D_PAD, PARTITION)
            tl.atomic_xchg(count_ptr + g * tl.num_programs(1) + h, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_entries(
    m_ptr, l_ptr, acc_ptr, gate_ptr, o_ptr, rows, heads, me, ctx_len, group_len, row0,
    num_q_heads, D, num_parts, gate_row, gate_head, o_row, o_head,
    HAS_GATE: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr,
):
    """`_merge_kernel` for the entries [G_PAD] (row, query head) where `me`, side by side: each entry
    takes exactly the merge kernel's steps over its own row's partitions, so the same bits."""
    ds = tl.arange(0, D_PAD)
    md = ds < D
    parts = tl.where(me, tl.cdiv(ctx_len, PARTITION), 0)  # [G_PAD]
    base = ((rows - row0) * num_q_heads + heads) * num_parts
    m = tl.full(parts.shape, float("-inf"), tl.float32)
    for p in range(0, tl.cdiv(group_len, PARTITION)):
        m = tl.maximum(m, tl.load(m_ptr + base + p, mask=p < parts, other=float("-inf"), cache_modifier=".cg"))
    total = tl.zeros((parts.shape[0], D_PAD), dtype=tl.float32)
    norm = tl.zeros(parts.shape, dtype=tl.float32)
    for p in range(0, tl.cdiv(group_len, PARTITION)):
        mine = p < parts
        w = tl.exp(tl.load(m_ptr + base + p, mask=mine, other=0.0, cache_modifier=".cg") - m)
        norm = tl.where(mine, norm + w * tl.load(l_ptr + base + p, mask=mine, other=0.0, cache_modifier=".cg"), norm)
        part = tl.load(acc_ptr + (base + p)[:, None] * D + ds[None, :], mask=mine[:, None] & md[None, :], other=0.0, cache_modifier=".cg")
        total = tl.where(mine[:, None], total + w[:, None] * part, total)
    out = (total / tl.where(me, norm, 1.0)[:, None]).to(o_ptr.dtype.element_ty)
    offs = rows[:, None].to(tl.int64) * o_row + heads[:, None] * o_head + ds[None, :]
    if HAS_GATE:
        gate = tl.load(gate_ptr + rows[:, None].to(tl.int64) * gate_row + heads[:, None] * gate_head + ds[None, :],
                       mask=me[:, None] & md[None, :], other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate).to(o_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + offs, out, mask=me[:, None] & md[None, :])


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, gate_ptr, o_ptr, ctx_len_ptr,
    D, num_parts, gate_row, gate_head, o_row, o_head,
    HAS_GATE: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr, PDL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    ds = tl.arange(0, D_PAD)
    md = ds < D
    parts = tl.cdiv(tl.load(ctx_len_ptr + r), PARTITION)  # a host copy: before the wait (pdl.py)
    base = (r * tl.num_programs(1) + hq) * num_parts
    pdl.sync(PDL)
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
    assert PARTITION == BLOCK_N, "one key block per partition: every row takes the same softmax steps"
    table = batch.block_table
    num_parts = triton.cdiv(table.shape[1] * block_size, PARTITION)  # covers the longest context the table can hold
    g_pad = max(16, triton.next_power_of_2(group))
    per_group = max(1, g_pad // group)  # rows whose query heads fit in the dot's G_PAD rows
    sizes, groups = batch.row_groups(per_group)
    assert sum(sizes) == n
    rows_per_launch = max(per_group, WORKSPACE_BYTES // (num_q_heads * num_parts * (d + 2) * 4))
    rows_ws = min(n, rows_per_launch)
    m_ws = torch.empty(rows_ws * num_q_heads * num_parts, dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty(rows_ws * num_q_heads * num_parts * d, dtype=torch.float32, device=q.device)
    g = gate if gate is not None else q
    d_pad = max(16, triton.next_power_of_2(d))
    merge_here = len(sizes) <= MERGE_IN_PARTITION_MAX_GROUPS
    counters = linear_triton.arrival_counters(q.device, len(sizes) * num_kv_heads) if merge_here else m_ws  # an unread stand-in
    for g0, g1, r0, r1 in _launches(sizes, rows_per_launch):
        _partition_kernel[(g1 - g0, num_kv_heads, num_parts)](
            q, k_cache, v_cache, m_ws, l_ws, acc_ws, groups[g0:], batch.row_seq, batch.context_lens, table,
            group, d, block_size, scale, num_parts, r0,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
            counters, g, out, g.stride(0), g.stride(1), out.stride(0), out.stride(1),
            G_PAD=g_pad, D_PAD=d_pad, PARTITION=PARTITION, DOT_F32=INTERPRET, MERGE=merge_here, HAS_GATE=gate is not None,
            num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
        if merge_here:
            continue
        _merge_kernel[(r1 - r0, num_q_heads)](
            m_ws, l_ws, acc_ws, g[r0:], out[r0:], batch.context_lens[r0:],
            d, num_parts, g.stride(0), g.stride(1), out.stride(0), out.stride(1),
            HAS_GATE=gate is not None, D_PAD=d_pad, PARTITION=PARTITION, num_warps=MERGE_WARPS, **pdl.launch_kwargs(),
        )
    return out


def _launches(sizes: tuple[int, ...], max_rows: int):
    """Runs of whole row groups of at most max_rows rows -> (first group, end group, first row, end row)."""
    if sum(sizes) <= max_rows:
        yield 0, len(sizes), 0, sum(sizes)
        return
    g0 = r0 = 0
    while g0 < len(sizes):
        g1, r1 = g0, r0
        while g1 < len(sizes) and r1 + sizes[g1] - r0 <= max_rows:
            r1 += sizes[g1]
            g1 += 1
        yield g0, g1, r0, r1
        g0, r0 = g1, r1
