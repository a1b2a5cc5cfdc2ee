"""The token embedding gather and the greedy graphs' token feed-back (Triton).

Each replaces a few short torch kernels at the start of a captured step (torch's index kernel, and
clamp / index_select / where / copy) with one launch that takes part in the PDL chain (pdl.py).
Both only move values, so they give torch's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)

BLOCK_H = 1024  # embedding features a program


@triton.jit
def _embedding_kernel(w_ptr, ids_ptr, out_ptr, H, stride_w, stride_o, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token = tl.load(ids_ptr + row).to(tl.int64)
    vals = tl.load(w_ptr + token * stride_w + cols, mask=cols < H)
    tl.store(out_ptr + row * stride_o + cols, vals, mask=cols < H)


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight [V, H] (unit column stride), ids [N] int -> weight[ids] [N, H]."""
    assert weight.stride(1) == 1, "embedding: the weight's rows must be contiguous"
    n, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty((n, hidden), dtype=weight.dtype, device=weight.device)
    if n:
        _embedding_kernel[(n, triton.cdiv(hidden, BLOCK_H))](
            weight, ids, out, hidden, weight.stride(0), out.stride(0), BLOCK_H=BLOCK_H, num_warps=4, **pdl.launch_kwargs(),
        )
    return out


@triton.jit
def _take_fed_back_kernel(ids_ptr, rows_ptr, last_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(rows_ptr + i, mask=i < N, other=-1)
    fed = tl.load(last_ptr + tl.maximum(src, 0), mask=(i < N) & (src >= 0))
    tl.store(ids_ptr + i, fed.to(ids_ptr.dtype.element_ty), mask=(i < N) & (src >= 0))


def take_fed_back(input_ids: torch.Tensor, fed_back_rows: torch.Tensor, last_tokens: torch.Tensor) -> None:
    """In place: input_ids[i] = last_tokens[fed_back_rows[i]] where fed_back_rows[i] >= 0 (all [N] on the device)."""
    n = input_ids.shape[0]
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _take_fed_back_kernel[(triton.cdiv(n, block),)](input_ids, fed_back_rows, last_tokens, n, BLOCK=block, num_warps=1, **pdl.launch_kwargs())
