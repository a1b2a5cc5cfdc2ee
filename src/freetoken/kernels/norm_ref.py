"""RMSNorm variants (reference): zero-centred (1 + w), also per group of a row, plain (w), and gated (w * norm(x) * act(z)).

Precision follows HF: normalise in fp32; the zero-centred form multiplies in fp32 and casts at the
end, the gated form casts the normalised value first, then multiplies by w and by act(z) in fp32.
"""

from __future__ import annotations

import torch

from freetoken.kernels import activation_ref


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = norm(x) * (1 + w); x [..., D], weight [D]."""
    return (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)


def grouped_zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """zc_rms_norm with one RMS per `group`-wide slice: x [..., G * group], weight [G * group] (transformers'
    `Qwen4ExpTextRMSNorm` over hyper-connection streams)."""
    shape = x.shape
    normed = _normalize(x.reshape(*shape[:-1], -1, group), eps).reshape(shape)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * norm(x) (plain Qwen3 RMSNorm); x [..., D], weight [D]."""
    return weight * _normalize(x, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "silu") -> torch.Tensor:
    """y = w * norm(x) * act(gate); x, gate [..., D], weight [D]."""
    dtype = x.dtype
    y = weight * _normalize(x, eps).to(dtype)
    g = gate.float()
    g = activation_ref.silu(g) if act == "silu" else activation_ref.sigmoid(g)
    return (y * g).to(dtype)


def add_zc_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) * (1 + w)) with s = x + residual; x, residual [N, D]."""
    s = x + residual
    return s, zc_rms_norm(s, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [N, 2I] = [gate | up] -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation_ref.silu(gate) * up
