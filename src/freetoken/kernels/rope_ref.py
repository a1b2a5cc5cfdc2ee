"""Partial NeoX-style rotary embedding (reference).

Text-only positions make interleaved mRoPE collapse to 1-D RoPE, so one position per row suffices
there. Rows of an image prompt carry three positions (t, h, w): frequency i takes the h position when
i % 3 == 1 and i < 3 * section[1], the w position when i % 3 == 2 and i < 3 * section[2], else the t
position (interleaved mRoPE). Equal rows give exactly the 1-D result.
Only the first `rotary_dim` channels of each head rotate; channel i pairs with i + rotary_dim / 2.
qwen4_exp's cos/sin (`scaled_cos_sin`, `rotate`) carry YaRN's attention factor and are computed one
row at a time on CPU, so a row's bits do not depend on the rows sharing the call.
"""

from __future__ import annotations

from typing import Callable

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies theta^(-2i / rotary_dim)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta**exponents)


def mrope_axes(half: int, mrope_section: tuple[int, ...]) -> list[int]:
    """Which of (t, h, w) each of the half rotary frequencies reads (interleaved mRoPE)."""
    s_h, s_w = mrope_section[1], mrope_section[2]
    return [1 if i % 3 == 1 and i < 3 * s_h else 2 if i % 3 == 2 and i < 3 * s_w else 0 for i in range(half)]


def rope_freqs(positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
    """positions [N] (or [3, N] with axes, mrope_axes as a tensor) -> fp32 angles [N, len(inv_freq)]."""
    if positions.dim() == 2:
        return positions.float()[axes.to(positions.device), :].t() * inv_freq[None, :]
    return positions.float()[:, None] * inv_freq[None, :]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: tuple[int, ...] = ()) -> torch.Tensor:
    """x [N, heads, head_dim], positions [N] (or [3, N] with mrope_section) -> x with its first
    2 * len(inv_freq) channels rotated."""
    rotary_dim = 2 * inv_freq.shape[0]
    axes = torch.tensor(mrope_axes(inv_freq.shape[0], mrope_section)) if positions.dim() == 2 else None
    freqs = rope_freqs(positions, inv_freq, axes)  # [N, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def row_by_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) computed one row (dim 0) at a time on CPU, in one call elsewhere; fn is elementwise."""
    if x.is_cuda or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(x[i : i + 1].contiguous()) for i in range(x.shape[0])])


def scaled_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor | None, scale: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] (or [3, N] with axes, mrope_axes as a tensor) -> cos, sin [N, 2 * len(inv_freq)] in dtype:
    fp32 cos and sin of the angles times scale, then cast (as transformers applies YaRN's attention factor)."""
    freqs = rope_freqs(positions, inv_freq, axes)
    cos = row_by_row(lambda f: f.cos() * scale, freqs)
    sin = row_by_row(lambda f: f.sin() * scale, freqs)
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] with its first rotary_dim channels rotated by cos, sin [N, rotary_dim]."""
    d, half = cos.shape[-1], cos.shape[-1] // 2
    x_rot, x_pass = x[..., :d], x[..., d:]
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos[:, None, :] + rotated * sin[:, None, :], x_pass], dim=-1)
