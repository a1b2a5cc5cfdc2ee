"""QSA, Qwen Sparse Attention: gated attention over the keys an indexer selects (architectures.md §4.4).

Per token the indexer projects n_i query heads and one raw key (width d_i). The raw key is cached
un-normed and un-roped, per token, in the KV pool's extra rows of this layer (same slots as K/V).
A query at position p sees n = p + 1 keys; they form floor(n / c) complete key blocks of c tokens
(c = compress_ratio) and a tail of n mod c tokens. Each block is pooled

    K_b = rope(k_layernorm(mean of its raw keys, in fp32), at the block's first position)

(in an image prompt, the (t, h, w) mRoPE position of the block's first token)

and scored sum_heads relu(q_h . K_b) / sqrt(d_i); the top min(budget / c, floor(n / c)) blocks and
the tail are the keys the query attends to (all of them while n <= budget + c - 1). The attention
is the gated attention of layers/attention.py with that key set instead of the causal prefix.

Selection and attention are `kernels.qsa_select` / `kernels.qsa_attention` (Triton, or the torch
reference kernels/qsa_ref.py, which also states the tie order and the attention's partitions and
roundings). Both take the step's batch layout and compute every row alone, so a row gets the same
bits in a prefill chunk, a decode step or a verify block. The attention multiplies its output by the
sigmoid output gate itself (its `gate`, in the merge launch; `paged_attention_batched` likewise
without an indexer). The cos/sin of every block's first position are built once per forward (`block_rope`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken import kernels
from freetoken.forward_context import ForwardContext
from freetoken.kernels.qsa_ref import selected_positions
from freetoken.layers.attention import GatedAttention
from freetoken.layers.basic import Linear, ZeroCenteredRMSNorm
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.rope import Rotary


@dataclass(frozen=True)
class Selection:
    """The indexer's choice for a step's rows: kept key blocks per row and the blocks' size."""

    block_ids: torch.Tensor  # [N, budget / c] int32, ascending, -1 padded
    counts: torch.Tensor  # [N] int32
    context_lens: torch.Tensor  # [N] keys each row sees, itself included
    ratio: int

    def positions(self) -> list[torch.Tensor]:
        """Per row the attended key positions [L] int64, ascending (host loop: for tests and inspection)."""
        counts, lens = self.counts.tolist(), self.context_lens.tolist()
        return [selected_positions(self.block_ids[r], counts[r], lens[r], self.ratio) for r in range(len(counts))]


def block_rope(ctx: ForwardContext, rotary: Rotary, ratio: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S or 1, max_blocks, rotary_dim] in dtype at the first position of every key block the
    step's block tables can hold (one row for all sequences of a text-only step; per sequence, from its
    mRoPE positions, when an image prompt is among them). Built once per forward and kept on ctx."""
    batch = kernels.seq_batch(ctx)
    key = (id(rotary), ratio, dtype)
    cached = ctx.__dict__.setdefault("_qsa_block_rope", {})
    if key in cached and cached[key][0] is ctx.seqs:
        return cached[key][1]
    max_blocks = batch.block_table.shape[1] * ctx.kv.block_size // ratio
    starts = torch.arange(max_blocks, device=batch.device) * ratio
    if all(seq.token_positions is None for seq in ctx.seqs):
        cos, sin = rotary.cos_sin(starts, dtype)
        tables = (cos[None], sin[None])
    else:
        positions = starts.expand(len(ctx.seqs), 3, max_blocks).clone()  # [S, 3, max_blocks]
        for i, seq in enumerate(ctx.seqs):
            blocks = (seq.num_cached_tokens + seq.num_rows) // ratio
            if seq.token_positions is not None and blocks:
                positions[i, :, :blocks] = seq.token_positions(0, blocks * ratio)[:, ::ratio].to(batch.device)
        cos, sin = rotary.cos_sin(positions.transpose(0, 1).reshape(3, -1), dtype)
        tables = (cos.view(len(ctx.seqs), max_blocks, -1), sin.view(len(ctx.seqs), max_blocks, -1))
    cached[key] = (ctx.seqs, tables)
    return tables


class Indexer(nn.Module):
    """Selects each query row's key blocks (a `Selection`)."""

    def __init__(self, cfg: Qwen4ExpConfig, cache_index: int, rotary: Rotary):
        super().__init__()
        self.num_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.max_blocks = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
        self.index_qk_proj = Linear(cfg.hidden_size, (self.num_heads + 1) * self.head_dim)
        self.q_layernorm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.cache_index = cache_index  # which of the KV pool's extra row tensors holds this layer's raw keys
        self.rotary = rotary

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> Selection:
        """x [N, H] (the block input) -> the rows' kept key blocks; norms and rotates the queries and
        stores the rows' raw keys first, in one `kernels.norm_rope_store` launch (no key to norm there)."""
        n = x.shape[0]
        qk = self.index_qk_proj(x)
        q = qk[:, : self.num_heads * self.head_dim].view(n, self.num_heads, self.head_dim)
        raw = ctx.kv.extra[self.cache_index]  # [num_slots, 1, d_i]
        q = kernels.norm_rope_store(q, None, qk[:, None, self.num_heads * self.head_dim :], self.q_layernorm.weight, None, self.q_layernorm.eps,
                                    ctx.positions, self.rotary.inv_freq_on(x.device), None, raw, ctx.slot_mapping,
                                    mrope_section=self.rotary.mrope_section, cos_scale=self.rotary.scale)
        batch = kernels.seq_batch(ctx)
        block_cos, block_sin = block_rope(ctx, self.rotary, self.ratio, raw.dtype)
        ids, counts = kernels.qsa_select(q, raw, self.k_layernorm.weight, self.k_layernorm.eps, block_cos, block_sin, batch,
                                         ctx.kv.block_size, self.ratio, self.max_blocks)
        return Selection(ids, counts, batch.context_lens, self.ratio)


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
        """The attention output of the block input x (defer_sum is accepted and ignored)."""
        n = x.shape[0]
        q_gate, k, v = self._project(x)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        k_cache, v_cache = ctx.kv.k[self.kv_index], ctx.kv.v[self.kv_index]
        q = kernels.norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, ctx.positions, self.rotary.inv_freq_on(x.device),
                                    k_cache, v_cache, ctx.slot_mapping, mrope_section=self.rotary.mrope_section, cos_scale=self.rotary.scale)
        batch = kernels.seq_batch(ctx)
        if self.indexer is None:
            out = kernels.paged_attention_batched(q, k_cache, v_cache, batch, ctx.kv.block_size, self.scale, gate)
        else:
            chosen = self.indexer(x, ctx)
            out = kernels.qsa_attention(q, k_cache, v_cache, chosen.block_ids, chosen.counts, batch, ctx.kv.block_size, chosen.ratio, self.scale, gate)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
