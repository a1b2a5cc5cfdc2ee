"""Turns scheduled rows into a ForwardContext on the model's device, and runs the target over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.request_images import RequestImages
from freetoken.forward_context import ForwardContext, ForwardMode, ImageEmbeds, SeqRows


@dataclass
class RowGroup:
    """Consecutive rows of one request: token ids at positions start, start+1, ...

    A request with images gives its rows the images' positions (RequestImages.positions) and, for rows
    whose token is an image pad, its feature instead of the token's embedding; token_offset: the rows'
    tokens are those at indices start + token_offset, ... of the request (an MTP row at position t
    reads token t + 1)."""

    block_table: list[int]
    state_slot: int | None
    start: int
    token_ids: list[int]
    chunkable_end: int | None = None  # see SeqRows.chunkable_end
    images: RequestImages | None = None
    token_offset: int = 0

    @property
    def rope_delta(self) -> int:
        return 0 if self.images is None else self.images.rope_delta


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
                token_positions=None if group.images is None else group.images.positions,
            )
        )
        input_ids += group.token_ids
        positions += range(group.start, group.start + n)
        slots += kv_pool.slots(group.block_table, group.start, group.start + n)
    return ForwardContext(
        mode=mode,
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=_positions(groups, positions, device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        seqs=seqs,
        kv=kv_pool.cache,
        linear_state=state_pool.state if state_pool is not None else None,
        image_embeds=_image_embeds(groups, device),
    )


def _positions(groups: list[RowGroup], plain: list[int], device: torch.device) -> torch.Tensor:
    """[N] positions (plain: each group's start, start + 1, ...), shifted by a request's rope_delta past its
    prompt; [3, N] when some row of an image prompt has unequal (t, h, w)."""
    if all(group.images is None for group in groups):
        return torch.tensor(plain, dtype=torch.long, device=device)
    rows = torch.cat([torch.tensor(range(g.start, g.start + len(g.token_ids))).expand(3, -1) if g.images is None
                      else g.images.positions(g.start, len(g.token_ids)) for g in groups], dim=1)
    if bool((rows == rows[0]).all()):
        rows = rows[0]
    return rows.to(device=device, dtype=torch.long).contiguous()


def _image_embeds(groups: list[RowGroup], device: torch.device) -> ImageEmbeds | None:
    """The feature rows of the groups' image-pad tokens, None if there are none."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    row_start = 0
    for group in groups:
        if group.images is not None:
            offsets, feature_rows = group.images.feature_rows(group.start + group.token_offset, len(group.token_ids))
            if offsets:
                rows += [row_start + o for o in offsets]
                values.append(group.images.features[torch.tensor(feature_rows, device=group.images.features.device)])
        row_start += len(group.token_ids)
    if not rows:
        return None
    return ImageEmbeds(torch.tensor(rows, dtype=torch.long, device=device), torch.cat(values).to(device))


def run_target(model: torch.nn.Module, ctx: ForwardContext, export_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's forward -> (hidden [N, D], the outputs of export_layers [N, n * D], None
    when there are none: then the forward is the plain one)."""
    if not export_layers:
        return model(ctx), None
    return model(ctx, export_layers=export_layers)
