"""The memory-bandwidth floor of a decode step: the bytes it must move, part by part (DESIGN.md).

A decode step of batch B at context length n reads (MTP head excluded, as in every bench floor):
- every weight once, except: the embedding only its B looked-up rows (the whole table too when it is
  the tied lm_head), the routed experts only min(E, B * top_k) of their E experts' rows (every
  token's top-k experts taken as distinct), and a PLE n-gram table only the B * heads rows its hash
  looks up (one per n-gram head and token, whatever the table's size);
- per attention layer and request the K/V rows it attends to: all n without QSA; with QSA the
  selected blocks and the tail, min(n, budget + n mod c), plus the indexer's raw keys of the
  floor(n / c) complete blocks it pools and scores;
- per request the linear-state pool's slot, read and written back: each GDN layer's conv window (model
  dtype) and recurrent state (fp32), and each PLE layer's id and gvn windows.

Parts are named `<kind>.<part>`, kind being where the bytes sit: `model` (once per step),
`linear_attention` or `full_attention` (summed over the layers of that kind) or `ple` (summed over the
PLE layers), so a floor measured on the first N layers scales to the full depth kind by kind;
`meta_model` builds the full config's model on the meta device, where the same count runs exactly.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _weight_part(name: str, p: torch.Tensor, cfg, batch_size: int) -> tuple[str, str, int]:
    """(kind, part, bytes read per decode step) of parameter `name`."""
    size = p.numel() * p.element_size()
    m = _LAYER.match(name)
    kind = "model" if m is None else ("ple" if ".ple." in name else cfg.layer_types[int(m[1])])
    if name == "model.embed_tokens.weight":
        rows = batch_size * p.shape[1] * p.element_size()
        return kind, "embedding_rows", rows + (size if cfg.tie_word_embeddings else 0)
    if name.endswith("ple_embedding.ngram_embedding.weight"):
        return kind, "ngram_rows", batch_size * cfg.num_ngram_heads * p.shape[1] * p.element_size()
    if ".mlp.experts." in name:
        active = min(cfg.num_experts, batch_size * cfg.num_experts_per_tok)
        return kind, "routed_experts", size * active // cfg.num_experts
    return kind, "weights", size


def attended_keys(cfg, context_len: int) -> int:
    """K/V rows one query at context length n attends to: n, or under QSA at most budget + n mod c."""
    if not getattr(cfg, "uses_qsa", False):
        return context_len
    return min(context_len, cfg.indexer_budget + context_len % cfg.indexer_compress_ratio)


def decode_floor_parts(model: torch.nn.Module, cfg, batch_size: int, context_len: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes a decode step of `model` (this rank's shard) must move at least, by `<kind>.<part>`; their
    sum is the floor."""
    parts: Counter[str] = Counter()
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue
        kind, part, size = _weight_part(name, p, cfg, batch_size)
        parts[f"{kind}.{part}"] += size
    attention_layers = len(cfg.full_attention_layers)
    if attention_layers:
        kv_heads, head_dim = model.kv_head_shape  # this rank's
        parts["full_attention.kv"] = attention_layers * batch_size * attended_keys(cfg, context_len) * kv_heads * head_dim * 2 * dtype_bytes
        if getattr(cfg, "uses_qsa", False):
            pooled = context_len // cfg.indexer_compress_ratio * cfg.indexer_compress_ratio
            parts["full_attention.indexer_keys"] = attention_layers * batch_size * pooled * cfg.indexer_head_dim * dtype_bytes
    gdn_layers, conv_shape, recurrent_shape = model.linear_state_shapes
    if gdn_layers:
        parts["linear_attention.conv_window"] = 2 * gdn_layers * batch_size * math.prod(conv_shape) * dtype_bytes
        parts["linear_attention.recurrent_state"] = 2 * gdn_layers * batch_size * math.prod(recurrent_shape) * 4
    for spec in getattr(model, "extra_state_specs", ()):  # the PLE windows (qwen4_exp/ple.py ple_state_specs)
        itemsize = spec.dtype.itemsize if spec.dtype is not None else dtype_bytes
        parts[f"ple.{spec.name.removeprefix('ple_')}_window"] = 2 * spec.num_layers * batch_size * math.prod(spec.shape) * itemsize
    return dict(sorted(parts.items()))


def layer_counts(cfg) -> dict[str, int]:
    """Decoder layers per kind of floor part (`ple`: the layers with a PLE block)."""
    return {"linear_attention": len(cfg.linear_attention_layers), "full_attention": len(cfg.full_attention_layers),
            "ple": len(getattr(cfg, "ple_layers", ()))}


def meta_model(cfg, family: str, dtype: torch.dtype, parallel=None) -> torch.nn.Module:
    """The model of `cfg` (this rank's shard) on the meta device, without the MTP head: parameters with
    shapes and dtypes but no memory, so a shape's full depth can be counted whatever its size."""
    from freetoken.distributed.context import SINGLE
    from freetoken.models.registry import family_module

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return family_module(family).build(cfg.to_dict(), False, parallel or SINGLE)
    finally:
        torch.set_default_dtype(previous)


def ngram_table_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's (first) PLE n-gram table; None without PLE."""
    for name, p in model.named_parameters():
        if name.endswith("ple_embedding.ngram_embedding.weight"):
            return p.shape[0]
    return None
