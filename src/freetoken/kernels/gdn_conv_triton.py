"""The short convolution and the gated delta rule of a GDN layer's recurrent rows in one launch (Triton).

Unfused, a decode or verify step runs `conv_triton._conv_kernel` (mixed_qkv -> conv_out) and then
`gdn_triton._gdn_fused_kernel` (conv_out -> outputs, state). Here program (b, h, vb) of sequence b,
value head h and the BLOCK_V slice vb of Dv computes, for each of the sequence's rows, the conv of
the channels it reads — key head kh = h // rep's q and k channels and its own v slice — with the
conv kernel's code (`conv_triton.conv_row`), rounds it to the rows' dtype as conv_out holds it, and
steps the state with the fused kernel's code (`gdn_triton.fused_step`). Outputs, conv_out and both
pools get the bits of the two launches.

Ownership of the conv window (write_state only; verify passes 0 and writes neither pool):
- v channels: one program reads them; it overwrites their window after its last read.
- q and k channels of (b, kh): all rep * num_v_blocks programs of the key head compute their conv
  (each redundantly) and read their window. Each arrives on the counter of (b, kh) once its reads are
  done; the program that arrives last writes the new window and puts the counter back to zero.
conv_out's q and k channels are written by the key head's first program (h % rep == 0, vb == 0).

The counters are a zeroed int32 buffer per device, made on first use (before any graph capture);
batches with more sequences than it covers are cut into launches (no bits change).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl
from freetoken.kernels.batched import SeqBatch
from freetoken.kernels.conv_triton import conv_row, next_window
from freetoken.kernels.gdn_triton import fused_step

MAX_COUNTERS = 1 << 14  # (sequence, key head) pairs per launch
BLOCK_V = 32  # at most, as gdn_triton.gdn_fused (the same state tiles, so the same reductions)

_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _as_read(y, rows_ptr, OPAQUE: tl.constexpr):
    """A conv value as the recurrence reads it from conv_out: rounded to the rows' dtype, then fp32.
    OPAQUE (fp32 rows on a GPU, where the rounding is no op) hides the value from the compiler, so it
    can never contract the silu product with the recurrence's `v - kv_mem` into an FMA: a value
    loaded from conv_out never gets those bits. (The sm_90 build does not contract it either way.)"""
    x = y.to(rows_ptr.dtype.element_ty).to(tl.float32)
    if OPAQUE:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return x


@triton.jit(do_not_specialize=["write_state", "write_conv"])
def _gdn_conv_kernel(
    state_ptr, win_ptr, x_ptr, w_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, o_ptr, y_ptr, count_ptr,
    starts_ptr, counts_ptr, slots_ptr,
    Dk, Dv, key_dim, num_k_heads, rep, scale, write_state, write_conv,
    s_slot, s_head, s_k, win_slot, win_t, x_row, w_c, a_row, b_row, o_row, o_head, y_row,
    KW: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    OPAQUE: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(starts_ptr + b).to(tl.int64)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kh = h // rep
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ks < Dk
    mv = vs < Dv
    qc = kh * Dk + ks  # channels of [q | k | v]
    kc = key_dim + qc
    vc = 2 * key_dim + h * Dv + vs
    win = win_ptr + slot * win_slot
    writes_qk = (h % rep == 0) & (vb == 0)
    s_ptrs = state_ptr + slot * s_slot + h * s_head + ks[:, None] * s_k + vs[None, :]
    s_mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in range(count):
        row = start + t
        q = conv_row(win, x_ptr, w_ptr, start, t, qc, mk, win_t, x_row, w_c, KW)
        k = conv_row(win, x_ptr, w_ptr, start, t, kc, mk, win_t, x_row, w_c, KW)
        v = conv_row(win, x_ptr, w_ptr, start, t, vc, mv, win_t, x_row, w_c, KW)
        if write_conv != 0:
            y_at = y_ptr + row * y_row
            tl.store(y_at + vc, v.to(y_ptr.dtype.element_ty), mask=mv)
            if writes_qk:
                tl.store(y_at + qc, q.to(y_ptr.dtype.element_ty), mask=mk)
                tl.store(y_at + kc, k.to(y_ptr.dtype.element_ty), mask=mk)
        q, k, v = _as_read(q, x_ptr, OPAQUE), _as_read(k, x_ptr, OPAQUE), _as_read(v, x_ptr, OPAQUE)
        s, q = fused_step(s, q, k, v, a_ptr + row * a_row + h, b_ptr + row * b_row + h, neg_a, dt_bias, scale)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + row * o_row + h * o_head + vs, o.to(o_ptr.dtype.element_ty), mask=mv)
    if write_state != 0:
        tl.store(s_ptrs, s, mask=s_mask)
        js = tl.arange(0, BLOCK_W)
        new_v, keep_v = next_window(win, x_ptr, start, count, vc, mv, win_t, x_row, KW, BLOCK_W)
        tl.debug_barrier()  # every thread's reads of the window are done: the v store, then the counter may move
        tl.store(win + js[:, None] * win_t + vc[None, :], new_v, mask=keep_v)
        counter = count_ptr + b * num_k_heads + kh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")  # releases this program's window reads
        if arrived == rep * tl.num_programs(2) - 1:  # every program of the key head has read its q/k window
            tl.debug_barrier()
            # No other program writes these channels, so plain loads see the old window.
            new_q, keep_q = next_window(win, x_ptr, start, count, qc, mk, win_t, x_row, KW, BLOCK_W)
            new_k, keep_k = next_window(win, x_ptr, start, count, kc, mk, win_t, x_row, KW, BLOCK_W)
            tl.debug_barrier()
            tl.store(win + js[:, None] * win_t + qc[None, :], new_q, mask=keep_q)
            tl.store(win + js[:, None] * win_t + kc[None, :], new_k, mask=keep_k)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def _key_head_counters(device: torch.device) -> torch.Tensor:
    """int32 [MAX_COUNTERS] kept at zero between launches (made on first use, before any graph capture)."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def gdn_conv_fused(
    windows: torch.Tensor,  # [slots, K-1, C] conv window pool (raw pre-conv rows)
    rows: torch.Tensor,  # [N, C] raw pre-conv rows mixed_qkv, C = 2 * Hk * Dk + Hv * Dv
    weight: torch.Tensor,  # [C, K]
    state: torch.Tensor,  # [slots, Hv, Dk, Dv] fp32 recurrent pool
    a: torch.Tensor,  # [N, Hv] raw decay input
    b: torch.Tensor,  # [N, Hv] raw beta input
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    num_k_heads: int,
    batch: SeqBatch,
    write_state: bool = True,
    return_conv_out: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`conv_triton.causal_conv1d` then `gdn_triton.gdn_fused` in one launch, with their bits ->
    (outputs [N, Hv, Dv] in out_dtype, conv_out [N, C] in rows.dtype if return_conv_out else None).
    write_state advances both pools; verify passes False and neither is written."""
    assert state.dtype == torch.float32 and state.stride(-1) == 1 and windows.stride(-1) == 1
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    _, num_heads, dk, dv = state.shape
    n, c = rows.shape
    kw = weight.shape[1]
    assert c == 2 * num_k_heads * dk + num_heads * dv and num_heads % num_k_heads == 0
    out = torch.empty((n, num_heads, dv), dtype=out_dtype, device=rows.device)
    conv_out = torch.empty_like(rows) if return_conv_out else None
    if batch.num_seqs == 0 or n == 0:
        return out, conv_out
    y = conv_out if conv_out is not None else rows  # never written when return_conv_out is False
    counters = _key_head_counters(rows.device)
    seqs_per_launch = MAX_COUNTERS // num_k_heads
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    opaque = rows.dtype == torch.float32 and not compat_triton.INTERPRET
    for s0 in range(0, batch.num_seqs, seqs_per_launch):
        s1 = min(s0 + seqs_per_launch, batch.num_seqs)
        grid = (s1 - s0, num_heads, triton.cdiv(dv, block_v))
        _gdn_conv_kernel[grid](
            state, windows, rows, weight, a, b, a_log, dt_bias, out, y, counters,
            batch.starts[s0:s1], batch.counts[s0:s1], batch.slots[s0:s1],
            dk, dv, num_k_heads * dk, num_k_heads, num_heads // num_k_heads, dk**-0.5, int(write_state), int(return_conv_out),
            state.stride(0), state.stride(1), state.stride(2), windows.stride(0), windows.stride(1), rows.stride(0), weight.stride(0),
            a.stride(0), b.stride(0), out.stride(0), out.stride(1), y.stride(0),
            KW=kw, BLOCK_W=triton.next_power_of_2(max(kw - 1, 1)), BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
            OPAQUE=opaque, num_warps=4, **pdl.launch_kwargs(),
        )
    return out, conv_out
