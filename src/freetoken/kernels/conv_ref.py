"""Causal depthwise short convolution over one sequence, with its window as state (reference).

The window holds the last K-1 raw (pre-conv) inputs. Output row t is
    sum_j w[:, j] * x[t - (K-1) + j],   x = window ++ new rows,
accumulated in fp32 in the fixed order j = 0..K-1, so a row computed in a prefill chunk, a decode
step or a verify block gets the same bits.
"""

from __future__ import annotations

import torch

from freetoken.kernels import activation_ref


def causal_conv1d(window: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """window [K-1, C], rows [T, C], weight [C, K] -> (silu(conv) [T, C] in rows.dtype, new window [K-1, C])."""
    kernel = weight.shape[1]
    full = torch.cat([window.to(rows.dtype), rows], dim=0)  # [K-1+T, C]
    t = rows.shape[0]
    w = weight.float()
    acc = full[0:t].float() * w[:, 0]
    for j in range(1, kernel):
        acc = acc + full[j : j + t].float() * w[:, j]
    out = activation_ref.silu(acc).to(rows.dtype)
    return out, full[t:].clone()
