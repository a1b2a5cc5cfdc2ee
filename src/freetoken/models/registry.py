"""Model families as data: HF model_type -> family, family -> module that builds and loads it,
its normalized config class and its checkpoint-tensor rules (`weight_rules.WeightRules`).

Imports are lazy so that the CLI can consult the registry without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from freetoken.errors import UnsupportedModelError


@dataclass(frozen=True)
class FamilySpec:
    name: str
    module: str  # provides build(config: dict, with_mtp: bool) and hf_text_config(config: dict) (transformers' config, the oracle)
    model_types: tuple[str, ...]
    config_class: str  # "module:Class" of the frozen normalized config (from_hf, from_dict, to_dict)
    weights: str  # module with RULES: WeightRules (canonical names, expected tensors, source transforms)


FAMILIES: dict[str, FamilySpec] = {
    "qwen3_5": FamilySpec(
        "qwen3_5", "freetoken.models.qwen3_5", ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        "freetoken.models.qwen3_5.config:Qwen35Config", "freetoken.models.qwen3_5.weights",
    ),
    "qwen4_exp": FamilySpec(
        "qwen4_exp", "freetoken.models.qwen4_exp", ("qwen4_exp", "qwen4_exp_text"),
        "freetoken.models.qwen4_exp.config:Qwen4ExpConfig", "freetoken.models.qwen4_exp.weights",
    ),
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


def family_config_class(family: str) -> type:
    """The normalized config class of `family` (e.g. Qwen35Config)."""
    if family not in FAMILIES:
        raise UnsupportedModelError(f"unknown model family {family!r}")
    module, _, name = FAMILIES[family].config_class.partition(":")
    return getattr(importlib.import_module(module), name)


def weight_rules(family: str):
    """The `WeightRules` of `family` (its weights module's RULES)."""
    if family not in FAMILIES:
        raise UnsupportedModelError(f"unknown model family {family!r}")
    return importlib.import_module(FAMILIES[family].weights).RULES


def hf_model_type(config: dict) -> str | None:
    """The model_type of an HF config.json dict: the top level's, else its text_config's."""
    return config.get("model_type") or (config.get("text_config") or {}).get("model_type")
