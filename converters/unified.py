"""A unified checkpoint plus a DFlash draft directory -> a new unified checkpoint.

The source's tensors (bit for bit, unless `dtype` casts them), config, family, draft heads,
tokenizer files and provenance are carried over unchanged; `read_dflash(...).attach(...)` adds the
draft exactly as the HF and GGUF converters do. Files outside the format (anything but the
manifest, the shards and the tokenizer files) are not copied. A source that already holds a DFlash
draft is refused: replacing a draft is a conversion from the target's original checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from freetoken.checkpoint import Manifest, UnifiedCheckpoint, write_checkpoint
from freetoken.converters.hf import TOKENIZER_FILES
from freetoken.errors import CheckpointError, OutputExistsError


def _tensors(source: UnifiedCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    for name in source.tensor_names():
        yield name, source.get(name)


def convert_unified(
    src: Path,
    dst: str | Path,
    *,
    dflash: str | Path,
    force: bool = False,
    dtype: torch.dtype | None = None,
    shard_size: int = 5 * 10**9,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write `src` with the DFlash draft directory `dflash` added as a new unified checkpoint at `dst`."""
    from freetoken.converters.dflash import read_dflash

    dst = Path(dst)
    if dst.exists() and not force:
        raise OutputExistsError("output exists (use --force to replace it)", dst)
    if dst.exists() and dst.resolve() == Path(src).resolve():
        raise CheckpointError("the output is the source checkpoint; write to a new directory", dst)
    source = UnifiedCheckpoint.open(src)
    if "dflash" in source.draft_heads:
        raise CheckpointError("the checkpoint already has a DFlash draft (draft_heads['dflash']); add a draft to a checkpoint without one", src)
    manifest = source.manifest
    tensors, draft_heads, provenance = read_dflash(dflash, manifest.config).attach(_tensors(source), manifest.draft_heads, manifest.provenance)
    tokenizer_files = {name: (source.path / name).read_bytes() for name in TOKENIZER_FILES if (source.path / name).is_file()}
    return write_checkpoint(
        dst,
        family=manifest.family,
        config=manifest.config,
        tensors=tensors,
        draft_heads=draft_heads,
        tokenizer_files=tokenizer_files,
        provenance=provenance,
        dtype=dtype,
        shard_size=int(shard_size),
        force=force,
        progress=progress,
    )
