"""Qwen3.8-Flash-Next (`qwen4_exp`): config, model, canonical weights, MTP head."""

from __future__ import annotations

from typing import Any

from freetoken.models.qwen4_exp.config import Qwen4ExpConfig

SUPPORTS_TENSOR_PARALLEL = False


def build(config: dict[str, Any], with_mtp: bool, parallel=None):
    """The model with unset parameters (one rank: tensor parallelism is not supported for this family)."""
    from freetoken.models.qwen4_exp.model import Qwen4ExpForCausalLM

    return Qwen4ExpForCausalLM(Qwen4ExpConfig.from_dict(config), with_mtp=with_mtp)


def hf_text_config(config: dict[str, Any]):
    """transformers' text config for the normalized `config` (the `parity --against hf` oracle)."""
    from freetoken.models.qwen4_exp.hf_config import hf_text_config as build_hf_config

    return build_hf_config(config)
