"""Build a family's model directly on the target device and fill it from a tensor source.

A tensor source is anything with `get(name) -> Tensor` (the unified checkpoint reader, or a dict in
tests). Parameters are created on the meta device and materialised once on the target device, so a
large model is never held twice.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from freetoken.errors import CheckpointError
from freetoken.models.registry import family_module


class TensorSource(Protocol):
    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under canonical name `name`."""


def build_empty(family: str, config: dict[str, Any], *, with_mtp: bool, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """The model with uninitialised parameters of `dtype` on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = family_module(family).build(config, with_mtp)
    finally:
        torch.set_default_dtype(previous)
    return model.to_empty(device=device).eval()


@torch.no_grad()
def load_model(source: TensorSource, family: str, config: dict[str, Any], *, with_mtp: bool, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, origin: str | None = None) -> torch.nn.Module:
    model = build_empty(family, config, with_mtp=with_mtp, device=device, dtype=dtype)
    for name, param in model.named_parameters():
        try:
            tensor = source.get(name)
        except (KeyError, CheckpointError) as exc:
            raise CheckpointError(f"missing tensor {name}", origin) from exc
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}", origin)
        param.copy_(tensor.to(device=param.device, dtype=param.dtype))
    return model
