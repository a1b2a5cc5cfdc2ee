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

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import apply_rope
from freetoken.kernels.rope_ref import rope_inv_freq
from freetoken.spec.dflash.config import DFlashConfig
from freetoken.spec.dflash.dflash2 import CandidateSelector, GroupedDynamicConv


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor | None:
    """[Bq, Nk] bool, True where query position q_pos[i] sees key position k_pos[j]; None: sees all.

    Full and not causal: every key. Causal: k <= q. Sliding window W: also q - k < W, and k - q < W
    when not causal."""
    if not causal and window is None:
        return None
    d = q_pos[:, None] - k_pos[None, :]  # [Bq, Nk]
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

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Block rows h [B, H] (normed) at positions [B] over keys [context ctx_k/ctx_v [kv, n, hd] at
        ctx_positions [n], block] -> [B, H]."""
        b = h.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(h).view(b, self.num_heads, self.head_dim)), positions, inv_freq)
        k, v = self.kv(h, positions, inv_freq)
        k = torch.cat([ctx_k, k], dim=1).float().repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)  # [heads, n+B, hd]
        v = torch.cat([ctx_v, v], dim=1).float().repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)
        scores = q.transpose(0, 1).float() @ k.transpose(1, 2) * self.scale  # [heads, B, n+B]
        mask = attention_mask(positions, torch.cat([ctx_positions, positions]), self.causal, self.window)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = (scores.softmax(dim=-1) @ v).to(h.dtype)  # [heads, B, hd]
        return self.o_proj(out.transpose(0, 1).reshape(b, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.attention_conv = GroupedDynamicConv(cfg) if cfg.is_dflash2 else None
        self.mlp_conv = GroupedDynamicConv(cfg) if cfg.is_dflash2 else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """x [B, H] -> [B, H]; the context rows of this layer ctx_k, ctx_v [kv, n, hd]."""
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_positions, inv_freq)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, finishing = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, positions, ctx_k, ctx_v, ctx_positions, inv_freq), finishing)
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

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_positions: torch.Tensor) -> torch.Tensor:
        """One block: block_embeds [B, H] (the target's embeddings of [anchor, mask x (B-1)]) at
        block_positions [B] (int64), attending to the context rows ctx_k, ctx_v [L, kv, n, hd] at
        ctx_positions [n] -> the normed hidden [B, H]; slot j >= 1 predicts the token at
        block_positions[j] through the target's lm_head."""
        inv_freq = self._inv_freq(block_embeds.device)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, block_positions, ctx_k[i], ctx_v[i], ctx_positions, inv_freq)
        return self.norm(x)
