"""`freetoken inspect PATH`: what a checkpoint holds, as one table.

Works on unified checkpoints, Hugging Face checkpoint directories (or cached repo ids) and GGUF
files. Each kind has a small function returning (field, value) rows; only headers and metadata
are read, never the weights.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

Rows = list[tuple[str, str]]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return ""


def _shape(shapes: dict[str, list[int]], name: str) -> str:
    return "x".join(map(str, shapes[name])) if name in shapes else "-"


def _ngram_tables(cfg, shapes: dict[str, list[int]]) -> str:
    return ", ".join(f"layer {i}: {_shape(shapes, f'model.layers.{i}.ple.ple_embedding.ngram_embedding.weight')}" for i in cfg.ple_layers)


def _vision(vision_config: dict | None, image_processing: dict | None, has_tower: bool, source: str) -> str:
    """The vision tower's shape and the image preprocessing it takes (`source`: where the settings come from)."""
    if not has_tower:
        return "no"
    if vision_config is None:
        return "yes (no vision_config)"
    from freetoken.models.vision.config import ImageProcessing, VisionConfig

    v = VisionConfig.from_dict(vision_config)
    if image_processing is None:
        proc, source = ImageProcessing.from_hf(None, v), "Qwen3-VL defaults"
    else:
        proc = ImageProcessing.from_dict(image_processing)
    tower = (f"depth {v.depth}, hidden {v.hidden_size} ({v.num_heads} heads), "
             f"patch {v.patch_size} x temporal {v.temporal_patch_size}, "
             f"merge {v.spatial_merge_size}, out hidden {v.out_hidden_size}")
    return (f"{tower}\npreprocessing ({source}): pixels {proc.min_pixels}..{proc.max_pixels}, patch {proc.patch_size}, "
            f"merge {proc.merge_size}, mean {list(proc.image_mean)}, std {list(proc.image_std)}")


# rows a family's config adds when it has the feature: (label, has it, value)
FEATURE_ROWS = (
    ("hyper-connections", lambda c: hasattr(c, "hc_count"), lambda c, s: f"{c.hc_count} streams x {c.hidden_size}, mixer rank {c.hc_lowrank}"),
    ("PLE layers", lambda c: bool(getattr(c, "ple_layers", ())),
     lambda c, s: f"{list(c.ple_layers)} (0-indexed), n-gram orders 2..{c.ngram_size} x {c.heads_per_ngram} heads, width {c.ple_embed_dim}"),
    ("n-gram tables", lambda c: bool(getattr(c, "ple_layers", ())), _ngram_tables),
    ("QSA", lambda c: getattr(c, "uses_qsa", False),
     lambda c, s: f"budget {c.indexer_budget} tokens, block (compress ratio) {c.indexer_compress_ratio}, indexer {c.indexer_n_heads} heads x {c.indexer_head_dim}"),
)


def _config_rows(cfg, shapes: dict[str, list[int]]) -> Rows:
    """Rows shared by unified and HF checkpoints of any family (`cfg` is the family's normalized config)."""
    n_lin, n_full = len(cfg.linear_attention_layers), len(cfg.full_attention_layers)
    if cfg.is_moe:
        mlp = f"MoE: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, expert {cfg.moe_intermediate_size}, shared {cfg.shared_expert_intermediate_size}"
    else:
        mlp = f"dense: intermediate {cfg.intermediate_size}"
    rows = [
        ("model type", cfg.model_type),
        ("layers", f"{cfg.num_hidden_layers} ({n_lin} linear attention, {n_full} full attention)"),
        ("hidden / vocab", f"{cfg.hidden_size} / {cfg.vocab_size}"),
        ("attention heads / kv / head_dim", f"{cfg.num_attention_heads} / {cfg.num_key_value_heads} / {cfg.head_dim}"),
        ("GDN k / v heads x dim", f"{cfg.linear_num_key_heads} / {cfg.linear_num_value_heads} x {cfg.linear_key_head_dim}"),
        ("MLP", mlp),
        ("tied embeddings", str(cfg.tie_word_embeddings)),
        ("embed_tokens", _shape(shapes, "model.embed_tokens.weight")),
        ("lm_head", "tied" if cfg.tie_word_embeddings else _shape(shapes, "lm_head.weight")),
    ]
    if cfg.is_moe:
        rows.append(("experts.gate_up_proj", _shape(shapes, "model.layers.0.mlp.experts.gate_up_proj")))
    return rows + [(label, show(cfg, shapes)) for label, has, show in FEATURE_ROWS if has(cfg)]


def _head_summary(name: str, entry: dict) -> str:
    """One draft head as shown by inspect: the DFlash draft's shape in words, other heads' fields as key=value."""
    if name == "dflash":
        selector = f", selector top {entry['selector_top_k']} rank {entry['selector_rank']}" if "selector_top_k" in entry else ""
        return (f"dflash ({'DFlash2, ' if selector else ''}block size {entry['block_size']}, {entry['num_hidden_layers']} layers, "
                f"taps {entry['target_layer_ids']}, mask id {entry['mask_token_id']}{selector})")
    return f"{name} ({', '.join(f'{k}={v}' for k, v in entry.items())})"


def _dflash_rows(path: Path) -> Rows:
    """A DFlash draft directory as released: its settings as the dflash package reads them
    (`dflash_config` first, then the top level), before any check against a target."""
    from freetoken.converters.dflash import draft_value

    config = json.loads((path / "config.json").read_text())

    def value(key: str) -> str:
        found = draft_value(config, key)
        return "-" if found is None else str(found)

    rows = [
        ("format", "DFlash draft"), ("architecture", ", ".join(config.get("architectures") or [])),
        ("hidden size", value("hidden_size")), ("layers", value("num_hidden_layers")), ("layer types", value("layer_types")),
        ("block size", value("block_size")), ("taps (target layers)", value("target_layer_ids")), ("mask token id", value("mask_token_id")),
    ]
    if draft_value(config, "conv_kernel_size") is not None:  # DFlash2
        rows += [("conv kernel / group", f"{value('conv_kernel_size')} / {value('conv_group_size')}"),
                 ("selector rank / top-k", f"{value('selector_rank')} / {value('selector_top_k')}")]
    return rows


def _unified_rows(path: Path) -> Rows:
    from freetoken.checkpoint import UnifiedCheckpoint
    from freetoken.models.registry import FAMILIES, family_config_class

    ck = UnifiedCheckpoint.open(path)
    m = ck.manifest
    shapes = {n: info["shape"] for n, info in m.tensors.items()}
    dtypes = Counter(info["dtype"] for info in m.tensors.values())
    rows: Rows = [("format", "freetoken unified checkpoint"), ("family", m.family)]
    if m.family in FAMILIES:
        rows += _config_rows(family_config_class(m.family).from_dict(m.config), shapes)
    heads = "\n".join(_head_summary(k, v) for k, v in m.draft_heads.items()) or "none"
    rows += [
        ("draft heads", heads),
        ("vision tower", _vision(m.config.get("vision_config"), m.config.get("image_processing"),
                                 any(n.startswith("model.visual.") for n in shapes), "preprocessor_config.json")),
        ("tensors", f"{len(shapes)} in {len({i['shard'] for i in m.tensors.values()})} shard(s); " + ", ".join(f"{d} x{c}" for d, c in dtypes.items())),
        ("tokenizer", m.tokenizer.get("file") or "none"),
        ("converter", f"{m.provenance.converter} (freetoken {m.provenance.freetoken_version})"),
        ("sources", "\n".join(f"{Path(s.path).name} sha256:{s.sha256[:12]}" for s in m.provenance.sources) or "-"),
        ("transforms", "\n".join(m.provenance.transforms) or "none"),
        ("size on disk", _size(ck.size_on_disk)),
    ]
    return rows


def _hf_rows(path: Path) -> Rows:
    from freetoken.checkpoint import read_safetensors_header
    from freetoken.errors import CheckpointError, UnsupportedModelError
    from freetoken.models.registry import family_config_class, family_for_model_type, hf_model_type, weight_rules

    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise CheckpointError(f"unreadable config.json ({e})", path / "config.json") from None
    try:
        family = family_for_model_type(hf_model_type(raw)).name
        cfg = family_config_class(family).from_hf(raw)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(str(e), path / "config.json") from None
    rules = weight_rules(family)
    files = sorted(path.glob("*.safetensors"))
    headers = {n: i for f in files for n, i in read_safetensors_header(f).items()}
    shapes = {rules.canonical_name(n): i["shape"] for n, i in headers.items()}
    for name, shape in list(shapes.items()):  # a sharded tensor shows as its joined shape
        if (shard := rules.shard_key(name)) is not None:
            joined = shapes.setdefault(shard[0], [0, *shape[1:]])
            joined[0] += shape[0]
    has_mtp = any(n.startswith("mtp.") for n in shapes)
    per_expert = any(".experts.0." in n for n in shapes)
    rows: Rows = [("format", "Hugging Face safetensors"), ("architecture", ", ".join(raw.get("architectures") or ["?"])), ("family", family)]
    rows += _config_rows(cfg, shapes)
    rows += [
        ("draft heads", f"mtp (layers: {cfg.mtp_num_hidden_layers or 1})" if has_mtp else "none"),
        ("vision tower", _vision(raw.get("vision_config"), _hf_image_processing(path, raw),
                                 any(n.startswith("model.visual.") for n in shapes), "preprocessor_config.json")),
        ("expert layout", "per-expert" if per_expert else ("fused" if cfg.is_moe else "-")),
        ("tensors", f"{len(headers)} in {len(files)} file(s); " + ", ".join(f"{d} x{c}" for d, c in Counter(i["dtype"] for i in headers.values()).items())),
        ("size on disk", _size(sum(f.stat().st_size for f in path.iterdir() if f.is_file()))),
    ]
    return rows


def _hf_image_processing(path: Path, raw: dict) -> dict | None:
    """The ImageProcessing dict of the directory's preprocessor_config.json, None without one (or without a vision_config)."""
    from freetoken.errors import CheckpointError
    from freetoken.models.vision.config import ImageProcessing, VisionConfig

    file = path / "preprocessor_config.json"
    if not file.is_file() or raw.get("vision_config") is None:
        return None
    try:
        return ImageProcessing.from_hf(json.loads(file.read_text()), VisionConfig.from_dict(raw["vision_config"])).to_dict()
    except ValueError as e:
        raise CheckpointError(f"unreadable preprocessor_config.json ({e})", file) from None


def _gguf_rows(path: Path) -> Rows:
    try:
        from freetoken.converters.gguf import describe_gguf
    except ImportError:
        describe_gguf = None
    if describe_gguf is not None:
        return [("format", "GGUF")] + [(str(k), str(v)) for k, v in describe_gguf(path).items()]
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    arch = field("general.architecture")
    quants = Counter(t.tensor_type.name for t in reader.tensors)
    return [
        ("format", f"GGUF v{field('GGUF.version')}"),
        ("architecture", str(arch)),
        ("block_count", str(field(f"{arch}.block_count"))),
        ("nextn_predict_layers", str(field(f"{arch}.nextn_predict_layers") or 0)),
        ("experts", str(field(f"{arch}.expert_count") or "dense")),
        ("tensor types", ", ".join(f"{q} x{c}" for q, c in quants.most_common())),
        ("tensors", str(len(reader.tensors))),
        ("size on disk", _size(path.stat().st_size)),
    ]


def inspect(
    path: Annotated[str, typer.Argument(help="Unified checkpoint, HF checkpoint directory (or cached repo id), or .gguf file.")],
) -> None:
    """Show what a checkpoint holds: family, layer mix, shapes, draft heads, provenance, size."""
    from rich.console import Console
    from rich.table import Table

    from freetoken.converters.detect import detect_format, resolve_source

    resolved = resolve_source(path)
    fmt = detect_format(resolved)
    if fmt == "unified":
        rows = _unified_rows(resolved)
    elif fmt == "gguf":
        rows = _gguf_rows(resolved)
    elif fmt == "hf":
        rows = _hf_rows(resolved)
    else:
        rows = _dflash_rows(resolved)
    table = Table(title=str(path), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
