"""A request's images: the tower's input, the prompt layout they imply and, once encoded, their
features; what a forward over some of the request's rows needs from them (3-row positions, the
feature rows that replace image-pad embeddings); and what identifies the image content of some rows
for the prefix cache (every pad has the same token id, so a page key names the image by a hash of
its preprocessed pixels and grid)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class RequestImages:
    pixel_values: torch.Tensor  # [sum t*h*w, patch_dim] fp32, host
    grids: list[tuple[int, int, int]]  # (t, h, w) per image, in patches
    pad_spans: tuple[tuple[int, int], ...]  # [start, end) of each image's pad tokens in the prompt
    prompt_positions: torch.Tensor  # [3, prompt length] int64 (t, h, w)
    rope_delta: int  # a token at index i past the prompt sits at i + rope_delta
    features: torch.Tensor | None = None  # [sum of pad tokens, H] on the model's device, once encoded
    content_hashes: tuple[bytes, ...] = field(init=False)  # per image: a hash of its pixel rows and grid

    def __post_init__(self):
        self.content_hashes = image_content_hashes(self.pixel_values, self.grids)

    def has_pads_from(self, index: int) -> bool:
        """Whether an image-pad token sits at index or later (its feature is still needed there)."""
        return self.pad_spans[-1][1] > index

    def content_key(self, start: int, stop: int) -> tuple[tuple[bytes, int], ...]:
        """For each image with pads among indices start .. stop - 1: (its content hash, the place of the
        first of them among the image's pads)."""
        return tuple((digest, max(lo, start) - lo) for digest, (lo, hi) in zip(self.content_hashes, self.pad_spans) if lo < stop and start < hi)

    def positions(self, start: int, n: int) -> torch.Tensor:
        """[3, n] int64 positions of the tokens at indices start .. start + n - 1."""
        prompt_len = self.prompt_positions.shape[1]
        inside = self.prompt_positions[:, start : min(start + n, prompt_len)]
        past = torch.arange(max(start, prompt_len), max(start + n, prompt_len)) + self.rope_delta
        return torch.cat([inside, past.expand(3, -1)], dim=1)

    def feature_rows(self, start: int, n: int) -> tuple[list[int], list[int]]:
        """(offsets in [0, n), feature rows) of the image-pad tokens among indices start .. start + n - 1."""
        offsets, rows, before = [], [], 0
        for lo, hi in self.pad_spans:
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                offsets += range(a - start, b - start)
                rows += range(before + a - lo, before + b - lo)
            before += hi - lo
        return offsets, rows


def image_content_hashes(pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[bytes, ...]:
    """Per image, a 128-bit BLAKE2b hash of its preprocessed pixel rows (t*h*w of them, in order, with
    their dtype and width) and its (t, h, w) grid: equal for the same picture under the same
    preprocessing, so equal features and positions."""
    hashes, row = [], 0
    pixels = pixel_values.detach().cpu().contiguous()
    for grid in grids:
        rows = pixels[row : row + grid[0] * grid[1] * grid[2]]
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((tuple(grid), tuple(rows.shape), str(rows.dtype))).encode())
        digest.update(rows.view(torch.uint8).numpy())
        hashes.append(digest.digest())
        row += rows.shape[0]
    return tuple(hashes)
