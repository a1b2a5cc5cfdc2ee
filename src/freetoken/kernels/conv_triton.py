"""Causal depthwise short convolution over a batch of sequences, window pool as state (Triton).

Program (b, cb) owns BLOCK_C channels of sequence b. Output row t is
    silu(sum_j w[:, j] * x[t - (K-1) + j]),   x = window ++ rows,
accumulated in fp32 for j = 0..K-1 in that order, so a row gets the same bits in a prefill chunk,
a decode step, a verify block or a replay. With `write_state` the window becomes the last K-1
entries of window ++ rows (read completely before it is overwritten); verify passes 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)
from freetoken.kernels.batched import SeqBatch

# Channels a program, and warps. H200, 35B-A3B decode step (logs/variants-35b-small-kernels.jsonl): 128 or 512 channels, 2 warps, none faster.
BLOCK_C = 256
NUM_WARPS = 4


@triton.jit(do_not_specialize=["write_state"])
def _conv_kernel(
    win_ptr, x_ptr, w_ptr, y_ptr,
    starts_ptr, counts_ptr, slots_ptr,
    C, write_state,
    win_slot, win_t, x_row, w_c, y_row,
    KW: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(starts_ptr + b).to(tl.int64)  # the batch's rows and slots: host copies, read before the wait (pdl.py)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pdl.sync(PDL)
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = cs < C
    win = win_ptr + slot * win_slot
    for t in range(count):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(KW):
            p = t + j  # index into window ++ rows
            in_win = tl.zeros_like(cs) + p < KW - 1  # per lane (a scalar-and-tensor mask is refused by triton 3.9's interpreter)
            from_win = tl.load(win + p * win_t + cs, mask=mc & in_win, other=0.0)
            from_rows = tl.load(x_ptr + (start + p - (KW - 1)) * x_row + cs, mask=mc & ~in_win, other=0.0)
            xj = tl.where(p < KW - 1, from_win, from_rows).to(tl.float32)
            wj = tl.load(w_ptr + cs * w_c + j, mask=mc, other=0.0).to(tl.float32)
            if j == 0:
                acc = xj * wj
            else:
                acc = acc + xj * wj
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + (start + t) * y_row + cs, y.to(y_ptr.dtype.element_ty), mask=mc)
    if write_state != 0:
        js = tl.arange(0, BLOCK_W)
        p = count + js  # the new window is (window ++ rows)[count : count + K-1]
        keep = (js < KW - 1)[:, None] & mc[None, :]
        from_win = tl.load(win + p[:, None] * win_t + cs[None, :], mask=keep & (p < KW - 1)[:, None], other=0.0)
        from_rows = tl.load(x_ptr + (start + p - (KW - 1))[:, None] * x_row + cs[None, :], mask=keep & (p >= KW - 1)[:, None], other=0.0)
        new = tl.where((p < KW - 1)[:, None], from_win, from_rows.to(from_win.dtype))
        tl.debug_barrier()
        tl.store(win + js[:, None] * win_t + cs[None, :], new, mask=keep)


def causal_conv1d(
    windows: torch.Tensor,  # [slots, K-1, C] raw pre-conv inputs
    rows: torch.Tensor,  # [N, C]
    weight: torch.Tensor,  # [C, K]
    batch: SeqBatch,
    write_state: bool = True,
) -> torch.Tensor:
    """silu(causal conv) of each sequence's rows after its window -> [N, C] in rows.dtype."""
    assert windows.stride(-1) == 1
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n, c = rows.shape
    kw = weight.shape[1]
    out = torch.empty_like(rows)
    if batch.num_seqs == 0 or n == 0:
        return out
    block_c = min(BLOCK_C, triton.next_power_of_2(c))
    grid = (batch.num_seqs, triton.cdiv(c, block_c))
    _conv_kernel[grid](
        windows, rows, weight, out, batch.starts, batch.counts, batch.slots,
        c, int(write_state),
        windows.stride(0), windows.stride(1), rows.stride(0), weight.stride(0), out.stride(0),
        KW=kw, BLOCK_W=triton.next_power_of_2(max(kw - 1, 1)), BLOCK_C=block_c, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
    )
    return out
