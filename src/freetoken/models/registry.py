"""Model families as data: HF model_type -> family, family -> module that builds and loads it.

Imports are lazy so that the CLI can consult the registry without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from freetoken.errors import UnsupportedModelError


@dataclass(frozen=True)
class FamilySpec:
    name: str
    module: str  # provides build(config: dict, with_mtp: bool) and parse_hf_config(dict) -> normalized dict
    model_types: tuple[str, ...]


FAMILIES: dict[str, FamilySpec] = {
    "qwen3_5": FamilySpec("qwen3_5", "freetoken.models.qwen3_5", ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")),
    "qwen4_exp": FamilySpec("qwen4_exp", "freetoken.models.qwen4_exp", ("qwen4_exp", "qwen4_exp_text")),
}


def family_for_model_type(model_type: str | None, path: str | None = None) -> FamilySpec:
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec
    raise UnsupportedModelError(f"unsupported model_type {model_type!r}", path)


def family_module(family: str):
    if family not in FAMILIES:
        raise UnsupportedModelError(f"unknown model family {family!r}")
    return importlib.import_module(FAMILIES[family].module)
