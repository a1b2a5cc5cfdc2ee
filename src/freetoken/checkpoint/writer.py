"""Atomic, streaming writer of unified checkpoints.

Tensors arrive one at a time from a converter's iterator and are packed into safetensors shards
of at most `shard_size` bytes (a larger tensor gets a shard of its own); at most one shard is held
in memory. A tensor too large to hold at all (Qwen3.8-Flash-Next's ~95 GiB n-gram table) arrives
as a `ChunkedTensor`: its pieces are read and written one at a time when its shard is written. Everything is written into a hidden temporary sibling of `dst` which is renamed into
place only when complete, so a failed or interrupted conversion (any exception, Ctrl-C included)
leaves nothing behind, and `--force` replaces an old checkpoint only once the new one is whole.

Layout: `write_checkpoint` (the public entry), `ChunkedTensor`, `_ShardPacker` (grouping into
shards), `write_safetensors` (one file in the safetensors layout: u64 header length, JSON header,
data).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.checkpoint.manifest import MANIFEST_FILE, Manifest, Provenance
from freetoken.errors import CheckpointError, OutputExistsError

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


@dataclass(frozen=True)
class ChunkedTensor:
    """A tensor given as pieces that concatenate on dim 0, produced one at a time by `chunks()`
    (called once, when the tensor is written); the writer checks every piece's dtype and shape."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def to(self, dtype: torch.dtype) -> "ChunkedTensor":
        """The same pieces, each cast to `dtype` as it is produced."""
        chunks = self.chunks
        return ChunkedTensor(self.shape, dtype, lambda: (c.to(dtype) for c in chunks()))


def _nbytes(t: torch.Tensor | ChunkedTensor) -> int:
    return t.nbytes if isinstance(t, ChunkedTensor) else t.numel() * t.element_size()


def _write_tensor(f, t: torch.Tensor) -> None:
    """t's bytes, row-major, appended to the open file f (a copy to the CPU if needed)."""
    f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_chunks(f, name: str, t: ChunkedTensor) -> None:
    rows = 0
    for chunk in t.chunks():
        if chunk.dtype != t.dtype or tuple(chunk.shape[1:]) != tuple(t.shape[1:]):
            raise CheckpointError(f"tensor {name!r}: a piece of dtype {chunk.dtype} and shape {list(chunk.shape)} does not fit {t.dtype} {list(t.shape)}")
        rows += chunk.shape[0]
        if rows > t.shape[0]:
            break
        _write_tensor(f, chunk)
    if rows != t.shape[0]:
        raise CheckpointError(f"tensor {name!r}: its pieces hold {rows} rows, expected {t.shape[0]}")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the spelling used in manifests)."""
    return str(dtype).removeprefix("torch.")


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor | ChunkedTensor]]) -> None:
    """Write `tensors` in the safetensors layout; tensors may share storage (each is copied out),
    a ChunkedTensor is written piece by piece."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        n = _nbytes(t)
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, t in tensors:
            if isinstance(t, ChunkedTensor):
                _write_chunks(f, name, t)
            else:
                _write_tensor(f, t)
        f.flush()
        os.fsync(f.fileno())


class _ShardPacker:
    """Groups tensors into shards of <= shard_size bytes, writing each shard when it is full."""

    def __init__(self, root: Path, shard_size: int):
        self.root, self.shard_size = root, shard_size
        self.pending: list[tuple[str, torch.Tensor | ChunkedTensor]] = []
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # names per written shard, in order

    def add(self, name: str, t: torch.Tensor | ChunkedTensor) -> None:
        n = _nbytes(t)
        if self.pending and self.pending_bytes + n > self.shard_size:
            self.flush()
        self.pending.append((name, t))
        self.pending_bytes += n

    def flush(self) -> None:
        if not self.pending:
            return
        write_safetensors(self.root / f".shard-{len(self.shards):05d}", self.pending)
        self.shards.append([name for name, _ in self.pending])
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> dict[str, str]:
        """Give the shards their final names (model-0000i-of-0000N) and return name -> shard file."""
        self.flush()
        where: dict[str, str] = {}
        total = len(self.shards)
        for i, names in enumerate(self.shards):
            file = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(self.root / f".shard-{i:05d}", self.root / file)
            where |= {name: file for name in names}
        return where


def _tokenizer_entry(tokenizer_files: dict[str, bytes], eos_token_ids: list[int]) -> dict:
    chat_template = None
    if "chat_template.jinja" in tokenizer_files:
        chat_template = tokenizer_files["chat_template.jinja"].decode()
    elif "tokenizer_config.json" in tokenizer_files:
        template = json.loads(tokenizer_files["tokenizer_config.json"]).get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        chat_template = template if isinstance(template, str) else None
    return {
        "file": "tokenizer.json" if "tokenizer.json" in tokenizer_files else None,
        "config_file": "tokenizer_config.json" if "tokenizer_config.json" in tokenizer_files else None,
        "chat_template": chat_template,
        "eos_token_ids": [int(i) for i in eos_token_ids],
    }


def write_checkpoint(
    dst: Path,
    *,
    family: str,
    config: dict,
    tensors: Iterable[tuple[str, torch.Tensor | ChunkedTensor]],
    draft_heads: dict[str, dict],
    tokenizer_files: dict[str, bytes],
    provenance: Provenance,
    dtype: torch.dtype | None = None,
    shard_size: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write a unified checkpoint at `dst` atomically and return its manifest.

    Floating tensors are cast to `dtype` when given (integer tensors never are). `progress` gets
    the byte count of each tensor after it is taken. An existing `dst` raises OutputExistsError
    unless `force`, in which case it is replaced once the new checkpoint is complete.
    """
    dst = Path(dst)
    if dst.exists() and not force:
        raise OutputExistsError("output exists (use --force to replace it)", dst)
    if shard_size <= 0:
        raise CheckpointError(f"shard size must be positive, got {shard_size}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        packer = _ShardPacker(tmp, int(shard_size))
        entries: dict[str, dict] = {}
        for name, t in tensors:
            if name in entries:
                raise CheckpointError(f"duplicate tensor name {name!r}", dst)
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            entries[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            packer.add(name, t)
            if progress is not None:
                progress(_nbytes(t))
        for name, file in packer.finish().items():
            entries[name] = {"shard": file} | entries[name]
        for file, data in tokenizer_files.items():
            (tmp / file).write_bytes(data)
        manifest = Manifest(
            family=family,
            config=config,
            draft_heads=draft_heads,
            tokenizer=_tokenizer_entry(tokenizer_files, config.get("eos_token_ids") or []),
            provenance=provenance,
            tensors=entries,
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        _move_into_place(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _move_into_place(tmp: Path, dst: Path, force: bool) -> None:
    if not dst.exists():
        os.rename(tmp, dst)
        return
    if not force:
        raise OutputExistsError("output appeared while converting (use --force to replace it)", dst)
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()
