"""`per_row` for elementwise torch ops of the qwen4_exp blocks, and the grouped norm's module (its op
is `kernels.grouped_zc_rms_norm`).

Row invariance on CPU: an element's bits must not depend on how many rows share a call (a decode
step has 1 row, a verify step k+1). `per_row` applies an elementwise op one row at a time on CPU
(CUDA elementwise kernels treat every element alike and take the whole tensor). The
hyper-connections' elementwise steps are kernels of their own (kernels/hc_ref.py, hc_triton.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from freetoken import kernels
from freetoken.layers.basic import _empty


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) computed row by row (dim 0) on CPU; in one call elsewhere. fn is elementwise."""
    if x.is_cuda or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(x[i : i + 1].contiguous()) for i in range(x.shape[0])])


class GroupedZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm with one RMS per `group`-wide slice and its weight [G * group] (the streams'
    norms of hyper-connections and PLE; transformers' `Qwen4ExpTextRMSNorm`)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight = _empty(dim)
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, G * group] -> [N, G * group]
        return kernels.grouped_zc_rms_norm(x, self.weight, self.group, self.eps)
