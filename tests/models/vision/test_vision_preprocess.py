"""Image preprocessing vs transformers' Qwen2-VL image processor (PIL backend), and image-file errors."""

import pytest
import torch

from freetoken.errors import FreetokenError
from freetoken.models.vision.config import ImageProcessing, VisionConfig
from freetoken.models.vision.image_file import load_image
from freetoken.models.vision.preprocess import preprocess
from tests.conftest import FIXTURES
from tests.models.vision.conftest import hf_processor, random_image


def fixture_processing() -> ImageProcessing:
    import json

    vision = json.loads((FIXTURES / "qwen35_dense" / "hf" / "config.json").read_text())["vision_config"]
    return ImageProcessing.from_hf(None, VisionConfig.from_dict(vision))


@pytest.mark.parametrize("sizes", [[(32, 48)], [(70, 41), (64, 72), (9, 300)]])
def test_pixel_values_and_grids_match_transformers(sizes):
    proc = fixture_processing()
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    want = hf_processor(proc)(images, return_tensors="pt")
    pixel_values, grids = preprocess(images, proc)
    assert grids == [tuple(g) for g in want["image_grid_thw"].tolist()]
    torch.testing.assert_close(pixel_values, want["pixel_values"].float(), rtol=0, atol=1e-6)


def test_bounds_from_a_preprocessor_config():
    vision = VisionConfig(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=64, patch_size=16
    )
    proc = ImageProcessing.from_hf({"size": {"shortest_edge": 1000, "longest_edge": 5000}, "image_mean": [0.1, 0.2, 0.3]}, vision)
    assert (proc.min_pixels, proc.max_pixels, proc.patch_size, proc.image_mean) == (1000, 5000, 16, (0.1, 0.2, 0.3))
    assert ImageProcessing.from_hf(None, vision).min_pixels == 65536  # Qwen3-VL's own, unscaled at patch 16


def test_missing_and_unreadable_images_are_one_line_errors(tmp_path):
    with pytest.raises(FreetokenError, match="image file not found"):
        load_image(tmp_path / "nope.png")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(FreetokenError, match="cannot read the image") as err:
        load_image(bad)
    assert "\n" not in str(err.value)
