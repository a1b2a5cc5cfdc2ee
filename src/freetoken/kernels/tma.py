"""Weight tiles through TMA (the Hopper tensor-memory accelerator): host-side tensor descriptors.

A kernel built with W_TMA takes the weight as a `TensorDescriptor` instead of a pointer and loads
its [BLOCK_N, BLOCK_K] tiles with `desc.load([row, k])`: one bulk copy per tile into shared memory,
issued by one thread, instead of every thread's 16-byte copies and address arithmetic. Rows and
columns past the described shape read as zero, which is what the pointer path's masks give. The
loaded values are the same, so a kernel computes the same bits either way.
"""

from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from freetoken.kernels.compat_triton import INTERPRET


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def usable(weight: torch.Tensor) -> bool:
    """Whether `weight` (2-D, unit column stride) can be described: a Hopper GPU (or the interpreter),
    and a 16-byte aligned base and row stride, as TMA requires."""
    if not (INTERPRET or (weight.is_cuda and _hopper(weight.device.index or 0))):
        return False
    row_bytes = weight.stride(0) * weight.element_size()
    return weight.dim() == 2 and weight.stride(1) == 1 and weight.data_ptr() % 16 == 0 and row_bytes % 16 == 0


def descriptor(weight: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The descriptor of a 2-D weight [N, K] whose tiles are [block_n, block_k]."""
    return TensorDescriptor.from_tensor(weight, [block_n, block_k])
