"""Hugging Face transformers as an oracle: build its model for a unified checkpoint.

The unified checkpoint uses HF's own tensor names, so the trunk loads name for name into
`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (or a family's own transformers class, from its
`hf_text_config`: `Qwen4ExpForCausalLM`). Used by `parity --against hf` and by the tests.
Needs `transformers`, which is not a runtime dependency.
"""

from __future__ import annotations

from typing import Any

import torch

from freetoken.errors import FreetokenError
from freetoken.models.loader import TensorSource


def hf_text_config(config: dict[str, Any], family: str = "qwen3_5"):
    """transformers' text config for a normalized config: the family's own `hf_text_config` where it
    has one (models/<family>/__init__.py), else the Qwen3.5 one below."""
    from freetoken.models.registry import family_module

    own = getattr(family_module(family), "hf_text_config", None)
    if own is not None:
        return own(config)
    try:
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    except ImportError as exc:
        raise FreetokenError("--against hf needs transformers (pip install transformers)") from exc
    from freetoken.models.qwen3_5.config import Qwen35Config

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


@torch.no_grad()
def load_hf_model(source: TensorSource, config: dict[str, Any], names: list[str], dtype: torch.dtype = torch.float32, family: str = "qwen3_5"):
    """transformers' causal LM for the trunk tensors of `source` (eager attention and experts); buffers
    transformers computes itself (qwen4_exp's n-gram hash constants) are not read."""
    from transformers import AutoModelForCausalLM

    hf_config = hf_text_config(config, family)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = {n: source.get(n) for n in names if n.startswith(("model.", "lm_head.")) and not n.startswith("model.visual.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    buffers = dict(model.named_buffers())
    missing = [m for m in missing if not (m == "lm_head.weight" and hf_config.tie_word_embeddings) and m not in buffers]
    if missing or unexpected:
        raise FreetokenError(f"transformers model does not match the checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    """transformers' own greedy generate for one prompt (no padding)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(eos_ids) or None, pad_token_id=eos_ids[0] if eos_ids else 0)
    return out[0, len(prompt):].tolist()
