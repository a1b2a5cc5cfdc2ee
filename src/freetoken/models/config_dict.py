"""The manifest form of a family's frozen config dataclass: tuples as JSON lists and back."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, TypeVar

T = TypeVar("T")


class ManifestConfig:
    """Mixin for a frozen config dataclass: `to_dict()` for the unified manifest, `from_dict()` to read it
    back (unknown keys ignored, lists become tuples)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {key: list(value) if isinstance(value, tuple) else value for key, value in d.items()}

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        names = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})
