"""The chunked (WY / UT-transform) gated delta rule over a varlen batch (Triton), for prefill.

The math is `gdn_chunk_ref`'s: each chunk of C = 64 rows of a sequence is turned into
    U = T (beta V),  W = T (beta e^G K),  Aqk = Q K^T * e^{G_t - G_s} (s <= t)
with T = (I + A)^{-1}, and the chunks are then chained through the state:
    delta = U - W S;  O = (e^G Q) S + Aqk delta;  S <- e^{G_last} S + (e^{G_last - G} K)^T delta

Two launches:
  `_prep_kernel`   program (chunk, head): everything that does not need the state (the Gram
                   matrices, T by recursive block inversion on a [C, C] register tile, W, U, Aqk),
                   for all chunks of all sequences at once. Writes W, U, Aqk to fp32 scratch.
  `_chain_kernel`  program (sequence, head, Dv block): loads the slot's state tile [Dk, BLOCK_V],
                   walks the sequence's chunks in order, stores the outputs and, at the end, the
                   state back in place. State columns are independent, so splitting Dv is exact.

The chunk table (first row and length of every chunk) comes from `SeqBatch`'s host lists, so both
grids are computed on the host without reading the device. Every dot operand is fp32 and every dot
runs with input_precision="ieee": no tf32, and nothing for the interpreter's bf16 dot problem
(compat_triton's DOT_F32) to touch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)
from freetoken.kernels.batched import SeqBatch

CHUNK = 64


@triton.jit
def _prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, a_ptr,
    chunk_starts_ptr, chunk_lens_ptr,
    Dk, Dv,
    q_row, q_head, k_row, k_head, v_row, v_head, g_row, beta_row,
    w_row, w_head, u_row, u_head, a_row, a_head,
    C: tl.constexpr, LOG2_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(chunk_starts_ptr + c).to(tl.int64)
    n = tl.load(chunk_lens_ptr + c)
    ts = tl.arange(0, C)
    valid = ts < n
    rows = start + ts
    g = tl.load(g_ptr + rows * g_row + h, mask=valid, other=0.0)
    beta = tl.load(beta_ptr + rows * beta_row + h, mask=valid, other=0.0)
    cum = tl.cumsum(g, axis=0)  # [C] G_t
    causal = (ts[:, None] >= ts[None, :]) & valid[:, None] & valid[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)  # [C, C]

    kk = tl.zeros((C, C), dtype=tl.float32)
    qk = tl.zeros((C, C), dtype=tl.float32)
    for d0 in range(0, Dk, BLOCK_K):
        ds = d0 + tl.arange(0, BLOCK_K)
        m = valid[:, None] & (ds < Dk)[None, :]
        kb = tl.load(k_ptr + rows[:, None] * k_row + h * k_head + ds[None, :], mask=m, other=0.0)
        qb = tl.load(q_ptr + rows[:, None] * q_row + h * q_head + ds[None, :], mask=m, other=0.0)
        kk += tl.dot(kb, tl.trans(kb), input_precision="ieee")
        qk += tl.dot(qb, tl.trans(kb), input_precision="ieee")
    tl.store(a_ptr + rows[:, None] * a_row + h * a_head + ts[None, :], qk * decay, mask=valid[:, None])

    # T = (I + A)^{-1} by recursive block inversion: T starts as the inverse of the 1x1 diagonal
    # blocks (I); at block size b every 2b x 2b diagonal block [[L1, 0], [L21, L2]] of I + A gets
    # [[T1, 0], [-T2 L21 T1, T2]], i.e. T <- T - T A_b T with A_b the L21 parts of A.
    a = tl.where(ts[:, None] > ts[None, :], beta[:, None] * kk * decay, 0.0)
    t = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    for lvl in tl.static_range(LOG2_C):
        b = 1 << lvl
        a_b = tl.where((ts[:, None] // (2 * b) == ts[None, :] // (2 * b)) & (ts[:, None] // b != ts[None, :] // b), a, 0.0)
        t = t - tl.dot(t, tl.dot(a_b, t, input_precision="ieee"), input_precision="ieee")

    k_scale = beta * tl.exp(cum)
    for d0 in range(0, Dk, BLOCK_K):
        ds = d0 + tl.arange(0, BLOCK_K)
        m = valid[:, None] & (ds < Dk)[None, :]
        kb = tl.load(k_ptr + rows[:, None] * k_row + h * k_head + ds[None, :], mask=m, other=0.0)
        w = tl.dot(t, kb * k_scale[:, None], input_precision="ieee")
        tl.store(w_ptr + rows[:, None] * w_row + h * w_head + ds[None, :], w, mask=m)
    for d0 in range(0, Dv, BLOCK_V):
        ds = d0 + tl.arange(0, BLOCK_V)
        m = valid[:, None] & (ds < Dv)[None, :]
        vb = tl.load(v_ptr + rows[:, None] * v_row + h * v_head + ds[None, :], mask=m, other=0.0)
        u = tl.dot(t, vb * beta[:, None], input_precision="ieee")
        tl.store(u_ptr + rows[:, None] * u_row + h * u_head + ds[None, :], u, mask=m)


@triton.jit
def _chain_kernel(
    state_ptr, q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, a_ptr, o_ptr,
    starts_ptr, counts_ptr, slots_ptr,
    Dk, Dv,
    s_slot, s_head, s_k,  # state strides (Dv contiguous)
    q_row, q_head, k_row, k_head, g_row, w_row, w_head, u_row, u_head, a_row, a_head, o_row, o_head,
    C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(starts_ptr + b).to(tl.int64)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ks < Dk
    mv = vs < Dv
    s_ptrs = state_ptr + slot * s_slot + h * s_head + ks[:, None] * s_k + vs[None, :]
    s_mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    ts = tl.arange(0, C)
    for c0 in range(0, count, C):
        valid = c0 + ts < count
        rows = start + c0 + ts
        g = tl.load(g_ptr + rows * g_row + h, mask=valid, other=0.0)
        cum = tl.cumsum(g, axis=0)  # padded rows add 0, so cum[C-1] is G_last
        last = tl.sum(tl.where(ts == C - 1, cum, 0.0), axis=0)
        mrk = valid[:, None] & mk[None, :]
        mrv = valid[:, None] & mv[None, :]
        w = tl.load(w_ptr + rows[:, None] * w_row + h * w_head + ks[None, :], mask=mrk, other=0.0)
        u = tl.load(u_ptr + rows[:, None] * u_row + h * u_head + vs[None, :], mask=mrv, other=0.0)
        delta = u - tl.dot(w, s, input_precision="ieee")  # [C, BLOCK_V]
        q = tl.load(q_ptr + rows[:, None] * q_row + h * q_head + ks[None, :], mask=mrk, other=0.0)
        aqk = tl.load(a_ptr + rows[:, None] * a_row + h * a_head + ts[None, :], mask=valid[:, None], other=0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision="ieee") + tl.dot(aqk, delta, input_precision="ieee")
        tl.store(o_ptr + rows[:, None] * o_row + h * o_head + vs[None, :], o, mask=mrv)
        k = tl.load(k_ptr + rows[:, None] * k_row + h * k_head + ks[None, :], mask=mrk, other=0.0)
        k_decayed = k * tl.exp(last - cum)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), delta, input_precision="ieee")
    if count > 0:
        tl.store(s_ptrs, s, mask=s_mask)


def _chunk_table(batch: SeqBatch) -> torch.Tensor:  # [2, num_chunks] int32: first row, length
    """Every C-row chunk of every sequence, from the host lists; kept on the batch for its other layers."""
    table = batch.__dict__.get("_gdn_chunk_table")
    if table is None:
        starts, lens = [], []
        for row_start, n in zip(batch.row_starts, batch.num_rows):
            for c0 in range(0, n, CHUNK):
                starts.append(row_start + c0)
                lens.append(min(CHUNK, n - c0))
        table = torch.tensor([starts, lens], dtype=torch.int32, device=batch.device)
        batch.__dict__["_gdn_chunk_table"] = table
    return table


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _block(n: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(n)))  # tl.dot needs every side >= 16


def gdn_chunked(
    state: torch.Tensor,  # [slots, Hv, Dk, Dv] fp32 pool, advanced in place
    q: torch.Tensor,  # [N, Hv, Dk] fp32, l2-normed and scaled
    k: torch.Tensor,  # [N, Hv, Dk] fp32, l2-normed
    v: torch.Tensor,  # [N, Hv, Dv] fp32
    g: torch.Tensor,  # [N, Hv] fp32 log-decay
    beta: torch.Tensor,  # [N, Hv] fp32
    batch: SeqBatch,
    out: torch.Tensor | None = None,  # [N, Hv, Dv] fp32: written only at the batch's rows
) -> torch.Tensor:
    """Advance each sequence's slot over its rows in chunks -> outputs [N, Hv, Dv] fp32."""
    assert state.dtype == torch.float32 and state.stride(-1) == 1
    q, k, v, g, beta = (_inner_contiguous(t.float()) for t in (q, k, v, g, beta))
    _, num_heads, dk, dv = state.shape
    if out is None:
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    assert out.dtype == torch.float32 and out.stride(-1) == 1
    table = _chunk_table(batch)
    num_chunks = table.shape[1]
    if num_chunks == 0:
        return out
    w = torch.empty(k.shape, dtype=torch.float32, device=k.device)  # [N, Hv, Dk]
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [N, Hv, Dv]
    aqk = torch.empty(v.shape[0], num_heads, CHUNK, dtype=torch.float32, device=v.device)  # [N, Hv, C]
    _prep_kernel[(num_chunks, num_heads)](
        q, k, v, g, beta, w, u, aqk, table[0], table[1],
        dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1),
        C=CHUNK, LOG2_C=CHUNK.bit_length() - 1, BLOCK_K=_block(dk, 64), BLOCK_V=_block(dv, 64), num_warps=4, num_stages=1, **pdl.launch_kwargs(),
    )
    block_v = _block(dv, 32)
    _chain_kernel[(batch.num_seqs, num_heads, triton.cdiv(dv, block_v))](
        state, q, k, g, w, u, aqk, out, batch.starts, batch.counts, batch.slots,
        dk, dv,
        state.stride(0), state.stride(1), state.stride(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1), out.stride(0), out.stride(1),
        C=CHUNK, BLOCK_K=_block(dk, 1 << 30), BLOCK_V=block_v, num_warps=4, num_stages=1, **pdl.launch_kwargs(),
    )
    return out
