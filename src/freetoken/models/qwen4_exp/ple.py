"""PLE: hashed n-gram embeddings injected into the hyper-connection streams (architectures.md §4.3).

For a token at position t, n-gram order n in 2..N and shift s < n, tok_s is the id at t - s if no
EOS lies strictly between t - s and t (the n-gram does not reach back across a segment break), else
EOS; positions before 0 read as EOS (kernels.ple_ngram_tokens). x_n = XOR_s tok_s * mu_s, and head h
of order n looks up row (x_n mod P_h) + offset_h of one shared table (torch integer ops: multiply,
xor, remainder, elementwise and without host syncs). The layer then gates a value per stream:

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
VERIFY only reads them and stashes its gvn rows, and `commit` replays the accepted rows (their ids
are the verify step's input ids) through the same two kernels, which advance the windows as plain
decode would have. Both kernels take the step's layout as device tensors (`SeqBatch.starts`,
`counts`, `slots`, `cached`), so the layer launches the same work whatever the values: a CUDA graph
replays it.
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
        self._head_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def head_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' primes and row offsets [heads] int64 on `device`, copied there on first use (a CUDA
        graph's capture comes after eager steps, so it reads the copies and copies nothing)."""
        tables = self._head_tables.get(device)
        if tables is None:
            tables = tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (self.table_sizes, self.offsets))
            self._head_tables[device] = tables
        return tables

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, ngram_size] (column s: tok_s) -> [N, E_p]
        sizes, offsets = self.head_tables(tokens.device)
        products = [tokens[:, s] * self.multipliers[s] for s in range(self.ngram_size)]
        rows, mixed = [], products[0]
        for n in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, products[n - 1])
            heads = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            rows.append(torch.remainder(mixed[:, None], sizes[heads]) + offsets[heads])
        return self.ngram_embedding(torch.cat(rows, dim=1).flatten()).view(tokens.shape[0], -1)


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

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, S*H] -> [N, S*H]
        """The PLE term added to the streams (VERIFY: the windows are read only, the gvn rows stashed)."""
        batch = kernels.seq_batch(ctx)
        ids_pool, conv_pool = self._windows(ctx)
        verify = ctx.mode is ForwardMode.VERIFY
        tokens = kernels.ple_ngram_tokens(ids_pool, ctx.input_ids, batch, self.eos, self.ngram_size, write_state=not verify)  # [N, ngram_size]
        e = self.ple_embedding(tokens)  # [N, E_p]
        k = self.norm_key(self.key_proj(e))  # [N, S*H]
        v = self.value_proj(e)  # [N, H]
        q = self.norm_query(x)  # [N, S*H]
        gv, gvn = kernels.ple_gated_value(k, q, v, self.norm_conv.weight, self.norm_conv.eps)
        if verify:
            ctx.stash[f"ple.{self.ple_index}"] = gvn
        conv = kernels.dilated_causal_conv1d_batched(conv_pool, gvn, self.conv1d.weight[:, 0, :], batch, self.ngram_size, write_state=not verify)
        return gv + conv

    def commit(self, ctx: ForwardContext, replay: kernels.SeqBatch) -> None:
        """Advance the windows over each sequence's accepted verify rows (replay: the verify layout cut to
        them) with the forward's own kernels, as decoding those rows would have; their outputs are dropped."""
        gvn = ctx.stash[f"ple.{self.ple_index}"]
        ids_pool, conv_pool = self._windows(ctx)
        kernels.ple_ngram_tokens(ids_pool, ctx.input_ids, replay, self.eos, self.ngram_size)
        kernels.dilated_causal_conv1d_batched(conv_pool, gvn, self.conv1d.weight[:, 0, :], replay, self.ngram_size)
