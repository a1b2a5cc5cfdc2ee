"""The grouped norm's module of the qwen4_exp blocks (its op is `kernels.grouped_zc_rms_norm`). The
hyper-connections' elementwise steps are kernels of their own (kernels/hc_ref.py, hc_triton.py).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.layers.basic import _empty


class GroupedZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm with one RMS per `group`-wide slice and its weight [G * group] (the streams'
    norms of hyper-connections and PLE; transformers' `Qwen4ExpTextRMSNorm`)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight = _empty(dim)
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, G * group] -> [N, G * group]
        return kernels.grouped_zc_rms_norm(x, self.weight, self.group, self.eps)
