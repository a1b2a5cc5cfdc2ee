"""transformers' `Qwen4ExpTextConfig` for a normalized qwen4_exp config (the `parity --against hf` oracle).

The unified checkpoint keeps transformers' tensor names, so `Qwen4ExpForCausalLM` built from this
config loads the trunk name for name (its int64 n-gram buffers are recomputed by transformers).
"""

from __future__ import annotations

from typing import Any

from freetoken.errors import FreetokenError
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig


def hf_text_config(config: dict[str, Any]):
    try:
        from transformers import Qwen4ExpTextConfig
    except ImportError as exc:
        raise FreetokenError("--against hf needs transformers with qwen4_exp (pip install 'transformers>=5.23')") from exc
    cfg = Qwen4ExpConfig.from_dict(config)
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
            "mrope_section": list(cfg.mrope_section), "mrope_interleaved": cfg.mrope_interleaved}
    if cfg.rope_type == "yarn":
        rope |= {"factor": cfg.yarn_factor, "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
                 "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow, "truncate": cfg.yarn_truncate}
        if cfg.yarn_attention_factor is not None:
            rope["attention_factor"] = cfg.yarn_attention_factor
    indexer = {"indexer_n_heads": cfg.indexer_n_heads, "indexer_kv_heads": cfg.indexer_kv_heads, "indexer_head_dim": cfg.indexer_head_dim,
               "indexer_budget": cfg.indexer_budget, "indexer_compress_ratio": cfg.indexer_compress_ratio}
    return Qwen4ExpTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers, layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob, output_gate_type=cfg.output_gate_type, hidden_act=cfg.hidden_act,
        hc_count=cfg.hc_count, hc_lowrank=cfg.hc_lowrank, ple_layer_ids=list(cfg.ple_layer_ids), ple_embed_dim=cfg.ple_embed_dim,
        ple_conv_kernel_size=cfg.ple_conv_kernel_size, ngram_size=cfg.ngram_size, heads_per_ngram=cfg.heads_per_ngram,
        ngram_vocab_size_base=cfg.ngram_vocab_size_base, make_ngram_vocab_size_divisible_by=cfg.make_ngram_vocab_size_divisible_by,
        seed=cfg.seed, **indexer, rope_parameters=rope, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    )
