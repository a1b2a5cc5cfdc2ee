"""qwen4_exp RoPE (default and YaRN) against transformers' `Qwen4ExpTextRotaryEmbedding`.

The fixture checkpoint uses default RoPE; the released config's YaRN (factor 2, original 262144,
architectures.md §4.1) and a variant with a short original length and truncate off (so the ramp
lands inside the rotary channels) are checked here: inverse frequencies, the cos/sin scale, and
cos/sin of text positions, which transformers builds from its config with interleaved mRoPE.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.rope import Rotary

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 262144}
SHORT_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": False, "beta_fast": 16}


def hf_text_config(rope: dict):
    from transformers import Qwen4ExpTextConfig

    params = {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True, **rope}
    return Qwen4ExpTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters=params, max_position_embeddings=524288, eos_token_id=1,
    )


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, YARN, SHORT_YARN], ids=["default", "yarn", "short-yarn"])
def test_rotary_matches_transformers(rope):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    hf_config = hf_text_config(rope)
    hf = Qwen4ExpTextRotaryEmbedding(hf_config)
    ours = Rotary(Qwen4ExpConfig.from_hf(hf_config.to_dict()))
    assert torch.allclose(ours.inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    assert ours.scale == pytest.approx(hf.attention_scaling, rel=1e-12)
    positions = torch.tensor([0, 1, 7, 1000, 300000])
    x = torch.zeros(1, len(positions), 256)
    cos, sin = hf(x, positions.view(1, 1, -1).expand(3, 1, -1))
    our_cos, our_sin = ours.cos_sin(positions, torch.float32)
    assert torch.allclose(our_cos, cos[0], atol=2e-6) and torch.allclose(our_sin, sin[0], atol=2e-6)
    if rope.get("rope_type") == "yarn":
        assert ours.scale > 1.0
