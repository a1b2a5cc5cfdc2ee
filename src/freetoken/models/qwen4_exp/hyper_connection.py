"""Hyper-connections: the S-stream residual of qwen4_exp (architectures.md §4.2).

The residual X is [N, S*H] (S streams of H). Each block reads one mixed input from it and writes its
output back into every stream with its own weight:

    Xn = grouped zero-centred RMSNorm (one RMS per stream, weight hc_norm [S*H])
    m  = sigmoid(W_up silu(W_down Xn / S))       [N, S*H]
    u  = mean_s (m_s * Xn_s)                     [N, H]     the block's input
    i  = 2 sigmoid(W_inject Xn / S)              [N, S]     (absent in the final mixer)
    X  <- X + i_s * block(u)  for every stream s

The final `hyper_connection_mixer` is the same module without the injection: its u feeds lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.layers.basic import Linear
from freetoken.models.qwen4_exp import ops


class GatedResidual(nn.Module):
    def __init__(self, hidden_size: int, streams: int, rank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hidden_size, self.streams = hidden_size, streams
        wide = streams * hidden_size
        self.hc_norm = ops.GroupedZCRMSNorm(wide, hidden_size, eps)
        self.input_mix_weight_down = Linear(wide, rank)
        self.input_mix_weight_up = Linear(rank, wide)
        self.block_inject_weight = Linear(wide, streams) if inject else None

    def mix(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, S*H] -> u [N, H], normed x [N, S*H]
        """The block input u and the normed streams Xn."""
        n, s, h = x.shape[0], self.streams, self.hidden_size
        xn = self.hc_norm(x)
        m = ops.sigmoid(self.input_mix_weight_up(ops.silu(self.input_mix_weight_down(xn) / s)))
        return ops.mean_over((m * xn).view(n, s, h), dim=1), xn

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [N, S*H] -> u [N, H] (the final mixer), or (u, injection weights [N, S])."""
        u, xn = self.mix(x)
        if self.block_inject_weight is None:
            return u
        return u, 2 * ops.sigmoid(self.block_inject_weight(xn) / self.streams)


def inject(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, S*H] + weights [N, S] (x) y [N, H]: the block output added to every stream with its weight."""
    n, s = weights.shape
    return x + (y[:, None, :] * weights[:, :, None]).reshape(n, -1)
