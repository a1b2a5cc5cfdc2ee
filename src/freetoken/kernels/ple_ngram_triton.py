"""The PLE layer's n-gram token columns over a batch of sequences, id windows as state (Triton), as
`ple_ref.ngram_tokens_batched`.

Program b owns sequence b. With W = NGRAM - 1 window entries, x = window ++ rows (its index W + t is
row t); a window entry of a position before 0 reads as EOS. Row t's columns, s = 0 .. NGRAM-1:

    tok_0 = x[W + t];   tok_s = x[W + t - s] if none of x[W + t - s + 1 .. W + t - 1] is EOS, else EOS

BLOCK_T rows at a time. Every input comes from the batch's device tensors (starts, counts, slots,
cached), so a CUDA graph replays it with new values. With `write_state` the window becomes
x[count : count + W] (entries of positions before 0 written as EOS), after every read of it; a
sequence without rows keeps it as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)
from freetoken.kernels.batched import SeqBatch

BLOCK_T = 16
NUM_WARPS = 1


@triton.jit
def _x_at(win, ids_ptr, start, cached, i, mask, eos, W: tl.constexpr):
    """x[i] for a vector of indices i into window ++ rows (EOS for window entries before position 0)."""
    in_win = i < W
    from_win = tl.load(win + i, mask=mask & in_win & (i + cached >= W), other=eos)
    from_rows = tl.load(ids_ptr + start + i - W, mask=mask & ~in_win, other=eos)
    return tl.where(in_win, from_win, from_rows)


@triton.jit(do_not_specialize=["write_state"])
def _ngram_tokens_kernel(
    win_ptr, ids_ptr, out_ptr,
    starts_ptr, counts_ptr, slots_ptr, cached_ptr,
    eos, write_state, win_slot, out_row,
    NGRAM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    W: tl.constexpr = NGRAM - 1
    pdl.sync(PDL)
    b = tl.program_id(0)
    start = tl.load(starts_ptr + b).to(tl.int64)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    cached = tl.load(cached_ptr + b)
    win = win_ptr + slot * win_slot
    for t0 in range(0, count, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        mt = ts < count
        at = W + ts  # each row's index into window ++ rows
        tok = _x_at(win, ids_ptr, start, cached, at, mt, eos, W)
        tl.store(out_ptr + (start + ts) * out_row, tok, mask=mt)
        alive = mt  # no EOS among the ids strictly between the row and the next shift
        for s in tl.static_range(1, NGRAM):
            x = _x_at(win, ids_ptr, start, cached, at - s, mt, eos, W)
            tl.store(out_ptr + (start + ts) * out_row + s, tl.where(alive, x, eos), mask=mt)
            alive = alive & (x != eos)
    if (write_state != 0) & (count > 0):
        js = tl.arange(0, BLOCK_W)
        keep = js < W
        new = _x_at(win, ids_ptr, start, cached, count + js, keep, eos, W)  # the new window is x[count : count + W]
        tl.debug_barrier()
        tl.store(win + js, new, mask=keep)


def ngram_tokens(
    windows: torch.Tensor,  # [slots, ngram_size - 1] int64
    ids: torch.Tensor,  # [N] int64, the step's input ids
    batch: SeqBatch,
    eos: int,
    ngram_size: int,
    write_state: bool = True,
) -> torch.Tensor:
    """tok_s of every row [N, ngram_size] int64 after each sequence's window; the windows advance if write_state."""
    assert windows.dtype == ids.dtype == torch.int64 and windows.shape[1] == ngram_size - 1 and windows.stride(-1) == 1
    ids = ids if ids.stride(0) == 1 else ids.contiguous()
    out = torch.empty((ids.shape[0], ngram_size), dtype=torch.int64, device=ids.device)
    if batch.num_seqs == 0 or ids.shape[0] == 0:
        return out
    _ngram_tokens_kernel[(batch.num_seqs,)](
        windows, ids, out, batch.starts, batch.counts, batch.slots, batch.cached,
        eos, int(write_state), windows.stride(0), out.stride(0),
        NGRAM=ngram_size, BLOCK_T=BLOCK_T, BLOCK_W=triton.next_power_of_2(max(ngram_size - 1, 1)), num_warps=NUM_WARPS, **pdl.launch_kwargs(),
    )
    return out
