"""MTP packs (a GGUF holding only an MTP head, under its Hugging Face names) -> the `mtp.*` part of a unified checkpoint.

Why: Strata builds its own qwen4_exp MTP head from the official BF16 checkpoint for targets that
ship none (shared/reference/gguf.md §3). Its pack has `general.architecture = "qwen4exp-mtp"`,
`strata.mtp.*` keys naming its source, and tensors named exactly as HF names them (`mtp.*`: no
llama.cpp renaming, no +1 on norms, no V reorder): 1-D F32, dense BF16, the fused routed experts
quantized along their input axis (Q2_0 / Q4_0 / Q8_0 / BF16). It has no trunk hyper-parameters, so
it is validated against the target's normalized config.

Layout: `PACK_FORMATS` (pack architecture -> `PackFormat`), `is_mtp_pack` / `is_mtp_pack_file`,
`MtpPack` (its `attach` adds the head to a target's tensors, draft heads and provenance),
`read_mtp_pack` (validation, before any weight is read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from freetoken.checkpoint import ChunkedTensor, Provenance, SourceFile, hash_file
from freetoken.converters.gguf_quants import QUANT_TYPES, type_name
from freetoken.errors import CheckpointError, FreetokenError, UnsupportedModelError

PREFIX = "mtp."


@dataclass(frozen=True)
class PackFormat:
    family: str  # freetoken family of the targets it belongs to
    producer: str  # who writes it, for messages and provenance
    keys: tuple[str, ...]  # metadata keys it must carry, recorded in provenance
    types: tuple[str, ...]  # tensor types it may hold


PACK_FORMATS: dict[str, PackFormat] = {
    "qwen4exp-mtp": PackFormat(
        family="qwen4_exp",
        producer="Strata",
        keys=("strata.mtp.source", "strata.mtp.source_sha256", "strata.mtp.expert_format", "strata.mtp.expert_quantizer"),
        types=("F32", "BF16", "Q8_0", "Q4_0", "Q2_0"),
    ),
}


def is_mtp_pack(g) -> bool:
    """Whether an opened GGUF (`gguf.GgufFile`) is an MTP pack of a registered format."""
    return g.arch in PACK_FORMATS


def is_mtp_pack_file(path: str | Path) -> bool:
    """Whether `path` is a readable GGUF holding an MTP pack (False for anything else, missing files included)."""
    from freetoken.converters.gguf import open_gguf

    try:
        return is_mtp_pack(open_gguf(path))
    except FreetokenError:
        return False


@dataclass
class MtpPack:
    file: Any  # gguf.GgufFile
    format: PackFormat
    config: Any  # the target's normalized config, with mtp_num_hidden_layers set to the pack's
    sources: tuple[SourceFile, ...]

    def transforms(self) -> list[str]:
        """Provenance notes: where the head came from (the pack's source keys) and what was dequantized."""
        g = self.file
        keys = ", ".join(f"{k}={g.meta[k]}" for k in self.format.keys)
        types = Counter(type_name(t.type_id) for t in g.tensors.values())
        listed = ", ".join(f"{k} x{v}" for k, v in sorted(types.items()))
        return [
            f"MTP head {PREFIX}* ({len(g.tensors)} tensors, names as in HF) from {self.format.producer} pack {g.path.name} ({keys})",
            f"MTP pack tensors dequantized to the output dtype: {listed}",
        ]

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | ChunkedTensor]]:
        """The pack's tensors, dequantized and cast to `dtype`; the large ones in row blocks."""
        from freetoken.converters.gguf import load_tensor

        for name in self.file.tensors:
            yield name, load_tensor(self.file, name, dtype)

    def attach(
        self, tensors: Iterable[tuple[str, Any]], draft_heads: dict[str, dict], provenance: Provenance, dtype: torch.dtype,
    ) -> tuple[Iterator[tuple[str, Any]], dict[str, dict], Provenance]:
        """A target's tensors, draft heads and provenance with this MTP head added (its tensors as `dtype`)."""
        provenance = replace(provenance, sources=provenance.sources + self.sources, transforms=(*provenance.transforms, *self.transforms()))
        heads = {"mtp": {"num_layers": self.config.mtp_num_hidden_layers}} | draft_heads
        return chain(tensors, self.tensors(dtype)), heads, provenance


def read_mtp_pack(g, family: str, cfg: Any) -> MtpPack:
    """Validate an opened MTP pack (`gguf.GgufFile`) against a target of `family` with normalized config `cfg`.

    Every MTP tensor the family expects must be there with the shape `cfg` implies, nothing else,
    in a type the format allows, quantized in whole blocks along the input axis. Any problem is a
    one-line CheckpointError / UnsupportedModelError naming the pack. No weight is read here.
    """
    from freetoken.models.registry import weight_rules
    from freetoken.models.weight_rules import mtp_layer_count

    path = g.path
    fmt = PACK_FORMATS.get(g.arch)
    if fmt is None:
        raise CheckpointError(f"not an MTP pack: general.architecture is {g.arch!r} (packs: {', '.join(PACK_FORMATS)})", path)
    if family != fmt.family:
        raise UnsupportedModelError(f"a {fmt.producer} MTP pack ({g.arch}) belongs to a {fmt.family} target, not {family}", path)
    missing_keys = [k for k in fmt.keys if k not in g.meta]
    if missing_keys:
        raise CheckpointError(f"{fmt.producer} MTP pack lacks metadata {', '.join(missing_keys)}", path)
    for name, t in g.tensors.items():
        kind = type_name(t.type_id)
        if kind not in fmt.types:
            raise CheckpointError(f"tensor {name} is {kind}; a {g.arch} pack holds {', '.join(fmt.types)} only", path)
        block = QUANT_TYPES[t.type_id].block_size
        if t.shape[-1] % block:
            raise CheckpointError(f"tensor {name}: input width {t.shape[-1]} is not whole {kind} blocks of {block}", path)
    cfg = replace(cfg, mtp_num_hidden_layers=mtp_layer_count(g.tensors) or 1)
    want = {n: s for n, s in weight_rules(family).expected_tensors(cfg, with_mtp=True).items() if n.startswith(PREFIX)}
    unknown = sorted(set(g.tensors) - set(want))
    if unknown:
        raise CheckpointError(f"unknown tensor {unknown[0]} (not part of a {family} MTP head; {len(unknown)} in all)", path)
    missing = sorted(set(want) - set(g.tensors))
    if missing:
        raise CheckpointError(f"MTP pack lacks {len(missing)} tensors of the head, e.g. {missing[0]}", path)
    for name, shape in want.items():
        if tuple(g.tensors[name].shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(g.tensors[name].shape)}, the target's config implies {list(shape)}", path)
    return MtpPack(g, fmt, cfg, tuple(hash_file(p) for p in g.paths))
