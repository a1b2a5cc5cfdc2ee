"""What the families' frozen config dataclasses share: their manifest form (tuples as JSON lists and
back) and the sizes a Gated DeltaNet / gated attention hybrid derives from its fields."""

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


class HybridLayout:
    """Mixin for a config with `layer_types` ("linear_attention" | "full_attention"), head_dim,
    partial_rotary_factor and the linear_* GDN fields (Hugging Face's names)."""

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN short convolution: [q | k | v]."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim
