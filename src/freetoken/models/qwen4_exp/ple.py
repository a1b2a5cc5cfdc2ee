"""PLE: hashed n-gram embeddings injected into the hyper-connection streams (architectures.md §4.3).

For a token at position t, n-gram order n in 2..N and shift s < n, tok_s is the id at t - s if no
EOS lies strictly between t - s and t (the n-gram does not reach back across a segment break), else
EOS; positions before 0 read as EOS. x_n = XOR_s tok_s * mu_s, and head h of order n looks up row
(x_n mod P_h) + offset_h of one shared table. The layer then gates a value per stream:

    k = norm_key(key_proj e) [S, H]    v = value_proj e [H]    q = norm_query(X) [S, H]
    g_s = <k_s, q_s> / sqrt(H);  g_s <- sign(g_s) sqrt(max(|g_s|, 1e-6))
    gv  = [sigmoid(g_s) v]_s;    gvn = norm_conv(gv)                 (kernels.ple_gated_value)
    PLE(X) = gv + silu(causal depthwise conv of gvn: K taps, dilation N, no bias)   (kernels.dilated_causal_conv1d_batched)

The multipliers mu, the primes P_h and the offsets are recomputed from the config (weights.py, as
transformers' `_build_layer_multipliers`, `_find_nth_prime_after`); they are plain Python numbers,
not tensors of the checkpoint.

State per request and PLE layer (the linear-state pool's extra states): the last N-1 raw ids
("ple_ids") and the last (K-1)*N gvn rows ("ple_conv"). A window entry for a position before 0 is
never read as stored: ids there read as EOS and gvn rows as zero. EXTEND advances the windows;
VERIFY only reads them and stashes its gvn rows, and `commit` appends each sequence's accepted rows
(their ids are the verify step's input ids), as plain decode would have.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.forward_context import ForwardContext, ForwardMode, StateSpec
from freetoken.layers.basic import Embedding, Linear, _empty
from freetoken.models.qwen4_exp import ops
from freetoken.models.qwen4_exp import weights
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig

def ple_state_specs(cfg: Qwen4ExpConfig) -> tuple[StateSpec, ...]:
    """The pool entries of the PLE layers' windows (none without PLE)."""
    if not cfg.ple_layers:
        return ()
    n = len(cfg.ple_layers)
    return (
        StateSpec("ple_ids", n, (cfg.ngram_size - 1,), torch.int64),
        StateSpec("ple_conv", n, ((cfg.ple_conv_kernel_size - 1) * cfg.ngram_size, cfg.wide_size)),
    )


class NGramEmbedding(nn.Module):
    """The hashed lookup: ids of each row's n-gram window -> the concatenated head rows [N, E_p]."""

    def __init__(self, cfg: Qwen4ExpConfig, ple_index: int):
        super().__init__()
        self.ngram_size, self.heads_per_ngram = cfg.ngram_size, cfg.heads_per_ngram
        self.multipliers = weights.ngram_layer_multipliers(cfg, ple_index)
        self.table_sizes = weights.ngram_head_vocab_sizes(cfg, ple_index)
        self.offsets = weights.ngram_head_offsets(cfg, ple_index)
        self.ngram_embedding = Embedding(weights.ngram_table_rows(cfg, ple_index), weights.ngram_table_dim(cfg))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, ngram_size] (column s: tok_s) -> [N, E_p]
        device = tokens.device
        sizes = torch.tensor(self.table_sizes, dtype=torch.int64, device=device)
        offsets = torch.tensor(self.offsets, dtype=torch.int64, device=device)
        products = [tokens[:, s] * self.multipliers[s] for s in range(self.ngram_size)]
        rows, mixed = [], products[0]
        for n in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, products[n - 1])
            heads = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            rows.append(torch.remainder(mixed[:, None], sizes[heads]) + offsets[heads])
        return self.ngram_embedding(torch.cat(rows, dim=1).flatten()).view(tokens.shape[0], -1)


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


class PLELayer(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig, ple_index: int):
        super().__init__()
        h, wide, e = cfg.hidden_size, cfg.wide_size, cfg.ple_embed_dim
        self.ngram_size, self.eos = cfg.ngram_size, cfg.ple_eos_token_id
        self.kernel_size = cfg.ple_conv_kernel_size
        self.ple_index = ple_index  # this layer's row of the PLE state pools
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = Linear(e, wide)
        self.value_proj = Linear(e, h)
        self.norm_key = ops.GroupedZCRMSNorm(wide, h, cfg.rms_norm_eps)
        self.norm_query = ops.GroupedZCRMSNorm(wide, h, cfg.rms_norm_eps)
        self.norm_conv = ops.GroupedZCRMSNorm(wide, h, cfg.rms_norm_eps)
        self.conv1d = nn.Module()
        self.conv1d.weight = _empty(wide, 1, self.kernel_size)

    def _windows(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's id windows [slots, N-1] and gvn windows [slots, (K-1)*N, S*H]."""
        extra = ctx.linear_state.extra
        return extra["ple_ids"][self.ple_index], extra["ple_conv"][self.ple_index]

    def _tokens(self, ctx: ForwardContext, ids_pool: torch.Tensor, batch: kernels.SeqBatch) -> torch.Tensor:
        """[N, ngram_size] tok_s of every row; the id windows advance in EXTEND mode."""
        history = self.ngram_size - 1
        out = []
        for i in range(batch.num_seqs):
            rows, cached, slot = batch.rows(i), batch.num_cached[i], batch.state_slots[i]
            past = ids_pool[slot]
            before_start = torch.arange(cached - history, cached, device=past.device) < 0
            window = torch.cat([torch.where(before_start, self.eos, past), ctx.input_ids[rows]])
            out.append(ngram_tokens(window, self.eos, self.ngram_size))
            if ctx.mode is ForwardMode.EXTEND:
                past.copy_(window[window.shape[0] - history :])
        return torch.cat(out)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, S*H] -> [N, S*H]
        """The PLE term added to the streams (VERIFY: the windows are read only, the gvn rows stashed)."""
        batch = kernels.seq_batch(ctx)
        ids_pool, conv_pool = self._windows(ctx)
        e = self.ple_embedding(self._tokens(ctx, ids_pool, batch))  # [N, E_p]
        k = self.norm_key(self.key_proj(e))  # [N, S*H]
        v = self.value_proj(e)  # [N, H]
        q = self.norm_query(x)  # [N, S*H]
        gv, gvn = kernels.ple_gated_value(k, q, v, self.norm_conv.weight, self.norm_conv.eps)
        verify = ctx.mode is ForwardMode.VERIFY
        if verify:
            ctx.stash[f"ple.{self.ple_index}"] = gvn
        conv = kernels.dilated_causal_conv1d_batched(conv_pool, gvn, self.conv1d.weight[:, 0, :], batch, self.ngram_size, write_state=not verify)
        return gv + conv

    def commit(self, ctx: ForwardContext, replay: kernels.SeqBatch) -> None:
        """Append each sequence's accepted verify rows (replay: the verify layout cut to them) to its windows."""
        gvn = ctx.stash[f"ple.{self.ple_index}"]
        ids_pool, conv_pool = self._windows(ctx)
        for i in range(replay.num_seqs):
            rows, slot = replay.rows(i), replay.state_slots[i]
            ids, conv = ids_pool[slot], conv_pool[slot]
            ids.copy_(torch.cat([ids, ctx.input_ids[rows]])[-ids.shape[0] :])
            conv.copy_(torch.cat([conv, gvn[rows]])[-conv.shape[0] :])
