"""GGUF (llama.cpp) -> unified checkpoint, for `qwen35`, `qwen35moe` and `qwen4exp` targets and their MTP heads.

Why: GGUF files carry llama.cpp's conventions, not Hugging Face's. This module reads a target
(single file or `-0000i-of-0000N.gguf` split, with or without its nextn MTP block), optionally an
MTP-only `mtp-*.gguf` head, dequantizes every tensor with the torch dequantizers, undoes each
transform llama.cpp's converter applied (see gguf_names.py and shared/reference/gguf.md §1.3-1.4)
and streams the canonical tensors into `write_checkpoint`.

Layout:
- `GgufFile` / `open_gguf`: metadata and a tensor table over all shards (types gguf-py does not
  know, such as Q2_0, are read too).
- `ARCHITECTURES`: llama.cpp architecture -> `GgufArch` (freetoken family, name table, the
  function that builds the family's config from the metadata: `qwen35_config` here,
  `gguf_qwen4exp.qwen4exp_config`).
- `_Plan`: which GGUF tensors make which canonical tensor, with which undo steps; built and
  validated against the family's `expected_tensors` before anything is written. Tensors larger
  than `STREAM_ABOVE_BYTES` that need no undo are streamed to the writer in row blocks (`load_tensor`).
- `find_mtp_sidecar`, `check_pairing`: MTP head discovery and validation (MTP packs, which carry
  HF names and no hyper-parameters, are read by gguf_mtp_pack.py).
- `convert_gguf`, `describe_gguf`: the public entry points.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken.checkpoint.writer import ChunkedTensor
from freetoken.converters.gguf_names import NEXTN_DEDICATED, QWEN4EXP, QWEN35, NameTable, block_index, resolve
from freetoken.converters.gguf_quants import QUANT_TYPES, dequantize, type_name
from freetoken.converters.gguf_tokenizer import eos_token_ids, tokenizer_files
from freetoken.errors import CheckpointError, FreetokenError, UnsupportedModelError


@dataclass(frozen=True)
class GgufArch:
    family: str  # freetoken model family (models/registry.py)
    names: NameTable
    config: str  # "module:function" (GgufFile, tied=bool) -> the family's normalized config


ARCHITECTURES: dict[str, GgufArch] = {
    "qwen35": GgufArch("qwen3_5", QWEN35, "freetoken.converters.gguf:qwen35_config"),
    "qwen35moe": GgufArch("qwen3_5", QWEN35, "freetoken.converters.gguf:qwen35_config"),
    "qwen4exp": GgufArch("qwen4_exp", QWEN4EXP, "freetoken.converters.gguf_qwen4exp:qwen4exp_config"),
}
QWEN35_MODEL_TYPES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
STREAM_ABOVE_BYTES = 1 << 30  # undo-free tensors larger than this in float32 go to the writer in row blocks of about this size
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")

# hyper-parameters a head must share with its target (suffixes of `{arch}.`)
PAIRING_KEYS = (
    "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.dimension_sections", "ssm.conv_kernel",
    "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # torch order (ggml ne reversed)
    path: Path
    offset: int  # absolute byte offset of the data in `path`
    nbytes: int


@dataclass
class GgufFile:
    path: Path  # the first shard
    paths: list[Path]
    meta: dict[str, Any]
    tensors: dict[str, GgufTensor]
    _maps: dict[Path, np.memmap] = field(default_factory=dict, repr=False)

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def key(self, suffix: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{suffix}", default)

    @property
    def block_count(self) -> int:
        return int(self.key("block_count", 0))

    @property
    def nextn(self) -> int:
        return int(self.key("nextn_predict_layers", 0) or 0)

    @property
    def n_layer(self) -> int:
        """Trunk depth: block_count - nextn_predict_layers."""
        return self.block_count - self.nextn

    @property
    def has_mtp_block(self) -> bool:
        return self.nextn > 0 and any((block_index(n) or -1) >= self.n_layer for n in self.tensors)

    @property
    def mtp_only(self) -> bool:
        """An MTP head without trunk blocks (an `mtp-*.gguf` sidecar)."""
        blocks = (block_index(n) for n in self.tensors)
        return self.nextn > 0 and not any(i is not None and i < self.n_layer for i in blocks)

    def raw(self, t: GgufTensor) -> torch.Tensor:
        """The packed bytes of `t` as a uint8 CPU tensor (a copy)."""
        mm = self._maps.get(t.path)
        if mm is None:
            mm = self._maps[t.path] = np.memmap(t.path, mode="r")
        return torch.from_numpy(np.array(mm[t.offset : t.offset + t.nbytes]))

    def load(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Dequantized float32 tensor in torch order."""
        t = self.tensors[name]
        return dequantize(self.raw(t).to(device), t.type_id, t.shape, name=f"{t.path.name}: {name}")

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (along dim 0) of a tensor, dequantized to float32, reading only their bytes."""
        t = self.tensors[name]
        row_bytes = t.nbytes // t.shape[0]
        part = GgufTensor(name, t.type_id, (stop - start, *t.shape[1:]), t.path, t.offset + start * row_bytes, (stop - start) * row_bytes)
        return dequantize(self.raw(part), t.type_id, part.shape, name=f"{t.path.name}: {name}")


def _read_one(path: Path) -> tuple[dict[str, Any], list[GgufTensor]]:
    from gguf import GGUFReader

    class _TableReader(GGUFReader):
        """GGUFReader that keeps the raw tensor table, so unknown type ids do not abort parsing."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            self.table = []
            for f in fields:
                _, name_data, _, dims, raw_dtype, offset = f.parts
                self.table.append((bytes(name_data).decode("utf-8"), int(raw_dtype[0]), [int(d) for d in dims], int(start_offs + offset[0])))
            self.tensors = []

    try:
        reader = _TableReader(path)
        meta = {}
        for key, fld in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            value = fld.contents()
            meta[key] = value
    except FreetokenError:
        raise
    except Exception as e:  # the gguf parser raises ValueError/IndexError/struct errors on damaged files
        raise CheckpointError(f"not a readable GGUF file (truncated or corrupt: {type(e).__name__}: {e})", path) from None
    size = path.stat().st_size
    tensors = []
    for name, type_id, dims, offset in reader.table:
        if type_id not in QUANT_TYPES:
            raise CheckpointError(f"tensor {name} has unsupported quantization type {type_name(type_id)} (id {type_id})", path)
        qt = QUANT_TYPES[type_id]
        shape = tuple(reversed(dims))
        numel = math.prod(shape)
        if numel % qt.block_size:
            raise CheckpointError(f"tensor {name}: {numel} values are not whole {qt.name} blocks", path)
        nbytes = numel // qt.block_size * qt.type_size
        if offset + nbytes > size:
            raise CheckpointError(f"truncated GGUF: tensor {name} needs bytes up to {offset + nbytes}, the file has {size}", path)
        tensors.append(GgufTensor(name, type_id, shape, path, offset, nbytes))
    return meta, tensors


def _shard_paths(path: Path) -> list[Path]:
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    if int(m["i"]) != 1:
        raise CheckpointError(f"pass the first shard of a split GGUF ({m['stem']}-00001-of-{m['n']}.gguf)", path)
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['n']}.gguf") for i in range(1, int(m["n"]) + 1)]
    for p in paths:
        if not p.is_file():
            raise CheckpointError(f"split GGUF shard missing: {p.name}", path)
    return paths


def open_gguf(path: str | Path) -> GgufFile:
    """Read the metadata and tensor table of a GGUF file (all shards of a split file)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("GGUF file not found", path)
    paths = _shard_paths(path)
    meta: dict[str, Any] = {}
    tensors: dict[str, GgufTensor] = {}
    for i, p in enumerate(paths):
        m, ts = _read_one(p)
        if i == 0:
            meta = m
        for t in ts:
            if t.name in tensors:
                raise CheckpointError(f"tensor {t.name} appears in two shards", p)
            tensors[t.name] = t
    if len(paths) > 1 and "split.tensors.count" in meta and int(meta["split.tensors.count"]) != len(tensors):
        raise CheckpointError(f"split GGUF lists {meta['split.tensors.count']} tensors but its shards hold {len(tensors)}", path)
    return GgufFile(path=path, paths=paths, meta=meta, tensors=tensors)


# ---------------------------------------------------------------- config


def gguf_arch(g: GgufFile) -> GgufArch:
    """The `GgufArch` of a file's `general.architecture`; UnsupportedModelError for others."""
    if g.arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {g.arch!r} (supported: {', '.join(ARCHITECTURES)})", g.path)
    return ARCHITECTURES[g.arch]


def config_from_meta(g: GgufFile, *, tied: bool):
    """The family's normalized config from a GGUF's metadata (trunk depth excludes nextn)."""
    module, _, function = gguf_arch(g).config.partition(":")
    return getattr(importlib.import_module(module), function)(g, tied=tied)


def qwen35_config(g: GgufFile, *, tied: bool):
    """Qwen35Config from the metadata of a qwen35 / qwen35moe GGUF (trunk depth excludes nextn)."""
    from freetoken.models.qwen3_5.config import Qwen35Config

    try:
        trunk = hybrid_fields(g)
        head_dim = trunk["head_dim"]
        moe = g.arch == "qwen35moe"
        sections = [int(s) for s in g.key("rope.dimension_sections", [11, 11, 10, 0])]
        return Qwen35Config(
            **trunk,
            intermediate_size=None if moe else int(g.key("feed_forward_length")),
            num_experts=int(g.key("expert_count")) if moe else 0,
            num_experts_per_tok=int(g.key("expert_used_count")) if moe else 0,
            moe_intermediate_size=int(g.key("expert_feed_forward_length")) if moe else 0,
            shared_expert_intermediate_size=int(g.key("expert_shared_feed_forward_length", 0)) if moe else 0,
            rope_theta=meta_float(g.key("rope.freq_base", 1e7)),
            partial_rotary_factor=int(g.key("rope.dimension_count", head_dim // 4)) / head_dim,
            mrope_section=tuple(sections[:3]),
            rms_norm_eps=meta_float(g.key("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings=tied,
            mtp_num_hidden_layers=g.nextn,
            max_position_embeddings=int(g.key("context_length", 262144)),
            eos_token_ids=eos_token_ids(g.meta),
            model_type=QWEN35_MODEL_TYPES[g.arch],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"GGUF metadata incomplete for {g.arch} ({type(e).__name__}: {e})", g.path) from None


def hybrid_fields(g: GgufFile) -> dict[str, Any]:
    """The GDN / attention hybrid trunk's geometry from a qwen35 / qwen4exp GGUF's metadata, under the
    normalized configs' (Hugging Face's) field names; trunk depth excludes nextn."""
    n_layer = g.n_layer
    recurrent = g.key("attention.recurrent_layers")
    if recurrent:
        layer_types = tuple("linear_attention" if r else "full_attention" for r in list(recurrent)[:n_layer])
    else:
        interval = int(g.key("full_attention_interval", 4))
        layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer))
    nv = int(g.key("ssm.time_step_rank"))
    return dict(
        vocab_size=len(g.meta["tokenizer.ggml.tokens"]),
        hidden_size=int(g.key("embedding_length")),
        num_hidden_layers=n_layer,
        layer_types=layer_types,
        num_attention_heads=int(g.key("attention.head_count")),
        num_key_value_heads=int(g.key("attention.head_count_kv")),
        head_dim=int(g.key("attention.key_length")),
        linear_num_key_heads=int(g.key("ssm.group_count")),
        linear_num_value_heads=nv,
        linear_key_head_dim=int(g.key("ssm.state_size")),
        linear_value_head_dim=int(g.key("ssm.inner_size")) // nv,
        linear_conv_kernel_dim=int(g.key("ssm.conv_kernel", 4)),
    )


def meta_float(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(v)))


# ---------------------------------------------------------------- MTP heads


def find_mtp_sidecar(target: Path) -> Path | None:
    """The one `mtp-*.gguf` beside `target` (first shard if split); None if there is none."""
    found = sorted(p for p in target.parent.glob("mtp-*.gguf") if p.resolve() != target.resolve())
    found = [p for p in found if (m := _SPLIT.match(p.name)) is None or int(m["i"]) == 1]
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise FreetokenError(f"several MTP heads beside the target ({names}); choose one with --mtp", target)
    return found[0] if found else None


def vocab_hash(g: GgufFile) -> str:
    tokens = g.meta.get("tokenizer.ggml.tokens") or []
    return hashlib.sha256("\x00".join(tokens).encode()).hexdigest()


def is_shared_head(head: GgufFile) -> bool:
    return bool(head.key("nextn_shared_target_tensors", False)) or "token_embd.weight" not in head.tensors


def check_pairing(target: GgufFile, head: GgufFile) -> None:
    """Raise FreetokenError unless `head` is an MTP head made from the same model as `target`."""

    def differ(what: str, a: Any, b: Any) -> FreetokenError:
        return FreetokenError(
            f"MTP head does not belong to the target: {what} is {a!r} in {head.path.name} but {b!r} in {target.path}", head.path
        )

    if head.arch != target.arch:
        raise differ("general.architecture", head.arch, target.arch)
    if head.nextn <= 0 or not head.has_mtp_block:
        raise FreetokenError(f"not an MTP head: no nextn block (nextn_predict_layers={head.nextn})", head.path)
    for key in PAIRING_KEYS:
        a, b = head.key(key), target.key(key)
        if _norm(a) != _norm(b):
            raise differ(f"{head.arch}.{key}", a, b)
    if head.n_layer != target.n_layer:
        raise differ("trunk depth (block_count - nextn_predict_layers)", head.n_layer, target.n_layer)
    ha, ta = len(head.meta.get("tokenizer.ggml.tokens") or []), len(target.meta.get("tokenizer.ggml.tokens") or [])
    if ha != ta:
        raise differ("vocabulary size", ha, ta)
    if vocab_hash(head) != vocab_hash(target):
        raise differ("vocabulary (sha256 of tokenizer.ggml.tokens)", vocab_hash(head)[:16], vocab_hash(target)[:16])


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, float):
        return float(np.float32(v))
    return v


# ---------------------------------------------------------------- plan


PARTS = {"gate_half": (1, 0), "up_half": (1, 1), "qk_q": (0, 0), "qk_k": (0, 1)}  # undo tag -> (join dim, position)


@dataclass
class _Item:
    name: str  # canonical
    parts: list[tuple[GgufFile, str, tuple[str, ...]]]  # (file, gguf name, undo) - 2 parts for split experts / indexer
    shape: tuple[int, ...]
    join_dim: int = 0  # dim on which several parts are joined


@dataclass
class _Plan:
    items: list[_Item]
    transforms: list[str]


def _out_shape(shape: tuple[int, ...], undo: tuple[str, ...]) -> tuple[int, ...]:
    if "unsqueeze1" in undo:
        return (shape[0], 1, *shape[1:])
    if "row1" in undo:
        return (1, math.prod(shape))
    if "flat" in undo:
        return (math.prod(shape),)
    return shape


def _part_of(undo: tuple[str, ...]) -> tuple[int, int] | None:
    return next((PARTS[u] for u in undo if u in PARTS), None)


def _plan(target: GgufFile, head: GgufFile | None, cfg, *, drop_target_mtp: bool = False) -> _Plan:
    table = gguf_arch(target).names
    ple_layers = getattr(cfg, "ple_layers", ())
    items: dict[str, _Item] = {}
    undo_count: Counter[str] = Counter()
    split_qkv = 0
    split_cols: list[str] = []
    flattened = 0  # hyper-connection norms stored 2-D
    sources: list[tuple[GgufFile, str]] = []
    for name in target.tensors:
        i = block_index(name)
        if (head is not None or drop_target_mtp) and i is not None and i >= target.n_layer:
            continue  # the sidecar's (or a pack's) head replaces an embedded one
        sources.append((target, name))
    if head is not None:
        sources += [(head, n) for n in head.tensors if (block_index(n) or -1) >= head.n_layer]
    for g, name in sources:
        if name.endswith(".input_scale") or name.endswith(".scale"):
            continue  # NVFP4 companions, applied when the weight is loaded
        if any(name.endswith(d) for d in NEXTN_DEDICATED):
            raise UnsupportedModelError(f"tensor {name}: dedicated MTP embedding/head tables are not supported", g.path)
        r = resolve(name, g.n_layer, table, ple_layers[0] if len(ple_layers) == 1 else None)
        if r is None:
            raise CheckpointError(f"unexpected tensor {name} for architecture {g.arch}", g.path)
        canon, undo = r
        t = g.tensors[name]
        flattened += "flat" in undo and len(t.shape) > 1
        if isinstance(canon, tuple):  # one GGUF tensor split evenly along its columns
            w = t.shape[1] // len(canon)
            for j, c in enumerate(canon):
                items[c] = _Item(c, [(g, name, (*undo, f"cols:{j * w}:{(j + 1) * w}"))], (t.shape[0], w))
            split_cols.append(name)
            continue
        layer = block_index(name)
        full = layer is not None and (layer >= g.n_layer or cfg.layer_types[layer] == "full_attention")
        if canon.endswith("linear_attn.in_proj_qkv.weight") and full:  # fused q|k|v on an attention layer
            prefix = canon.removesuffix("linear_attn.in_proj_qkv.weight") + "self_attn."
            q, kv = 2 * cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            for proj, (a, b) in (("q", (0, q)), ("k", (q, q + kv)), ("v", (q + kv, q + 2 * kv))):
                items[f"{prefix}{proj}_proj.weight"] = _Item(f"{prefix}{proj}_proj.weight", [(g, name, (f"rows:{a}:{b}",))], (b - a, t.shape[1]))
            split_qkv += 1
            continue
        undo_count.update(u.split(":")[0] for u in undo)
        if (part := _part_of(undo)) is not None:
            item = items.setdefault(canon, _Item(canon, [], (), join_dim=part[0]))
            item.parts.append((g, name, undo))
            item.parts.sort(key=lambda p: _part_of(p[2])[1])  # gate before up, query rows before the key
            shape = list(_out_shape(t.shape, undo))
            shape[part[0]] = sum(_out_shape(p[0].tensors[p[1]].shape, p[2])[part[0]] for p in item.parts)
            item.shape = tuple(shape)
            continue
        if canon in items:
            raise CheckpointError(f"two GGUF tensors map to {canon} (second: {name})", g.path)
        items[canon] = _Item(canon, [(g, name, undo)], _out_shape(t.shape, undo))

    transforms = []
    if undo_count["norm-1"]:
        transforms.append(f"zero-centred RMSNorm weights: subtracted llama.cpp's +1 ({undo_count['norm-1']} tensors)")
    if undo_count["neg_exp"]:
        transforms.append(f"A_log = log(-ssm_a) ({undo_count['neg_exp']} layers)")
    if cfg.linear_num_key_heads != cfg.linear_num_value_heads and (undo_count["vrows"] or undo_count["vcols"]):
        transforms.append(
            f"GatedDeltaNet V heads reordered tiled -> grouped (k heads {cfg.linear_num_key_heads}, v heads "
            f"{cfg.linear_num_value_heads}): in_proj_qkv V rows, in_proj_z/a/b rows, conv1d V channels, dt_bias, A_log, out_proj columns"
        )
    if undo_count["unsqueeze1"]:
        transforms.append("conv1d weights unsqueezed [C, K] -> [C, 1, K]")
    if any(n.endswith("ssm_dt.bias") or n.endswith("ssm_dt") for g, n in sources):
        transforms.append("ssm_dt.bias renamed to dt_bias")
    if undo_count["gate_half"]:
        transforms.append(f"experts fused from ffn_gate_exps + ffn_up_exps into gate_up_proj ({undo_count['gate_half']} layers)")
    if any(n.endswith("ffn_gate_up_exps.weight") for g, n in sources):
        transforms.append("experts taken from fused ffn_gate_up_exps (gate rows first)")
    if undo_count["row1"]:
        transforms.append("shared_expert_gate reshaped to [1, H]")
    if split_qkv:
        transforms.append(f"fused attn_qkv split into q/k/v projections ({split_qkv} layers)")
    if undo_count["qk_q"]:
        transforms.append(f"QSA indexer.q_proj + indexer.k_proj joined into index_qk_proj ({undo_count['qk_q']} layers)")
    if flattened:
        transforms.append(f"hyper-connection norms stored as [hc, hidden] flattened to [hc * hidden] ({flattened} tensors)")
    for name in split_cols:
        transforms.append(f"{name} split along its columns into mtp.fc_embedding | mtp.fc_hidden")
    if any(n == "per_layer_token_embd.weight" for g, n in sources):
        transforms.append("per_layer_token_embd renamed to the PLE layer's ple_embedding.ngram_embedding")
    if any(n.endswith(".scale") and not n.endswith(".input_scale") for g, n in sources):
        transforms.append("NVFP4 per-tensor .scale multiplied into the weights")
    mtp_src = head if head is not None else (target if target.has_mtp_block and not drop_target_mtp else None)
    if mtp_src is not None:
        transforms.append(f"MTP block blk.{mtp_src.n_layer}.* (nextn) renamed to mtp.* from {mtp_src.path.name}")
    types = Counter(type_name(g.tensors[n].type_id) for g, n in sources)
    quantized = {k: v for k, v in types.items() if k not in ("F32",)}
    if quantized:
        transforms.append("dequantized " + ", ".join(f"{k} x{v}" for k, v in sorted(quantized.items())))
    return _Plan(list(items.values()), transforms)


def _validate(plan: _Plan, cfg, family: str, with_mtp: bool, path: Path) -> None:
    from freetoken.models.registry import weight_rules

    want = weight_rules(family).expected_tensors(cfg, with_mtp=with_mtp)
    have = {it.name: it.shape for it in plan.items}
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointError(f"GGUF lacks {len(missing)} tensors of the model, e.g. {missing[0]}", path)
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(f"GGUF has tensors the model does not use, e.g. {extra[0]}", path)
    for name, shape in want.items():
        if tuple(have[name]) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(have[name])}, expected {list(shape)} from the metadata", path)


# ---------------------------------------------------------------- undo


def _v_index(nk: int, nv: int, w: int) -> torch.Tensor:  # gather index tiled -> grouped over nv * w
    r = nv // nk
    return torch.arange(nv * w).reshape(r, nk, w).transpose(0, 1).reshape(-1)


def _undo(t: torch.Tensor, steps: tuple[str, ...], cfg) -> torch.Tensor:  # t: float32, torch order
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    for step in steps:
        kind, *args = step.split(":")
        if kind == "norm-1":
            t = t - 1.0
        elif kind == "neg_exp":
            t = torch.log(-t)
        elif kind in ("vrows", "vcols") and nk != nv:
            w = cfg.linear_value_head_dim if args[0] == "dv" else 1
            if kind == "vcols":
                t = t[:, _v_index(nk, nv, w)]
            else:
                off = 2 * nk * cfg.linear_key_head_dim if len(args) > 1 and args[1] == "kd2" else 0
                t = t.clone()
                t[off : off + nv * w] = t[off : off + nv * w][_v_index(nk, nv, w)]
        elif kind == "unsqueeze1":
            t = t.unsqueeze(1)
        elif kind == "row1":
            t = t.reshape(1, -1)
        elif kind == "flat":
            t = t.reshape(-1)
        elif kind == "rows":
            t = t[int(args[0]) : int(args[1])]
        elif kind == "cols":
            t = t[:, int(args[0]) : int(args[1])]
    return t


def _load_scaled(g: GgufFile, name: str) -> torch.Tensor:
    t = g.load(name)
    if name.endswith(".weight") and (sname := name[: -len(".weight")] + ".scale") in g.tensors:
        s = g.load(sname).reshape(-1)
        t = t * (s.reshape(-1, *([1] * (t.dim() - 1))) if s.numel() > 1 else s)
    return t


def _as_stored(item: _Item) -> bool:
    """One GGUF tensor taken as it is: no undo step, no NVFP4 scale."""
    if len(item.parts) != 1 or item.parts[0][2]:
        return False
    g, name, _ = item.parts[0]
    return name[: -len(".weight")] + ".scale" not in g.tensors


def load_tensor(g: GgufFile, name: str, dtype: torch.dtype) -> torch.Tensor | ChunkedTensor:
    """A tensor dequantized and cast to `dtype`; one too large to hold in float32 in one piece
    (over STREAM_ABOVE_BYTES, 2-D or more) as row blocks read when the writer asks for them."""
    t = g.tensors[name]
    if len(t.shape) >= 2 and 4 * math.prod(t.shape) > STREAM_ABOVE_BYTES:
        return _row_blocks(g, name, dtype)
    return g.load(name).to(dtype).contiguous()


def _row_blocks(g: GgufFile, name: str, dtype: torch.dtype) -> ChunkedTensor:
    """The tensor as blocks of rows whose dequantized float32 values take at most about STREAM_ABOVE_BYTES."""
    t = g.tensors[name]
    step = max(1, STREAM_ABOVE_BYTES // (4 * math.prod(t.shape[1:])))

    def chunks() -> Iterator[torch.Tensor]:
        for start in range(0, t.shape[0], step):
            yield g.load_rows(name, start, min(start + step, t.shape[0])).to(dtype)

    return ChunkedTensor(t.shape, dtype, chunks)


def _stream(plan: _Plan, cfg, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | ChunkedTensor]]:
    for item in plan.items:
        if _as_stored(item):
            yield item.name, load_tensor(item.parts[0][0], item.parts[0][1], dtype)
            continue
        parts = [_undo(_load_scaled(g, n), undo, cfg) for g, n, undo in item.parts]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=item.join_dim)
        yield item.name, t.to(dtype).contiguous()


# ---------------------------------------------------------------- public API


def convert_gguf(
    src: Path,
    dst: Path,
    *,
    mtp: Path | None = None,
    force: bool = False,
    dtype: torch.dtype | None = None,
    shard_size: int = 5 * 10**9,
    dflash: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
):
    """Convert a qwen35 / qwen35moe / qwen4exp GGUF (+ optional MTP head) into a unified checkpoint at `dst`.

    The MTP head comes from `mtp` if given (it replaces an embedded nextn block), else from the
    target's own nextn block, else from the one `mtp-*.gguf` beside the target (recorded in
    provenance.sources, nothing printed). `mtp` may also be an MTP pack (`gguf_mtp_pack.py`,
    validated against the target's config; its tensors already carry canonical names). Tensors are written as `dtype` (default bfloat16: the
    released checkpoints are bf16 and llama.cpp's F32 files hold their exact upcasts; pass
    torch.float32 to keep dequantized values unrounded). `dflash`: a DFlash draft directory
    converted with it (under `dflash.*`, `converters/dflash.py`; its tensors keep their dtype
    unless `dtype` is given). Everything is validated before writing. Returns the Manifest.
    """
    from freetoken import __version__
    from freetoken.checkpoint.manifest import Provenance, hash_file
    from freetoken.checkpoint.writer import write_checkpoint

    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        from freetoken.errors import OutputExistsError

        raise OutputExistsError("output exists (use --force to replace it)", dst)
    from freetoken.converters.gguf_mtp_pack import is_mtp_pack, read_mtp_pack

    target = open_gguf(src)
    if is_mtp_pack(target):
        raise FreetokenError("this is an MTP pack, not a target; pass it as --mtp next to its target", src)
    family = gguf_arch(target).family
    if target.mtp_only:
        raise FreetokenError("this is an MTP-only head, not a target; pass it as --mtp next to its target GGUF", src)
    head_path = Path(mtp) if mtp is not None else (None if target.has_mtp_block else find_mtp_sidecar(src))
    head = open_gguf(head_path) if head_path is not None else None
    pack = None
    if head is not None and is_mtp_pack(head):
        pack, head = head, None
    elif head is not None:
        check_pairing(target, head)

    tied = "output.weight" not in target.tensors
    cfg = config_from_meta(target, tied=tied)
    if pack is not None:
        pack = read_mtp_pack(pack, family, cfg)
        cfg = pack.config
    with_mtp = head is not None or (target.has_mtp_block and pack is None)  # an MTP head among the GGUF tensors
    n_mtp = head.nextn if head is not None else target.nextn
    if pack is None:
        cfg = replace(cfg, mtp_num_hidden_layers=n_mtp if with_mtp else 0)
    plan = _plan(target, head, cfg, drop_target_mtp=pack is not None)
    if pack is not None and target.has_mtp_block:
        plan.transforms.append(f"the target's own MTP block blk.{target.n_layer}.* replaced by the pack's head")
    if tied:
        plan.transforms.append("no output.weight: lm_head tied to token_embd")
    if head is not None and is_shared_head(head):
        plan.transforms.append(f"MTP head {head.path.name} shares token_embd/output with the target")
    _validate(plan, cfg, family, with_mtp, src)
    tok_files = tokenizer_files(target.meta, src)

    sources = tuple(hash_file(p) for p in target.paths + (head.paths if head is not None else []))
    provenance = Provenance(converter="gguf", freetoken_version=__version__, sources=sources, transforms=tuple(plan.transforms))
    config = cfg.to_dict()
    out_dtype = dtype if dtype is not None else torch.bfloat16
    tensors = _stream(plan, cfg, out_dtype)
    draft_heads = {"mtp": {"num_layers": n_mtp}} if with_mtp else {}
    if pack is not None:
        tensors, draft_heads, provenance = pack.attach(tensors, draft_heads, provenance, out_dtype)
    if dflash is not None:
        from freetoken.converters.dflash import read_dflash

        tensors, draft_heads, provenance = read_dflash(dflash, config).attach(tensors, draft_heads, provenance)
    return write_checkpoint(
        dst,
        family=family,
        config=config,
        tensors=tensors,
        draft_heads=draft_heads,
        tokenizer_files=tok_files,
        provenance=provenance,
        dtype=dtype,
        shard_size=shard_size,
        force=force,
        progress=progress,
    )


def describe_gguf(path: str | Path) -> dict[str, Any]:
    """Summary for `freetoken inspect`: architecture, depths, quant types, tensor count, size."""
    g = open_gguf(path)
    return {
        "path": str(g.path),
        "architecture": g.arch,
        "name": g.meta.get("general.name"),
        "block_count": g.block_count,
        "nextn_predict_layers": g.nextn,
        "trunk_layers": g.n_layer,
        "has_mtp_block": g.has_mtp_block,
        "mtp_only": g.mtp_only,
        "quant_types": dict(sorted(Counter(type_name(t.type_id) for t in g.tensors.values()).items())),
        "tensor_count": len(g.tensors),
        "vocab_size": len(g.meta.get("tokenizer.ggml.tokens") or []),
        "shards": len(g.paths),
        "file_size": sum(p.stat().st_size for p in g.paths),
    } | {label: show(g) for label, key, show in GGUF_DETAILS if g.key(key) is not None}


def _table_shape(g: GgufFile) -> str:
    t = g.tensors.get("per_layer_token_embd.weight")
    return "x".join(map(str, t.shape)) if t is not None else "-"


# architecture-specific rows of describe_gguf: (label, metadata key that must be present, formatter)
GGUF_DETAILS: tuple[tuple[str, str, Callable[[GgufFile], str]], ...] = (
    ("hyper_connections", "hyper_connection.count", lambda g: f"{g.key('hyper_connection.count')} streams, rank {g.key('hyper_connection.low_rank')}"),
    ("ple_layers", "ple.layers", lambda g: f"{list(g.key('ple.layers'))} (0-indexed), n-gram orders 2..{g.key('ple.ngram_size')} x {g.key('ple.heads_per_ngram')} heads"),
    ("ngram_table", "ple.layers", lambda g: f"{_table_shape(g)} (rows x head width), head sizes {list(g.key('ple.head_vocab_sizes', []))}"),
    ("qsa", "attention.indexer.head_count", lambda g: (
        f"budget {g.key('attention.indexer.top_k')}, compress ratios {list(g.key('attention.compress_ratios', []))}, "
        f"indexer {g.key('attention.indexer.head_count')} heads x {g.key('attention.indexer.key_length')}")),
)
