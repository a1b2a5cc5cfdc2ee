"""Gated full attention (Qwen3-Next style) over the paged KV cache.

q_proj yields [query_h ; gate_h] per head; q and k get a zero-centred RMSNorm per head and partial
NeoX RoPE; the attention output is multiplied by sigmoid(gate) before o_proj.

Across ranks the query heads are split evenly (q_proj by output, o_proj by input) and so are the KV
heads; when there are fewer KV heads than ranks, each KV head is replicated on the ranks whose
query heads read it.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.errors import FreetokenError
from freetoken.forward_context import ForwardContext
from freetoken.kernels.rope_ref import rope_inv_freq
from freetoken.layers.basic import ZeroCenteredRMSNorm
from freetoken.layers.parallel import ColumnParallelLinear, RowParallelLinear


def kv_head_range(num_kv_heads: int, parallel: ParallelContext) -> tuple[int, int]:
    """The KV heads this rank holds: an even split, or one replicated head when ranks outnumber them."""
    if num_kv_heads % parallel.world_size == 0:
        return parallel.split(num_kv_heads, "KV heads")
    if parallel.world_size % num_kv_heads == 0:
        head = parallel.rank // (parallel.world_size // num_kv_heads)
        return head, head + 1
    raise FreetokenError(f"--tensor-parallel {parallel.world_size} neither divides nor is a multiple of the KV heads ({num_kv_heads})")


class GatedAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float, eps: float, kv_index: int, parallel: ParallelContext = SINGLE,
                 mrope_section: tuple[int, ...] = ()):
        super().__init__()
        h0, h1 = parallel.split(num_heads, "attention heads")
        kv0, kv1 = kv_head_range(num_kv_heads, parallel)
        self.num_heads, self.num_kv_heads, self.head_dim = h1 - h0, kv1 - kv0, head_dim
        kv_rows = ((kv0 * head_dim, kv1 * head_dim),)
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim * 2, parallel, ((h0 * 2 * head_dim, h1 * 2 * head_dim),))
        self.k_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, parallel, kv_rows)
        self.v_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, parallel, kv_rows)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, parallel, ((h0 * head_dim, h1 * head_dim),))
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
        self.mrope_section = mrope_section  # (t, h, w) frequency counts for [3, N] positions (interleaved mRoPE)
        self.kv_index = kv_index  # which KV-cache layer this attention owns
        self.scale = head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # [q_gate | k | v] rows once merged (layers/merge.py)

    def merge_projections(self) -> None:
        """Read q (with its gate), k and v as one weight."""
        if self.qkv_weight is None:
            from freetoken.layers.merge import merge_linears

            self.qkv_weight = merge_linears([self.q_proj, self.k_proj, self.v_proj])

    def _project(self, x: torch.Tensor):
        """x [N, H] -> q_gate [N, Hq, 2D], k, v [N, Hkv, D]."""
        n = x.shape[0]
        if self.qkv_weight is None:
            q_gate, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv = self.num_kv_heads * self.head_dim
            q_gate, k, v = torch.split(kernels.linear(x, self.qkv_weight), [self.qkv_weight.shape[0] - 2 * kv, kv, kv], dim=-1)
        return q_gate.view(n, self.num_heads, 2 * self.head_dim), k.view(n, self.num_kv_heads, self.head_dim), v.view(n, self.num_kv_heads, self.head_dim)

    @property
    def input_weight(self) -> torch.Tensor | None:
        """The merged q/k/v projection (None until merged): the first GEMM of the layer's forward."""
        return self.qkv_weight

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """[rotary_dim / 2] fp32, computed once per device."""
        cached = self.__dict__.get("_inv_freq_cache")
        if cached is None or cached.device != device:
            cached = rope_inv_freq(self.rotary_dim, self.rope_theta, device=device)
            self.__dict__["_inv_freq_cache"] = cached
        return cached

    def forward(self, x: torch.Tensor, ctx: ForwardContext, defer_sum: bool = False) -> torch.Tensor:  # [N, H] -> [N, H]
        """defer_sum: o_proj's output may be its split-K partials, for the decoder's next add + norm."""
        n = x.shape[0]
        q_gate, k, v = self._project(x)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        k_cache, v_cache = ctx.kv.k[self.kv_index], ctx.kv.v[self.kv_index]
        q = kernels.norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, ctx.positions, self._inv_freq(x.device), k_cache, v_cache, ctx.slot_mapping,
                                    prefetch=kernels.l2_span(self.o_proj.weight, x, "out_proj"), mrope_section=self.mrope_section)
        out = kernels.paged_attention_batched(q, k_cache, v_cache, kernels.seq_batch(ctx), ctx.kv.block_size, self.scale, gate)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim), defer_sum=defer_sum)
