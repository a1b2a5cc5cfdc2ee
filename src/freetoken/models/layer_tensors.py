"""Canonical tensors (name -> shape) of the shared layers (layers/) under a prefix, as both families'
`weights.py` list them: gated attention, Gated DeltaNet and the sparse MoE block. `cfg` is any
family config with the usual Hugging Face field names (hidden_size, head_dim, linear_*, num_experts, ...).
"""

from __future__ import annotations

from typing import Any

Shapes = dict[str, tuple[int, ...]]


def gated_attention(prefix: str, cfg: Any) -> Shapes:
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        f"{prefix}.q_proj.weight": (2 * nh * hd, h),  # query and output gate, interleaved per head
        f"{prefix}.k_proj.weight": (nkv * hd, h),
        f"{prefix}.v_proj.weight": (nkv * hd, h),
        f"{prefix}.o_proj.weight": (h, nh * hd),
        f"{prefix}.q_norm.weight": (hd,),
        f"{prefix}.k_norm.weight": (hd,),
    }


def gated_deltanet(prefix: str, cfg: Any) -> Shapes:
    h, nv, dv, c = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_dim
    return {
        f"{prefix}.in_proj_qkv.weight": (c, h),
        f"{prefix}.in_proj_z.weight": (nv * dv, h),
        f"{prefix}.in_proj_b.weight": (nv, h),
        f"{prefix}.in_proj_a.weight": (nv, h),
        f"{prefix}.conv1d.weight": (c, 1, cfg.linear_conv_kernel_dim),
        f"{prefix}.A_log": (nv,),
        f"{prefix}.dt_bias": (nv,),
        f"{prefix}.norm.weight": (dv,),
        f"{prefix}.out_proj.weight": (h, nv * dv),
    }


def sparse_moe(prefix: str, cfg: Any) -> Shapes:
    """The router, the fused routed experts (gate rows first) and, if it has one, the gated shared expert."""
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = {
        f"{prefix}.gate.weight": (e, h),
        f"{prefix}.experts.gate_up_proj": (e, 2 * i, h),
        f"{prefix}.experts.down_proj": (e, h, i),
    }
    if s:
        out |= {
            f"{prefix}.shared_expert.gate_proj.weight": (s, h),
            f"{prefix}.shared_expert.up_proj.weight": (s, h),
            f"{prefix}.shared_expert.down_proj.weight": (h, s),
            f"{prefix}.shared_expert_gate.weight": (1, h),
        }
    return out
