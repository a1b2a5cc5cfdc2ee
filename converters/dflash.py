"""DFlash and DFlash2 draft directories (`config.json` + `model.safetensors`, as z-lab releases them) -> the `dflash.*` part of a unified checkpoint.

A DFlash draft has no embedding and no lm_head of its own (it borrows the target's) and reads the
hidden states of some target layers, so it is converted together with its target:
`read_dflash(draft_dir, target_config)` validates the draft's config and safetensors header against
the target's normalized config before any weight is read, and returns a `DFlashDraft` whose
`attach` adds the draft to the target's tensors, draft heads and provenance. The draft's tensors
keep their names under the prefix `dflash.`; the manifest entry `draft_heads["dflash"]` is
`DFlashConfig.to_dict()` (spec/dflash/config.py).

Config keys the `dflash` package reads from `dflash_config` first, then from the top level
(`block_size`, `mask_token_id`, `target_layer_ids`, and DFlash2's `conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k`), are read the same way here
(`../shared/reference/dflash.md` §1.1, §3). A DFlash2 draft's selector codebooks have one row per
token of the target's vocabulary.

Layout: build_target_layer_ids, config parsing (`_draft_config` and its helpers),
tensor checks (`expected_tensors`, `_validate_tensors`), DFlashDraft, read_dflash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from freetoken.checkpoint import Provenance, SourceFile, hash_file, read_safetensors_header
from freetoken.converters.detect import resolve_source
from freetoken.converters.hf import _first, _load_json
from freetoken.errors import CheckpointError, FreetokenError, UnsupportedModelError
from freetoken.spec.dflash.config import ARCHITECTURES, LAYER_TYPES, DFlashConfig

PREFIX = "dflash."
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_BLOCK_SIZE = 16  # the dflash package's default
DEFAULT_ROPE_THETA = 10000.0  # transformers' default_theta, which Qwen3Config falls back to
DEFAULT_HEAD_DIM = 128  # Qwen3Config's default
DEFAULT_RMS_NORM_EPS = 1e-6  # Qwen3Config's default
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The dflash package's default taps: n ids spread evenly over [1, T-3], or T//2 for one layer.

    Reimplemented from `build_target_layer_ids` in the `dflash` package's `model.py`
    (`../shared/reference/dflash.md` §1.1), with the same rounding (Python's `round`, half to even).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ---------------------------------------------------------------- config


def _or_default(raw: dict, key: str, default: Any) -> Any:
    return raw[key] if raw.get(key) is not None else default


def draft_value(raw: dict, key: str, default: Any = None) -> Any:
    """`dflash_config[key]` if present, else the top-level `key`, else `default` (the package's lookup order)."""
    nested = raw.get("dflash_config") or {}
    if isinstance(nested, dict) and nested.get(key) is not None:
        return nested[key]
    return _or_default(raw, key, default)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _architecture(raw: dict, path: Path) -> str:
    """DFlashDraftModel or DFlash2DraftModel, on a Qwen3 backbone."""
    architectures = raw.get("architectures") or []
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    if name not in ARCHITECTURES:
        raise CheckpointError(f"not a DFlash draft (architectures {architectures!r}, expected one of {list(ARCHITECTURES)})", path)
    if raw.get("model_type") != "qwen3":
        raise UnsupportedModelError(f"unsupported DFlash backbone model_type {raw.get('model_type')!r} (expected 'qwen3')", path)
    return name


def _rope_theta(raw: dict, path: Path) -> float:
    """The RoPE base; anything but default RoPE over the whole head is refused."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointError("rope_parameters / rope_scaling must be objects", path)
    if any(k in LAYER_TYPES for k in params):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported", path)
    for field, entry in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"{field} rope type {rope_type!r} is not supported (only default RoPE)", path)
        if entry.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"{field} partial_rotary_factor {entry['partial_rotary_factor']!r} is not supported", path)
    theta = _or_default(params, "rope_theta", _or_default(raw, "rope_theta", DEFAULT_ROPE_THETA))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"rope_theta must be a positive number, got {theta!r}", path)
    return float(theta)


def _layer_types(raw: dict, num_layers: int, path: Path) -> tuple[str, ...]:
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or not all(t in LAYER_TYPES for t in layer_types):
        raise CheckpointError(f"layer_types {layer_types!r} must list {num_layers} of {', '.join(LAYER_TYPES)}", path)
    return tuple(layer_types)


def _sliding_window(raw: dict, layer_types: tuple[str, ...], path: Path) -> int | None:
    if "sliding_attention" not in layer_types:
        return None
    window = raw.get("sliding_window")
    if not _is_int(window) or window < 1:
        raise CheckpointError(f"sliding_attention layers need a positive sliding_window, got {window!r}", path)
    return window


def _causal(raw: dict, layer_types: tuple[str, ...], path: Path) -> tuple[bool, ...]:
    """`is_causal` applies to every layer; absent, sliding layers are causal and full ones bidirectional (reference §1.1)."""
    is_causal = raw.get("is_causal")
    if is_causal is None:
        return tuple(t == "sliding_attention" for t in layer_types)
    if not isinstance(is_causal, bool):
        raise CheckpointError(f"is_causal must be true or false, got {is_causal!r}", path)
    return (is_causal,) * len(layer_types)


def _target_layer_ids(raw: dict, num_layers: int, target_layers: int, path: Path) -> tuple[int, ...]:
    """Explicit taps, or the package's default from `num_target_layers` (the target's trunk depth when absent)."""
    ids = draft_value(raw, "target_layer_ids")
    if ids is None:
        num_target_layers = _or_default(raw, "num_target_layers", target_layers)
        if not _is_int(num_target_layers):
            raise CheckpointError(f"num_target_layers must be an int, got {num_target_layers!r}", path)
        ids = build_target_layer_ids(num_target_layers, num_layers)
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        raise CheckpointError(f"target_layer_ids must be a non-empty list of ints, got {ids!r}", path)
    outside = [i for i in ids if not 0 <= i < target_layers]
    if outside:
        raise CheckpointError(f"target_layer_ids {ids} reach outside the target's layers 0..{target_layers - 1} ({outside})", path)
    return tuple(ids)


def _mask_token_id(raw: dict, vocab_size: int, path: Path) -> int:
    mask = draft_value(raw, "mask_token_id")
    if mask is None:
        raise CheckpointError("no mask_token_id (neither in dflash_config nor at the top level)", path)
    if not _is_int(mask) or not 0 <= mask < vocab_size:
        raise CheckpointError(f"mask_token_id {mask!r} is outside the target's vocabulary ({vocab_size} tokens)", path)
    return mask


def _block_size(raw: dict, path: Path) -> int:
    block = draft_value(raw, "block_size", DEFAULT_BLOCK_SIZE)
    if not _is_int(block) or block < 2:
        raise CheckpointError(f"block_size must be an int >= 2, got {block!r}", path)
    return block


def _dflash2_fields(raw: dict, target: dict, path: Path) -> dict[str, Any]:
    """The convolution and selector settings of a DFlash2 draft (no defaults: the package needs them)."""
    out = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = draft_value(raw, key)
        if not _is_int(value) or value < 1:
            raise CheckpointError(f"a DFlash2 draft needs a positive int {key} (in dflash_config), got {value!r}", path)
        out[key] = value
    return out | {"vocab_size": target["vocab_size"]}


def _backbone(raw: dict, path: Path) -> dict[str, Any]:
    """The Qwen3 backbone fields of DFlashConfig, with Qwen3Config's defaults for the optional ones."""
    try:
        heads = int(raw["num_attention_heads"])
        return {
            "hidden_size": int(raw["hidden_size"]),
            "num_hidden_layers": int(raw["num_hidden_layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_or_default(raw, "num_key_value_heads", heads)),
            "head_dim": int(_or_default(raw, "head_dim", DEFAULT_HEAD_DIM)),
            "intermediate_size": int(raw["intermediate_size"]),
            "rms_norm_eps": float(_or_default(raw, "rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"missing or bad field {e}", path) from None


def _draft_config(raw: dict, target: dict, path: Path) -> DFlashConfig:
    """Normalize and validate a draft's config.json against the target's normalized config."""
    architecture = _architecture(raw, path)
    if raw.get("attention_bias"):
        raise UnsupportedModelError("attention_bias true is not supported (the DFlash draft network has no attention bias)", path)
    backbone = _backbone(raw, path)
    if backbone["hidden_size"] != target["hidden_size"]:
        raise CheckpointError(f"hidden_size {backbone['hidden_size']} differs from the target's {target['hidden_size']} (the draft reads the target's embeddings and hidden states)", path)
    num_layers = backbone["num_hidden_layers"]
    layer_types = _layer_types(raw, num_layers, path)
    fields = dict(
        architecture=architecture,
        **backbone,
        rope_theta=_rope_theta(raw, path),
        block_size=_block_size(raw, path),
        mask_token_id=_mask_token_id(raw, target["vocab_size"], path),
        target_layer_ids=_target_layer_ids(raw, num_layers, target["num_hidden_layers"], path),
        layer_types=layer_types,
        sliding_window=_sliding_window(raw, layer_types, path),
        causal=_causal(raw, layer_types, path),
        attention_bias=False,
        **(_dflash2_fields(raw, target, path) if architecture == "DFlash2DraftModel" else {}),
    )
    try:
        return DFlashConfig(**fields)
    except FreetokenError as e:  # the config's own checks (head counts, windows), named by this file
        raise type(e)(str(e), path) from None


# ---------------------------------------------------------------- tensors


def expected_tensors(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash or DFlash2 draft (names as in its safetensors, no prefix) -> its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if cfg.is_dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                out[f"{p}{conv}.base_kernel"] = (2, cfg.conv_kernel_size, h)
                out[f"{p}{conv}.kernel_projection.weight"] = (2 * cfg.conv_kernel_size * cfg.num_conv_groups, h)
    if cfg.is_dflash2:
        out |= {
            "candidate_selector.predecessor_codebook": (cfg.vocab_size, cfg.selector_rank),
            "candidate_selector.successor_codebook": (cfg.vocab_size, cfg.selector_rank),
            "candidate_selector.hidden_projection.weight": (cfg.selector_rank, h),
        }
    return out


def _validate_tensors(header: dict[str, dict], cfg: DFlashConfig, path: Path) -> None:
    expected = expected_tensors(cfg)
    unexpected = [n for n in header if n not in expected]
    if unexpected:
        raise CheckpointError(f"unexpected tensors (not part of a {'DFlash2' if cfg.is_dflash2 else 'DFlash'} draft): {_first(unexpected)}", path)
    missing = [n for n in expected if n not in header]
    if missing:
        raise CheckpointError(f"missing tensors: {_first(missing)}", path)
    for name, shape in expected.items():
        if name.endswith("_codebook") and header[name]["shape"][0] != shape[0]:
            raise CheckpointError(f"tensor {name} has {header[name]['shape'][0]} rows, one per token of the target's vocabulary ({shape[0]}) expected", path)
        if tuple(header[name]["shape"]) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(header[name]['shape'])}, config.json implies {list(shape)}", path)
        if header[name]["dtype"] not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {header[name]['dtype']}, expected one of {', '.join(FLOAT_DTYPES)}", path)


# ---------------------------------------------------------------- public API


@dataclass(frozen=True)
class DFlashDraft:
    """A validated DFlash draft directory; its tensors are read only when `tensors()` is iterated."""

    root: Path
    config: DFlashConfig
    tensor_names: tuple[str, ...]  # in file order
    sources: tuple[SourceFile, ...]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(`dflash.<name>`, tensor) for every draft tensor, in the dtype it is stored in."""
        with safe_open(self.root / WEIGHTS_FILE, "pt") as f:
            for name in self.tensor_names:
                yield PREFIX + name, f.get_tensor(name)

    def attach(
        self, tensors: Iterable[tuple[str, torch.Tensor]], draft_heads: dict[str, dict], provenance: Provenance,
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, dict], Provenance]:
        """A target's tensors, draft heads and provenance with this draft added."""
        note = f"{'DFlash2' if self.config.is_dflash2 else 'DFlash'} draft from {self.root.absolute()} under {PREFIX}*"
        provenance = replace(provenance, sources=provenance.sources + self.sources, transforms=(*provenance.transforms, note))
        return chain(tensors, self.tensors()), draft_heads | {"dflash": self.config.to_dict()}, provenance


def _required_file(root: Path, name: str) -> Path:
    path = root / name
    if not path.is_file():
        raise CheckpointError(f"missing (a DFlash draft directory holds {CONFIG_FILE} and {WEIGHTS_FILE})", path)
    return path


def read_dflash(src: str | Path, target_config: dict[str, Any]) -> DFlashDraft:
    """Read and validate a DFlash draft directory (or cached repo id) against a target's normalized config.

    `target_config` needs `hidden_size`, `vocab_size` and `num_hidden_layers` (the trunk's depth,
    MTP layers not counted). No weight is loaded here (config.json and the safetensors header are
    parsed, both files hashed for the provenance); any problem raises a one-line CheckpointError /
    UnsupportedModelError naming the file.
    """
    root = resolve_source(src)
    if not root.is_dir():
        raise CheckpointError(f"not a DFlash draft directory (expected {CONFIG_FILE} and {WEIGHTS_FILE})", root)
    config_path = _required_file(root, CONFIG_FILE)
    weights_path = _required_file(root, WEIGHTS_FILE)
    raw = _load_json(config_path)
    if not isinstance(raw, dict):
        raise CheckpointError("config.json is not a JSON object", config_path)
    cfg = _draft_config(raw, target_config, config_path)
    header = read_safetensors_header(weights_path)
    _validate_tensors(header, cfg, weights_path)
    order = tuple(sorted(header, key=lambda n: header[n]["data_offsets"][0]))
    return DFlashDraft(root, cfg, order, (hash_file(config_path), hash_file(weights_path)))
