"""The DFlash draft network: a few Qwen3 decoder layers whose keys and values also cover the
target's context (shared/reference/dflash.md §1); a DFlash2 draft adds a convolution around each
sublayer and a candidate selector (spec/dflash/dflash2.py, reference §3).

The target exports, per position p, the outputs of its decoder layers `target_layer_ids`; `fc` then
`hidden_norm` turn their concatenation into one context vector c_p [H]. A draft step runs one block
of B slots at positions a..a+B-1 (the anchor token's embedding, then the mask token's, both from the
target's embedding table) through the layers. Queries come from the block only; keys and values
from [context rows 0..a-1, block]. A context row, K = RoPE_p(k_norm(k_proj(c_p))) and
V = v_proj(c_p) (no input_layernorm), depends on (c_p, p) alone: `context_kv` computes the rows a
draft KV cache holds. Slot j >= 1 of the output predicts the token at position a+j through the
target's lm_head.

Numerics follow the reference's transformers Qwen3 modules: linear outputs in the weight dtype,
norms in fp32 cast back before the weight, RoPE cos/sin in fp32 cast to the activation dtype; the
attention runs in fp32 and rounds its output once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import apply_rope
from freetoken.kernels.rope_ref import rope_inv_freq
from freetoken.spec.dflash.config import DFlashConfig
from freetoken.spec.dflash.dflash2 import CandidateSelector, GroupedDynamicConv


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor | None:
    """q_pos [..., Bq], k_pos [..., Nk] -> [..., Bq, Nk] bool, True where query position q_pos[i] sees
    key position k_pos[j]; None: sees all.

    Full and not causal: every key. Causal: k <= q. Sliding window W: also q - k < W, and k - q < W
    when not causal."""
    if not causal and window is None:
        return None
    d = q_pos[..., :, None] - k_pos[..., None, :]  # [..., Bq, Nk]
    keep = torch.ones_like(d, dtype=torch.bool)
    if causal:
        keep &= d >= 0
    if window is not None:
        keep &= (d < window) if causal else (d.abs() < window)
    return keep


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _empty(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """w * x / rms(x) (transformers' Qwen3RMSNorm): normalised in fp32, cast back, then times w."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = _Linear(hidden_size, intermediate_size)
        self.up_proj = _Linear(hidden_size, intermediate_size)
        self.down_proj = _Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = _Linear(h, self.num_heads * hd)
        self.k_proj = _Linear(h, self.num_kv_heads * hd)
        self.v_proj = _Linear(h, self.num_kv_heads * hd)
        self.o_proj = _Linear(self.num_heads * hd, h)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.causal, self.window = cfg.causal[layer], cfg.window(layer)
        self.scale = hd**-0.5

    def kv(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] at positions [N] -> K = RoPE(k_norm(k_proj(x))), V = v_proj(x), each [kv, N, hd]."""
        n = x.shape[0]
        k = apply_rope(self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)), positions, inv_freq)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: BlockContext, inv_freq: torch.Tensor) -> torch.Tensor:
        """b blocks' rows h [b, B, H] (normed) at positions [b, B] over keys [this layer's context rows
        (ctx), the block's own] -> [b, B, H]. Each KV head serves its group of query heads in one
        fp32 product (the heads of a group stacked as rows), without copying K and V per head."""
        b, n = h.shape[:2]
        rows = h.reshape(b * n, -1)
        q = apply_rope(self.q_norm(self.q_proj(rows).view(b * n, self.num_heads, self.head_dim)), positions.reshape(-1), inv_freq)
        k, v = (t.view(self.num_kv_heads, b, n, self.head_dim).transpose(0, 1) for t in self.kv(rows, positions.reshape(-1), inv_freq))
        kv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        k = torch.cat([ctx.keys, k], dim=2).float()  # [b, kv, n_ctx+B, hd]
        v = torch.cat([ctx.values, v], dim=2).float()
        q = q.view(b, n, kv, group, self.head_dim).permute(0, 2, 3, 1, 4).reshape(b, kv, group * n, self.head_dim).float()  # [b, kv, group*B, hd]
        scores = q @ k.transpose(2, 3) * self.scale  # [b, kv, group*B, n_ctx+B]
        hidden_keys = ctx.hidden_keys(self.causal, self.window)
        if hidden_keys is not None:
            scores = scores.view(b, kv, group, n, -1).masked_fill(hidden_keys, float("-inf")).view(b, kv, group * n, -1)
        out = (scores.softmax(dim=-1) @ v).to(h.dtype)  # [b, kv, group*B, hd]
        out = out.view(b, kv, group, n, self.head_dim).permute(0, 3, 1, 2, 4)  # [b, B, kv, group, hd]
        return self.o_proj(out.reshape(b, n, self.num_heads * self.head_dim))


@dataclass(frozen=True)
class BlockContext:
    """One draft layer's context rows for b blocks, and which keys each block query must not see
    (`masks`: one [b, 1, 1, B, n + B] bool per (causal, window) rule, True where hidden, made once
    per forward and shared by the layers of that rule; None where a query sees every key)."""

    keys: torch.Tensor  # [b, kv, n, hd]
    values: torch.Tensor  # [b, kv, n, hd]
    masks: dict[tuple[bool, int | None], torch.Tensor | None]

    def hidden_keys(self, causal: bool, window: int | None) -> torch.Tensor | None:  # -> [b, 1, 1, B, n + B] bool
        """The keys hidden from each query under this layer's rule (and the padding rows)."""
        return self.masks[(causal, window)]


def hidden_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None, causal: bool, window: int | None) -> torch.Tensor | None:
    """q_pos [b, B], k_pos [b, nk], k_valid [b, nk] bool (None: every key is a real row) -> [b, 1, 1, B, nk]
    bool, True where a query must not see a key (outside its rule, or padding); None: it sees all."""
    keep = attention_mask(q_pos, k_pos, causal, window)
    if k_valid is not None:
        keep = k_valid[:, None, :] if keep is None else keep & k_valid[:, None, :]
    return None if keep is None else ~keep[:, None, None]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.attention_conv = GroupedDynamicConv(cfg) if cfg.is_dflash2 else None
        self.mlp_conv = GroupedDynamicConv(cfg) if cfg.is_dflash2 else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: BlockContext, inv_freq: torch.Tensor) -> torch.Tensor:
        """x [b, B, H] at positions [b, B] -> [b, B, H]; ctx: this layer's context rows."""
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), positions, ctx, inv_freq)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, finishing = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, positions, ctx, inv_freq), finishing)
        h, finishing = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), finishing)


class DFlashDraft(nn.Module):
    """The draft's own tensors, named as in released checkpoints (no embedding, no lm_head)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = _Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.is_dflash2 else None

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """[head_dim / 2] fp32 RoPE frequencies over the whole head, computed once per device."""
        cached = self.__dict__.get("_inv_freq_cache")
        if cached is None or cached.device != device:
            cached = rope_inv_freq(self.config.head_dim, self.config.rope_theta, device=device)
            self.__dict__["_inv_freq_cache"] = cached
        return cached

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, n_taps * H] (the tapped layers' outputs, concatenated in
        target_layer_ids order) -> context vectors c = hidden_norm(fc(features)) [n, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context vectors [n, H] at absolute positions [n] (int64) -> every layer's context rows
        K, V [L, kv, n, hd]; row p is a function of (context[p], positions[p]) only."""
        inv_freq = self._inv_freq(context.device)
        kvs = [layer.self_attn.kv(context, positions, inv_freq) for layer in self.layers]
        return torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_positions: torch.Tensor,
                ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """b blocks at once: block_embeds [b, B, H] (the target's embeddings of [anchor, mask x (B-1)])
        at block_positions [b, B] (int64), each attending to its context rows ctx_k, ctx_v
        [L, b, kv, n, hd] at ctx_positions [b, n], of which only those with ctx_valid [b, n] (all when
        None; the rows of shorter contexts are padding) -> the normed hidden [b, B, H]; slot j >= 1
        predicts the token at block_positions[:, j] through the target's lm_head. One block alone may
        drop the b axis everywhere (embeds [B, H], ctx_k [L, kv, n, hd], ...)."""
        if block_embeds.dim() == 2:
            valid = None if ctx_valid is None else ctx_valid[None]
            return self(block_embeds[None], block_positions[None], ctx_k[:, None], ctx_v[:, None], ctx_positions[None], valid)[0]
        inv_freq = self._inv_freq(block_embeds.device)
        key_positions = torch.cat([ctx_positions, block_positions], dim=1)  # [b, n + B]
        key_valid = None if ctx_valid is None else torch.cat([ctx_valid, ctx_valid.new_ones(block_positions.shape)], dim=1)
        rules = dict.fromkeys((layer.self_attn.causal, layer.self_attn.window) for layer in self.layers)  # in layer order
        masks = {rule: hidden_keys(block_positions, key_positions, key_valid, *rule) for rule in rules}
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, block_positions, BlockContext(ctx_k[i], ctx_v[i], masks), inv_freq)
        return self.norm(x)
