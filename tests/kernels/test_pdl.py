"""Programmatic dependent launch: off where it cannot apply, and every kernel starts with its wait.

A kernel launched with PDL that touched memory before `griddepcontrol.wait` could read what the
previous kernel has not written yet, so every Triton kernel must begin with `pdl.sync(PDL)`.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import freetoken.kernels as kernels_pkg
from freetoken.kernels import pdl


def _kernels():
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        if info.name.endswith("_triton"):
            module = importlib.import_module(f"freetoken.kernels.{info.name}")
            for name, value in vars(module).items():
                if name.endswith("_kernel") and inspect.isfunction(getattr(value, "fn", None)):  # a @triton.jit kernel (compiled or interpreted)
                    yield f"{info.name}.{name}", value


KERNELS = dict(_kernels())


def test_kernels_are_found():
    assert {"linear_triton._linear_kernel", "attention_triton._partition_kernel", "moe_triton._gate_up_kernel"} <= KERNELS.keys()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_starts_with_the_grid_dependency_wait(name):
    source = inspect.getsource(KERNELS[name].fn)
    body = source.split("):\n", 1)[1].lstrip()
    assert body.startswith("pdl.sync(PDL)\n"), f"{name} must start with pdl.sync(PDL)"
    assert "PDL: tl.constexpr" in source


def test_off_without_a_hopper_gpu_or_when_disabled(monkeypatch):
    pdl.enabled.cache_clear()
    monkeypatch.setenv("FREETOKEN_PDL", "0")
    assert pdl.launch_kwargs() == {"PDL": False, "launch_pdl": False}
    pdl.enabled.cache_clear()
    monkeypatch.delenv("FREETOKEN_PDL")
    import torch

    expected = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and not pdl.INTERPRET
    assert pdl.enabled() == expected
    pdl.enabled.cache_clear()
