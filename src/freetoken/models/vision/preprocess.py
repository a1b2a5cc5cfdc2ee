"""Image files -> the vision tower's input: `pixel_values [sum t*h*w, 3 * temporal * patch^2]` and
grids (t, h, w) in patches, as transformers' Qwen2-VL image processor (its PIL backend) makes them.

An image is converted to RGB, resized with PIL's bicubic filter to the `smart_resize` size (each side a
multiple of patch x merge, the pixel count within bounds, the aspect ratio kept as well as that allows),
scaled to [0, 1], normalized per channel and cut into patches in merge-block order; a still image
fills the temporal patch by repetition (t = 1).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from freetoken.errors import FreetokenError
from freetoken.models.vision.config import ImageProcessing

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of factor, scaled into [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise FreetokenError(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds {MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(image: np.ndarray, proc: ImageProcessing) -> tuple[np.ndarray, tuple[int, int, int]]:
    """image [3, H, W] fp32 -> (patches [h*w, 3 * temporal * p^2] in merge-block order, grid (1, h, w))."""
    c, height, width = image.shape
    p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    h, w = height // p, width // p
    blocks = image.reshape(c, h // m, m, p, w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [h/m, w/m, m, m, c, p, p]
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    return frames.reshape(h * w, c * tp * p * p), (1, h, w)


def preprocess(images: Sequence, proc: ImageProcessing) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """PIL images -> (pixel_values [sum t*h*w, patch_dim] fp32, grids)."""
    from PIL import Image

    mean = np.asarray(proc.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(proc.image_std, dtype=np.float32)[:, None, None]
    patches, grids = [], []
    for image in images:
        height, width = smart_resize(
            image.height, image.width, proc.patch_size * proc.merge_size, proc.min_pixels, proc.max_pixels
        )
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), Image.Resampling.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
        flat, grid = patchify((pixels - mean) / std, proc)
        patches.append(flat)
        grids.append(grid)
    return torch.from_numpy(np.concatenate(patches)), grids
