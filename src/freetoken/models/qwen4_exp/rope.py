"""Partial NeoX RoPE of qwen4_exp, default or YaRN (architectures.md §1.3).

Text positions make the interleaved mRoPE one-dimensional: positions [N]. Rows of an image prompt
carry (t, h, w) positions [3, N]; frequency i then reads the axis `mrope_axes` gives it (kernels/rope_ref.py,
interleaved over `mrope_section`), before the YaRN scale, as transformers recomposes them. YaRN is transformers'
`_compute_yarn_parameters` with dim = rotary_dim: the inverse frequencies blend interpolation
(divided by `factor`) and extrapolation over the correction range of beta_fast/beta_slow, and cos
and sin are multiplied by the attention factor (0.1 ln(factor) + 1 unless the config sets one).
The attention and the QSA indexer rotate with these cos/sin (the indexer's heads are at least rotary_dim
wide and rotate their first rotary_dim channels), each in its `kernels.norm_rope_store` launch, which
computes them from the positions, `inv_freq_on` and `scale` itself.
"""

from __future__ import annotations

import math

import torch

from freetoken.kernels.rope_ref import mrope_axes, rope_inv_freq, rotate, scaled_cos_sin
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig


def yarn_inv_freq(cfg: Qwen4ExpConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] fp32, cos/sin scale) of a YaRN config."""
    dim, base, factor = cfg.rotary_dim, cfg.rope_theta, cfg.yarn_factor
    original = cfg.yarn_original_max_position_embeddings or cfg.max_position_embeddings
    scale = cfg.yarn_attention_factor
    if scale is None:
        scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(scale)


class Rotary:
    """cos/sin per position and their application; not a module (it holds no parameters). Its inverse
    frequencies are built on the CPU (also while the model is built on the meta device) and copied to
    each device once (`inv_freq_on`)."""

    def __init__(self, cfg: Qwen4ExpConfig):
        if cfg.rope_type == "yarn":
            self.inv_freq, self.scale = yarn_inv_freq(cfg)
        else:
            self.inv_freq, self.scale = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, device="cpu"), 1.0
        self.rotary_dim = cfg.rotary_dim
        self.mrope_section = cfg.mrope_section  # (t, h, w) frequency counts for [3, N] positions (interleaved mRoPE)
        # [rotary_dim / 2]: the axis (0 t, 1 h, 2 w) each frequency reads from [3, N] positions
        self.mrope_axes = torch.tensor(mrope_axes(cfg.rotary_dim // 2, cfg.mrope_section), device="cpu")
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies on `device`, copied there on first use (a CUDA graph's capture comes
        after eager steps, so it reads the copy and copies nothing)."""
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[device] = self.inv_freq.to(device)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (or [3, N] (t, h, w)) -> cos, sin [N, rotary_dim] in dtype (scaled, then cast, as
        transformers does)."""
        return scaled_cos_sin(positions, self.inv_freq_on(positions.device), self.mrope_axes, self.scale, dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] with its first rotary_dim channels rotated by cos, sin [N, rotary_dim]."""
        return rotate(x, cos, sin)
