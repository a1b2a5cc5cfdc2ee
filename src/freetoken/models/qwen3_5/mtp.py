"""The Qwen3.5 MTP draft network (architectures.md §5.1).

    u  = fc(concat[zc_norm_e(embed(x_{t+1})), zc_norm_h(h_t)])     embedding half first
    u  = one full-attention decoder layer (dense MLP or MoE, like the trunk)
    h' = zc_norm(mtp.norm)(u);  draft logits = lm_head(h')

h_t is the target's post-final-norm hidden. The layer has its own paged KV (an extra KV layer of the
pool, indexed by the target position t of the pair) and is reused for every chained step, whose
hidden input is the previous step's h'. Embeddings and lm_head are the target's.

Across ranks the head is split like the trunk: the decoder layer by heads/experts, and fc by its
input features (each rank multiplies its slice of [e ; h] and the partial sums are all-reduced).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.forward_context import ForwardContext
from freetoken.layers.basic import ZeroCenteredRMSNorm
from freetoken.layers.parallel import RowParallelLinear
from freetoken.models.qwen3_5.config import Qwen35Config


class Qwen35MTP(nn.Module):
    def __init__(self, cfg: Qwen35Config, target: nn.Module, kv_index: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        from freetoken.models.qwen3_5.model import DecoderLayer

        h = cfg.hidden_size
        self.fc = RowParallelLinear(2 * h, h, parallel, input_is_parallel=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", kv_index, parallel)])
        self.norm = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        self._target = [target]  # a plain list: the target is not a submodule of its own head

    def forward(self, ctx: ForwardContext, hidden: torch.Tensor) -> torch.Tensor:
        """ctx.input_ids [N] = x_{t+1}, hidden [N, H] = h_t, ctx.positions = t -> h' [N, H] after mtp.norm."""
        target = self._target[0]
        e = target.embed(ctx.input_ids)
        if ctx.image_embeds is not None:  # an image-pad token x_{t+1} enters as its image feature (as SGLang does)
            e = ctx.image_embeds.apply(e)
        e = self.pre_fc_norm_embedding(e)
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:  # [M, H] -> [M, V] fp32
        """The target's logits (its lm_head)."""
        return self._target[0].compute_logits(hidden, upcast)
