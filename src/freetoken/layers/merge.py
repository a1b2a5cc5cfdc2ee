"""Merge the projections that read the same input into one weight, so one launch streams them all.

A decode step is a long chain of small launches; reading [q | k | v] (or [gate | up], the four GDN
input projections, or a MoE block's router and shared-expert gate) as one [sum N, K] weight halves
the launches and gives the linear kernel a wide N to spread over the GPU (a MoE block also stacks its
shared expert after the routed experts, layers/moe.py). The merged weight is one new tensor; each
original parameter becomes a view of its rows, so names, shapes and state_dict are unchanged. Row
invariance is kept: the merged linear's configuration is still a function of its weight shape alone.

Modules opt in with `merge_projections()`; `merge_projections(model)` runs them all, once.
"""

from __future__ import annotations

import torch
from torch import nn


def merge_linears(linears: list[nn.Module]) -> torch.Tensor:
    """Concatenate the linears' weights along N; each weight becomes a row-view of the result."""
    merged = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(merged[start : start + rows], requires_grad=False)
        start += rows
    return merged


def split_columns(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """y [N, sum(sizes)] -> column blocks [N, size] (views)."""
    return list(torch.split(y, sizes, dim=-1))


def merge_projections(model: nn.Module) -> nn.Module:
    """Merge every opted-in module's projections (idempotent). The replaced tensors' memory goes back
    to the device, so free memory measured next (the KV pool's size) counts it."""
    for module in model.modules():
        if hasattr(module, "merge_projections") and module is not model:
            module.merge_projections()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return model
