"""Partial NeoX-style rotary embedding (reference).

Text-only positions make interleaved mRoPE collapse to 1-D RoPE, so one position per row suffices.
Only the first `rotary_dim` channels of each head rotate; channel i pairs with i + rotary_dim / 2.
"""

from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies theta^(-2i / rotary_dim)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta**exponents)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim], positions [N] -> x with its first 2 * len(inv_freq) channels rotated."""
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
