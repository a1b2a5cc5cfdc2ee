"""The unified checkpoint format: manifest, lazy reader (memory-mapped), atomic writer.

`docs/format.md` is the specification. Converters produce checkpoints with `write_checkpoint`;
the runtime opens them with `UnifiedCheckpoint.open`.
"""

from freetoken.checkpoint.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, Manifest, Provenance, SourceFile, hash_file
from freetoken.checkpoint.reader import UnifiedCheckpoint, is_unified_checkpoint, read_safetensors_header
from freetoken.checkpoint.writer import ChunkedTensor, write_checkpoint

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_FILE", "Manifest", "Provenance", "SourceFile", "hash_file",
    "UnifiedCheckpoint", "is_unified_checkpoint", "read_safetensors_header", "write_checkpoint", "ChunkedTensor",
]
