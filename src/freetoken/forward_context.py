"""What one model forward needs besides the token ids: where each sequence's rows are, where their
KV lives, which linear-attention state slot they own, and whether that state may change.

Built by the engine's runner for every step and passed explicitly down the layers (no globals).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunk or plain decode: linear-attention state advances in place
    VERIFY = "verify"  # speculative verify: state is read only; rows are stashed for the commit replay


@dataclass(frozen=True)
class SeqRows:
    """One sequence's share of a step."""

    row_start: int  # first row of this sequence in the flat batch
    num_rows: int  # rows this step (chunk length, 1 for decode, k+1 for verify)
    num_cached_tokens: int  # tokens already in the KV cache before this step
    block_table: torch.Tensor  # [max_blocks] int32, on the model's device
    state_slot: int  # row of the linear-attention state pool
    chunkable_end: int | None = None  # prefill: positions below it may take a chunked rule (whole prompt chunks); None: any
    # an image prompt's (start, n) -> [3, n] int64 mRoPE positions of its tokens start .. start + n - 1; None: token i sits at i
    token_positions: Callable[[int, int], torch.Tensor] | None = None

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_rows)


@dataclass(frozen=True)
class StateSpec:
    """A per-request state a model keeps besides the GDN conv window and recurrent state
    (`extra_state_specs` of a model): one [num_layers, slots, *shape] pool, zeroed for a new request."""

    name: str
    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the model's dtype


@dataclass
class KVCache:
    """Paged keys and values of every full-attention layer (draft layers appended after the target's)."""

    k: list[torch.Tensor]  # per attention layer: [num_slots, Hkv, D]
    v: list[torch.Tensor]
    block_size: int
    extra: list[torch.Tensor] = field(default_factory=list)  # per-token rows a model declares (`extra_kv_shapes`): [num_slots, *shape], same slots


@dataclass
class LinearState:
    """Gated DeltaNet state of every linear-attention layer, one slot per running request."""

    conv: torch.Tensor  # [L_gdn, slots, K-1, C] raw pre-conv inputs, model dtype
    recurrent: torch.Tensor  # [L_gdn, slots, Hv, Dk, Dv] fp32
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # StateSpec.name -> [num_layers, slots, *shape]


@dataclass
class GDNStash:
    """The verify step's recurrence inputs for all its rows, replayed by the commit.

    Rows keep the step's layout (each sequence's rows contiguous, at its row_start), so the commit
    reads the first accepted rows of each sequence in place.
    """

    conv_rows: torch.Tensor  # [N, C] raw pre-conv rows
    inputs: tuple[torch.Tensor, ...]  # (q, k, v, g, beta) fp32, or (conv_out, a, b) when `fused`
    fused: bool = False  # the recurrence prepares its inputs itself (the Triton path)


@dataclass(frozen=True)
class ImageEmbeds:
    """Rows of a step whose token embedding is replaced by an image feature."""

    rows: torch.Tensor  # [M] int64 rows of the step
    values: torch.Tensor  # [M, H] the features

    def apply(self, embeds: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return embeds.index_copy(0, self.rows, self.values.to(embeds.dtype))


@dataclass
class ForwardContext:
    mode: ForwardMode
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N], or [3, N] (t, h, w) when some row of an image prompt has unequal mRoPE rows
    slot_mapping: torch.Tensor  # [N] int64: KV slot of each row
    seqs: list[SeqRows]
    kv: KVCache
    linear_state: LinearState | None
    # VERIFY only: the rows each stateful layer keeps for its commit, keyed by the layer (a GDN layer by
    # its linear ordinal -> GDNStash; another layer by its own name, e.g. qwen4_exp's "ple.0" -> its gvn rows)
    stash: dict[int | str, Any] = field(default_factory=dict)
    image_embeds: ImageEmbeds | None = None  # image features replacing the embeddings of image-pad rows
