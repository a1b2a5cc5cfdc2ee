"""The vision tower of a unified checkpoint, filled from its `model.visual.*` tensors."""

from __future__ import annotations

from typing import Any

import torch

from freetoken.models.loader import TensorSource, fill_parameters
from freetoken.models.vision.config import VisionConfig
from freetoken.models.vision.tower import VisionTower

PREFIX = "model.visual."


@torch.no_grad()
def load_vision_tower(
    source: TensorSource,
    vision_config: dict[str, Any],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    origin: str | None = None,
) -> VisionTower:
    """The tower of the manifest's `vision_config`, in `dtype` on `device` (a CheckpointError naming
    `origin` for a missing or misshapen tensor)."""
    with torch.device("meta"):
        tower = VisionTower(VisionConfig.from_dict(vision_config))
    tower = tower.to_empty(device=device).to(dtype).eval()
    fill_parameters(tower, source.get, prefix=PREFIX, origin=origin)
    return tower
