"""Turns scheduled rows into a ForwardContext on the model's device, and runs the target over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.forward_context import ForwardContext, ForwardMode, SeqRows


@dataclass
class RowGroup:
    """Consecutive rows of one request: token ids at positions start, start+1, ..."""

    block_table: list[int]
    state_slot: int | None
    start: int
    token_ids: list[int]
    chunkable_end: int | None = None  # see SeqRows.chunkable_end


def build_context(groups: list[RowGroup], mode: ForwardMode, kv_pool: KVPool, state_pool: LinearStatePool | None, device: torch.device) -> ForwardContext:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seqs: list[SeqRows] = []
    for group in groups:
        n = len(group.token_ids)
        seqs.append(
            SeqRows(
                row_start=len(input_ids),
                num_rows=n,
                num_cached_tokens=group.start,
                block_table=torch.tensor(group.block_table, dtype=torch.int32, device=device),
                state_slot=-1 if group.state_slot is None else group.state_slot,
                chunkable_end=group.chunkable_end,
            )
        )
        input_ids += group.token_ids
        positions += range(group.start, group.start + n)
        slots += kv_pool.slots(group.block_table, group.start, group.start + n)
    return ForwardContext(
        mode=mode,
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        seqs=seqs,
        kv=kv_pool.cache,
        linear_state=state_pool.state if state_pool is not None else None,
    )


def run_target(model: torch.nn.Module, ctx: ForwardContext, export_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's forward -> (hidden [N, D], the outputs of export_layers [N, n * D], None
    when there are none: then the forward is the plain one)."""
    if not export_layers:
        return model(ctx), None
    return model(ctx, export_layers=export_layers)
