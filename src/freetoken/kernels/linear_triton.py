"""Row-invariant linear layer y = x W^T (Triton).

One tile configuration for every M: each program owns BLOCK_M rows x BLOCK_N output features and
walks K in BLOCK_K steps from 0 upwards, accumulating in fp32. A row's result therefore depends on
its own inputs only, never on how many rows share the launch (decode 1, verify k+1, prefill many).
The configuration depends on the dtype alone, there is no split-K, and M is not specialised on, so
M = 1 compiles to the same code as M = 1000.

Decode and verify are memory bound: the grid puts N / BLOCK_N programs over the weight, each
streaming its BLOCK_N x K slice once per BLOCK_M rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.compat_triton import INTERPRET

BLOCK_M = 16
BLOCK_N = 64


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=(rows[:, None] < M) & (cols[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x.dtype, fp32 accumulation."""
    assert x.dtype == weight.dtype, f"linear: x is {x.dtype}, weight is {weight.dtype}"
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    block_k = 32 if x.dtype == torch.float32 else 64
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
    _linear_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, DOT_F32=INTERPRET, num_warps=4)
    return y
