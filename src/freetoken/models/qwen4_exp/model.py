"""Qwen3.8-Flash-Next (`qwen4_exp`) text model over the paged runtime (architectures.md §4).

The residual is S streams wide (hyper_connection.py): X0 = [e, e, .., e]; layer i adds its PLE term
(ple.py, on the PLE layers), then mixes with Gated DeltaNet (sigmoid output gate, layers/) or QSA
attention (qsa.py), then runs the sparse MoE block (layers/), each reading one mixed input from the
streams and writing back into all of them. There are no pre-norms and no final norm: the final
`hyper_connection_mixer` turns the streams into the lm_head input.

The engine's `hidden` for this family is the wide stream after the last decoder layer, [N, S*H]:
`forward` returns it (it is the MTP head's input h_t) and `compute_logits` applies the mixer, then
lm_head. `export_layers` returns the wide streams after the given layers, [N, n * S*H] (a DFlash
draft reads H-wide taps, so `draft_network("dflash")` refuses this family).

Beyond paged K/V and GDN state the model declares (`extra_kv_shapes`, `extra_state_specs`): the QSA
indexers' raw keys per token (one extra KV row tensor per attention layer, the MTP layer's
included, same slots as its K/V) and the PLE windows per request (ple.py).

Kernels: every op goes through `kernels`, so on CUDA (and under the interpreter with
FREETOKEN_KERNELS=triton) these run on Triton: the embedding, every linear (the hyper-connections'
merged down/inject projections and up projections, PLE key/value, GDN, attention, indexer and MoE
projections, lm_head), the norms (the grouped per-stream norms of the hyper-connections and PLE, the
MTP's pre-fc norms), the attention's q/k norms with their YaRN RoPE and the K/V store, and the
indexer's query norm with its RoPE and the raw key store (one `kernels.norm_rope_store` launch each,
qsa.py), the hyper-connections' elementwise steps (their gates,
the mean over the streams, the injection, which also normalises the sum for the next
hyper-connection: kernels/hc_triton.py), the GDN layer (convolution, recurrence with its fused input
preparation, chunked prefill, the sigmoid-gated norm), the MoE routing and experts, the PLE n-gram
token columns with their id windows, its gated value with its norm and its dilated causal
convolution, and QSA's block selection and sparse attention with its sigmoid output gate (qsa.py,
`kernels.qsa_select` / `kernels.qsa_attention`). Torch on every device: the embedding's repeat over
the streams, the PLE term's add to the residual, the cos/sin of the QSA key blocks' first positions
(once per forward, `qsa.block_rope`), and the PLE n-gram hash (integer ops).

A hyper-connection with its injection is five launches (hyper_connection.py): the merged projection,
the gates, W_up, the mean, the injection. The injection also writes the next hyper-connection's
normed input (`DecoderLayer.run`), so only the first layer, a PLE layer (its input changes before
the norm) and the final mixer launch a norm of their own.

CUDA graphs (`supports_cuda_graphs`) are behind a switch: FREETOKEN_QWEN4_GRAPHS=1 (`CUDA_GRAPHS`,
read once at import) lets the engine capture the decode and verify steps, the commit and the MTP
draft loop (engine/cuda_graph.py, spec/mtp/draft_graph.py). It is off by default because no capture
has run on a GPU yet: tests/engine/test_cuda_graph_qwen4_exp.py checks graphs against eager there, and
tests/kernels/test_qwen4_exp_static_step.py runs the step over static inputs on CPU. Nothing in the forward or the commit waits on the host:
the PLE kernels read the step's layout from the batch's device tensors (starts, counts, state slots,
cached lengths; the graphs stage them per step), the commit replays the accepted rows through the
same kernels, and the RoPE frequencies and the hash's primes and offsets are copied to the device
once, by the eager steps before any capture. Rows of image prompts run eagerly beside the graphs
(`graphs_cover_image_prompts`): QSA pools its block keys at each sequence's mRoPE positions, which
`qsa.block_rope` reads on the host. No tensor parallelism.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from freetoken import kernels
from freetoken.errors import FreetokenError, UnsupportedModelError
from freetoken.forward_context import ForwardContext, StateSpec
from freetoken.layers.basic import Embedding, Linear
from freetoken.layers.linear_attn import GatedDeltaNet
from freetoken.layers.moe import SparseMoE
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.hyper_connection import GatedResidual, inject
from freetoken.models.qwen4_exp.ops import GroupedZCRMSNorm
from freetoken.models.qwen4_exp.ple import PLELayer, ple_state_specs
from freetoken.models.qwen4_exp.qsa import QSAAttention
from freetoken.models.qwen4_exp.rope import Rotary


# Capture this family's steps in CUDA graphs (FREETOKEN_QWEN4_GRAPHS=1; read once, like kernels.MODE).
# Off by default until the GPU tests (tests/engine/test_cuda_graph_qwen4_exp.py) have passed.
CUDA_GRAPHS = os.environ.get("FREETOKEN_QWEN4_GRAPHS", "0") == "1"


def hyper_connection(cfg: Qwen4ExpConfig, inject_output: bool = True) -> GatedResidual:
    return GatedResidual(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, inject_output)


class DecoderLayer(nn.Module):
    """PLE (optional) -> attn hyper-connection -> GDN or QSA -> mlp hyper-connection -> MoE, on [N, S*H]."""

    def __init__(self, cfg: Qwen4ExpConfig, layer_type: str, mixer_index: int, rotary: Rotary, ple_index: int | None = None):
        super().__init__()
        self.ple = PLELayer(cfg, ple_index) if ple_index is not None else None
        self.attn_hyper_connection = hyper_connection(cfg)
        self.mlp_hyper_connection = hyper_connection(cfg)
        if layer_type == "full_attention":
            self.self_attn = QSAAttention(cfg, mixer_index, rotary)
        else:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, mixer_index, gate_act=cfg.output_gate_type,
            )
        self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if hasattr(self, "self_attn") else self.linear_attn

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, S*H] -> [N, S*H]
        return self.run(x, ctx)[0]

    def run(self, x: torch.Tensor, ctx: ForwardContext, xn: torch.Tensor | None = None,
            next_norm: GroupedZCRMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, S*H] -> (x after the layer [N, S*H], its norm by next_norm [N, S*H] or None).

        xn: the attn hyper-connection's norm of x, when the launch that wrote x made it (never on a
        PLE layer, which adds to x first). next_norm: the next layer's attn hyper-connection norm,
        applied in the layer's last launch (`inject`)."""
        if self.ple is not None:
            x, xn = x + self.ple(x, ctx), None
        u, weights = self.attn_hyper_connection(x, xn)
        x, xn = inject(x, self.mixer(u, ctx), weights, self.mlp_hyper_connection.hc_norm)
        u, weights = self.mlp_hyper_connection(x, xn)
        return inject(x, self.mlp(u), weights, next_norm)

    @property
    def input_norm(self) -> GroupedZCRMSNorm | None:
        """The norm of this layer's input that the layer before may apply in its last launch (none on a
        PLE layer: its input changes before the norm)."""
        return self.attn_hyper_connection.hc_norm if self.ple is None else None

    def commit(self, ctx: ForwardContext, replay: kernels.SeqBatch) -> None:
        """Fold the accepted verify rows into this layer's GDN and PLE state."""
        if hasattr(self, "linear_attn"):
            self.linear_attn.commit(ctx, replay)
        if self.ple is not None:
            self.ple.commit(ctx, replay)


class Qwen4ExpModel(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig, rotary: Rotary):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        attn_ids = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}
        gdn_ids = {layer: i for i, layer in enumerate(cfg.linear_attention_layers)}
        ple_ids = {layer: i for i, layer in enumerate(cfg.ple_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, kind, attn_ids.get(i, gdn_ids.get(i)), rotary, ple_ids.get(i)) for i, kind in enumerate(cfg.layer_types)
        )
        self.hyper_connection_mixer = hyper_connection(cfg, inject_output=False)


class Qwen4ExpForCausalLM(nn.Module):
    """The target: forward() -> the wide residual [N, S*H], compute_logits() -> fp32 logits."""

    def __init__(self, cfg: Qwen4ExpConfig, with_mtp: bool):
        super().__init__()
        from freetoken.models.qwen4_exp.mtp import Qwen4ExpMTP

        if not cfg.norm_topk_prob:
            raise UnsupportedModelError("qwen4_exp with norm_topk_prob = false is not supported (the MoE block renormalises its top-k)")
        self.config = cfg
        self.rotary = Rotary(cfg)
        self.model = Qwen4ExpModel(cfg, self.rotary)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = Qwen4ExpMTP(cfg, self, kv_index=len(cfg.full_attention_layers), rotary=self.rotary) if with_mtp else None
        self.attached_drafts: dict[str, nn.Module] = {}
        self._graphs_allowed = True  # False once something with host work per step is attached (expert offload)

    # -- CUDA graphs ---------------------------------------------------------------------------------
    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether the engine may capture the decode/verify steps and the MTP draft loop in CUDA graphs:
        with the switch on (`CUDA_GRAPHS`) and unless it was turned off (the expert offload assigns False)."""
        return CUDA_GRAPHS and self._graphs_allowed

    @supports_cuda_graphs.setter
    def supports_cuda_graphs(self, allowed: bool) -> None:
        self._graphs_allowed = bool(allowed)

    @property
    def graphs_cover_image_prompts(self) -> bool:
        """Whether a captured step may run rows of image prompts: not with QSA, whose pooled block keys
        take each sequence's mRoPE positions from the host (qsa.block_rope), which a capture would freeze."""
        return not self.config.uses_qsa

    # -- what the runtime needs to size its pools -------------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        """Attention layers holding paged KV, the MTP layer included."""
        return len(self.config.full_attention_layers) + (len(self.mtp.layers) if self.mtp is not None else 0)

    @property
    def kv_head_shape(self) -> tuple[int, int]:
        """(KV heads, head dim)."""
        return self.config.num_key_value_heads, self.config.head_dim

    @property
    def extra_kv_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token rows beside K/V: each attention layer's indexer raw key [1, d_i] (none without QSA)."""
        return ((1, self.config.indexer_head_dim),) * self.num_kv_layers if self.config.uses_qsa else ()

    @property
    def linear_state_shapes(self) -> tuple[int, tuple[int, int], tuple[int, int, int]]:
        """(number of GDN layers, conv window [K-1, C], recurrent state [Hv, Dk, Dv])."""
        cfg = self.config
        return (
            len(cfg.linear_attention_layers),
            (cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
            (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        )

    @property
    def extra_state_specs(self) -> tuple[StateSpec, ...]:
        """Per-request state beside the GDN state: the PLE windows."""
        return ple_state_specs(self.config)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def draft_network(self, name: str):
        """The MTP head for "mtp" (None without one); DFlash drafts are refused (they read H-wide layer taps)."""
        if name == "dflash":
            raise FreetokenError("--spec dflash does not run on qwen4_exp targets (their layer outputs are the S*H-wide residual)")
        return self.mtp if name == "mtp" else self.attached_drafts.get(name)

    # -- compute -------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, H]
        return self.model.embed_tokens(ids)

    def forward(self, ctx: ForwardContext, export_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the rows of ctx through the trunk -> the wide residual after the last layer [N, S*H].

        export_layers: also return the wide residual after each of these layers, concatenated in that
        order [N, n * S*H]; reading them changes no computation."""
        x = self.embed(ctx.input_ids)
        if ctx.image_embeds is not None:  # image-pad rows enter as their image features (PLE still hashes the pad ids)
            x = ctx.image_embeds.apply(x)
        x = x.repeat(1, self.config.hc_count)
        streams: dict[int, torch.Tensor] = {}
        layers = self.model.layers
        xn = None
        for i, layer in enumerate(layers):
            x, xn = layer.run(x, ctx, xn, layers[i + 1].input_norm if i + 1 < len(layers) else None)
            if i in export_layers:
                streams[i] = x
        if not export_layers:
            return x
        return x, torch.cat([streams[i] for i in export_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:  # [M, S*H] -> [M, V] fp32
        """The mixer, then lm_head; upcast=False leaves the logits in the weights' dtype."""
        return self.logits_of_mixed(self.model.hyper_connection_mixer(hidden), upcast)

    def logits_of_mixed(self, mixed: torch.Tensor, upcast: bool = True) -> torch.Tensor:  # [M, H] -> [M, V]
        """lm_head (the embedding when tied) of a mixer output; shared with the MTP head."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = kernels.linear(mixed, weight)
        return logits.float() if upcast else logits

    def commit(self, ctx: ForwardContext, accepted_rows: "list[int] | kernels.SeqBatch") -> None:
        """After a VERIFY forward: fold each sequence's first accepted_rows[i] rows into its GDN and PLE state."""
        replay = accepted_rows if isinstance(accepted_rows, kernels.SeqBatch) else kernels.seq_batch(ctx).accepted(list(accepted_rows))
        for layer in self.model.layers:
            layer.commit(ctx, replay)
