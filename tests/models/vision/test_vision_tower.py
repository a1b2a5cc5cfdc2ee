"""The vision tower vs transformers' Qwen3.5 vision model (fp32), on redrawn fixture weights."""

import pytest
import torch

from freetoken.checkpoint.reader import UnifiedCheckpoint
from freetoken.models.vision.config import ImageProcessing, VisionConfig
from freetoken.models.vision.load import load_vision_tower
from freetoken.models.vision.preprocess import preprocess
from tests.models.vision.conftest import random_image


@pytest.mark.parametrize("model", ["qwen35_dense", "qwen35_moe"])
@torch.no_grad()
def test_features_match_transformers(vl_checkpoints, model):
    from transformers import AutoModelForImageTextToText

    hf_dir, unified = vl_checkpoints[model]
    ck = UnifiedCheckpoint.open(unified)
    tower = load_vision_tower(ck, ck.config["vision_config"], device="cpu", dtype=torch.float32)
    proc = ImageProcessing.from_hf(None, VisionConfig.from_dict(ck.config["vision_config"]))
    pixel_values, grids = preprocess([random_image(32, 48, 0), random_image(80, 40, 1)], proc)  # grids 14x20, 22x12... two images
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    want = hf.model.visual(pixel_values, grid_thw=torch.tensor(grids)).pooler_output
    got = tower(pixel_values, grids)
    assert got.shape == (sum(t * h * w for t, h, w in grids) // 4, 64)
    assert want.abs().max() > 0.5  # the redrawn tower is far from an identity
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
