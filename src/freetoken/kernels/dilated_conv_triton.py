"""Dilated causal depthwise convolution over a batch of sequences, window pool as state (Triton): the
PLE layer's, as `ple_ref.dilated_causal_conv1d_batched`.

Program (b, cb) owns BLOCK_C channels of sequence b. With SPAN = (K-1) * DILATION window rows,
output row t is
    silu(sum_j w[:, j] * x[t + j * DILATION]),   x = window ++ rows (window entries of positions before 0 read as 0),
accumulated in fp32 for j = 0..K-1 in that order, so a row gets the same bits in a prefill chunk, a
decode step, a verify block or a replay. With `write_state` the window becomes the last SPAN entries
of x (read completely before it is overwritten; a sequence without rows keeps it as it is); verify passes 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)
from freetoken.kernels.batched import SeqBatch

BLOCK_C = 256
NUM_WARPS = 4


@triton.jit(do_not_specialize=["write_state"])
def _dilated_conv_kernel(
    win_ptr, x_ptr, w_ptr, y_ptr,
    starts_ptr, counts_ptr, slots_ptr, cached_ptr,
    C, write_state,
    win_slot, win_t, x_row, w_c, y_row,
    KW: tl.constexpr, DILATION: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    SPAN: tl.constexpr = (KW - 1) * DILATION
    pdl.sync(PDL)
    b = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(starts_ptr + b).to(tl.int64)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    cached = tl.load(cached_ptr + b)
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = cs < C
    win = win_ptr + slot * win_slot
    for t in range(count):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(KW):
            p = t + j * DILATION  # index into window ++ rows
            lane_p = tl.zeros_like(cs) + p  # per lane (a scalar-and-tensor mask is refused by triton 3.9's interpreter)
            in_win = lane_p < SPAN
            from_win = tl.load(win + p * win_t + cs, mask=mc & in_win & (lane_p + cached >= SPAN), other=0.0)
            from_rows = tl.load(x_ptr + (start + p - SPAN) * x_row + cs, mask=mc & ~in_win, other=0.0)
            xj = tl.where(in_win, from_win.to(tl.float32), from_rows.to(tl.float32))
            wj = tl.load(w_ptr + cs * w_c + j, mask=mc, other=0.0).to(tl.float32)
            if j == 0:
                acc = xj * wj
            else:
                acc = acc + xj * wj
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + (start + t) * y_row + cs, y.to(y_ptr.dtype.element_ty), mask=mc)
    if (write_state != 0) & (count > 0):  # a sequence without rows keeps its window as it is
        js = tl.arange(0, BLOCK_W)
        p = count + js  # the new window is (window ++ rows)[count : count + SPAN]
        keep = (js < SPAN)[:, None] & mc[None, :]
        from_win = tl.load(win + p[:, None] * win_t + cs[None, :], mask=keep & ((p < SPAN) & (p + cached >= SPAN))[:, None], other=0.0)
        from_rows = tl.load(x_ptr + (start + p - SPAN)[:, None] * x_row + cs[None, :], mask=keep & (p >= SPAN)[:, None], other=0.0)
        new = tl.where((p < SPAN)[:, None], from_win, from_rows.to(from_win.dtype))
        tl.debug_barrier()
        tl.store(win + js[:, None] * win_t + cs[None, :], new, mask=keep)


def dilated_causal_conv1d(
    windows: torch.Tensor,  # [slots, (K-1) * dilation, C]
    rows: torch.Tensor,  # [N, C]
    weight: torch.Tensor,  # [C, K]
    batch: SeqBatch,
    dilation: int,
    write_state: bool = True,
) -> torch.Tensor:
    """silu(dilated causal conv) of each sequence's rows after its window -> [N, C] in rows.dtype."""
    assert windows.stride(-1) == 1 and windows.shape[1] == (weight.shape[1] - 1) * dilation
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n, c = rows.shape
    kw = weight.shape[1]
    out = torch.empty_like(rows)
    if batch.num_seqs == 0 or n == 0:
        return out
    block_c = min(BLOCK_C, triton.next_power_of_2(c))
    grid = (batch.num_seqs, triton.cdiv(c, block_c))
    _dilated_conv_kernel[grid](
        windows, rows, weight, out, batch.starts, batch.counts, batch.slots, batch.cached,
        c, int(write_state),
        windows.stride(0), windows.stride(1), rows.stride(0), weight.stride(0), out.stride(0),
        KW=kw, DILATION=dilation, BLOCK_W=triton.next_power_of_2(windows.shape[1]), BLOCK_C=block_c, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
    )
    return out
