"""Hugging Face safetensors checkpoints of any registered family -> unified checkpoint.

The family comes from config.json's model_type through the registry (`models/registry.py`),
which gives its normalized config class and its `WeightRules` (`models/weight_rules.py`); nothing
here names a family. The conversion is planned from the safetensors headers alone, before any
weight is read: every source tensor must map to a canonical name and every expected tensor must
be present with its shape, so a bad checkpoint fails fast with the names at fault. Then tensors
are streamed one at a time into the atomic writer: per-expert tensors are buffered only until
their layer is complete, then fused; a tensor stored as shards (qwen4_exp's n-gram tables) is
handed over as a `ChunkedTensor`, one shard read at a time.

What is undone here, and recorded in the provenance: wrapper prefixes (`model.language_model.`),
per-expert MoE tensors (fused), sharded tensors (joined), constants the config implies (checked
equal to the recomputed values, then dropped), an `lm_head.weight` that duplicates tied
embeddings, a dropped vision tower (`text_only`).

Layout: `read_hf` (plan + tensor stream, reusable by other converters), `convert_hf`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

import freetoken
from freetoken.checkpoint import ChunkedTensor, Manifest, Provenance, hash_file, read_safetensors_header, write_checkpoint
from freetoken.checkpoint.writer import SAFETENSORS_DTYPES
from freetoken.converters.detect import resolve_source
from freetoken.errors import CheckpointError, OutputExistsError, UnsupportedModelError
from freetoken.models.registry import FAMILIES, family_config_class, family_for_model_type, hf_model_type, weight_rules
from freetoken.models.weight_rules import WeightRules, fuse_group, mtp_layer_count, per_expert_key

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
_SHARD_INDEX = re.compile(r"\.shard_\d+\.")
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class HFSource(NamedTuple):
    config: Any  # the family's normalized config (Qwen35Config, Qwen4ExpConfig, ...)
    tensors: Iterator[tuple[str, torch.Tensor | ChunkedTensor]]  # (canonical name, tensor), streamed
    tokenizer_files: dict[str, bytes]
    provenance: Provenance
    vision_config: dict | None  # the source's vision_config when model.visual.* is kept
    family: str
    image_processing: dict | None = None  # ImageProcessing of its preprocessor_config.json (kept tower only)


@dataclass
class _Plan:
    """Where each canonical tensor comes from; built from headers only."""

    direct: dict[str, tuple[Path, str]] = field(default_factory=dict)  # canonical -> (file, source name)
    experts: dict[str, dict[tuple[int, str], tuple[Path, str]]] = field(default_factory=dict)  # fused prefix -> (e, kind) -> src
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # canonical -> shape
    source_of: dict[str, str] = field(default_factory=dict)  # canonical -> source name (for messages)
    shards: dict[str, dict[int, tuple[Path, str]]] = field(default_factory=dict)  # joined name -> index -> src
    buffers: dict[str, tuple[Path, str]] = field(default_factory=dict)  # recomputable constant -> src
    dropped: set[str] = field(default_factory=set)  # source names not converted
    renamed: bool = False


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(sorted(names)[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"unreadable JSON ({e})", path) from None


def _read_config(root: Path) -> tuple[dict, Any, str]:
    """(raw config.json, the family's normalized config, family name)."""
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError("not a Hugging Face checkpoint (no config.json)", root)
    raw = _load_json(path)
    model_type = hf_model_type(raw)
    try:
        family = family_for_model_type(model_type).name
    except UnsupportedModelError:
        supported = ", ".join(t for spec in FAMILIES.values() for t in spec.model_types if not t.endswith("_text"))
        raise UnsupportedModelError(f"unsupported model_type {model_type!r} (supported: {supported})", path) from None
    try:
        cfg = family_config_class(family).from_hf(raw)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(str(e), path) from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"missing or bad field {e}", path) from None
    if not cfg.eos_token_ids and (root / "generation_config.json").is_file():
        eos = _load_json(root / "generation_config.json").get("eos_token_id")
        if eos is not None:
            cfg = replace(cfg, eos_token_ids=tuple(int(i) for i in (eos if isinstance(eos, list) else [eos])))
    return raw, cfg, family


def _shard_files(root: Path) -> tuple[list[Path], Path | None]:
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError("no weight_map", index)
        files = [root / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {INDEX_FILE} is missing", f)
        return files, index
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError("no *.safetensors files", root)
    return files, None


def _plan(files: list[Path], headers: dict[Path, dict], rules: WeightRules, buffers: set[str], *, text_only: bool) -> _Plan:
    plan = _Plan()
    for file in files:
        for name, info in headers[file].items():
            if name.startswith("model.visual.") and text_only:
                plan.dropped.add(name)
                continue
            canon = rules.canonical_name(name)
            plan.renamed |= canon != name
            key = per_expert_key(canon)
            if key is not None:
                plan.experts.setdefault(key[0], {})[(key[1], key[2])] = (file, name)
                plan.shapes[canon] = tuple(info["shape"])
                continue
            shard = rules.shard_key(canon)
            if shard is not None:
                plan.shards.setdefault(shard[0], {})[shard[1]] = (file, name)
                plan.shapes[canon] = tuple(info["shape"])
                continue
            if canon in buffers:
                plan.buffers[canon] = (file, name)
                continue
            if canon in plan.direct:
                raise CheckpointError(f"tensor {canon!r} appears twice (as {plan.source_of[canon]!r} and {name!r})", file)
            plan.direct[canon] = (file, name)
            plan.shapes[canon] = tuple(info["shape"])
            plan.source_of[canon] = name
    return plan


def _fused_shapes(plan: _Plan, num_experts: int) -> None:
    """Add the shapes of the fused expert tensors to the plan (from expert 0's shapes)."""
    for prefix, group in plan.experts.items():
        if f"{prefix}.gate_up_proj" in plan.direct or f"{prefix}.down_proj" in plan.direct:
            raise CheckpointError(f"{prefix} has both fused and per-expert tensors")
        want = {(e, k) for e in range(num_experts) for k in ("gate_proj", "up_proj", "down_proj")}
        if set(group) != want:
            missing = [f"{prefix}.{e}.{k}.weight" for e, k in sorted(want - set(group))]
            extra = [f"{prefix}.{e}.{k}.weight" for e, k in sorted(set(group) - want)]
            raise CheckpointError(f"incomplete per-expert tensors: {'missing ' + _first(missing) if missing else 'unexpected ' + _first(extra)}")
        gate, down = plan.shapes[f"{prefix}.0.gate_proj.weight"], plan.shapes[f"{prefix}.0.down_proj.weight"]
        plan.shapes[f"{prefix}.gate_up_proj"] = (num_experts, 2 * gate[0], *gate[1:])
        plan.shapes[f"{prefix}.down_proj"] = (num_experts, *down)
        plan.source_of[f"{prefix}.gate_up_proj"] = plan.source_of[f"{prefix}.down_proj"] = f"{prefix}.*"


def _joined_shapes(plan: _Plan, headers: dict[Path, dict], rules: WeightRules, raw: dict, root: Path) -> None:
    """Check each sharded tensor's shards (all indices present, one row width and dtype) and add the joined shape."""
    for joined, group in plan.shards.items():
        some_name = next(iter(group.values()))[1]
        declared = rules.declared_shards(raw, joined)
        want = set(range(declared if declared is not None else max(group) + 1))
        missing, extra = sorted(want - set(group)), sorted(set(group) - want)
        if missing or extra:
            names = [_SHARD_INDEX.sub(f".shard_{k}.", some_name) for k in (missing or extra)]
            of = f" of {declared} (config.json)" if declared is not None else ""
            raise CheckpointError(f"{'missing' if missing else 'unexpected'} shard(s){of}: {_first(names, 3)}", root)
        infos = [(file, name, headers[file][name]) for file, name in (group[k] for k in sorted(group))]
        first = infos[0][2]
        for file, name, info in infos:
            if info["shape"][1:] != first["shape"][1:] or info["dtype"] != first["dtype"] or len(info["shape"]) < 1:
                raise CheckpointError(f"shard {name} has {info['dtype']} {info['shape']}, the first shard {first['dtype']} {first['shape']}", file)
        plan.shapes[joined] = (sum(info["shape"][0] for _, _, info in infos), *first["shape"][1:])
        plan.source_of[joined] = _SHARD_INDEX.sub(".shard_*.", some_name)


def _check_buffers(plan: _Plan, rules: WeightRules, cfg: Any) -> None:
    """Stored constants must equal the values recomputed from the config (they are then dropped)."""
    expected = rules.derived_buffers(cfg)
    for canon, (file, name) in plan.buffers.items():
        with safe_open(file, "pt") as f:
            stored = f.get_tensor(name).tolist()
        if stored != expected[canon]:
            raise CheckpointError(f"tensor {name} is {stored}, but config.json implies {expected[canon]}", file)
        plan.dropped.add(name)


def _validate(plan: _Plan, cfg: Any, rules: WeightRules, root: Path) -> None:
    mtp = cfg.mtp_num_hidden_layers > 0
    expected = rules.expected_tensors(cfg, with_mtp=mtp)
    available = set(plan.direct) | set(plan.shards) | {f"{p}.{s}" for p in plan.experts for s in ("gate_up_proj", "down_proj")}
    unknown = [plan.source_of[n] for n in available if n not in expected and not n.startswith("model.visual.")]
    if unknown:
        raise CheckpointError(f"unknown tensors (not part of a {cfg.model_type} checkpoint): {_first(unknown)}", root)
    missing = [n for n in expected if n not in available]
    missing_mtp = [n for n in missing if n.startswith("mtp.")]
    if missing_mtp:
        raise CheckpointError(f"incomplete MTP head: missing {_first(missing_mtp)}", root)
    if missing:
        raise CheckpointError(f"missing tensors: {_first(missing)}", root)
    for name, shape in expected.items():
        if plan.shapes[name] != shape:
            raise CheckpointError(f"tensor {plan.source_of[name]} has shape {list(plan.shapes[name])}, config.json implies {list(shape)}", root)


def _tie(plan: _Plan, cfg: Any, transforms: list[str]) -> Any:
    if "lm_head.weight" not in plan.direct:
        if not cfg.tie_word_embeddings:
            transforms.append("tie_word_embeddings set: the checkpoint has no lm_head.weight")
        return replace(cfg, tie_word_embeddings=True)
    if not cfg.tie_word_embeddings:
        return cfg
    (f_head, n_head), (f_emb, n_emb) = plan.direct["lm_head.weight"], plan.direct.get("model.embed_tokens.weight", (None, None))
    if f_emb is None:
        return cfg  # reported as missing by _validate
    with safe_open(f_head, "pt") as a, safe_open(f_emb, "pt") as b:
        same = torch.equal(a.get_tensor(n_head), b.get_tensor(n_emb))
    if not same:
        raise CheckpointError("tie_word_embeddings is true but lm_head.weight differs from embed_tokens", f_head)
    del plan.direct["lm_head.weight"]
    plan.dropped.add(n_head)
    transforms.append("lm_head.weight dropped: identical to the tied embed_tokens")
    return cfg


def _joined(joined: str, group: dict[int, tuple[Path, str]], plan: _Plan, headers: dict[Path, dict]) -> ChunkedTensor:
    """A sharded tensor as its shards in index order, each read when the writer asks for it."""

    def shards() -> Iterator[torch.Tensor]:
        for k in sorted(group):
            file, name = group[k]
            with safe_open(file, "pt") as f:
                yield f.get_tensor(name)

    file, name = group[0]
    return ChunkedTensor(plan.shapes[joined], _TORCH_DTYPES[headers[file][name]["dtype"]], shards)


def _stream(files: list[Path], headers: dict[Path, dict], plan: _Plan, num_experts: int) -> Iterator[tuple[str, torch.Tensor | ChunkedTensor]]:
    by_source = {(f, n): canon for canon, (f, n) in plan.direct.items()}
    expert_of = {src: (prefix, key) for prefix, group in plan.experts.items() for key, src in group.items()}
    joined_of = {src: joined for joined, group in plan.shards.items() for src in group.values()}
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for file in files:
        order = sorted(headers[file], key=lambda n: headers[file][n]["data_offsets"][0])
        with safe_open(file, "pt") as f:
            for name in order:
                if (file, name) in by_source:
                    yield by_source[(file, name)], f.get_tensor(name)
                elif (joined := joined_of.get((file, name))) is not None:
                    group = plan.shards[joined]
                    if (file, name) == group[min(group)]:  # the joined tensor goes where its first shard is
                        yield joined, _joined(joined, group, plan, headers)
                elif (file, name) in expert_of:
                    prefix, key = expert_of[(file, name)]
                    group = pending.setdefault(prefix, {})
                    group[key] = f.get_tensor(name)
                    if len(group) == 3 * num_experts:
                        yield from fuse_group(prefix, pending.pop(prefix), num_experts).items()


def read_hf(src: str | Path, *, text_only: bool = False) -> HFSource:
    """Plan and validate the conversion of an HF checkpoint; the tensors are read when iterated."""
    root = resolve_source(src)
    if not root.is_dir():
        raise CheckpointError("not a Hugging Face checkpoint directory", root)
    raw, cfg, family = _read_config(root)
    rules = weight_rules(family)
    files, index = _shard_files(root)
    headers = {f: read_safetensors_header(f) for f in files}
    if index is not None:
        listed = set(_load_json(index)["weight_map"])
        found = {n for h in headers.values() for n in h}
        if listed != found:
            raise CheckpointError(f"weight_map does not match the shards (e.g. {_first(list(listed ^ found), 3)})", index)
    plan = _plan(files, headers, rules, set(rules.derived_buffers(cfg)), text_only=text_only)
    transforms: list[str] = []
    if plan.renamed:
        transforms.append("model.language_model.* renamed to model.*")
    if plan.experts:
        transforms.append(f"experts fused from per-expert tensors ({len(plan.experts)} layers)")
    if text_only and plan.dropped:
        transforms.append("model.visual.* dropped (text only)")
    _fused_shapes(plan, cfg.num_experts)
    _joined_shapes(plan, headers, rules, raw, root)
    for joined, group in plan.shards.items():
        transforms.append(f"{joined} joined on dim 0 from {len(group)} shards {plan.source_of[joined]}")
    _check_buffers(plan, rules, cfg)
    if plan.buffers:
        transforms.append(f"constants recomputed from the config, checked equal and dropped: {', '.join(sorted(plan.buffers))}")
    cfg = replace(cfg, mtp_num_hidden_layers=mtp_layer_count(plan.shapes))
    cfg = _tie(plan, cfg, transforms)
    _validate(plan, cfg, rules, root)

    keeps_visual = any(n.startswith("model.visual.") for n in plan.direct)
    vision_config = raw.get("vision_config") if keeps_visual else None
    image_processing = _image_processing(root, vision_config) if vision_config is not None else None
    extra = [root / "config.json", root / "generation_config.json", *([index] if index else []), *files]
    if image_processing is not None:
        extra.append(root / PREPROCESSOR_FILE)
    tokenizer_files = {name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()}
    sources = tuple(hash_file(p) for p in extra + [root / n for n in tokenizer_files] if p.is_file())
    provenance = Provenance("hf", freetoken.__version__, sources, tuple(transforms))
    tensors = _stream(files, headers, plan, cfg.num_experts)
    return HFSource(cfg, tensors, tokenizer_files, provenance, vision_config, family, image_processing)


def _image_processing(root: Path, vision_config: dict) -> dict | None:
    """The image preprocessing settings of the checkpoint's preprocessor_config.json (None without one)."""
    from freetoken.models.vision.config import ImageProcessing, VisionConfig

    path = root / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        return ImageProcessing.from_hf(_load_json(path), VisionConfig.from_dict(vision_config)).to_dict()
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"unusable image preprocessing settings ({type(e).__name__}: {e})", path) from None


def convert_hf(
    src: str | Path,
    dst: str | Path,
    *,
    force: bool = False,
    dtype: torch.dtype | None = None,
    text_only: bool = False,
    shard_size: int = 5 * 10**9,
    mtp: str | Path | None = None,
    dflash: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Convert an HF checkpoint directory (or a cached repo id) into a unified checkpoint at `dst`.

    `mtp`: an MTP pack GGUF (`converters/gguf_mtp_pack.py`) for a checkpoint without `mtp.*`; its
    tensors are written as `dtype` (default bfloat16). `dflash`: a DFlash draft directory converted
    with it (under `dflash.*`, `converters/dflash.py`).
    """
    dst = Path(dst)
    if dst.exists() and not force:
        raise OutputExistsError("output exists (use --force to replace it)", dst)
    source = read_hf(src, text_only=text_only)
    cfg, pack = source.config, None
    n_mtp = cfg.mtp_num_hidden_layers
    if mtp is not None:
        from freetoken.converters.gguf import open_gguf
        from freetoken.converters.gguf_mtp_pack import read_mtp_pack

        pack = read_mtp_pack(open_gguf(mtp), source.family, cfg)
        if n_mtp:
            raise CheckpointError("the checkpoint already has an MTP head (mtp.*); an MTP pack is for a target without one", resolve_source(src))
        cfg = pack.config
    config = cfg.to_dict()
    if source.vision_config is not None:
        config["vision_config"] = source.vision_config
    if source.image_processing is not None:
        config["image_processing"] = source.image_processing
    tensors, provenance = source.tensors, source.provenance
    draft_heads = {"mtp": {"num_layers": n_mtp}} if n_mtp else {}
    if pack is not None:
        tensors, draft_heads, provenance = pack.attach(tensors, draft_heads, provenance, dtype if dtype is not None else torch.bfloat16)
    if dflash is not None:
        from freetoken.converters.dflash import read_dflash

        tensors, draft_heads, provenance = read_dflash(dflash, config).attach(tensors, draft_heads, provenance)
    return write_checkpoint(
        dst,
        family=source.family,
        config=config,
        tensors=tensors,
        draft_heads=draft_heads,
        tokenizer_files=source.tokenizer_files,
        provenance=provenance,
        dtype=dtype,
        shard_size=int(shard_size),
        force=force,
        progress=progress,
    )
