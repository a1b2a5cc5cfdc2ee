"""A request's images: the tower's input, the prompt layout they imply and, once encoded, their
features; and what a forward over some of the request's rows needs from them (3-row positions, the
feature rows that replace image-pad embeddings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestImages:
    pixel_values: torch.Tensor  # [sum t*h*w, patch_dim] fp32, host
    grids: list[tuple[int, int, int]]  # (t, h, w) per image, in patches
    pad_spans: tuple[tuple[int, int], ...]  # [start, end) of each image's pad tokens in the prompt
    prompt_positions: torch.Tensor  # [3, prompt length] int64 (t, h, w)
    rope_delta: int  # a token at index i past the prompt sits at i + rope_delta
    features: torch.Tensor | None = None  # [sum of pad tokens, H] on the model's device, once encoded

    @property
    def first_pad(self) -> int:
        """Index of the prompt's first image-pad token (no prefix reaching it may be shared)."""
        return self.pad_spans[0][0]

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
