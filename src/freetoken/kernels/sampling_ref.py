"""Argmax and inverse-CDF sampling in plain torch: the CPU path and the oracle of `sampling_triton`.

Why an integer CDF: a floating-point cumulative sum depends on its summation order, which differs
between torch's CPU loop, its CUDA scan and a Triton block scan, so the same uniform could pick
different tokens on different devices. Here every weight is first turned into an exact integer
(fixed point relative to the row's maximum), and integer sums do not depend on order. Any
implementation that follows the three steps below samples the same token for the same uniform.

  quantize      q_i = trunc(w_i * 2^(BITS - E)) in int64, where max_i w_i = m * 2^E with m in
                [0.5, 1) (frexp) and BITS = 62 - ceil(log2(V)); so every q_i < 2^BITS and
                sum q < 2^62. Weights below max * 2^-BITS (2^-44 of the max at V = 248k) become 0.
  threshold     t = min(trunc(u * double(total)), total - 1), total = sum q, u in [0, 1) fp64
  pick          token = #{i : cdf_i <= t}, cdf = inclusive cumsum of q: the first i with
                cdf_i > t, which always has q_i > 0. A row whose weights are all 0 picks token 0.
"""

from __future__ import annotations

import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] any float dtype -> [R] int64; ties -> the lowest index, NaN counts as the maximum."""
    return x.argmax(dim=-1)


def cdf_bits(vocab: int) -> int:
    """Fixed-point bits per weight so that V weights sum below 2^62 (no int64 overflow)."""
    return 62 - max(vocab - 1, 1).bit_length()


def quantize(weights: torch.Tensor) -> torch.Tensor:
    """Non-negative finite fp32 weights [R, V] -> int64 fixed point [R, V] (see the module docstring)."""
    w = weights.float()
    m = w.amax(dim=-1)  # [R]
    _, e = torch.frexp(m.double())
    scale = torch.ldexp(torch.ones_like(m, dtype=torch.float64), cdf_bits(w.shape[-1]) - e)
    scale = torch.where(m > 0, scale, torch.zeros_like(scale))
    return (w.double() * scale[:, None]).to(torch.int64)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalized weights [R, V] (fp32, >= 0) with uniforms u [R] fp64 -> [R] int64."""
    cdf = torch.cumsum(quantize(weights), dim=-1)  # [R, V] int64, exact
    total = cdf[:, -1]
    t = torch.minimum((u.double() * total.double()).to(torch.int64), total - 1)
    return (cdf <= t[:, None]).sum(dim=-1)
