"""The image prompt layout: placeholder expansion and mRoPE positions (transformers' `get_rope_index`).

A prompt names each image by one `<|image_pad|>` token between `<|vision_start|>` and `<|vision_end|>`;
expansion repeats it t*h*w / merge^2 times (one token per merged feature). Positions have three rows
(t, h, w): a text token at running position p gets (p, p, p); an image whose pads start at running
position s gets (s + frame, s + row, s + col) over its merged grid, and the running position after it
is s + max(h, w) / merge. rope_delta = max position + 1 - prompt length: a token at index i past the
prompt sits at i + rope_delta on all three rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from freetoken.errors import FreetokenError


@dataclass(frozen=True)
class ImageLayout:
    token_ids: list[int]  # the expanded prompt
    pad_spans: tuple[tuple[int, int], ...]  # [start, end) of each image's pad tokens in token_ids
    positions: torch.Tensor  # [3, len(token_ids)] int64 (t, h, w)
    rope_delta: int


def merged_token_count(grid: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid
    return t * h * w // merge**2


def expand_image_pads(token_ids: Sequence[int], image_pad_id: int, counts: Sequence[int]) -> list[int]:
    """token_ids with its i-th image pad token repeated counts[i] times; an error unless there is one pad per image."""
    found = sum(1 for t in token_ids if t == image_pad_id)
    if found != len(counts):
        raise FreetokenError(f"the prompt has {found} image placeholder(s) for {len(counts)} image(s)")
    out: list[int] = []
    images = iter(counts)
    for t in token_ids:
        out += [t] * next(images) if t == image_pad_id else [t]
    return out


def image_layout(token_ids: Sequence[int], image_pad_id: int, grids: Sequence[tuple[int, int, int]], merge: int) -> ImageLayout:
    """Expand the prompt's image pads (one per image, in order) and compute its mRoPE positions."""
    expanded = expand_image_pads(token_ids, image_pad_id, [merged_token_count(g, merge) for g in grids])
    rows: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    index, pos = 0, 0
    for t, h, w in grids:
        start = expanded.index(image_pad_id, index)
        text = torch.arange(start - index) + pos
        rows.append(text.expand(3, -1))
        pos += start - index
        gh, gw = h // merge, w // merge
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        rows.append(torch.stack([frame, row, col]).reshape(3, -1) + pos)
        spans.append((start, start + t * gh * gw))
        index, pos = start + t * gh * gw, pos + max(gh, gw)
    rows.append((torch.arange(len(expanded) - index) + pos).expand(3, -1))
    positions = torch.cat(rows, dim=1).to(torch.int64)
    return ImageLayout(expanded, tuple(spans), positions, int(positions.max()) + 1 - len(expanded))
