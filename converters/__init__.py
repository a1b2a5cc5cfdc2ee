"""Converters from published checkpoint formats to the unified checkpoint.

`convert(src, dst, **opts)` detects the source format (`detect.py`) and dispatches to the
converter of that format, imported lazily so that `freetoken --help` stays fast:
  hf    -> `hf.convert_hf`        (Hugging Face safetensors directory or cached repo id)
  gguf  -> `gguf.convert_gguf`    (a .gguf file, optionally with an `mtp-*.gguf` sidecar)
`mtp=` may also be an MTP pack (`gguf_mtp_pack.py`: Strata's qwen4exp-mtp), for a GGUF or HF target without an MTP head.
  unified -> `unified.convert_unified` (only with `dflash=`: the checkpoint plus a DFlash draft)
Any target may take a DFlash draft directory (`dflash=`, read by `dflash.read_dflash`); a draft
passed as the source itself is refused, and so is a unified source without one.
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
        from freetoken.converters.gguf_mtp_pack import is_mtp_pack_file

        if mtp is not None and not is_mtp_pack_file(mtp):
            raise FreetokenError("--mtp applies to GGUF sources only, or to an MTP pack (a HF checkpoint carries its MTP head inside)", mtp)
        from freetoken.converters.hf import convert_hf

        return convert_hf(path, dst, force=force, dtype=dtype, text_only=text_only, shard_size=shard_size, mtp=mtp, dflash=dflash, progress=progress)
    if fmt == "gguf":
        from freetoken.converters.gguf import convert_gguf

        return convert_gguf(path, Path(dst), mtp=Path(mtp) if mtp else None, force=force, dtype=dtype, shard_size=shard_size, dflash=dflash, progress=progress)
    if fmt == "dflash":
        raise CheckpointError("a DFlash draft, not a target: pass it with --dflash next to its target", path)
    if fmt == "unified":
        if dflash is None:
            raise CheckpointError("already a unified checkpoint; nothing to convert (pass --dflash DRAFT_DIR to add a DFlash draft)", path)
        if mtp is not None or text_only:
            raise FreetokenError("a unified source is copied as it is: --mtp and --text-only do not apply (only --dflash, --dtype, --shard-size)", path)
        from freetoken.converters.unified import convert_unified

        return convert_unified(path, dst, dflash=dflash, force=force, dtype=dtype, shard_size=shard_size, progress=progress)
    raise UnsupportedModelError(f"no converter for {fmt} checkpoints yet", path)
