"""examples/image_prompt.py: it runs on a checkpoint with a vision tower, its prefix cache is used,
and its completions are those of the same prompts and images with the prefix cache off.

Oracle: LLM.generate in this process with EngineConfig(prefix_cache=False) (the cache-off engine;
the image path itself is checked against transformers in tests/engine/test_image_prompts.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "image_prompt.py"


def test_example_output_equals_the_cache_off_run(fixture_unified, tmp_path):
    from PIL import Image

    from freetoken.engine.config import EngineConfig
    from freetoken.llm import LLM
    from freetoken.sampling import SamplingParams

    model = fixture_unified("qwen35_dense")
    image = tmp_path / "a.png"
    Image.fromarray((np.random.default_rng(0).random((48, 64, 3)) * 255).astype("uint8")).save(image)
    out = subprocess.run([sys.executable, str(SCRIPT), str(model), str(image)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    got = [ast.literal_eval(line.split(" -> ", 1)[1]) for line in lines[:3]]
    assert int(re.search(r"(\d+) prompt tokens from the prefix cache", lines[3]).group(1)) > 0

    shared = "You describe pictures in one short sentence, plainly and without guessing.\n" * 8
    prompts = [shared + "A picture: <image> Describe it.", shared + "Two pictures: <image> and <image>. Compare them.", shared + "No picture here."]
    llm = LLM(str(model), EngineConfig(prefix_cache=False))
    completions, stats = llm.generate(prompts, SamplingParams(max_new_tokens=24), images=[[image], [image, image], []])
    assert stats.cached_prompt_tokens == 0
    assert got == [c.text for c in completions]
