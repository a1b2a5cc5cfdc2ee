"""Normalized config of the Qwen3.5 family (dense `qwen3_5` and MoE `qwen3_5_moe`).

`Qwen35Config.from_hf` reads a Hugging Face config.json (image-text with `text_config`, or
text-only), in both the `rope_parameters` form and the legacy top-level rope fields. The unified
manifest stores `asdict(config)`; `from_dict` reads it back. Nothing else about a checkpoint's
origin survives into the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.errors import UnsupportedModelError
from freetoken.models.config_base import HybridLayout, ManifestConfig

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config(ManifestConfig, HybridLayout):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    intermediate_size: int | None = None  # dense MLP width; None for MoE
    num_experts: int = 0  # 0 means dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    video_token_id: int | None = None
    model_type: str = "qwen3_5"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen35Config":
        """Normalize a Hugging Face config.json dict (top level, possibly with `text_config`)."""
        top = config
        text = dict(config.get("text_config") or config)
        model_type = top.get("model_type") or text.get("model_type")
        if model_type not in MODEL_TYPES:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r} (supported: qwen3_5, qwen3_5_moe)")
        is_moe = "moe" in model_type or bool(text.get("num_experts"))
        n_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise UnsupportedModelError(f"layer_types {layer_types!r} do not fit num_hidden_layers={n_layers}")

        rope = dict(text.get("rope_parameters") or top.get("rope_parameters") or {})
        legacy_scaling = text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 1e7))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        mrope_section = rope.get("mrope_section", legacy_scaling.get("mrope_section", [11, 11, 10]))
        rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
        if rope_type not in ("default", "mrope"):
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}")

        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # The top-level flag governs *ForConditionalGeneration, the text one *ForCausalLM; a
        # converter also ties when the checkpoint has no lm_head.weight.
        tie = bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(head_dim),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=None if is_moe else int(text["intermediate_size"]),
            num_experts=int(text.get("num_experts", 0)) if is_moe else 0,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0)) if is_moe else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0)) if is_moe else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)) if is_moe else 0,
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            mrope_section=tuple(int(s) for s in mrope_section),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_act=str(text.get("hidden_act", "silu")),
            tie_word_embeddings=tie,
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            eos_token_ids=eos_ids,
            image_token_id=top.get("image_token_id"),
            vision_start_token_id=top.get("vision_start_token_id"),
            vision_end_token_id=top.get("vision_end_token_id"),
            video_token_id=top.get("video_token_id"),
            model_type="qwen3_5_moe" if is_moe else "qwen3_5",
        )
