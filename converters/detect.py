"""Which kind of checkpoint a path holds, and where a Hugging Face repo id lives in the local cache.

`detect_format` answers "unified" (a freetoken manifest), "gguf" (a .gguf file), "dflash" (a HF-style
directory whose architecture is a DFlash draft) or "hf" (config.json + safetensors); anything else
is a one-line CheckpointError. `resolve_source` turns an `org/name` repo id into its cached snapshot
directory (offline only: freetoken never downloads).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from freetoken.checkpoint.reader import is_unified_checkpoint
from freetoken.errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
GGUF_MAGIC = b"GGUF"


def resolve_source(src: str | Path) -> Path:
    """A local path as-is, or an `org/name` repo id resolved in the local Hugging Face cache."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    if _REPO_ID.match(str(src)):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(src), local_files_only=True))
        except Exception:  # noqa: BLE001 - any hub failure means "not in the cache"
            raise CheckpointError("no such path, and not a repo id in the local Hugging Face cache (freetoken is offline; download it first)", src) from None
    raise CheckpointError("no such file or directory", src)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"unreadable config.json ({e})", path / "config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError("config.json is not a JSON object", path / "config.json")
    return config


def detect_format(path: str | Path) -> str:
    """"unified" | "hf" | "gguf" | "dflash" for an existing local path; CheckpointError otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError("no such file or directory", path)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == GGUF_MAGIC:
            return "gguf"
        if path.suffix == ".gguf":
            raise CheckpointError("not a GGUF file (bad magic)", path)
        raise CheckpointError("not a checkpoint: expected a .gguf file or a checkpoint directory", path)
    if is_unified_checkpoint(path):
        return "unified"
    if (path / "config.json").is_file():
        architectures = _read_config(path).get("architectures") or [""]
        if str(architectures[0]).startswith("DFlash"):
            return "dflash"
        if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
            return "hf"
        raise CheckpointError("config.json but no *.safetensors weights (only safetensors checkpoints are supported)", path)
    raise CheckpointError("not a checkpoint: no manifest.json, no config.json with safetensors, no .gguf", path)
