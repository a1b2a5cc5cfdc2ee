"""A generation request and its progress through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from freetoken.engine.request_images import RequestImages
from freetoken.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # tokens whose KV and linear state are in the pools
    prefix_cut: int = 0  # the prefill ends a piece here, for the prefix cache to snapshot the state (0: nowhere)
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    draft_state: Any = None  # owned by the spec method
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_target_steps: int = 0  # decode/verify forwards that produced tokens for this request
    accepted_lens: list[int] = field(default_factory=list)  # accepted drafts per verify
    images: RequestImages | None = None  # the prompt's images (their pads already expanded in prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens processed by prefill: all but the last, which the first decode step feeds."""
        return self.num_tokens - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_cached_tokens < self.num_prefill_tokens

    def chunkable_end(self, prefill_align: int) -> int:
        """Positions below it may take the chunked GDN rule (layers/linear_attn.split_extend): the prompt's
        prefill rows in whole pieces of prefill_align, the same for a first prefill and for a recompute
        after preemption (whose prefill also covers the generated tokens)."""
        return (len(self.prompt_token_ids) - 1) // prefill_align * prefill_align

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
