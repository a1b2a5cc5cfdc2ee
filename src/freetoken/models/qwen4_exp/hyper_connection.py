"""Hyper-connections: the S-stream residual of qwen4_exp (architectures.md §4.2).

The residual X is [N, S*H] (S streams of H). Each block reads one mixed input from it and writes its
output back into every stream with its own weight:

    Xn = grouped zero-centred RMSNorm (one RMS per stream, weight hc_norm [S*H])
    m  = sigmoid(W_up silu(W_down Xn / S))       [N, S*H]
    u  = mean_s (m_s * Xn_s)                     [N, H]     the block's input
    i  = 2 sigmoid(W_inject Xn / S)              [N, S]     (absent in the final mixer)
    X  <- X + i_s * block(u)  for every stream s

The final `hyper_connection_mixer` is the same module without the injection: its u feeds lm_head.

Launches (kernels/hc_ref.py states the steps and their roundings): W_down and W_inject read Xn as
one merged weight [r + S, S*H] (`merge_projections`; the checkpoint's parameters become views of
its rows), `kernels.hc_gates` turns its output into W_up's input and the injection weights,
`kernels.hc_mix_mean` gives u from W_up's output, and `kernels.hc_inject` adds the block output,
and may normalise the sum for the next hyper-connection in the same launch (`inject`'s next_norm).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.layers.basic import Linear
from freetoken.models.qwen4_exp import ops


class GatedResidual(nn.Module):
    def __init__(self, hidden_size: int, streams: int, rank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hidden_size, self.streams, self.rank = hidden_size, streams, rank
        wide = streams * hidden_size
        self.hc_norm = ops.GroupedZCRMSNorm(wide, hidden_size, eps)
        self.input_mix_weight_down = Linear(wide, rank)
        self.input_mix_weight_up = Linear(rank, wide)
        self.block_inject_weight = Linear(wide, streams) if inject else None
        self.down_inject_weight: torch.Tensor | None = None  # [r (+ S), S*H]: W_down's rows, then W_inject's, once merged

    def merge_projections(self) -> None:
        """Read W_down and W_inject as one weight (layers/merge.py); without an injection, W_down alone."""
        if self.down_inject_weight is not None:
            return
        if self.block_inject_weight is None:
            self.down_inject_weight = self.input_mix_weight_down.weight
        else:
            from freetoken.layers.merge import merge_linears

            self.down_inject_weight = merge_linears([self.input_mix_weight_down, self.block_inject_weight])

    def mix(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # [N, S*H] -> u [N, H], weights [N, S] or None
        """The block input u and the injection weights (None in the final mixer) of the normed streams xn."""
        self.merge_projections()
        down, weights = kernels.hc_gates(kernels.linear(xn, self.down_inject_weight), self.rank, self.streams)
        u = kernels.hc_mix_mean(kernels.linear(down, self.input_mix_weight_up.weight), xn, self.streams)
        return u, weights if self.block_inject_weight is not None else None

    def forward(self, x: torch.Tensor, xn: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [N, S*H] -> u [N, H] (the final mixer), or (u, injection weights [N, S]). xn: hc_norm(x) [N, S*H]
        when the launch that wrote x also normalised it (`inject`)."""
        u, weights = self.mix(self.hc_norm(x) if xn is None else xn)
        return u if weights is None else (u, weights)


def inject(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
           next_norm: ops.GroupedZCRMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, S*H] + weights [N, S] (x) y [N, H]: the block output added to every stream with its weight
    -> (X, next_norm(X) [N, S*H], or None without next_norm: the next hyper-connection's norm, same launch)."""
    if next_norm is None:
        return kernels.hc_inject(x, y, weights)
    assert next_norm.group == y.shape[-1], f"inject: a norm over groups of {next_norm.group} for streams of {y.shape[-1]}"
    return kernels.hc_inject(x, y, weights, next_norm.weight, next_norm.eps)
