"""Build a family's model directly on the target device and fill it from a tensor source.

A tensor source is anything with `get(name) -> Tensor` (the unified checkpoint reader, or a dict in
tests). Parameters are created on the meta device and materialised once on the target device, so a
large model is never held twice.

With a ParallelContext of N ranks the family builds rank r's shard (its `model` module's
`build(config, with_mtp, parallel)`), each parameter's module declares which slice it holds
(`shard_specs`, distributed/sharding.py), and only that slice is read: `source.get_slice` on a
memory-mapped checkpoint, never the whole tensor.

With an ExpertOffloadConfig (cache or hybrid) the routed experts are dropped before the model is
materialised and attached afterwards, off the device (models/expert_offload.py).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


import torch

from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import read_shard, shard_spec_of
from freetoken.errors import CheckpointError, UnsupportedModelError
from freetoken.layers.offload_config import ExpertOffloadConfig
from freetoken.models.registry import family_module


class TensorSource(Protocol):
    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under canonical name `name`."""


def _build(family: str, config: dict[str, Any], with_mtp: bool, parallel: ParallelContext) -> torch.nn.Module:
    module = family_module(family)
    if parallel.is_parallel and not getattr(module, "SUPPORTS_TENSOR_PARALLEL", False):
        raise UnsupportedModelError(f"model family {family!r} does not support --tensor-parallel")
    return module.build(config, with_mtp, parallel)


def build_empty(family: str, config: dict[str, Any], *, with_mtp: bool, device: torch.device | str, dtype: torch.dtype, parallel: ParallelContext = SINGLE,
                prepare: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """The model (this rank's shard of it) with uninitialised parameters of `dtype` on `device`;
    prepare(model) runs on the meta-device model first (it may drop parameters)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = _build(family, config, with_mtp, parallel)
    finally:
        torch.set_default_dtype(previous)
    if prepare is not None:
        prepare(model)
    return model.to_empty(device=device).eval()


@torch.no_grad()
def load_model(source: TensorSource, family: str, config: dict[str, Any], *, with_mtp: bool, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, origin: str | None = None, parallel: ParallelContext = SINGLE,
               expert_offload: ExpertOffloadConfig | None = None) -> torch.nn.Module:
    offloader = None
    if expert_offload is not None and expert_offload.enabled:
        from freetoken.models.expert_offload import ExpertOffloader

        offloader = ExpertOffloader(expert_offload, device, dtype, parallel.world_size)
    model = build_empty(family, config, with_mtp=with_mtp, device=device, dtype=dtype, parallel=parallel, prepare=offloader and offloader.detach)

    def read(name: str) -> torch.Tensor:
        spec = shard_spec_of(model, name) if parallel.is_parallel else None
        return source.get(name) if spec is None else read_shard(source, name, spec)

    fill_parameters(model, read, origin=origin)
    if offloader is not None:
        offloader.attach(model, source)
    return model


@torch.no_grad()
def fill_parameters(module: torch.nn.Module, read: Callable[[str], torch.Tensor], *, prefix: str = "", origin: str | None = None) -> None:
    """Copy read(prefix + name) into each parameter `name` of module, checking that it exists and
    has the parameter's shape (a CheckpointError naming `origin` otherwise)."""
    for name, param in module.named_parameters():
        stored = prefix + name
        try:
            tensor = read(stored)
        except (KeyError, CheckpointError) as exc:
            raise CheckpointError(f"missing tensor {stored}", origin) from exc
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {stored} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}", origin)
        param.copy_(tensor.to(device=param.device, dtype=param.dtype))
