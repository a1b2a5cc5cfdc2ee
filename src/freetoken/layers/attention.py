"""Gated full attention (Qwen3-Next style) over the paged KV cache.

q_proj yields [query_h ; gate_h] per head; q and k get a zero-centred RMSNorm per head and partial
NeoX RoPE; the attention output is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.forward_context import ForwardContext
from freetoken.kernels.rope_ref import rope_inv_freq
from freetoken.layers.basic import Linear, ZeroCenteredRMSNorm


class GatedAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float, eps: float, kv_index: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim * 2)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim)
        self.o_proj = Linear(num_heads * head_dim, hidden_size)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
        self.kv_index = kv_index  # which KV-cache layer this attention owns
        self.scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, H] -> [N, H]
        n = x.shape[0]
        q_gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        inv_freq = rope_inv_freq(self.rotary_dim, self.rope_theta, device=x.device)
        q = kernels.apply_rope(self.q_norm(q), ctx.positions, inv_freq)
        k = kernels.apply_rope(self.k_norm(k), ctx.positions, inv_freq)
        k_cache, v_cache = ctx.kv.k[self.kv_index], ctx.kv.v[self.kv_index]
        kernels.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = kernels.paged_attention_batched(q, k_cache, v_cache, kernels.seq_batch(ctx), ctx.kv.block_size, self.scale)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
