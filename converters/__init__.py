"""Converters from published checkpoint formats to the unified checkpoint.

`convert(src, dst, **opts)` detects the source format (`detect.py`) and dispatches to the
converter of that format, imported lazily so that `freetoken --help` stays fast:
  hf    -> `hf.convert_hf`        (Hugging Face safetensors directory or cached repo id)
  gguf  -> `gguf.convert_gguf`    (a .gguf file, optionally with an `mtp-*.gguf` sidecar)
Either target may take a DFlash draft directory (`dflash=`, read by `dflash.read_dflash`); a draft
passed as the source itself is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from freetoken.errors import CheckpointError, FreetokenError, UnsupportedModelError


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    force: bool = False,
    dtype=None,  # torch.dtype | None: cast floating tensors; None keeps the source dtype
    text_only: bool = False,
    shard_size: int = 5 * 10**9,
    mtp: str | Path | None = None,
    dflash: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
):
    """Convert `src` (and the DFlash draft directory `dflash`, if given) into a unified checkpoint at `dst`; returns its Manifest."""
    from freetoken.converters.detect import detect_format, resolve_source

    path = resolve_source(src)
    fmt = detect_format(path)
    if fmt == "hf":
        if mtp is not None:
            raise FreetokenError("--mtp applies to GGUF sources only (a HF checkpoint carries its MTP head inside)", mtp)
        from freetoken.converters.hf import convert_hf

        return convert_hf(path, dst, force=force, dtype=dtype, text_only=text_only, shard_size=shard_size, dflash=dflash, progress=progress)
    if fmt == "gguf":
        from freetoken.converters.gguf import convert_gguf

        return convert_gguf(path, Path(dst), mtp=Path(mtp) if mtp else None, force=force, dtype=dtype, shard_size=shard_size, dflash=dflash, progress=progress)
    if fmt == "dflash":
        raise CheckpointError("a DFlash draft, not a target: pass it with --dflash next to its target", path)
    if fmt == "unified":
        raise CheckpointError("already a unified checkpoint; nothing to convert", path)
    raise UnsupportedModelError(f"no converter for {fmt} checkpoints yet", path)
