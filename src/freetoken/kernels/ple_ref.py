"""The PLE layer's own ops (reference): its n-gram token columns, its gated value and its dilated
causal convolution (models/qwen4_exp/ple.py, architectures.md §4.3).

    tok_s of a row at position t = id[t - s] if no EOS lies at positions t - s + 1 .. t - 1, else EOS
    (s = 0 .. ngram_size - 1; positions before 0 read as EOS; the ids before a sequence's first row
    come from its window of the last ngram_size - 1 ids)
    g_s = <k_s, q_s> / sqrt(H)  (fp32 sum, rounded to the input dtype);  g_s <- sign(g_s) sqrt(max(|g_s|, 1e-6))
    gv  = [sigmoid(g_s) v]_s  [N, S*H];   gvn = grouped zero-centred RMSNorm of gv (one RMS per stream)
    out = silu(sum_j w[:, j] * x[t - (K-1-j) * dilation])   over window ++ rows, fp32, j = 0..K-1 in order

The convolution's window holds the (K-1) * dilation rows before a sequence's first row; entries of
positions before 0 read as zero.
"""

from __future__ import annotations

import math

import torch

from freetoken.kernels import activation_ref, norm_ref
from freetoken.kernels.batched import SeqBatch


def gated_value(k: torch.Tensor, q: torch.Tensor, v: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """k, q [N, S*H] (normed key and query streams), v [N, H], norm_weight [S*H] -> gv, gvn [N, S*H] in v.dtype."""
    n, h = v.shape
    s = k.shape[1] // h
    g = ((k.float().view(n, s, h) * q.float().view(n, s, h)).sum(-1) / math.sqrt(h)).to(v.dtype)  # [N, S]
    g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
    gv = (activation_ref.sigmoid(g)[:, :, None] * v[:, None, :]).reshape(n, s * h)
    return gv, norm_ref.grouped_zc_rms_norm(gv, norm_weight, h, eps)


def dilated_causal_conv1d_batched(windows: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, batch: SeqBatch, dilation: int,
                                  write_state: bool = True) -> torch.Tensor:
    """silu(dilated causal depthwise conv) of rows [N, C] after each sequence's window (the pool [slots,
    (K-1) * dilation, C]; weight [C, K]) -> [N, C] in rows.dtype; the windows advance if write_state."""
    span, kernel_size = windows.shape[1], weight.shape[1]
    w = weight.float()
    out = torch.empty_like(rows)
    for i in range(batch.num_seqs):
        n, cached = batch.num_rows[i], batch.num_cached[i]
        if n == 0:
            continue
        rows_i, past = rows[batch.rows(i)], windows[batch.state_slots[i]]
        before_start = (torch.arange(cached - span, cached, device=rows.device) < 0)[:, None]
        full = torch.cat([past.masked_fill(before_start, 0), rows_i.to(past.dtype)])  # [span + n, C]
        acc = full[0:n].float() * w[:, 0]
        for j in range(1, kernel_size):
            acc = acc + full[j * dilation : j * dilation + n].float() * w[:, j]
        out[batch.rows(i)] = activation_ref.silu(acc).to(rows.dtype)
        if write_state:
            past.copy_(full[n:])
    return out


def ngram_tokens(window: torch.Tensor, eos: int, ngram_size: int) -> torch.Tensor:
    """window [W + n] ids (EOS before position 0; the last n are the rows) -> [n, ngram_size]: tok_s of each row."""
    m = window.shape[0]
    n = m - (ngram_size - 1)
    pos = torch.arange(m, device=window.device)
    eos_at = torch.where(window == eos, pos, -1)
    last_eos_before = torch.cat([eos_at.new_full((1,), -1), torch.cummax(eos_at, dim=0).values[:-1]])
    in_segment = pos - last_eos_before - 1  # tokens of the row's segment before it
    rows = pos[m - n :]
    cols = []
    for s in range(ngram_size):
        source = (rows - s).clamp(min=0)
        valid = (in_segment[rows] >= s) & (rows - s >= 0)
        cols.append(torch.where(valid, window[source], torch.full_like(window[source], eos)))
    return torch.stack(cols, dim=1)


def ngram_tokens_batched(windows: torch.Tensor, ids: torch.Tensor, batch: SeqBatch, eos: int, ngram_size: int, write_state: bool = True) -> torch.Tensor:
    """tok_s of every row [N, ngram_size] int64 from the step's ids [N] after each sequence's window
    (the pool [slots, ngram_size - 1] of its last ids); if write_state the windows advance to the last
    ngram_size - 1 ids (entries of positions before 0 written as EOS; a sequence without rows keeps its window)."""
    history = windows.shape[1]
    out = ids.new_empty((ids.shape[0], ngram_size))
    for i in range(batch.num_seqs):
        n, cached = batch.num_rows[i], batch.num_cached[i]
        if n == 0:
            continue
        past = windows[batch.state_slots[i]]
        before_start = torch.arange(cached - history, cached, device=past.device) < 0
        window = torch.cat([torch.where(before_start, eos, past), ids[batch.rows(i)]])
        out[batch.rows(i)] = ngram_tokens(window, eos, ngram_size)
        if write_state:
            past.copy_(window[window.shape[0] - history :])
    return out
