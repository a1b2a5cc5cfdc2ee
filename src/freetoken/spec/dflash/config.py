"""The normalized config of a DFlash or DFlash2 draft: the unified checkpoint's `draft_heads["dflash"]` entry.

The converter (converters/dflash.py) builds it from a released draft's config.json; the runtime
(spec/dflash/draft.py) builds the draft from it. A DFlash2 draft (`architecture`
"DFlash2DraftModel") adds a grouped dynamic convolution around each sublayer and a candidate
selector (shared/reference/dflash.md §3): the `conv_*`, `selector_*` and `vocab_size` fields
(DFLASH2_FIELDS), None for DFlash.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from freetoken.errors import FreetokenError, UnsupportedModelError

LAYER_TYPES = ("full_attention", "sliding_attention")
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "vocab_size")


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
    conv_kernel_size: int | None = None  # DFlash2: taps of each sublayer's convolution over the block
    conv_group_size: int | None = None  # DFlash2: channels sharing one dynamic kernel value
    selector_rank: int | None = None  # DFlash2: rank of the selector's predecessor -> successor score
    selector_top_k: int | None = None  # DFlash2: candidates per slot (the top of the slot's logits)
    vocab_size: int | None = None  # DFlash2: the target's vocabulary, the rows of the selector's codebooks

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(f"DFlash draft architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        extra = {name: getattr(self, name) for name in DFLASH2_FIELDS}
        if self.is_dflash2:
            bad = {name: value for name, value in extra.items() if not (isinstance(value, int) and value >= 1)}
            if bad:
                raise FreetokenError(f"DFlash2 draft: {', '.join(f'{k} {v!r}' for k, v in bad.items())} (must be positive ints)")
            if self.selector_top_k > self.vocab_size:
                raise FreetokenError(f"DFlash2 draft: selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size} tokens)")
            if self.hidden_size % self.conv_group_size:
                raise FreetokenError(f"DFlash2 draft: conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        elif any(value is not None for value in extra.values()):
            raise FreetokenError(f"DFlash draft ({self.architecture}) with DFlash2 fields {[k for k, v in extra.items() if v is not None]}")
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
    def is_dflash2(self) -> bool:
        """A DFlash2 draft: convolutions around its sublayers, a candidate selector over its logits."""
        return self.architecture == "DFlash2DraftModel"

    @property
    def num_conv_groups(self) -> int:
        """DFlash2: dynamic kernel values per tap (hidden_size / conv_group_size)."""
        return self.hidden_size // self.conv_group_size

    @property
    def num_taps(self) -> int:
        """How many target layers feed the context (fc takes num_taps * hidden_size features)."""
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window W, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_dict(self) -> dict[str, Any]:
        """The manifest entry (lists for tuples, no DFlash2 fields for a DFlash draft); `from_dict` reads it back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if not (k in DFLASH2_FIELDS and v is None)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Build from the manifest entry; every field must be present (the DFlash2 ones may be left
        out for a DFlash draft) and nothing else."""
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in d and k not in DFLASH2_FIELDS]
        unexpected = sorted(set(d) - set(names))
        if missing or unexpected:
            raise FreetokenError(f"draft_heads['dflash']: missing keys {missing}, unexpected keys {unexpected}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
