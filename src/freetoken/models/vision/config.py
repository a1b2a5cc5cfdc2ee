"""Normalized configs of the vision tower (`vision_config` of a manifest) and of the image
preprocessing (`image_processing`: a checkpoint's preprocessor_config.json, or Qwen3-VL's defaults
scaled to the patch size)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Qwen3-VL's preprocessor_config.json for 16-px patches: 256x256 .. 4096x4096 pixels, mean = std = 0.5.
QWEN3_VL_MIN_PIXELS = 65536
QWEN3_VL_MAX_PIXELS = 16777216
QWEN3_VL_PATCH = 16


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, vision: dict[str, Any]) -> "VisionConfig":
        """From an HF `vision_config` dict (as the manifest keeps it)."""
        rope = vision.get("rope_parameters") or {}
        return cls(
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            out_hidden_size=int(vision["out_hidden_size"]),
            num_position_embeddings=int(vision["num_position_embeddings"]),
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            in_channels=int(vision.get("in_channels", 3)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
        )


@dataclass(frozen=True)
class ImageProcessing:
    """How an image becomes patches: resized (bicubic) to multiples of patch x merge within
    [min_pixels, max_pixels], scaled to [0, 1], normalized per channel, patchified."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's `image_processing` (from_dict reads it back)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageProcessing":
        return cls(
            int(d["patch_size"]),
            int(d["merge_size"]),
            int(d["temporal_patch_size"]),
            int(d["min_pixels"]),
            int(d["max_pixels"]),
            tuple(float(x) for x in d["image_mean"]),
            tuple(float(x) for x in d["image_std"]),
        )

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any] | None, vision: VisionConfig) -> "ImageProcessing":
        """From a preprocessor_config.json dict; None: Qwen3-VL's settings, the pixel bounds scaled by
        (patch_size / 16)^2 so that a tiny tower gets the same grid sizes in patches."""
        scale = (vision.patch_size / QWEN3_VL_PATCH) ** 2
        p = preprocessor or {}
        size = p.get("size") or {}
        min_pixels = p.get("min_pixels", size.get("shortest_edge", round(QWEN3_VL_MIN_PIXELS * scale)))
        max_pixels = p.get("max_pixels", size.get("longest_edge", round(QWEN3_VL_MAX_PIXELS * scale)))
        return cls(
            patch_size=int(p.get("patch_size", vision.patch_size)),
            merge_size=int(p.get("merge_size", vision.spatial_merge_size)),
            temporal_patch_size=int(p.get("temporal_patch_size", vision.temporal_patch_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(x) for x in p.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(x) for x in p.get("image_std", (0.5, 0.5, 0.5))),
        )
