"""A checkpoint's own image preprocessing settings (its preprocessor_config.json) through convert,
inspect and generate, on a copy of the qwen35_dense fixture with a preprocessor_config.json added
whose pixel bounds, mean and std differ from Qwen3-VL's defaults.

Oracles: the JSON file written here (manifest fields, inspect rows) and transformers' Qwen2-VL image
processor loaded from that directory with `from_pretrained` (pixel values and grids, hence the pad
count of the prompt that generate writes).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.cli import app
from freetoken.engine.config import EngineConfig
from freetoken.llm import LLM
from tests.conftest import FIXTURES, convert_unified
from tests.models.vision.conftest import random_image

PREPROCESSOR = {
    "size": {"shortest_edge": 8192, "longest_edge": 65536},
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(HF dir with preprocessor_config.json, its unified conversion)."""
    root = tmp_path_factory.mktemp("preprocessor")
    hf = root / "hf"
    shutil.copytree(FIXTURES / "qwen35_dense" / "hf", hf)
    (hf / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return hf, convert_unified(hf, root / "unified")


def test_the_manifest_carries_the_preprocessing_and_the_video_token_id(checkpoints):
    hf, unified = checkpoints
    config = UnifiedCheckpoint.open(unified).manifest.config
    raw = json.loads((hf / "config.json").read_text())
    assert config["video_token_id"] == raw["video_token_id"] and config["image_token_id"] == raw["image_token_id"]
    assert config["image_processing"] == {
        "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 8192, "max_pixels": 65536,
        "image_mean": PREPROCESSOR["image_mean"], "image_std": PREPROCESSOR["image_std"],
    }
    sources = [s.path for s in UnifiedCheckpoint.open(unified).manifest.provenance.sources]
    assert str(hf / "preprocessor_config.json") in sources


def test_a_checkpoint_without_a_preprocessor_config_stores_none(tmp_path):
    unified = convert_unified(FIXTURES / "qwen35_dense" / "hf", tmp_path / "u")
    assert "image_processing" not in UnifiedCheckpoint.open(unified).manifest.config


def test_inspect_shows_the_tower_shape_and_preprocessing(checkpoints):
    raw = json.loads((checkpoints[0] / "config.json").read_text())["vision_config"]
    for path in checkpoints:
        result = CliRunner().invoke(app, ["inspect", str(path)], env={"COLUMNS": "400"})
        assert result.exit_code == 0, result.output
        row = next(line for line in result.output.splitlines() if "vision tower" in line)
        assert (f"depth {raw['depth']}, hidden {raw['hidden_size']} ({raw['num_heads']} heads), "
                f"patch {raw['patch_size']} x temporal {raw['temporal_patch_size']}, "
                f"merge {raw['spatial_merge_size']}, out hidden {raw['out_hidden_size']}") in row
        assert "pixels 8192..65536" in result.output and "0.26862954" in result.output


def test_generate_uses_the_checkpoints_preprocessing(checkpoints, tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf, unified = checkpoints
    image = random_image(32, 48, 0)
    want = Qwen2VLImageProcessorPil.from_pretrained(hf)([image], return_tensors="pt")
    llm = LLM(str(unified), EngineConfig(max_model_len=512))
    ids, images = llm.encode_with_images("what is it", [image])
    assert images.grids == [tuple(g) for g in want["image_grid_thw"].tolist()]
    torch.testing.assert_close(images.pixel_values, want["pixel_values"], rtol=0, atol=1e-5)

    image.save(tmp_path / "a.png")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "what is it", "images": ["a.png"]}) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(unified), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "-n", "1"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    pads = int(want["image_grid_thw"].prod()) // 4
    assert json.loads(out.read_text())["prompt_tokens"] == len(ids) == 2 + pads + len(llm.encode("what is it"))
