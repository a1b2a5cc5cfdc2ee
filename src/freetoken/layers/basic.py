"""Parameter holders with Hugging Face names (`.weight`), each calling one op in `kernels`."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.kernels import activation_ref


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T, no bias; row-invariant."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _empty(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        return kernels.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = _empty(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, H]
        return kernels.embedding(self.weight, ids)


class ZeroCenteredRMSNorm(nn.Module):
    """norm(x) * (1 + w); the stored weight is an offset from one."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.zc_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """w * norm(x) * act(z), per value head (w is not zero-centred)."""

    def __init__(self, dim: int, eps: float, act: str = "silu"):
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps
        self.act = act

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return kernels.gated_rms_norm(x, gate, self.weight, self.eps, self.act)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up split by output and down by input across ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel=None):
        from freetoken.distributed.context import SINGLE
        from freetoken.layers.parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        parallel = parallel or SINGLE
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel)
        self.gate_up_weight: torch.Tensor | None = None  # [2I, H] once merged (layers/merge.py)

    def merge_projections(self) -> None:
        """Read gate and up as one [2I, H] weight."""
        if self.gate_up_weight is None:
            from freetoken.layers.merge import merge_linears

            self.gate_up_weight = merge_linears([self.gate_proj, self.up_proj])

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, defer_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), x + residual); [N, H] each. The decoder layer's entry to every MLP
        block. defer_output: the mlp output may be down's split-K partials, for the caller's next
        `kernels.add_zc_rms_norm` only."""
        prefetch = kernels.l2_span(self.gate_up_weight, residual, "mlp")  # queued by the add + norm launch
        residual, h = kernels.add_zc_rms_norm(x, residual, norm.weight, norm.eps, prefetch)
        return self(h, defer_sum=defer_output), residual

    def forward(self, x: torch.Tensor, defer_sum: bool = False) -> torch.Tensor:  # [N, H] -> [N, H]
        if self.gate_up_weight is not None:
            return self.down_proj(kernels.silu_mul(kernels.linear(x, self.gate_up_weight)), defer_sum=defer_sum)
        return self.down_proj(activation_ref.silu(self.gate_proj(x)) * self.up_proj(x), defer_sum=defer_sum)
