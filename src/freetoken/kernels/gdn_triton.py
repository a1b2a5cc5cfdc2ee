"""The gated delta rule recurrence over a batch of sequences (Triton).

One launch covers the whole batch: program (b, h, vb) loads the fp32 state tile
[Dk, BLOCK_V] of sequence b's slot and value head h into registers, steps through the sequence's
rows in order, and stores the tile back only when `write_state` is set. Columns of the state are
independent (the reductions run over Dk), so splitting Dv across programs changes no bits.

Decode, verify (write_state=0, on the pool itself: nothing is written) and the commit replay
(write_output=0) are the same compiled kernel: the two flags are runtime arguments that are not
specialised on, and neither guards anything the state update reads. A replayed row therefore
updates the state exactly as decoding it did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, l2_prefetch, pdl  # noqa: F401  (compat_triton: interpreter fix-up)
from freetoken.kernels.batched import SeqBatch

# Value columns a program (its state tile is [Dk, BLOCK_V] fp32) and the fused kernel's warps. H200, 35B-A3B
# decode step (logs/variants-35b-small-kernels.jsonl): 16 or 64 columns, 2 or 8 warps, none faster.
BLOCK_V = 32
NUM_WARPS = 4


@triton.jit(do_not_specialize=["write_state", "write_output"])
def _gdn_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    starts_ptr, counts_ptr, slots_ptr,
    Dk, Dv, write_state, write_output,
    s_slot, s_head, s_k,  # state strides (Dv contiguous)
    q_row, q_head, k_row, k_head, v_row, v_head, g_row, beta_row, o_row, o_head,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
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
    for t in range(count):
        row = start + t
        q = tl.load(q_ptr + row * q_row + h * q_head + ks, mask=mk, other=0.0)
        k = tl.load(k_ptr + row * k_row + h * k_head + ks, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * v_row + h * v_head + vs, mask=mv, other=0.0)
        g = tl.load(g_ptr + row * g_row + h)
        beta = tl.load(beta_ptr + row * beta_row + h)
        s = s * tl.exp(g)
        kv_mem = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
        delta = (v - kv_mem) * beta
        s = s + k[:, None] * delta[None, :]
        if write_output != 0:
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(o_ptr + row * o_row + h * o_head + vs, o, mask=mv)
    if write_state != 0:
        tl.store(s_ptrs, s, mask=s_mask)


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_recurrent(
    state: torch.Tensor,  # [slots, Hv, Dk, Dv] fp32 pool
    q: torch.Tensor,  # [N, Hv, Dk] fp32
    k: torch.Tensor,  # [N, Hv, Dk] fp32
    v: torch.Tensor,  # [N, Hv, Dv] fp32
    g: torch.Tensor,  # [N, Hv] fp32
    beta: torch.Tensor,  # [N, Hv] fp32
    batch: SeqBatch,
    write_state: bool = True,
    compute_output: bool = True,
) -> torch.Tensor | None:
    """Advance each sequence's slot over its rows (unless write_state is False) -> outputs [N, Hv, Dv] fp32."""
    assert state.dtype == torch.float32 and state.stride(-1) == 1
    q, k, v, g, beta = (_inner_contiguous(t.float()) for t in (q, k, v, g, beta))
    _, num_heads, dk, dv = state.shape
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device) if compute_output else None
    if batch.num_seqs == 0 or q.shape[0] == 0:
        return out
    o = out if out is not None else v  # never written when compute_output is False
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (batch.num_seqs, num_heads, triton.cdiv(dv, block_v))
    _gdn_kernel[grid](
        state, q, k, v, g, beta, o, batch.starts, batch.counts, batch.slots,
        dk, dv, int(write_state), int(compute_output),
        state.stride(0), state.stride(1), state.stride(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4, **pdl.launch_kwargs(),
    )
    return out


@triton.jit(do_not_specialize=["write_state", "write_output"])
def _gdn_fused_kernel(
    state_ptr, x_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, o_ptr,
    starts_ptr, counts_ptr, slots_ptr,
    Dk, Dv, key_dim, rep, scale, write_state, write_output,
    s_slot, s_head, s_k, x_row, a_row, b_row, o_row, o_head,
    pf_ptr, pf_lines, num_seqs,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    if PREFETCH:  # the programs past the sequences' prefetch the next GEMM's weight (l2_prefetch)
        if tl.program_id(0) >= num_seqs:
            l2_prefetch.run(pf_ptr, pf_lines, num_seqs, PDL)
            return
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    # Before the wait (pdl.py), so the state tile streams in while the short convolution still runs:
    # the batch's rows and slots are host copies, the state is written only by this layer's own
    # launches (of an earlier step, or the verify before a commit replay), the two parameters are weights.
    start = tl.load(starts_ptr + b).to(tl.int64)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kh = h // rep
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ks < Dk
    mv = vs < Dv
    s_ptrs = state_ptr + slot * s_slot + h * s_head + ks[:, None] * s_k + vs[None, :]
    s_mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    pdl.sync(PDL)
    for t in range(count):
        row = start + t
        x = x_ptr + row * x_row
        q = tl.load(x + kh * Dk + ks, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(x + key_dim + kh * Dk + ks, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(x + 2 * key_dim + h * Dv + vs, mask=mv, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        beta = tl.sigmoid(tl.load(b_ptr + row * b_row + h).to(tl.float32))
        z = tl.load(a_ptr + row * a_row + h).to(tl.float32) + dt_bias
        softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        g = neg_a * softplus
        s = s * tl.exp(g)
        kv_mem = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
        delta = (v - kv_mem) * beta
        s = s + k[:, None] * delta[None, :]
        if write_output != 0:
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(o_ptr + row * o_row + h * o_head + vs, o.to(o_ptr.dtype.element_ty), mask=mv)
    if write_state != 0:
        tl.store(s_ptrs, s, mask=s_mask)


def gdn_fused(
    state: torch.Tensor,  # [slots, Hv, Dk, Dv] fp32 pool
    conv_out: torch.Tensor,  # [N, 2 * Hk * Dk + Hv * Dv] = [q | k | v] after the short convolution
    a: torch.Tensor,  # [N, Hv] raw decay input
    b: torch.Tensor,  # [N, Hv] raw beta input
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    num_k_heads: int,
    batch: SeqBatch,
    write_state: bool = True,
    compute_output: bool = True,
    out_dtype: torch.dtype = torch.float32,
    prefetch: l2_prefetch.Span | None = None,
) -> torch.Tensor | None:
    """The gated delta rule with its input preparation fused in (l2-norm and scale of q and k, value
    head j reading key head j // (Hv / Hk), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias))
    -> outputs [N, Hv, Dv] in out_dtype unless compute_output is False. One kernel serves decode,
    verify (write_state=False) and the commit replay (compute_output=False). prefetch: queued by
    extra programs of the launch (l2_prefetch)."""
    assert state.dtype == torch.float32 and state.stride(-1) == 1
    conv_out = _inner_contiguous(conv_out)
    a, b = _inner_contiguous(a), _inner_contiguous(b)
    _, num_heads, dk, dv = state.shape
    n = conv_out.shape[0]
    out = torch.empty((n, num_heads, dv), dtype=out_dtype, device=conv_out.device) if compute_output else None
    if batch.num_seqs == 0 or n == 0:
        return out
    o = out if out is not None else state  # never written when compute_output is False
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    v_tiles = triton.cdiv(dv, block_v)
    extra, pf_args = l2_prefetch.launch_args(prefetch, num_heads * v_tiles, state)
    _gdn_fused_kernel[(batch.num_seqs + extra, num_heads, v_tiles)](
        state, conv_out, a, b, a_log, dt_bias, o, batch.starts, batch.counts, batch.slots,
        dk, dv, num_k_heads * dk, num_heads // num_k_heads, dk**-0.5, int(write_state), int(compute_output),
        state.stride(0), state.stride(1), state.stride(2), conv_out.stride(0), a.stride(0), b.stride(0),
        o.stride(0) if out is not None else 0, o.stride(1) if out is not None else 0,
        num_seqs=batch.num_seqs, **pf_args,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
    )
    return out
