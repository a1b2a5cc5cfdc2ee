"""Row-invariant linear layer (reference).

A BLAS GEMM may pick a different blocking or reduction order for M = 1 than for M = k+1, so the same
token can get different bits in decode and in verify. Here every row is its own M = 1 product with
the same shape every time, which makes the result a function of that row alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N], one row at a time."""
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]))
    rows = [F.linear(x[i : i + 1], weight) for i in range(x.shape[0])]
    return torch.cat(rows, dim=0)
