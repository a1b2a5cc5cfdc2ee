"""The hyper-connections' elementwise steps (reference; architectures.md §4.2): the gates after the
merged down/inject projection, the streams' gated mean, and the injection of a block's output.

A hyper-connection over the residual X [N, S*H] (S streams of H) computes, with Xn its per-stream norm:

    [d | i] = Xn [W_down ; W_inject]^T                 [N, r + S]   one linear (`gates` takes its output)
    g       = silu(d / S)                               [N, r]       the input of W_up
    iw      = 2 sigmoid(i / S)                          [N, S]       the injection weights
    u       = mean_s(sigmoid(up_s) * Xn_s)              [N, H]       (`mix_mean`; up = g W_up^T [N, S*H])
    X_s    <- X_s + iw_s * block(u)                     [N, S*H]     (`inject`, optionally with the next norm)

Each step is written as torch ops in the input dtype, every product, sum and quotient rounded to it
on its own, and the mean as a sum in stream order s = 0, 1, ... then a division by S; the Triton
kernels (hc_triton.py) take the same steps with the same roundings. sigmoid and silu are
activation_ref's, whose bits do not depend on the call an element is in; the other ops round each
element alone, so every row is computed alone on CPU too.
"""

from __future__ import annotations

import torch

from freetoken.kernels import activation_ref, norm_ref


def gates(down_inject: torch.Tensor, rank: int, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """down_inject [N, rank + k] (the merged projection's output; k = S, or 0 without an injection) ->
    (silu(d / S) [N, rank], 2 sigmoid(i / S) [N, k])."""
    d, i = down_inject[:, :rank], down_inject[:, rank:]
    return activation_ref.silu(d / streams), 2 * activation_ref.sigmoid(i / streams)


def mean_over(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The mean over `dim` as an explicit sum in index order: the same bits whatever the other sizes."""
    slices = parts.unbind(dim)
    acc = slices[0]
    for s in slices[1:]:
        acc = acc + s
    return acc / len(slices)


def mix_mean(up: torch.Tensor, xn: torch.Tensor, streams: int) -> torch.Tensor:
    """up [N, S*H] (W_up's output), xn [N, S*H] (the normed streams) -> u = mean_s(sigmoid(up_s) * xn_s) [N, H]."""
    n = xn.shape[0]
    return mean_over((activation_ref.sigmoid(up) * xn).view(n, streams, -1), dim=1)


def inject(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, S*H] + weights [N, S] (x) y [N, H]: the block output y added to every stream with its weight."""
    return x + (y[:, None, :] * weights[:, :, None]).reshape(weights.shape[0], -1)


def inject_norm(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Xn): X = `inject`'s sum [N, S*H] and its per-stream zero-centred norm with norm_weight [S*H]
    (the next hyper-connection's hc_norm)."""
    total = inject(x, y, weights)
    return total, norm_ref.grouped_zc_rms_norm(total, norm_weight, y.shape[-1], eps)
