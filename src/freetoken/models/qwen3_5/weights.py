"""Canonical tensor names and shapes of the Qwen3.5 family (dense `qwen3_5` and MoE `qwen3_5_moe`).

The canonical names are Hugging Face's text-model names (`model.*`, `lm_head.weight`), so a unified
checkpoint loads in transformers too. Two choices are fixed here for every source:
- routed experts are always fused: `experts.gate_up_proj [E, 2I, H]` (gate rows first) and
  `experts.down_proj [E, H, I]`, without a `.weight` suffix;
- the MTP head sits at the root under `mtp.*`; the vision tower under `model.visual.*` is kept
  as-is and not validated here.

Layout: `canonical_name` (prefix aliases), `expected_tensors` (name -> shape), `fuse_experts`
(per-expert -> fused, with `per_expert_key` / `fuse_group` from models/weight_rules.py), `RULES`
(what the converters read through the registry).
"""

from __future__ import annotations

import torch

from freetoken.models import layer_tensors
from freetoken.models.qwen3_5.config import Qwen35Config
from freetoken.models.weight_rules import WeightRules, fuse_group, per_expert_key


def canonical_name(hf_name: str) -> str:
    """Map an HF checkpoint name to its canonical name: `model.language_model.X` -> `model.X`."""
    if hf_name.startswith("model.language_model."):
        return "model." + hf_name[len("model.language_model.") :]
    return hf_name


def _mlp(prefix: str, cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    if not cfg.is_moe:
        i = cfg.intermediate_size
        return {f"{prefix}.gate_proj.weight": (i, h), f"{prefix}.up_proj.weight": (i, h), f"{prefix}.down_proj.weight": (h, i)}
    return layer_tensors.sparse_moe(prefix, cfg)


def _decoder_layer(prefix: str, layer_type: str, cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    out = {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,)}
    if layer_type == "full_attention":
        out |= layer_tensors.gated_attention(f"{prefix}.self_attn", cfg)
    else:
        out |= layer_tensors.gated_deltanet(f"{prefix}.linear_attn", cfg)
    return out | _mlp(f"{prefix}.mlp", cfg)


def expected_tensors(cfg: Qwen35Config, *, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the text model (and of its MTP head if `with_mtp`), with its shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for i, layer_type in enumerate(cfg.layer_types):
        out |= _decoder_layer(f"model.layers.{i}", layer_type, cfg)
    if with_mtp:
        out |= {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
        for j in range(max(cfg.mtp_num_hidden_layers, 1)):
            out |= _decoder_layer(f"mtp.layers.{j}", "full_attention", cfg)
    return out


def fuse_experts(tensors: dict[str, torch.Tensor], cfg: Qwen35Config) -> dict[str, torch.Tensor]:
    """Replace every per-expert `experts.{e}.{gate,up,down}_proj.weight` by the fused pair; error if incomplete."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = per_expert_key(name)
        if key is None:
            out[name] = tensor
        else:
            groups.setdefault(key[0], {})[(key[1], key[2])] = tensor
    for prefix, group in groups.items():
        out |= fuse_group(prefix, group, cfg.num_experts)
    return out


RULES = WeightRules(canonical_name=canonical_name, expected_tensors=expected_tensors)
