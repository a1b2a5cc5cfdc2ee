"""The normalized config of a DFlash (v1) draft: the unified checkpoint's `draft_heads["dflash"]` entry.

The converter (converters/dflash.py) builds it from a released draft's config.json; the runtime
(spec/dflash/draft.py) builds the draft from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from freetoken.errors import FreetokenError, UnsupportedModelError

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DFlashConfig:
    """The unified checkpoint's `draft_heads["dflash"]` entry."""

    architecture: str
    hidden_size: int  # equals the target's: the block embeddings come from its table
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # B: the anchor plus B-1 mask slots
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # the feature of id L is the output of target decoder layer L
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]  # per layer: block queries see only keys at positions <= their own
    attention_bias: bool

    def __post_init__(self):
        if self.architecture != "DFlashDraftModel":
            raise UnsupportedModelError(f"DFlash draft architecture {self.architecture!r} (supported: DFlashDraftModel)")
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.causal) != n or any(t not in LAYER_TYPES for t in self.layer_types):
            raise FreetokenError(f"DFlash draft: layer_types {list(self.layer_types)} / causal {list(self.causal)} do not fit {n} layers")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise FreetokenError(f"DFlash draft: sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if self.attention_bias:
            raise UnsupportedModelError("DFlash draft with attention_bias")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FreetokenError(f"DFlash draft: {self.num_attention_heads} query heads over {self.num_key_value_heads} KV heads")

    @property
    def num_taps(self) -> int:
        """How many target layers feed the context (fc takes num_taps * hidden_size features)."""
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window W, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_dict(self) -> dict[str, Any]:
        """The manifest entry (lists for tuples); `from_dict` reads it back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Build from the manifest entry; every field must be present and nothing else."""
        names = [f.name for f in fields(cls)]
        missing, unexpected = [k for k in names if k not in d], sorted(set(d) - set(names))
        if missing or unexpected:
            raise FreetokenError(f"draft_heads['dflash']: missing keys {missing}, unexpected keys {unexpected}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
