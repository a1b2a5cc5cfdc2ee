"""QSA, Qwen Sparse Attention: gated attention over the keys an indexer selects (architectures.md §4.4).

Per token the indexer projects n_i query heads and one raw key (width d_i). The raw key is cached
un-normed and un-roped, per token, in the KV pool's extra rows of this layer (same slots as K/V).
A query at position p sees n = p + 1 keys; they form floor(n / c) complete blocks of c tokens
(c = compress_ratio) and a tail of n mod c tokens. Each block is pooled

    K_b = rope(k_layernorm(mean of its raw keys, in fp32), at the block's first position)

(in an image prompt, the (t, h, w) mRoPE position of the block's first token)

and scored sum_heads relu(q_h . K_b) / sqrt(d_i); the top min(budget / c, floor(n / c)) blocks and
the tail are the keys the query attends to (all of them while n <= budget + c - 1). The attention
is the gated attention of layers/attention.py with that key set instead of the causal prefix.

Every query row is computed alone (its scores, top-k and softmax have shapes set by its position
only), so a row gets the same bits in a prefill chunk, a decode step or a verify block. Torch only:
the model runs its reference path.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from freetoken import kernels
from freetoken.forward_context import ForwardContext, SeqRows
from freetoken.kernels.attention_ref import store_kv, token_slots
from freetoken.layers.attention import GatedAttention
from freetoken.layers.basic import Linear, ZeroCenteredRMSNorm
from freetoken.models.qwen4_exp import ops
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.ops import mean_over
from freetoken.models.qwen4_exp.rope import Rotary


class Indexer(nn.Module):
    """Selects each query row's keys -> per row, the positions it attends to (ascending)."""

    def __init__(self, cfg: Qwen4ExpConfig, cache_index: int, rotary: Rotary):
        super().__init__()
        self.num_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.max_blocks = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
        self.index_qk_proj = Linear(cfg.hidden_size, (self.num_heads + 1) * self.head_dim)
        self.q_layernorm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.cache_index = cache_index  # which of the KV pool's extra row tensors holds this layer's raw keys
        self.rotary = rotary

    def _pooled_blocks(self, raw: torch.Tensor, slots: torch.Tensor, num_blocks: int, seq: SeqRows) -> torch.Tensor:
        """The first num_blocks complete blocks of a sequence's raw keys (at slots) -> K_b [num_blocks, d_i],
        each rotated at the position of its first token (an image prompt's mRoPE position there)."""
        keys = raw[slots[: num_blocks * self.ratio], 0].view(num_blocks, self.ratio, self.head_dim)
        pooled = mean_over(keys.float(), dim=1).to(raw.dtype)
        starts = torch.arange(num_blocks, device=raw.device) * self.ratio
        if seq.token_positions is not None:
            starts = seq.token_positions(0, num_blocks * self.ratio)[:, :: self.ratio].to(raw.device)  # [3, num_blocks]
        cos, sin = self.rotary.cos_sin(starts, raw.dtype)
        return self.rotary.apply(self.k_layernorm(pooled)[:, None, :], cos, sin)[:, 0]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """x [N, H] (the block input), cos/sin [N, rotary_dim] of the rows' positions -> per row the
        selected key positions [L] int64 (ascending); stores the rows' raw keys first."""
        n = x.shape[0]
        qk = self.index_qk_proj(x)
        q = qk[:, : self.num_heads * self.head_dim].reshape(n, self.num_heads, self.head_dim)
        q = self.rotary.apply(self.q_layernorm(q), cos, sin)
        raw = ctx.kv.extra[self.cache_index]  # [num_slots, 1, d_i]
        raw[ctx.slot_mapping] = qk[:, None, self.num_heads * self.head_dim :].to(raw.dtype)
        batch = kernels.seq_batch(ctx)
        selected: list[torch.Tensor] = []
        for i in range(batch.num_seqs):
            cached, rows = batch.num_cached[i], batch.num_rows[i]
            slots = token_slots(batch.block_tables[i], cached + rows, ctx.kv.block_size)
            blocks = None  # pooled once per sequence and step, for the rows that need them
            for j in range(rows):
                visible = cached + j + 1
                complete = visible // self.ratio
                keep = min(self.max_blocks, complete)
                if keep == complete:
                    selected.append(torch.arange(visible, device=x.device))
                    continue
                if blocks is None:
                    blocks = self._pooled_blocks(raw, slots, (cached + rows) // self.ratio, ctx.seqs[i]).float()
                scores = torch.relu(torch.matmul(q[batch.row_starts[i] + j].float(), blocks[:complete].T))  # [heads, blocks]
                top = (scores.sum(0) / math.sqrt(self.head_dim)).topk(keep).indices.sort().values
                tokens = (top[:, None] * self.ratio + torch.arange(self.ratio, device=x.device)).flatten()
                selected.append(torch.cat([tokens, torch.arange(complete * self.ratio, visible, device=x.device)]))
        return selected


def selected_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext, selected: list[torch.Tensor] | None, scale: float) -> torch.Tensor:
    """q [N, Hq, D]: each row's softmax attention over its selected positions (None: its causal prefix)
    of its sequence's paged caches [num_slots, Hkv, D] -> [N, Hq, D] in q.dtype."""
    batch = kernels.seq_batch(ctx)
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(batch.num_seqs):
        cached, rows = batch.num_cached[i], batch.num_rows[i]
        slots = token_slots(batch.block_tables[i], cached + rows, ctx.kv.block_size)
        for j in range(rows):
            row = batch.row_starts[i] + j
            keys_at = slots[: cached + j + 1] if selected is None else slots[selected[row]]
            keys = k_cache[keys_at].float().repeat_interleave(group, dim=1).transpose(0, 1).contiguous()  # [Hq, L, D]
            values = v_cache[keys_at].float().repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
            probs = torch.softmax(torch.matmul(keys, q[row].float()[:, :, None]).squeeze(-1) * scale, dim=-1)  # [Hq, L]
            out[row] = torch.matmul(probs[:, None, :], values).squeeze(1).to(q.dtype)
    return out


class QSAAttention(GatedAttention):
    """Gated attention (q/k/v/o projections, q/k norms, sigmoid output gate) with YaRN-capable RoPE and,
    when the config has an indexer, QSA key selection."""

    def __init__(self, cfg: Qwen4ExpConfig, kv_index: int, rotary: Rotary):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
                         cfg.rope_theta, cfg.rms_norm_eps, kv_index)
        self.rotary = rotary
        if cfg.uses_qsa:
            self.indexer = Indexer(cfg, kv_index, rotary)
        else:
            self.indexer = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, defer_sum: bool = False) -> torch.Tensor:  # [N, H] -> [N, H]
        """The attention output of the block input x (defer_sum is accepted and ignored: torch path)."""
        n = x.shape[0]
        q_gate, k, v = self._project(x)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        q = self.rotary.apply(self.q_norm(q), cos, sin)
        k = self.rotary.apply(self.k_norm(k), cos, sin)
        k_cache, v_cache = ctx.kv.k[self.kv_index], ctx.kv.v[self.kv_index]
        store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        selected = self.indexer(x, ctx, cos, sin) if self.indexer is not None else None
        out = selected_attention(q, k_cache, v_cache, ctx, selected, self.scale)
        out = out * ops.sigmoid(gate.reshape(n, -1)).view_as(gate)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
