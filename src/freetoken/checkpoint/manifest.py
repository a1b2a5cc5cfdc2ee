"""The manifest of a unified checkpoint: `manifest.json`, the one file that says what the directory holds.

It records the format name and version, the model family and its normalized config, the draft
heads present, the tokenizer, where the weights came from (source files with sha256, and what
the converter undid) and, per tensor, its shard, dtype and shape. `docs/format.md` specifies it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from freetoken.errors import CheckpointError

FORMAT_NAME = "freetoken-unified"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class SourceFile:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Provenance:
    converter: str  # "hf" | "gguf" | "strata" | "dflash" | "train"
    freetoken_version: str
    sources: tuple[SourceFile, ...]
    transforms: tuple[str, ...]  # what the converter undid, e.g. "experts fused from per-expert"


def hash_file(path: str | Path, chunk: int = 1 << 24) -> SourceFile:
    """sha256 and size of a file, read in chunks."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return SourceFile(path=str(path.absolute()), sha256=digest.hexdigest(), size=path.stat().st_size)


@dataclass(frozen=True)
class Manifest:
    family: str  # "qwen3_5"
    config: dict  # normalized config of the family (e.g. Qwen35Config.to_dict())
    draft_heads: dict[str, dict]  # {"mtp": {"num_layers": 1}}; {} when none
    tokenizer: dict  # {"file", "config_file", "chat_template", "eos_token_ids"}
    provenance: Provenance
    tensors: dict[str, dict]  # name -> {"shard": file, "dtype": "bfloat16", "shape": [..]}

    def to_json(self) -> str:
        d: dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
        d |= asdict(self)
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, path: str | Path) -> "Manifest":
        """Parse and validate; any problem raises CheckpointError naming `path`."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"manifest is not valid JSON ({e})", path) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"not a {FORMAT_NAME} manifest", path)
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"unsupported format_version {d.get('format_version')!r} (this freetoken reads {FORMAT_VERSION})", path)
        try:
            p = d["provenance"]
            provenance = Provenance(
                converter=str(p["converter"]),
                freetoken_version=str(p["freetoken_version"]),
                sources=tuple(SourceFile(str(s["path"]), str(s["sha256"]), int(s["size"])) for s in p["sources"]),
                transforms=tuple(str(t) for t in p["transforms"]),
            )
            manifest = cls(
                family=str(d["family"]),
                config=dict(d["config"]),
                draft_heads={str(k): dict(v) for k, v in d["draft_heads"].items()},
                tokenizer=dict(d["tokenizer"]),
                provenance=provenance,
                tensors={str(k): dict(v) for k, v in d["tensors"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"malformed manifest ({type(e).__name__}: {e})", path) from None
        for name, info in manifest.tensors.items():
            if not {"shard", "dtype", "shape"} <= info.keys():
                raise CheckpointError(f"malformed manifest entry for tensor {name!r}", path)
        return manifest
