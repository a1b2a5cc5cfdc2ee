"""Qwen3.5 family (dense `qwen3_5` and MoE `qwen3_5_moe`): config, model, weights, MTP head."""

from __future__ import annotations

from typing import Any

from freetoken.models.qwen3_5.config import Qwen35Config

SUPPORTS_TENSOR_PARALLEL = True


def parse_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    return Qwen35Config.from_hf(config).to_dict()


def build(config: dict[str, Any], with_mtp: bool, parallel=None):
    """The model (rank `parallel.rank`'s shard of it under tensor parallelism) with unset parameters."""
    from freetoken.distributed.context import SINGLE
    from freetoken.models.qwen3_5.model import Qwen35ForCausalLM

    return Qwen35ForCausalLM(Qwen35Config.from_dict(config), with_mtp=with_mtp, parallel=parallel or SINGLE)
