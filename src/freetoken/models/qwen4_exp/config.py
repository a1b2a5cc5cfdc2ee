"""Normalized config of Qwen3.8-Flash-Next (`model_type` qwen4_exp, text `qwen4_exp_text`).

`Qwen4ExpConfig.from_hf` reads a Hugging Face config.json (image-text with `text_config`, or text
only) and checks the architecture's invariants as transformers does (architectures.md §4.1): hyper
connections (hc_count residual streams, a rank-hc_lowrank mixer), PLE n-gram embeddings on the
1-indexed `ple_layer_ids` (linear-attention layers only), QSA on every attention layer when the
indexer fields are set (all five or none; one indexer key head; the budget a multiple of the
compress ratio; the attention's rotary dims within the indexer head), the sparse MoE block on
every layer. QSA layers may be written `full_attention`, `indexed_attention` or
`qwen_sparse_attention`; here they are `full_attention`. The unified manifest stores `to_dict()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.errors import UnsupportedModelError
from freetoken.models.config_base import HybridLayout, ManifestConfig

MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
ATTENTION_NAMES = ("full_attention", "indexed_attention", "qwen_sparse_attention")
GATE_ACTIVATIONS = ("sigmoid", "silu")
ROPE_TYPES = ("default", "mrope", "yarn")
INDEXER_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclass(frozen=True)
class Qwen4ExpConfig(ManifestConfig, HybridLayout):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" (QSA when the indexer is set)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    linear_conv_kernel_dim: int = 4
    norm_topk_prob: bool = True
    output_gate_type: str = "silu"  # the GDN output gate's activation (`output_gate_type or hidden_act`)
    # hyper-connections
    hc_count: int = 4  # residual streams S
    hc_lowrank: int = 320  # rank of the stream mixer
    # PLE n-gram embeddings
    ple_layer_ids: tuple[int, ...] = ()  # 1-indexed decoder layers with PLE, sorted
    ple_embed_dim: int = 0  # concat width of all n-gram heads
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    # QSA indexer (None: the attention layers are dense)
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    # RoPE (text positions: mRoPE reduces to 1-D RoPE)
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    rope_type: str = "default"  # "default" | "yarn"
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float | None = None  # None: transformers' default 0.1 ln(factor) + 1
    yarn_truncate: bool = True  # round the correction range outwards (transformers' `truncate`)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()  # the first one is PLE's eos (segment breaks, pad rows)
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    video_token_id: int | None = None
    model_type: str = "qwen4_exp"

    # -- derived -------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return True

    @property
    def uses_qsa(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """0-indexed decoder layers with PLE, in order (their position here is the layer's ple_index)."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def wide_size(self) -> int:
        """Width of the residual: S streams of hidden_size."""
        return self.hc_count * self.hidden_size

    @property
    def num_ngram_heads(self) -> int:
        """Hashed n-gram heads of a PLE layer: (ngram_size - 1) orders x heads_per_ngram."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    # -- from Hugging Face ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen4ExpConfig":
        """Normalize a Hugging Face config.json dict (top level, possibly with `text_config`); an
        UnsupportedModelError names the first invariant a config breaks."""
        top = config
        text = dict(config.get("text_config") or config)
        model_type = top.get("model_type") or text.get("model_type")
        if model_type not in MODEL_TYPES:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r} (supported: qwen4_exp)")
        n_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        layer_types = ["full_attention" if t in ATTENTION_NAMES else t for t in layer_types]
        if len(layer_types) != n_layers or any(t not in ("linear_attention", "full_attention") for t in layer_types):
            raise UnsupportedModelError(f"layer_types {text.get('layer_types')!r} do not fit num_hidden_layers={n_layers}")

        rope = dict(text.get("rope_parameters") or top.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if rope_type == "yarn" and (rope.get("mscale") or rope.get("mscale_all_dim")):
            raise UnsupportedModelError("YaRN with mscale / mscale_all_dim is not supported (set attention_factor instead)")
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        partial = float(rope.get("partial_rotary_factor", 0.25))

        hidden_act = str(text.get("hidden_act", "silu"))
        gate_act = str(text.get("output_gate_type") or hidden_act)
        if gate_act not in GATE_ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported output_gate_type {gate_act!r} (supported: sigmoid, silu)")
        hc_count = int(text.get("hc_count", 4))
        if hc_count <= 1:
            raise UnsupportedModelError(f"hc_count must be > 1, got {hc_count}")
        num_experts, top_k = int(text.get("num_experts", 512)), int(text.get("num_experts_per_tok", 10))
        if num_experts <= 0 or not 0 < top_k <= num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {num_experts}]")

        indexer = {name: text.get(name) for name in INDEXER_FIELDS}
        if any(v is not None for v in indexer.values()):
            missing = [name for name, v in indexer.items() if v is None]
            if missing:
                raise UnsupportedModelError(f"QSA config is missing {', '.join(missing)}")
            if any(int(v) <= 0 for v in indexer.values()):
                raise UnsupportedModelError(f"QSA config values must be positive: {indexer}")
            if int(indexer["indexer_kv_heads"]) != 1:
                raise UnsupportedModelError(f"QSA needs indexer_kv_heads = 1, got {indexer['indexer_kv_heads']}")
            if int(indexer["indexer_budget"]) % int(indexer["indexer_compress_ratio"]):
                raise UnsupportedModelError("indexer_budget must be a multiple of indexer_compress_ratio")
            if int(head_dim * partial) > int(indexer["indexer_head_dim"]):
                raise UnsupportedModelError(f"the attention's rotary dims {int(head_dim * partial)} exceed indexer_head_dim {indexer['indexer_head_dim']}")

        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        hidden = int(text["hidden_size"])
        ple_ids = tuple(sorted(set(int(i) for i in (text.get("ple_layer_ids") or ()))))
        ngram_size, heads_per_ngram = int(text.get("ngram_size", 3)), int(text.get("heads_per_ngram", 8))
        ple_embed_dim = int(text.get("ple_embed_dim") or hidden)
        if ple_ids:
            heads = (ngram_size - 1) * heads_per_ngram
            if heads <= 0 or ple_embed_dim <= 0 or ple_embed_dim % heads:
                raise UnsupportedModelError(f"ple_embed_dim {ple_embed_dim} is not a positive multiple of the {heads} n-gram heads")
            bad = [i for i in ple_ids if not 1 <= i <= n_layers or layer_types[i - 1] != "linear_attention"]
            if bad:
                raise UnsupportedModelError(f"ple_layer_ids {bad} are not linear-attention layers in [1, {n_layers}]")
            if not eos_ids:
                raise UnsupportedModelError("PLE layers need eos_token_id")

        factor = float(rope.get("factor", 1.0))
        original = rope.get("original_max_position_embeddings")
        tie = bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=head_dim,
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 512)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            output_gate_type=gate_act,
            hc_count=hc_count,
            hc_lowrank=int(text.get("hc_lowrank", 320)),
            ple_layer_ids=ple_ids,
            ple_embed_dim=ple_embed_dim,
            ple_conv_kernel_size=int(text.get("ple_conv_kernel_size", 4)),
            ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram,
            ngram_vocab_size_base=int(text.get("ngram_vocab_size_base", 20_000_000)),
            make_ngram_vocab_size_divisible_by=int(text.get("make_ngram_vocab_size_divisible_by", 128)),
            seed=int(text.get("seed", 1234)),
            **{name: (None if v is None else int(v)) for name, v in indexer.items()},
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e7))),
            partial_rotary_factor=partial,
            mrope_section=tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10))),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            rope_type="yarn" if rope_type == "yarn" else "default",
            yarn_factor=factor,
            yarn_original_max_position_embeddings=None if original is None else int(original),
            yarn_beta_fast=float(rope.get("beta_fast", 32.0)),
            yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
            yarn_attention_factor=None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
            yarn_truncate=bool(rope.get("truncate", True)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_act=hidden_act,
            tie_word_embeddings=tie,
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            eos_token_ids=eos_ids,
            image_token_id=top.get("image_token_id"),
            vision_start_token_id=top.get("vision_start_token_id"),
            vision_end_token_id=top.get("vision_end_token_id"),
            video_token_id=top.get("video_token_id"),
        )
