"""`freetoken convert SRC DST [--mtp HEAD] [--dflash DRAFT]`: any supported checkpoint (and an MTP head or DFlash draft for it) -> unified checkpoint, with a byte progress bar.

A unified SRC is accepted only with --dflash: it is copied with the draft added.

The source format is detected (`freetoken.converters.detect`); the work is done by
`freetoken.converters.convert`. Errors the user can fix are FreetokenError and propagate to the
app's `main()`, which prints them as one line.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from freetoken.errors import FreetokenError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class DType(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def parse_size(text: str) -> int:
    """"5GB" -> 5_000_000_000, "512MiB" -> 536_870_912, "1000" -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].upper() not in _UNITS or float(m[1]) <= 0:
        raise FreetokenError(f"bad --shard-size {text!r} (use e.g. 5GB, 500MB, 2GiB)")
    return int(float(m[1]) * _UNITS[m[2].upper()])


def _weight_bytes(src: str | None) -> int:
    """Bytes of weights in a file or a directory's *.safetensors; 0 when absent."""
    if not src:
        return 0
    path = Path(src)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return 0


def _source_bytes(src: str, mtp: str | None, dflash: str | None) -> int:
    """Bytes of weights to convert, for the progress bar's total (an estimate when casting)."""
    return _weight_bytes(src) + _weight_bytes(mtp) + _weight_bytes(dflash)


def convert(
    src: Annotated[str, typer.Argument(help="HF checkpoint directory, cached HF repo id (org/name), .gguf file, or a unified checkpoint (with --dflash: adds the draft).")],
    dst: Annotated[str, typer.Argument(help="Output directory for the unified checkpoint.")],
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists (only once the new one is complete).")] = False,
    dtype: Annotated[DType, typer.Option("--dtype", help="Cast floating tensors; auto keeps the source dtype.")] = DType.auto,
    text_only: Annotated[bool, typer.Option("--text-only", help="Drop the vision tower (model.visual.*).")] = False,
    shard_size: Annotated[str, typer.Option("--shard-size", help="Maximum shard size, e.g. 5GB or 2GiB.")] = "5GB",
    mtp: Annotated[str | None, typer.Option("--mtp", help="GGUF sources: a separate mtp-*.gguf MTP head; GGUF or HF qwen4_exp sources without a head: a Strata MTP pack.")] = None,
    dflash: Annotated[str | None, typer.Option("--dflash", help="A DFlash draft directory (config.json + model.safetensors) for this target, stored under dflash.*.")] = None,
) -> None:
    """Convert a checkpoint into freetoken's unified format."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from freetoken.converters import convert as run_convert

    size = parse_size(shard_size)
    cast = None if dtype == DType.auto else getattr(torch, dtype.value)
    console = Console(stderr=True)
    columns = (TextColumn("converting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("convert", total=_source_bytes(src, mtp, dflash) or None)
        manifest = run_convert(
            src, dst, force=force, dtype=cast, text_only=text_only, shard_size=size, mtp=mtp, dflash=dflash,
            progress=lambda n: bar.advance(task, n),
        )
    shards = len({info["shard"] for info in manifest.tensors.values()})
    heads = ", ".join(manifest.draft_heads) or "none"
    console.print(f"wrote {dst}: {len(manifest.tensors)} tensors in {shards} shard(s), family {manifest.family}, draft heads: {heads}")
