"""Speculative-decoding methods as data: name -> factory (lazy import).

A factory takes the target model, the engine's KV pool and the method options and returns a
`SpecMethod` (engine/spec_protocol.py). Methods reach draft networks only through the model's
`draft_network(name)`, so nothing here imports a model family.
"""

from __future__ import annotations

import importlib

METHODS: dict[str, str] = {
    "none": "freetoken.engine.spec_protocol:NoSpec",
    "mtp": "freetoken.spec.mtp.method:MTPMethod",
    "dflash": "freetoken.spec.dflash.method:DFlashMethod",
    "oracle": "freetoken.spec.oracle:OracleDrafts",  # benchmarking only: replays a known continuation
    "dflash-oracle": "freetoken.spec.oracle:OracleDFlash",  # benchmarking only: a DFlash draft's work, the oracle's tokens
}


def spec_method_class(name: str):
    from freetoken.errors import FreetokenError

    if name not in METHODS:
        raise FreetokenError(f"unknown spec method {name!r} (choose from {', '.join(METHODS)})")
    module, attr = METHODS[name].split(":")
    return getattr(importlib.import_module(module), attr)
