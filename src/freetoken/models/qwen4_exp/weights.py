"""Canonical tensor names and shapes of Qwen3.8-Flash-Next (`qwen4_exp`), and its n-gram hash constants.

The canonical names are Hugging Face's text-model names with `model.language_model.` shortened to
`model.` (architectures.md §4.5), the MTP head at the root under `mtp.*` (§5.2). Fixed here:
- there is no `model.norm`: `model.hyper_connection_mixer.*` plays its role;
- routed experts are always fused: `experts.gate_up_proj [E, 2I, H]` (gate rows first) and
  `experts.down_proj [E, H, I]`, without `.weight`;
- each PLE layer's n-gram table is one tensor `...ple.ple_embedding.ngram_embedding.weight`
  (the checkpoint's `ngram_embedding.shard_{k}.weight` joined on dim 0 in index order);
- the three int64 PLE buffers (`layer_multipliers`, `ngram_heads_vocab_sizes`,
  `ngram_heads_offsets`) are not stored: they are functions of the config (§4.3), computed by
  `ngram_layer_multipliers` / `ngram_head_vocab_sizes` / `ngram_head_offsets` with Python ints.

Layout: `canonical_name`, `expected_tensors`, the n-gram constants, `RULES` (for the converters).
"""

from __future__ import annotations

import math
import re

from freetoken.models import layer_tensors
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.weight_rules import WeightRules

# source prefixes -> canonical prefix, tried in order (vLLM's remaps included)
PREFIX_ALIASES = (("language_model.", ""), ("model.language_model.", "model."), ("model.mtp.", "mtp."))
NGRAM_TABLE = "ple.ple_embedding.ngram_embedding.weight"
NGRAM_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_NGRAM_SHARD = re.compile(r"^(?P<table>model\.layers\.\d+\.ple\.ple_embedding\.ngram_embedding)\.shard_(?P<k>\d+)\.weight$")

_MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
PLE_SEED_STRIDE = 10007  # base_seed = seed + 10007 * ple_index


def canonical_name(hf_name: str) -> str:
    """Map a checkpoint name to its canonical name (`model.language_model.X` -> `model.X`, `model.mtp.X` -> `mtp.X`)."""
    name = hf_name
    for old, new in PREFIX_ALIASES:
        if name.startswith(old):
            name = new + name[len(old) :]
    return name


# ---------------------------------------------------------------- n-gram hash constants (§4.3)


def splitmix64(value: int) -> int:
    """One splitmix64 step (add the golden gamma, then the two xor-shift-multiply rounds), mod 2**64."""
    value = (value + SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * SPLITMIX_M2) & _MASK64
    return value ^ (value >> 31)


def multiplier_half_bound(cfg: Qwen4ExpConfig) -> int:
    """Multipliers are odd numbers below 2 * this, so that token id x multiplier stays below 2**63."""
    return max(1, ((1 << 63) - 1) // max(cfg.vocab_size, 1) // 2)


def ngram_layer_multipliers(cfg: Qwen4ExpConfig, ple_index: int) -> list[int]:
    """The `ngram_size` hash multipliers of the PLE layer at position `ple_index` of `cfg.ple_layers`."""
    base_seed = cfg.seed + PLE_SEED_STRIDE * ple_index
    half = multiplier_half_bound(cfg)
    return [2 * (splitmix64((base_seed + SPLITMIX_GAMMA * (s + 1)) & _MASK64) % half) + 1 for s in range(cfg.ngram_size)]


def is_prime(n: int) -> bool:
    """Trial division (the n-gram head sizes are primes near ngram_vocab_size_base)."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ngram_head_vocab_sizes(cfg: Qwen4ExpConfig, ple_index: int) -> list[int]:
    """Rows of each n-gram head's hash table: head g (counted over all PLE layers) gets the (g+1)-th
    prime >= ngram_vocab_size_base."""
    heads = cfg.num_ngram_heads
    first = ple_index * heads
    primes, candidate = [], cfg.ngram_vocab_size_base - 1
    for g in range(first + heads):
        candidate += 1
        while not is_prime(candidate):
            candidate += 1
        if g >= first:
            primes.append(candidate)
    return primes


def ngram_head_offsets(cfg: Qwen4ExpConfig, ple_index: int) -> list[int]:
    """First table row of each head: the running sum of the head sizes before it."""
    sizes = ngram_head_vocab_sizes(cfg, ple_index)
    return [sum(sizes[:h]) for h in range(len(sizes))]


def ngram_table_rows(cfg: Qwen4ExpConfig, ple_index: int | None = None) -> int:
    """Rows of a PLE layer's n-gram table: the head sizes' sum rounded up to
    `make_ngram_vocab_size_divisible_by`. `ple_index` may be left out when there is one PLE layer."""
    if ple_index is None:
        if len(cfg.ple_layers) != 1:
            raise ValueError(f"ngram_table_rows needs ple_index: the config has {len(cfg.ple_layers)} PLE layers")
        ple_index = 0
    d = cfg.make_ngram_vocab_size_divisible_by
    return -(-sum(ngram_head_vocab_sizes(cfg, ple_index)) // d) * d


def ngram_table_dim(cfg: Qwen4ExpConfig) -> int:
    """Width of one n-gram head's embedding (the table's row width)."""
    return cfg.ple_embed_dim // cfg.num_ngram_heads


def derived_buffers(cfg: Qwen4ExpConfig) -> dict[str, list[int]]:
    """The int64 buffers `save_pretrained` writes for each PLE layer, recomputed from the config."""
    out: dict[str, list[int]] = {}
    for ple_index, layer in enumerate(cfg.ple_layers):
        prefix = f"model.layers.{layer}.ple.ple_embedding"
        out[f"{prefix}.layer_multipliers"] = ngram_layer_multipliers(cfg, ple_index)
        out[f"{prefix}.ngram_heads_vocab_sizes"] = ngram_head_vocab_sizes(cfg, ple_index)
        out[f"{prefix}.ngram_heads_offsets"] = ngram_head_offsets(cfg, ple_index)
    return out


def ngram_shard_key(name: str) -> tuple[str, int] | None:
    """`...ngram_embedding.shard_{k}.weight` -> (`...ngram_embedding.weight`, k); None for other names."""
    m = _NGRAM_SHARD.match(name)
    return (f"{m['table']}.weight", int(m["k"])) if m else None


def declared_ngram_shards(raw_config: dict, joined: str) -> int | None:
    """`split_ngram_parts` of an HF config.json (text_config or top level), the shard count of every n-gram table."""
    text = raw_config.get("text_config") or raw_config
    parts = text.get("split_ngram_parts")
    return int(parts) if parts and joined.endswith(NGRAM_TABLE) else None


# ---------------------------------------------------------------- expected tensors


def _gated_residual(prefix: str, cfg: Qwen4ExpConfig, *, inject: bool) -> dict[str, tuple[int, ...]]:
    w, r = cfg.wide_size, cfg.hc_lowrank
    out = {
        f"{prefix}.hc_norm.weight": (w,),
        f"{prefix}.input_mix_weight_down.weight": (r, w),
        f"{prefix}.input_mix_weight_up.weight": (w, r),
    }
    if inject:
        out[f"{prefix}.block_inject_weight.weight"] = (cfg.hc_count, w)
    return out


def _attention(prefix: str, cfg: Qwen4ExpConfig) -> dict[str, tuple[int, ...]]:
    out = layer_tensors.gated_attention(prefix, cfg)
    if cfg.uses_qsa:
        d = cfg.indexer_head_dim
        out |= {
            f"{prefix}.indexer.index_qk_proj.weight": ((cfg.indexer_n_heads + 1) * d, cfg.hidden_size),  # n_i query heads, then the key
            f"{prefix}.indexer.q_layernorm.weight": (d,),
            f"{prefix}.indexer.k_layernorm.weight": (d,),
        }
    return out


def _ple(prefix: str, cfg: Qwen4ExpConfig, ple_index: int) -> dict[str, tuple[int, ...]]:
    h, w, e = cfg.hidden_size, cfg.wide_size, cfg.ple_embed_dim
    return {
        f"{prefix}.key_proj.weight": (w, e),
        f"{prefix}.value_proj.weight": (h, e),
        f"{prefix}.norm_key.weight": (w,),
        f"{prefix}.norm_query.weight": (w,),
        f"{prefix}.norm_conv.weight": (w,),
        f"{prefix}.conv1d.weight": (w, 1, cfg.ple_conv_kernel_size),
        f"{prefix}.ple_embedding.ngram_embedding.weight": (ngram_table_rows(cfg, ple_index), ngram_table_dim(cfg)),
    }


def _decoder_layer(prefix: str, layer_type: str, cfg: Qwen4ExpConfig) -> dict[str, tuple[int, ...]]:
    out = _gated_residual(f"{prefix}.attn_hyper_connection", cfg, inject=True)
    out |= _gated_residual(f"{prefix}.mlp_hyper_connection", cfg, inject=True)
    if layer_type == "full_attention":
        out |= _attention(f"{prefix}.self_attn", cfg)
    else:
        out |= layer_tensors.gated_deltanet(f"{prefix}.linear_attn", cfg)
    return out | layer_tensors.sparse_moe(f"{prefix}.mlp", cfg)


def expected_tensors(cfg: Qwen4ExpConfig, *, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the text model (and of its MTP head if `with_mtp`), with its shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    out |= _gated_residual("model.hyper_connection_mixer", cfg, inject=False)
    ple_index = {layer: k for k, layer in enumerate(cfg.ple_layers)}
    for i, layer_type in enumerate(cfg.layer_types):
        out |= _decoder_layer(f"model.layers.{i}", layer_type, cfg)
        if i in ple_index:
            out |= _ple(f"model.layers.{i}.ple", cfg, ple_index[i])
    if with_mtp:
        out |= {
            "mtp.fc_embedding.weight": (h, h),
            "mtp.fc_hidden.weight": (h, h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (cfg.wide_size,),
        }
        out |= _gated_residual("mtp.hyper_connection_mixer", cfg, inject=False)
        for j in range(max(cfg.mtp_num_hidden_layers, 1)):
            out |= _decoder_layer(f"mtp.layers.{j}", "full_attention", cfg)
    return out


RULES = WeightRules(
    canonical_name=canonical_name,
    expected_tensors=expected_tensors,
    shard_key=ngram_shard_key,
    declared_shards=declared_ngram_shards,
    derived_buffers=derived_buffers,
)
