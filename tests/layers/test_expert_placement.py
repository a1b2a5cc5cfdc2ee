"""Hybrid expert offload with a placement file, on the qwen35_moe fixture (8 experts, top-2, 4 trunk MoE layers + the MTP head's).

Oracles: greedy generation without speculative decoding (within the mode), the fully resident model's
logits, the [0, N) placement given as --gpu-experts, and hand-written bad files.

Logits against the resident model: on this CPU-only machine the host products are the resident path's
(linear_ref, call-invariant activations), so the only change a placement makes is the order of each
token's fp32 sum (resident experts, then host experts). A fixture token has two routed experts, and the
sum 0 + a + b is the same in either order (IEEE addition is commutative), so the tolerance is zero.
"""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.checkpoint.reader import UnifiedCheckpoint
from freetoken.errors import FreetokenError
from freetoken.layers.offload_config import ExpertOffloadConfig
from tests.conftest import run_rows
from tests.layers.test_expert_offload import DTYPES, PROMPTS, generate, load

TRUNK = [f"model.layers.{i}" for i in range(4)]
SCATTERED = {"model.layers.0": [6, 1, 4], "model.layers.1": [7, 0, 3], "model.layers.2": [2, 5, 6], "model.layers.3": [1, 3, 7]}


@pytest.fixture(scope="module")
def checkpoint(fixture_unified):
    return UnifiedCheckpoint.open(fixture_unified("qwen35_moe"))


def placed(tmp_path, resident: dict, name: str = "placement.json") -> ExpertOffloadConfig:
    path = tmp_path / name
    path.write_text(json.dumps({"resident": resident}))
    return ExpertOffloadConfig.from_options("hybrid", placement_file=str(path))


@pytest.mark.parametrize("dtype", DTYPES)
def test_placement_spec_equals_no_spec_and_logits_match_resident(checkpoint, tmp_path, dtype):
    torch_dtype, name = DTYPES[dtype], "float32" if dtype == "fp32" else "bfloat16"
    hybrid = load(checkpoint, torch_dtype, placed(tmp_path, SCATTERED))
    blocks = {n.removesuffix(".mlp"): m.offload for n, m in hybrid.named_modules() if getattr(m, "offload", None) is not None}
    assert blocks["model.layers.0"].rank.tolist() == [3, 0, 4, 5, 1, 6, 2, 7]  # resident 1, 4, 6 first, then 0, 2, 3, 5, 7
    assert blocks["mtp.layers.0"].rank.tolist() == list(range(8))  # unlisted: [0, 3)
    plain = generate(hybrid, dtype=name)
    assert generate(hybrid, "mtp", 2, name) == plain
    assert generate(hybrid, "mtp", 1, name) == plain
    resident = load(checkpoint, torch_dtype)
    for ids in PROMPTS:
        want, got = resident.compute_logits(run_rows(resident, ids)[0]), hybrid.compute_logits(run_rows(hybrid, ids)[0])
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_first_n_as_a_file_is_gpu_experts_bit_for_bit(checkpoint, tmp_path):
    by_count = load(checkpoint, torch.bfloat16, ExpertOffloadConfig("hybrid", gpu_experts=3))
    by_file = load(checkpoint, torch.bfloat16, placed(tmp_path, {layer: [0, 1, 2] for layer in TRUNK + ["mtp.layers.0"]}))
    for ids in PROMPTS:
        assert torch.equal(by_count.compute_logits(run_rows(by_count, ids)[0]), by_file.compute_logits(run_rows(by_file, ids)[0]))
    assert generate(by_file, "mtp", 2, "bfloat16") == generate(by_count, "mtp", 2, "bfloat16")


@pytest.mark.parametrize("resident, message", [
    ({"model.layers.9": [0, 1]}, "unknown MoE layer 'model.layers.9'"),
    ({"model.layers.0": [0, 8]}, "expert 8 out of range [0, 8)"),
])
def test_placement_checked_against_the_model(checkpoint, tmp_path, resident, message):
    with pytest.raises(FreetokenError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load(checkpoint, torch.float32, placed(tmp_path, resident))


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read it as JSON"),
    ('{"model.layers.0": [1]}', 'expected {"resident"'),
    ('{"resident": {"model.layers.0": [1, 1]}}', "expert 1 listed twice"),
    ('{"resident": {"model.layers.0": [1, -2]}}', "integers >= 0"),
    ('{"resident": {"model.layers.0": [1, 2], "model.layers.1": [3]}}', "every layer keeps the same count"),
])
def test_bad_placement_files_are_one_line_errors_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(FreetokenError) as info:
        ExpertOffloadConfig.from_options("hybrid", placement_file=str(path))
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_placement_needs_hybrid_and_no_gpu_experts(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"resident": {"model.layers.0": [1]}}))
    with pytest.raises(FreetokenError, match="leave out --gpu-experts"):
        ExpertOffloadConfig.from_options("hybrid", gpu_experts="2", placement_file=str(path))
    with pytest.raises(FreetokenError, match="needs --expert-offload hybrid"):
        ExpertOffloadConfig.from_options("cache", expert_cache_gb=1.0, placement_file=str(path))
    with pytest.raises(FreetokenError, match="missing.json: cannot read it"):
        ExpertOffloadConfig.from_options("hybrid", placement_file=str(tmp_path / "missing.json"))
