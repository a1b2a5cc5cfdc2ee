"""The QSA indexer (models/qwen4_exp/qsa.py, through kernels.qsa_select) against a per-row reading of
architectures.md §4.4: for each query row alone, pool its sequence's complete key blocks from the
cached raw keys (fp32 mean in index order, k_layernorm, RoPE at the block's first position, mRoPE
for an image prompt), score sum_heads relu(q_h . K_b) / sqrt(d_i), keep the top budget / c blocks
(equal scores: the lower block first) and the tail. Tiny random configs with budget 8 and blocks of
4: a prefill turning sparse, a decode row, a verify block of 4 rows, a chunk after a cached prefix
with mRoPE positions; fp32 and bf16."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.forward_context import ForwardContext, ForwardMode, KVCache, SeqRows
from freetoken.kernels.attention_ref import token_slots
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.qsa import Indexer
from freetoken.models.qwen4_exp.rope import Rotary

PAGE = 4
ROWS, CACHED = [14, 1, 4, 5], [0, 30, 23, 17]  # per sequence


def tiny_config() -> Qwen4ExpConfig:
    return Qwen4ExpConfig(
        vocab_size=16, hidden_size=32, num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
        indexer_compress_ratio=4, mrope_section=(3, 3, 2),
    )


def image_positions(start: int, n: int) -> torch.Tensor:
    """(t, h, w) positions [3, n] of an image-like prompt: the three axes differ."""
    p = torch.arange(start, start + n)
    return torch.stack([p, p // 3 + 5, p % 7])


def indexer_case(dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """An Indexer with random weights, a step's rows x [N, H] over sequences with cached prefixes (their
    raw keys random in the pool), the step's context and the rows' cos/sin."""
    gen = torch.Generator().manual_seed(seed)
    cfg = tiny_config()
    rotary = Rotary(cfg)
    indexer = Indexer(cfg, 0, rotary)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 1.0))
    indexer = indexer.to(dtype).to(device)
    pages = [-(-(c + n) // PAGE) for c, n in zip(CACHED, ROWS)]
    order = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    seqs, row, used = [], 0, 0
    for i, (n, c) in enumerate(zip(ROWS, CACHED)):
        table = order[used : used + pages[i]].to(device)
        seqs.append(SeqRows(row, n, c, table, -1, token_positions=image_positions if i == 3 else None))
        row, used = row + n, used + pages[i]
    raw = torch.randn(sum(pages) * PAGE, 1, cfg.indexer_head_dim, generator=gen).to(dtype).to(device)
    slot_mapping = torch.cat([token_slots(s.block_table, s.num_cached_tokens + s.num_rows, PAGE)[s.num_cached_tokens :] for s in seqs])
    positions = torch.cat([image_positions(s.num_cached_tokens, s.num_rows) if s.token_positions else
                           torch.arange(s.num_cached_tokens, s.num_cached_tokens + s.num_rows).expand(3, -1) for s in seqs], dim=1).to(device)
    ctx = ForwardContext(ForwardMode.EXTEND, torch.zeros(row, dtype=torch.int64, device=device), positions, slot_mapping, seqs,
                         KVCache([], [], PAGE, [raw]), None)
    x = torch.randn(row, cfg.hidden_size, generator=gen).to(dtype).to(device)
    cos, sin = rotary.cos_sin(positions, dtype)
    return indexer, x, ctx, cos, sin


def per_row_selection(indexer: Indexer, x: torch.Tensor, ctx: ForwardContext, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """§4.4 row by row -> per row its attended positions (ascending); reads the raw keys the step stored."""
    c, d, heads = indexer.ratio, indexer.head_dim, indexer.num_heads
    q = indexer.index_qk_proj(x)[:, : heads * d].reshape(-1, heads, d)
    q = indexer.rotary.apply(indexer.q_layernorm(q), cos, sin)
    raw = ctx.kv.extra[0]
    selected = []
    for seq in ctx.seqs:
        slots = token_slots(seq.block_table, seq.num_cached_tokens + seq.num_rows, PAGE)
        for j in range(seq.num_rows):
            visible = seq.num_cached_tokens + j + 1
            complete = visible // c
            keep = min(indexer.max_blocks, complete)
            if keep == complete:
                selected.append(torch.arange(visible, device=x.device))
                continue
            keys = raw[slots[: complete * c], 0].view(complete, c, d).float()
            pooled = keys[:, 0]
            for i in range(1, c):
                pooled = pooled + keys[:, i]
            pooled = (pooled / c).to(raw.dtype)
            starts = torch.arange(complete, device=x.device) * c
            if seq.token_positions is not None:
                starts = seq.token_positions(0, complete * c)[:, ::c].to(x.device)
            block_cos, block_sin = indexer.rotary.cos_sin(starts, raw.dtype)
            blocks = indexer.rotary.apply(indexer.k_layernorm(pooled)[:, None, :], block_cos, block_sin)[:, 0].float()
            scores = torch.relu(q[seq.row_start + j].float() @ blocks.T).sum(0) / math.sqrt(d)
            top = torch.sort(scores, descending=True, stable=True).indices[:keep].sort().values
            tokens = (top[:, None] * c + torch.arange(c, device=x.device)).flatten()
            selected.append(torch.cat([tokens, torch.arange(complete * c, visible, device=x.device)]))
    return selected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_indexer_matches_per_row_reading(dtype):
    indexer, x, ctx, cos, sin = indexer_case(dtype)
    got = indexer(x, ctx).positions()
    want = per_row_selection(indexer, x, ctx, cos, sin)
    assert len(got) == len(want) == sum(ROWS)
    for row, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), row
    lens = ctx.seqs[0].num_cached_tokens + torch.arange(1, ROWS[0] + 1)
    assert sum(len(w) < n for w, n in zip(want, lens.tolist())) == 3, "the prefill's rows from 12 keys on select"
    assert all(len(w) < CACHED[i] for i, w in ((1, want[ROWS[0]]), (3, want[-1]))), "the decode row and the image chunk select"
