"""User-facing errors.

Anything the user can cause (a wrong path, a corrupt file, an unsupported config) raises
`FreetokenError` with a one-line message that names the file and the problem. The CLI prints it
without a traceback and exits non-zero; every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class FreetokenError(Exception):
    """A problem with the user's input, reported as one line."""

    def __init__(self, message: str, path: str | Path | None = None):
        self.path = str(path) if path is not None else None
        super().__init__(f"{self.path}: {message}" if self.path else message)


class CheckpointError(FreetokenError):
    """A checkpoint that is missing, corrupt, truncated or not of a supported kind."""


class UnsupportedModelError(FreetokenError):
    """A config or architecture freetoken does not run."""


class OutputExistsError(FreetokenError):
    """The output path exists and `--force` was not given."""
