"""QSA (Qwen Sparse Attention) key selection and sparse paged attention (reference).

architectures.md §4.4. A query row that sees n keys of its sequence splits them into floor(n / c)
complete *key blocks* of c = ratio tokens (block b holds positions b*c .. b*c + c - 1) and a tail
of n mod c tokens. Each block is pooled from the indexer's raw keys (cached per token slot,
un-normed and un-roped):

    K_b = rope(k_norm(mean of its c raw keys in fp32, in index order, cast to the cache dtype),
               at the block's first position)

and scored sum_heads relu(q_h . K_b) / sqrt(d_i) in fp32. The row keeps `top_blocks` blocks
(budget / c) or all of them while there are no more; the tail is always attended.

Selection order: the score's fp32 bits, -0.0 taken as +0.0, as an int32 key (scores are >= +0, so
the key orders like the score). The kept blocks are those whose key is above the top_blocks-th
largest key, then the blocks whose key equals it, lowest block index first. `score_keys` gives the
key; the Triton selection (qsa_select_triton.py) keeps the same blocks.

Layouts shared with the kernels:
- block ids [N, top_blocks] int32: each row's kept blocks ascending, padded with -1; counts [N] int32.
- block_cos / block_sin [S or 1, max_blocks, rotary_dim]: cos/sin (cache dtype) of block b's first
  position for sequence s (one row for all sequences when positions are plain token indices).
- raw keys [num_slots, d_i] (or [num_slots, 1, d_i]): the paged extra KV rows, slot = page * page
  size + offset through the sequence's block table.

Attention over a row's *key list*: its kept blocks' tokens in ascending block order, then the tail.
The list is cut into PARTITION-wide partitions counted from its start; for each partition p the
scores s = (q . k) * scale are fp32, m_p is their max, l_p the fp32 sum of e = exp(s - m_p), and the
partition's output e . V is taken with e rounded to the cache dtype (as torch's attention rounds the
probabilities; a no-op for fp32 caches), accumulated in fp32. The merge weighs partition p by
w_p = exp(m_p - max m) and adds w_p * l_p and w_p * (e . V) up MERGE_PARTS partitions at a time, in
order p = 0, 1, ...; the output is the sum of outputs divided by the sum of l. The Triton kernels
(qsa_attention_triton.py) take the same steps with the same roundings; they differ only in the
order of fp32 sums (the dots, a partition's sum, the sum over a merge step) and in exp's last bits.
Given the attention's output gate, the output rounded to q's dtype is multiplied by sigmoid(gate)
rounded to that dtype (the merge kernel's last step).

Each row is computed alone (its scores, top-k, partitions and merge have shapes set by its own
context), so it gets the same bits whichever rows share the call.
"""

from __future__ import annotations

import math

import torch

from freetoken.kernels import activation_ref, norm_ref
from freetoken.kernels.attention_ref import token_slots
from freetoken.kernels.batched import SeqBatch

PARTITION = 32  # keys per partition of a row's key list (the Triton kernel's too)
MERGE_PARTS = 16  # partitions the merge adds up per step (the Triton kernel's too)


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores (>= +0 or -0) -> int32 keys that order like them, -0.0 mapped to +0.0's key 0."""
    keys = scores.float().contiguous().view(torch.int32)
    return torch.where(keys == torch.iinfo(torch.int32).min, torch.zeros_like(keys), keys)


def top_blocks_of(keys: torch.Tensor, keep: int) -> torch.Tensor:
    """keys [B] -> the `keep` kept block ids ascending (module docstring: larger key first, on equal
    keys the lower block index)."""
    order = torch.sort(keys, descending=True, stable=True).indices
    return order[:keep].sort().values


def pooled_blocks(raw_keys: torch.Tensor, slots: torch.Tensor, num_blocks: int, ratio: int, k_norm_weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """K_b [num_blocks, d_i] in the cache dtype of a sequence whose token slots are `slots`; cos/sin
    [>= num_blocks, rotary_dim] at the blocks' first positions."""
    d = raw_keys.shape[-1]
    keys = raw_keys.reshape(-1, d)[slots[: num_blocks * ratio]].view(num_blocks, ratio, d).float()
    acc = keys[:, 0]
    for j in range(1, ratio):
        acc = acc + keys[:, j]
    pooled = (acc / ratio).to(raw_keys.dtype)
    normed = norm_ref.zc_rms_norm(pooled, k_norm_weight, eps)
    rot = cos.shape[-1]
    cos, sin = cos[:num_blocks], sin[:num_blocks]
    x_rot, x_pass = normed[:, :rot], normed[:, rot:]
    rotated = torch.cat([-x_rot[:, rot // 2 :], x_rot[:, : rot // 2]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def qsa_select(
    q: torch.Tensor,  # [N, H, d_i] the indexer's normed, rotated query heads
    raw_keys: torch.Tensor,  # [num_slots, d_i] or [num_slots, 1, d_i]
    k_norm_weight: torch.Tensor,  # [d_i] the zero-centred k_layernorm weight
    eps: float,
    block_cos: torch.Tensor,  # [S or 1, max_blocks, rotary_dim]
    block_sin: torch.Tensor,  # [S or 1, max_blocks, rotary_dim]
    batch: SeqBatch,
    page_size: int,
    ratio: int,
    top_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept key blocks -> (block ids [N, top_blocks] int32 ascending, -1 padded; counts [N] int32)."""
    n, _, d = q.shape
    ids = torch.full((n, top_blocks), -1, dtype=torch.int32, device=q.device)
    counts = torch.zeros(n, dtype=torch.int32, device=q.device)
    for i in range(batch.num_seqs):
        cached, rows = batch.num_cached[i], batch.num_rows[i]
        blocks = None  # pooled once per sequence, for the rows that need them
        for j in range(rows):
            row, complete = batch.row_starts[i] + j, (cached + j + 1) // ratio
            keep = min(top_blocks, complete)
            counts[row] = keep
            if keep == complete:
                ids[row, :keep] = torch.arange(keep, dtype=torch.int32, device=q.device)
                continue
            if blocks is None:
                slots = token_slots(batch.block_tables[i], cached + rows, page_size)
                s = i if block_cos.shape[0] > 1 else 0
                blocks = pooled_blocks(raw_keys, slots, (cached + rows) // ratio, ratio, k_norm_weight, eps, block_cos[s], block_sin[s]).float()
            scores = torch.relu(torch.matmul(q[row].float(), blocks[:complete].T))  # [H, complete]
            ids[row] = top_blocks_of(score_keys(scores.sum(0) / math.sqrt(d)), keep).to(torch.int32)
    return ids, counts


def selected_positions(block_ids: torch.Tensor, count: int, context_len: int, ratio: int) -> torch.Tensor:
    """One row's attended positions [L] int64 ascending: its kept blocks' tokens, then the tail."""
    offsets = torch.arange(ratio, device=block_ids.device)
    tokens = (block_ids[:count].long()[:, None] * ratio + offsets).flatten()
    return torch.cat([tokens, torch.arange((context_len // ratio) * ratio, context_len, device=block_ids.device)])


def partitioned_attention(
    q: torch.Tensor,  # [Hq, D] one row's query heads
    keys: torch.Tensor,  # [L, Hkv, D] the row's key list, cache dtype
    values: torch.Tensor,  # [L, Hkv, D]
    scale: float,
) -> torch.Tensor:
    """One row's softmax attention over its key list, partition by partition and merged in order
    (module docstring) -> [Hq, D] fp32."""
    num_keys, num_kv_heads, d = keys.shape
    group = q.shape[0] // num_kv_heads
    parts = -(-num_keys // PARTITION)
    pad = parts * PARTITION - num_keys
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D] cache dtype
    scores = torch.matmul(k, q.float()[:, :, None]).squeeze(-1) * scale  # [Hq, L]
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(-1, parts, PARTITION)
    v = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(-1, parts, PARTITION, d)
    m = scores.amax(-1)  # [Hq, parts]: every partition holds a key
    e = torch.exp(scores - m[..., None])
    sums = e.sum(-1)  # [Hq, parts]
    outs = torch.matmul(e.to(values.dtype)[:, :, None, :].float(), v.float()).squeeze(2)  # [Hq, parts, D]
    w = torch.exp(m - m.amax(-1, keepdim=True))
    norm = torch.zeros(q.shape[0], dtype=torch.float32, device=q.device)
    total = torch.zeros(q.shape[0], d, dtype=torch.float32, device=q.device)
    for p0 in range(0, parts, MERGE_PARTS):
        step = slice(p0, p0 + MERGE_PARTS)
        norm = norm + (w[:, step] * sums[:, step]).sum(-1)
        total = total + (w[:, step, None] * outs[:, step]).sum(1)
    return total / norm[:, None]


def qsa_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_ids: torch.Tensor,  # [N, top_blocks] int32 (qsa_select's)
    counts: torch.Tensor,  # [N] int32
    batch: SeqBatch,
    page_size: int,
    ratio: int,
    scale: float,
    gate: torch.Tensor | None = None,  # [N, Hq, D]: the output is multiplied by sigmoid(gate)
) -> torch.Tensor:
    """Each row's softmax attention over its key list (`partitioned_attention`) in its sequence's paged
    caches -> [N, Hq, D] in q.dtype; with a gate, that output times sigmoid(gate) (activation_ref's,
    rounded to q.dtype), the product rounded to q.dtype."""
    out = torch.empty_like(q)
    counts = counts.tolist()
    for i in range(batch.num_seqs):
        cached, rows = batch.num_cached[i], batch.num_rows[i]
        slots = token_slots(batch.block_tables[i], cached + rows, page_size)
        for j in range(rows):
            row = batch.row_starts[i] + j
            keys_at = slots[selected_positions(block_ids[row], counts[row], cached + j + 1, ratio)]
            attended = partitioned_attention(q[row], k_cache[keys_at], v_cache[keys_at], scale).to(q.dtype)
            out[row] = attended if gate is None else attended * activation_ref.sigmoid(gate[row])
    return out
