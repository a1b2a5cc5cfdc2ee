"""QSA sparse paged attention (Triton): each row over its kept key blocks and its tail; the reference
and the layouts are qsa_ref.py.

One program per (row, KV head) takes the G query heads of that KV head (the dot's M, padded to
G_PAD = max(16, next_pow2(G))). A row's keys form one list in ascending position order: for
t < count * c the token t % c of kept block ids[t // c], then the tail (the last n mod c positions).
The program walks that list in fixed KEYS-wide steps with an online softmax in fp32 (running max,
rescaled sum and output; fp32 dots, the probabilities kept fp32 as the reference keeps them), so a
row's reduction is one program's fixed sequence of steps set by its own count and context: the same
bits whichever rows share the launch. Launch shape: (rows, KV heads), no host read of a per-row value.
Only slots of the row's own keys are loaded (others are masked), so unwritten cache slots are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl
from freetoken.kernels.batched import SeqBatch

compat_triton.patch()  # the interpreter's fix-up (compat_triton), for the runtime loop bound

KEYS = 64  # keys per online-softmax step
NUM_WARPS = 4


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, ids_ptr, count_ptr,
    row_seq_ptr, ctx_len_ptr, table_ptr,
    G, D, page_size, scale,
    q_row, q_head, kv_slot, kv_head, o_row, o_head, ids_row, table_row,
    RATIO: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, KEYS: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx_len = tl.load(ctx_len_ptr + r)
    count = tl.load(count_ptr + r)
    complete = ctx_len // RATIO
    in_blocks = count * RATIO
    num_keys = in_blocks + ctx_len - complete * RATIO
    seq = tl.load(row_seq_ptr + r).to(tl.int64)
    gs = tl.arange(0, G_PAD)
    mg = gs < G
    ds = tl.arange(0, D_PAD)
    md = ds < D
    heads = h * G + gs
    q = tl.load(q_ptr + r * q_row + heads[:, None] * q_head + ds[None, :], mask=mg[:, None] & md[None, :], other=0.0).to(tl.float32)
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    for k0 in range(0, num_keys, KEYS):
        t = k0 + tl.arange(0, KEYS)
        mt = t < num_keys
        chosen = t < in_blocks
        block = tl.load(ids_ptr + r * ids_row + t // RATIO, mask=mt & chosen, other=0)
        pos = tl.where(chosen, block * RATIO + t % RATIO, complete * RATIO + t - in_blocks)
        page = tl.load(table_ptr + seq * table_row + pos // page_size, mask=mt, other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        kv_at = slot[:, None] * kv_slot + h * kv_head + ds[None, :]
        mkv = mt[:, None] & md[None, :]
        k = tl.load(k_ptr + kv_at, mask=mkv, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_at, mask=mkv, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, KEYS]
        s = tl.where(mt[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(e, axis=1)
        acc = acc * alpha[:, None] + tl.dot(e, v, input_precision="ieee")
        m = m_new
    out = (acc / total[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + r * o_row + heads[:, None] * o_head + ds[None, :], out, mask=mg[:, None] & md[None, :])


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
) -> torch.Tensor:
    """As qsa_ref.qsa_attention: -> [N, Hq, D] in q.dtype."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and block_ids.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    n, num_q_heads, d = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if n == 0:
        return out
    table = batch.block_table
    _attention_kernel[(n, num_kv_heads)](
        q, k_cache, v_cache, out, block_ids, counts, batch.row_seq, batch.context_lens, table,
        group, d, page_size, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1), block_ids.stride(0), table.stride(0),
        RATIO=ratio, G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=max(16, triton.next_power_of_2(d)), KEYS=KEYS, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
    )
    return out
