"""Qwen3.5 dense and MoE text model over the paged runtime.

Parameter names are the canonical (Hugging Face text-model) names, so loading is a name-for-name
copy. Layer i mixes with Gated DeltaNet or gated attention (config.layer_types), then a dense MLP or
the sparse MoE block; the final zero-centred norm gives the hidden state that feeds lm_head and the
MTP head.

With a ParallelContext of N ranks every rank holds its shard of each layer (layers/parallel.py):
heads, experts and the vocabulary are split, norms and routers replicated; the hidden state between
layers is whole and bitwise the same on every rank, and compute_logits gathers the full vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.forward_context import ForwardContext
from freetoken.layers.attention import GatedAttention, kv_head_range
from freetoken.layers.basic import MLP, ZeroCenteredRMSNorm
from freetoken.layers.linear_attn import GatedDeltaNet
from freetoken.kernels.batched import SeqBatch
from freetoken.layers.moe import SparseMoE
from freetoken.layers.parallel import ColumnParallelLinear, VocabParallelEmbedding
from freetoken.models.qwen3_5.config import Qwen35Config


def make_mlp(cfg: Qwen35Config, parallel: ParallelContext = SINGLE) -> nn.Module:
    if cfg.is_moe:
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, parallel)
    return MLP(cfg.hidden_size, cfg.intermediate_size, parallel)


def make_attention(cfg: Qwen35Config, kv_index: int, parallel: ParallelContext = SINGLE) -> GatedAttention:
    return GatedAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps, kv_index, parallel,
                          cfg.mrope_section)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, layer_type: str, mixer_index: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_type == "full_attention":
            self.self_attn = make_attention(cfg, mixer_index, parallel)
        else:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, mixer_index, parallel=parallel,
            )
        self.mlp = make_mlp(cfg, parallel)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, H] -> [N, H]
        out, residual = self.forward_residual(x, None, ctx)
        return residual + out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, defer_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its residual adds fused into the norms that follow them.

        The layer's input is x + residual (x alone when residual is None); returns (mlp output,
        residual stream before the MLP's add), whose sum is the layer's output. defer_output: the
        mlp output may be left unfinished (a MoE block's `PendingCombine`, a dense MLP's down
        partials `PendingSplitK`), for the caller's `add_norm` only."""
        return self.mix(*self.enter(x, residual), ctx, defer_output)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if hasattr(self, "self_attn") else self.linear_attn

    def enter(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's input stream x + residual, its input norm) [N, H] each: the first half of forward_residual."""
        if residual is None:
            return x, self.input_layernorm(x)
        # the add + norm launch prefetches the mixer's input projection into L2 (kernels.l2_span)
        return add_norm(x, residual, self.input_layernorm, kernels.l2_span(self.mixer.input_weight, residual, "input"))

    def mix(self, residual: torch.Tensor, h: torch.Tensor, ctx: ForwardContext, defer_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixer and the MLP over the entered stream (`enter`) -> forward_residual's (mlp output, residual)."""
        # The mixer may leave its output projection's split-K sum to the add + norm that follows it; the
        # MoE block fuses that add + norm into its routing (and may leave its combine to the next one).
        return self.mlp.add_norm_forward(self.mixer(h, ctx, defer_sum=True), residual, self.post_attention_layernorm, defer_output)


def add_norm(x: torch.Tensor, residual: torch.Tensor, norm: ZeroCenteredRMSNorm, prefetch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual)) in one pass; [N, H] each (x may be a layer's unfinished output:
    kernels.add_zc_rms_norm; the launch queues `prefetch`, a kernels.l2_span)."""
    return kernels.add_zc_rms_norm(x, residual, norm.weight, norm.eps, prefetch)


class Qwen35Model(nn.Module):
    def __init__(self, cfg: Qwen35Config, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        attn_ids = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}
        gdn_ids = {layer: i for i, layer in enumerate(cfg.linear_attention_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, kind, attn_ids.get(i, gdn_ids.get(i)), parallel) for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    """The target: forward() -> post-norm hidden states, compute_logits() -> fp32 logits."""

    def __init__(self, cfg: Qwen35Config, with_mtp: bool, parallel: ParallelContext = SINGLE):
        super().__init__()
        from freetoken.models.qwen3_5.mtp import Qwen35MTP

        self.config = cfg
        self.parallel = parallel
        self.model = Qwen35Model(cfg, parallel)
        if not cfg.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, parallel)
        self.mtp = Qwen35MTP(cfg, self, kv_index=len(cfg.full_attention_layers), parallel=parallel) if with_mtp else None
        self.attached_drafts: dict[str, nn.Module] = {}  # family-agnostic drafts (DFlash), set by whoever loads one

    # -- what the runtime needs to size its pools -------------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        """Full-attention layers holding paged KV, draft layers included."""
        return len(self.config.full_attention_layers) + (len(self.mtp.layers) if self.mtp is not None else 0)

    @property
    def kv_head_shape(self) -> tuple[int, int]:
        """(KV heads this rank holds, head dim)."""
        kv0, kv1 = kv_head_range(self.config.num_key_value_heads, self.parallel)
        return kv1 - kv0, self.config.head_dim

    @property
    def linear_state_shapes(self) -> tuple[int, tuple[int, int], tuple[int, int, int]]:
        """(number of GDN layers, conv window [K-1, C], recurrent state [Hv, Dk, Dv]) of this rank's heads."""
        cfg, w = self.config, self.parallel.world_size
        return (
            len(cfg.linear_attention_layers),
            (cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim // w),
            (cfg.linear_num_value_heads // w, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def draft_network(self, name: str):
        """The draft network of a spec method: the family's own MTP head, or a family-agnostic draft
        attached to the model (`attached_drafts`); None if the checkpoint has none."""
        return self.mtp if name == "mtp" else self.attached_drafts.get(name)

    # -- compute -------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, H]
        return self.model.embed_tokens(ids)

    def forward(self, ctx: ForwardContext, export_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the rows of ctx through the trunk -> post-norm hidden [N, H].

        export_layers: also return the outputs of these decoder layers (after both residual adds, as
        the residual stream carries them into the next layer), concatenated in that order [N, n * H];
        reading them changes no computation."""
        x, residual = self.embed(ctx.input_ids), None
        if ctx.image_embeds is not None:
            x = ctx.image_embeds.apply(x)
        streams: dict[int, torch.Tensor] = {}  # layer -> its output
        for i, layer in enumerate(self.model.layers):
            residual, h = layer.enter(x, residual)
            if i - 1 in export_layers:
                streams[i - 1] = residual
            x, residual = layer.mix(residual, h, ctx, defer_output=True)
        streams[len(self.model.layers) - 1], hidden = add_norm(x, residual, self.model.norm)
        if not export_layers:
            return hidden
        return hidden, torch.cat([streams[i] for i in export_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:  # [M, H] -> [M, V] fp32
        """Logits over the whole vocabulary (each rank's slice gathered in rank order); upcast=False
        leaves them in the weights' dtype (for an argmax alone: it is the same)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        from freetoken import kernels

        logits = kernels.linear(hidden, weight)
        return self.parallel.all_gather(logits.float() if upcast else logits)

    def commit(self, ctx: ForwardContext, accepted_rows: list[int] | SeqBatch) -> None:
        """After a VERIFY forward: fold each sequence's first accepted_rows[i] rows into its GDN state.

        accepted_rows is a list of counts or the replay batch itself (the verify's layout cut to
        those counts; a CUDA graph passes one whose counts live in a static device buffer)."""
        from freetoken import kernels

        replay = accepted_rows if isinstance(accepted_rows, kernels.SeqBatch) else kernels.seq_batch(ctx).accepted(list(accepted_rows))
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.commit(ctx, replay)
