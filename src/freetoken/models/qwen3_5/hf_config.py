"""transformers' `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig` for a normalized Qwen3.5 config (the
`parity --against hf` oracle): the unified checkpoint keeps transformers' names, so the trunk loads
name for name."""

from __future__ import annotations

from typing import Any

from freetoken.errors import FreetokenError
from freetoken.models.qwen3_5.config import Qwen35Config


def hf_text_config(config: dict[str, Any]):
    """Qwen3_5(Moe)TextConfig of the normalized config dict."""
    try:
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    except ImportError as exc:
        raise FreetokenError("--against hf needs transformers (pip install transformers)") from exc
    cfg = Qwen35Config.from_dict(config)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
                         "mrope_section": list(cfg.mrope_section), "mrope_interleaved": True},
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, layer_types=list(cfg.layer_types),
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    )
    if cfg.is_moe:
        return Qwen3_5MoeTextConfig(moe_intermediate_size=cfg.moe_intermediate_size, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                                    num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, **common)
    return Qwen3_5TextConfig(intermediate_size=cfg.intermediate_size, **common)


