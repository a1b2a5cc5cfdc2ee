"""The normalized config of a `qwen4exp` (Qwen3.8-Flash-Next) GGUF, rebuilt from its metadata.

Why a module of its own: llama.cpp's converter (`conversion/qwen4exp.py`) keeps what its graph needs,
not the HF config. Most fields map one to one (table below); three PLE fields are not stored and
are recovered from the hash constants it does store (`ple.layer_multipliers`,
`ple.head_vocab_sizes`, `ple.head_offsets`), then every stored constant is checked against the
values recomputed from the rebuilt config (`models/qwen4_exp/weights.py`):
- `seed`: multiplier 0 is 2 (splitmix64(seed + gamma) mod half) + 1; splitmix64 is a bijection,
  so each preimage of the residue is inverted and the one that reproduces every multiplier is kept;
- `ngram_vocab_size_base`: head 0's size is the first prime >= base, so any base in
  (previous prime, head 0's size] gives the same tables; the roundest one (most trailing decimal
  zeros) is taken, as published configs use round bases;
- `make_ngram_vocab_size_divisible_by`: the config default when the table's row count is the
  head sizes' sum rounded up to it, else the smallest divisor of the row count that is.
The vision marker ids are the ids of Qwen's `<|vision_start|>` / `<|vision_end|>` / `<|video_pad|>`
tokens in the vocabulary. Not stored either, and taken as llama.cpp's graph runs them: the GDN output gate is sigmoid and
the routed top-k weights are renormalised. The QSA block size is the non-zero `compress_ratios`
entry of the attention layers; a file whose attention layers all carry 0 (a known converter slip
when the config's layer types read `indexed_attention`) has lost it and is refused.

Layout: `qwen4exp_config` (the entry, registered in gguf.ARCHITECTURES), `recover_seed`,
`roundest_base`, `row_divisor`, `check_hash_constants`.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import numpy as np

from freetoken.converters.gguf import GgufFile, hybrid_fields, meta_float
from freetoken.converters.gguf_tokenizer import eos_token_ids
from freetoken.errors import CheckpointError, UnsupportedModelError
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.weights import (
    PLE_SEED_STRIDE,
    SPLITMIX_GAMMA,
    SPLITMIX_M1,
    SPLITMIX_M2,
    is_prime,
    multiplier_half_bound,
    ngram_head_offsets,
    ngram_head_vocab_sizes,
    ngram_layer_multipliers,
    ngram_table_rows,
)

TABLE = "per_layer_token_embd.weight"
VISION_MARKERS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                  "video_token_id": "<|video_pad|>"}  # config id -> token
_M64 = 1 << 64


_PLACEHOLDER = Qwen4ExpConfig(  # a config for the n-gram helpers, which read only vocab_size, seed, ngram_size and the PLE fields
    vocab_size=1, hidden_size=1, num_hidden_layers=1, layer_types=("linear_attention",), num_attention_heads=1,
    num_key_value_heads=1, head_dim=1, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=1,
    linear_value_head_dim=1, num_experts=1, num_experts_per_tok=1, moe_intermediate_size=1, shared_expert_intermediate_size=0,
)


def _unxorshift(y: np.ndarray, shift: int) -> np.ndarray:
    x = y.copy()
    for _ in range(64 // shift + 1):
        x = y ^ (x >> np.uint64(shift))
    return x


def _unsplitmix64(z: np.ndarray) -> np.ndarray:
    """Inverse of weights.splitmix64 (the gamma add included), elementwise on uint64."""
    x = _unxorshift(z, 31) * np.uint64(pow(SPLITMIX_M2, -1, _M64))
    x = _unxorshift(x, 27) * np.uint64(pow(SPLITMIX_M1, -1, _M64))
    return _unxorshift(x, 30) - np.uint64(SPLITMIX_GAMMA)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """weights.splitmix64, elementwise on uint64."""
    x = x + np.uint64(SPLITMIX_GAMMA)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(SPLITMIX_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(SPLITMIX_M2)
    return x ^ (x >> np.uint64(31))


def recover_seed(multipliers: list[int], vocab_size: int, ple_index: int) -> int | None:
    """The config seed whose hash multipliers (§4.3) are `multipliers`; None when there is none."""
    probe = replace(_PLACEHOLDER, vocab_size=vocab_size, ngram_size=len(multipliers))
    half = multiplier_half_bound(probe)
    residue = (multipliers[0] - 1) // 2
    if multipliers[0] % 2 == 0 or residue >= half:
        return None
    count = (_M64 - 1 - residue) // half + 1  # splitmix64 outputs with this residue mod half
    with np.errstate(over="ignore"):
        outputs = np.uint64(residue) + np.arange(count, dtype=np.uint64) * np.uint64(half)
        base_seeds = _unsplitmix64(outputs) - np.uint64(SPLITMIX_GAMMA)  # its input is base_seed + gamma
        keep = np.ones(count, dtype=bool)
        for s, m in enumerate(multipliers[1:], start=2):
            keep &= np.uint64(2) * (_splitmix64(base_seeds + np.uint64(SPLITMIX_GAMMA * s % _M64)) % np.uint64(half)) + np.uint64(1) == np.uint64(m)
    for base_seed in sorted(int(b) for b in base_seeds[keep]):
        seed = (base_seed - PLE_SEED_STRIDE * ple_index) % _M64
        seed = seed if seed < 1 << 63 else seed - _M64
        if ngram_layer_multipliers(replace(probe, seed=seed), ple_index) == multipliers:
            return seed
    return None


def roundest_base(first_prime: int) -> int:
    """The integer in (previous prime, first_prime] with the most trailing decimal zeros (the smallest on ties)."""
    low = first_prime - 1
    while low > 1 and not is_prime(low):
        low -= 1
    return max(range(low + 1, first_prime + 1), key=lambda n: (_trailing_zeros(n), -n))


def _trailing_zeros(n: int) -> int:
    zeros = 0
    while n and n % 10 == 0:
        n, zeros = n // 10, zeros + 1
    return zeros


def row_divisor(rows: int, used: int, default: int) -> int | None:
    """A `make_ngram_vocab_size_divisible_by` that pads `used` rows to `rows`: `default` if it does,
    else the smallest that does; None if none does."""
    small = [d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0]
    fits = sorted(d for d in {*small, *(rows // d for d in small)} if 0 <= rows - used < d)
    if not fits:
        return None
    return default if default in fits else fits[0]


def _default(name: str) -> Any:
    return next(f.default for f in fields(Qwen4ExpConfig) if f.name == name)


def _qsa_fields(g: GgufFile, layer_types: list[str]) -> dict[str, int]:
    if g.key("attention.indexer.head_count") is None:
        return {}
    ratios = [int(r) for r in list(g.key("attention.compress_ratios") or [])[: len(layer_types)]]
    attention = {r for r, t in zip(ratios, layer_types) if t == "full_attention"}
    if any(r for r, t in zip(ratios, layer_types) if t != "full_attention"):
        raise CheckpointError("attention.compress_ratios sets a QSA block size on a linear-attention layer", g.path)
    if attention in (set(), {0}):
        raise UnsupportedModelError(
            "attention.compress_ratios is 0 on every attention layer, so the QSA block size is lost "
            "(llama.cpp's converter writes 0 when config.json names these layers indexed_attention); reconvert the GGUF", g.path)
    if len(attention) != 1 or 0 in attention:
        raise UnsupportedModelError(f"attention.compress_ratios {sorted(attention)} differ between attention layers (one QSA block size per model)", g.path)
    return {
        "indexer_n_heads": int(g.key("attention.indexer.head_count")),
        "indexer_kv_heads": 1,
        "indexer_head_dim": int(g.key("attention.indexer.key_length")),
        "indexer_budget": int(g.key("attention.indexer.top_k")),
        "indexer_compress_ratio": attention.pop(),
    }


def _ple_fields(g: GgufFile, vocab_size: int) -> dict[str, Any]:
    layers = [int(i) for i in list(g.key("ple.layers") or [])]
    if not layers:
        return {}
    if len(layers) > 1:
        raise UnsupportedModelError(f"ple.layers {layers}: one PLE layer per GGUF (its table is the one {TABLE})", g.path)
    if TABLE not in g.tensors:
        raise CheckpointError(f"ple.layers is set but the file has no {TABLE}", g.path)
    sizes = [int(v) for v in g.key("ple.head_vocab_sizes")]
    multipliers = [int(v) for v in g.key("ple.layer_multipliers")]
    seed = recover_seed(multipliers, vocab_size, 0)
    if seed is None:
        raise CheckpointError(f"ple.layer_multipliers {multipliers} are not the hash multipliers of any seed", g.path)
    rows, width = g.tensors[TABLE].shape
    divisor = row_divisor(rows, sum(sizes), _default("make_ngram_vocab_size_divisible_by"))
    if divisor is None:
        raise CheckpointError(f"{TABLE} has {rows} rows, but the n-gram heads need {sum(sizes)}", g.path)
    return {
        "ple_layer_ids": [i + 1 for i in layers],
        "ngram_size": int(g.key("ple.ngram_size")),
        "heads_per_ngram": int(g.key("ple.heads_per_ngram")),
        "ple_embed_dim": int(width) * len(sizes),
        "ple_conv_kernel_size": int(g.key("ple.conv_kernel", 4)),
        "seed": seed,
        "ngram_vocab_size_base": roundest_base(sizes[0]),
        "make_ngram_vocab_size_divisible_by": divisor,
    }


def _rope(g: GgufFile, head_dim: int) -> dict[str, Any]:
    sections = [int(s) for s in g.key("rope.dimension_sections", [11, 11, 10, 0])]
    rope: dict[str, Any] = {
        "rope_theta": meta_float(g.key("rope.freq_base", 1e7)),
        "partial_rotary_factor": int(g.key("rope.dimension_count", head_dim // 4)) / head_dim,
        "mrope_section": sections[:3],
        "mrope_interleaved": True,
        "rope_type": "default",
    }
    if g.key("rope.scaling.type") == "yarn":
        rope |= {"rope_type": "yarn", "factor": meta_float(g.key("rope.scaling.factor", 1.0))}
        for ours, theirs in (("original_max_position_embeddings", "rope.scaling.original_context_length"),
                             ("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow")):
            if g.key(theirs) is not None:
                rope[ours] = meta_float(g.key(theirs)) if ours.startswith("beta") else int(g.key(theirs))
    return rope


def check_hash_constants(g: GgufFile, cfg: Qwen4ExpConfig) -> None:
    """The stored PLE constants and table rows must equal those recomputed from `cfg`."""
    for key, recomputed in (("ple.layer_multipliers", ngram_layer_multipliers(cfg, 0)),
                            ("ple.head_vocab_sizes", ngram_head_vocab_sizes(cfg, 0)),
                            ("ple.head_offsets", ngram_head_offsets(cfg, 0))):
        stored = [int(v) for v in g.key(key) or []]
        if stored != recomputed:
            raise CheckpointError(f"{g.arch}.{key} is {stored}, the config rebuilt from the metadata implies {recomputed}", g.path)
    if g.tensors[TABLE].shape[0] != ngram_table_rows(cfg, 0):
        raise CheckpointError(f"{TABLE} has {g.tensors[TABLE].shape[0]} rows, the n-gram heads imply {ngram_table_rows(cfg, 0)}", g.path)


def qwen4exp_config(g: GgufFile, *, tied: bool) -> Qwen4ExpConfig:
    """Qwen4ExpConfig from the metadata of a qwen4exp GGUF (trunk depth excludes nextn); the PLE
    hash constants are checked against the rebuilt config."""
    try:
        trunk = hybrid_fields(g)
        layer_types, head_dim, vocab_size = list(trunk["layer_types"]), trunk["head_dim"], trunk["vocab_size"]
        eos = list(eos_token_ids(g.meta))
        ple_eos = g.key("ple.eos_token_id")
        if ple_eos is not None:
            eos = [int(ple_eos)] + [e for e in eos if e != int(ple_eos)]  # PLE's eos first, as HF reads it
        text = {
            "model_type": "qwen4_exp_text",
            **trunk,
            "layer_types": layer_types,
            "num_experts": int(g.key("expert_count")),
            "num_experts_per_tok": int(g.key("expert_used_count")),
            "moe_intermediate_size": int(g.key("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(g.key("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": bool(g.key("expert_weights_norm", True)),
            "output_gate_type": "sigmoid",
            "hc_count": int(g.key("hyper_connection.count")),
            "hc_lowrank": int(g.key("hyper_connection.low_rank")),
            "rope_parameters": _rope(g, head_dim),
            "rms_norm_eps": meta_float(g.key("attention.layer_norm_rms_epsilon", 1e-6)),
            "mtp_num_hidden_layers": g.nextn,
            "max_position_embeddings": int(g.key("context_length", 262144)),
            "eos_token_id": eos if len(eos) != 1 else eos[0],
            **_qsa_fields(g, layer_types),
            **_ple_fields(g, vocab_size),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"GGUF metadata incomplete for {g.arch} ({type(e).__name__}: {e})", g.path) from None
    top = {"model_type": "qwen4_exp", "text_config": text, "tie_word_embeddings": tied}
    if g.key("ple.image_token_id") is not None:
        top["image_token_id"] = int(g.key("ple.image_token_id"))
    tokens = g.meta["tokenizer.ggml.tokens"]
    for key, token in VISION_MARKERS.items():
        if token in tokens:
            top[key] = tokens.index(token)
    try:
        cfg = Qwen4ExpConfig.from_hf(top)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(str(e), g.path) from None
    if cfg.ple_layers:
        check_hash_constants(g, cfg)
    return cfg
