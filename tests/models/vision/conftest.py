"""Image-prompt test helpers: fixture checkpoints whose vision tower is redrawn, tiny random images.

The fixtures' vision towers keep transformers' init (std 0.02, zero biases, LayerNorms at identity),
under which a wrong position table, rotation or merge order barely moves the features; here every
`model.visual.*` tensor is redrawn (seeded) and written back in the checkpoint's dtype, the rest of the
checkpoint unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import FIXTURES, convert_unified

VISION_SEED = 7


def _redraw(name: str, tensor: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    shape = tensor.shape
    if name.endswith(("norm1.weight", "norm2.weight", "merger.norm.weight")):
        out = 1 + torch.randn(shape, generator=g) * 0.2
    elif name.endswith(".bias"):
        out = torch.randn(shape, generator=g) * 0.1
    elif name.endswith("pos_embed.weight"):
        out = torch.randn(shape, generator=g) * 0.5
    else:
        fan_in = tensor[0].numel()
        out = torch.randn(shape, generator=g) * max(0.05, fan_in**-0.5)
    return out.to(tensor.dtype)


def write_redrawn_checkpoint(model: str, dst: Path) -> Path:
    """A copy of the fixture `model`'s HF checkpoint with its vision tower redrawn."""
    from safetensors.torch import load_file, save_file

    src = FIXTURES / model / "hf"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    g = torch.Generator().manual_seed(VISION_SEED)
    tensors = load_file(src / "model.safetensors")
    tensors = {n: _redraw(n, t, g) if n.startswith("model.visual.") else t for n, t in sorted(tensors.items())}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def vl_checkpoints(tmp_path_factory):
    """model -> (HF dir, unified dir) for the Qwen3.5 fixtures with redrawn vision towers."""
    root = tmp_path_factory.mktemp("vl")
    out = {}
    for model in ("qwen35_dense", "qwen35_moe"):
        hf = write_redrawn_checkpoint(model, root / model / "hf")
        out[model] = (hf, convert_unified(hf, root / model / "unified"))
    return out


@pytest.fixture(scope="session")
def vl_qwen4_exp(tmp_path_factory):
    """rope type ("default", "yarn") -> (HF dir, unified dir) of the qwen4_exp fixture with a redrawn vision
    tower; "yarn": its RoPE made YaRN (factor 4 over an original context of 8 positions)."""
    import json

    root = tmp_path_factory.mktemp("vl_qwen4_exp")
    out = {}
    for rope in ("default", "yarn"):
        hf = write_redrawn_checkpoint("qwen4_exp", root / rope / "hf")
        if rope == "yarn":
            config = json.loads((hf / "config.json").read_text())
            yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
            config["text_config"]["rope_parameters"] |= yarn
            (hf / "config.json").write_text(json.dumps(config))
        out[rope] = (hf, convert_unified(hf, root / rope / "unified"))
    return out


def random_image(height: int, width: int, seed: int):
    """A PIL RGB image of smooth random colours plus noise (height x width pixels)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(x / 5 + c) * np.cos(y / 7 - c) for c in range(3)], axis=-1) * 100 + 128
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def hf_processor(proc):
    """transformers' Qwen2-VL image processor (PIL backend) with the settings of an ImageProcessing."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=proc.patch_size,
        merge_size=proc.merge_size,
        temporal_patch_size=proc.temporal_patch_size,
        image_mean=list(proc.image_mean),
        image_std=list(proc.image_std),
        size={"shortest_edge": proc.min_pixels, "longest_edge": proc.max_pixels},
    )
