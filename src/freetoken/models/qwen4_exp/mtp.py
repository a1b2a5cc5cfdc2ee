"""The qwen4_exp MTP draft network (architectures.md §5.2).

    e    = fc_embedding(zc_norm_e(embed(x_{t+1})))                      [H]
    h    = zc_norm_h(h_t)     ONE RMS over all S*H channels (vLLM, SGLang; LightLLM normalises per stream)
    X0_s = fc_hidden(h_s) + e                                          for every stream s
    X1   = mtp.layers.0(X0)   a QSA decoder layer with its hyper-connections and MoE, no PLE
    draft logits = lm_head(mtp.hyper_connection_mixer(X1))             the target's lm_head

h_t is the target's wide residual after its last layer (before its mixer). The layer has its own
paged KV and indexer keys (the pool's last attention layer), indexed by the target position t of
the pair, and is reused for every chained step, whose hidden input is the previous step's X1.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.forward_context import ForwardContext
from freetoken.layers.basic import Linear, ZeroCenteredRMSNorm
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.rope import Rotary


class Qwen4ExpMTP(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig, target: nn.Module, kv_index: int, rotary: Rotary):
        super().__init__()
        from freetoken.models.qwen4_exp.model import DecoderLayer, hyper_connection

        h = cfg.hidden_size
        self.streams = cfg.hc_count
        self.fc_embedding = Linear(h, h)
        self.fc_hidden = Linear(h, h)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(cfg.wide_size, cfg.rms_norm_eps)
        self.hyper_connection_mixer = hyper_connection(cfg, inject_output=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", kv_index, rotary)])
        self._target = [target]  # a plain list: the target is not a submodule of its own head

    def forward(self, ctx: ForwardContext, hidden: torch.Tensor) -> torch.Tensor:
        """ctx.input_ids [N] = x_{t+1}, hidden [N, S*H] = h_t (or the previous step's output), ctx.positions = t
        -> X1 [N, S*H], the layer's wide output."""
        n, h = hidden.shape[0], self._target[0].config.hidden_size
        e = self._target[0].embed(ctx.input_ids)
        if ctx.image_embeds is not None:  # an image-pad token x_{t+1} enters as its image feature
            e = ctx.image_embeds.apply(e)
        e = self.fc_embedding(self.pre_fc_norm_embedding(e))  # [N, H]
        streams = self.fc_hidden(self.pre_fc_norm_hidden(hidden).reshape(n * self.streams, h)).view(n, self.streams, h)
        x = (streams + e[:, None, :]).reshape(n, self.streams * h)
        for layer in self.layers:
            x = layer(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:  # [M, S*H] -> [M, V] fp32
        """The head's own mixer, then the target's lm_head."""
        return self._target[0].logits_of_mixed(self.hyper_connection_mixer(hidden), upcast)
