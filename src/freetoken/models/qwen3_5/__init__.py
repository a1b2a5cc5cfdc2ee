"""Qwen3.5 family (dense `qwen3_5` and MoE `qwen3_5_moe`): config, model, weights, MTP head."""

from __future__ import annotations

from typing import Any

from freetoken.models.qwen3_5.config import Qwen35Config

SUPPORTS_TENSOR_PARALLEL = True


def hf_text_config(config: dict[str, Any]):
    """transformers' text config for the normalized `config` (the `parity --against hf` oracle)."""
    from freetoken.models.qwen3_5.hf_config import hf_text_config as build_hf_config

    return build_hf_config(config)


def build(config: dict[str, Any], with_mtp: bool, parallel=None):
    """The model (rank `parallel.rank`'s shard of it under tensor parallelism) with unset parameters."""
    from freetoken.distributed.context import SINGLE
    from freetoken.models.qwen3_5.model import Qwen35ForCausalLM

    return Qwen35ForCausalLM(Qwen35Config.from_dict(config), with_mtp=with_mtp, parallel=parallel or SINGLE)
