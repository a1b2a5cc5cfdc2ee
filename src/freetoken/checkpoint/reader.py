"""Lazy reader of unified checkpoints.

`UnifiedCheckpoint.open` reads the manifest and checks every shard's safetensors header against
it and against the file size (a truncated or corrupt shard is caught here, not mid-load);
tensors are then read on demand through memory-mapped `safe_open` handles. `get_slice` reads one
range along one dimension without touching the rest of the tensor (for tensor parallel loading).

Layout: `read_safetensors_header` (validation shared with the converters), `UnifiedCheckpoint`,
`is_unified_checkpoint`.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken.checkpoint.manifest import FORMAT_NAME, MANIFEST_FILE, Manifest
from freetoken.errors import CheckpointError

_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Header of a safetensors file (name -> dtype/shape/data_offsets), checked against the file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if n < 2 or n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError("truncated or corrupt safetensors file (bad header length)", path)
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"cannot read safetensors file ({e.strerror})", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError("corrupt safetensors file (header is not JSON)", path) from None
    if not isinstance(header, dict):
        raise CheckpointError("corrupt safetensors file (header is not an object)", path)
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            info["shape"], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"corrupt safetensors file (bad entry for {name!r})", path) from None
        end = max(end, int(stop))
    if 8 + n + end != size:
        raise CheckpointError(f"truncated or corrupt safetensors file (data ends at byte {8 + n + end}, file has {size})", path)
    return header


def is_unified_checkpoint(path: str | Path) -> bool:
    """True if `path` is a directory whose manifest.json names the unified format."""
    manifest = Path(path) / MANIFEST_FILE
    try:
        return manifest.is_file() and json.loads(manifest.read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


class UnifiedCheckpoint:
    """An opened unified checkpoint; tensors are memory-mapped and read on demand."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self._handles: dict[str, object] = {}

    @classmethod
    def open(cls, path: str | Path) -> "UnifiedCheckpoint":
        path = Path(path)
        if not path.exists():
            raise CheckpointError("no such file or directory", path)
        manifest_path = path / MANIFEST_FILE
        if not path.is_dir() or not manifest_path.is_file():
            raise CheckpointError(f"not a unified checkpoint (no {MANIFEST_FILE})", path)
        manifest = Manifest.from_json(manifest_path.read_text(), manifest_path)
        by_shard: dict[str, list[str]] = {}
        for name, info in manifest.tensors.items():
            by_shard.setdefault(info["shard"], []).append(name)
        for shard, names in by_shard.items():
            shard_path = path / shard
            if not shard_path.is_file():
                raise CheckpointError(f"missing shard {shard}", path)
            header = read_safetensors_header(shard_path)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"tensor {name!r} listed in the manifest is not in the shard", shard_path)
                if list(header[name]["shape"]) != list(manifest.tensors[name]["shape"]):
                    raise CheckpointError(f"tensor {name!r} has shape {header[name]['shape']}, manifest says {manifest.tensors[name]['shape']}", shard_path)
        return cls(path, manifest)

    @property
    def family(self) -> str:
        return self.manifest.family

    @property
    def config(self) -> dict:
        return self.manifest.config

    @property
    def draft_heads(self) -> dict:
        return self.manifest.draft_heads

    def tensor_names(self) -> list[str]:
        return list(self.manifest.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tensors

    def _handle(self, name: str):
        info = self.manifest.tensors.get(name)
        if info is None:
            raise CheckpointError(f"no tensor {name!r} in this checkpoint", self.path)
        shard = info["shard"]
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.path / shard, framework="pt")
        return self._handles[shard]

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (memory-mapped read)."""
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`get(name)[..., start:stop, ...]` along `dim`, reading only that range."""
        sl = self._handle(name).get_slice(name)
        ndim = len(sl.get_shape())
        dim = dim % ndim if ndim else 0
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))
        return sl[index]

    @property
    def tokenizer_path(self) -> Path | None:
        file = self.manifest.tokenizer.get("file")
        return self.path / file if file else None

    @property
    def chat_template(self) -> str | None:
        return self.manifest.tokenizer.get("chat_template")

    @cached_property
    def size_on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())
