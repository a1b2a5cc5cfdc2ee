"""Canonical Qwen3.5 names and shapes, checked against the fixture checkpoints written by transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from freetoken.errors import CheckpointError
from freetoken.models.qwen3_5.config import Qwen35Config
from freetoken.models.qwen3_5.weights import canonical_name, expected_tensors, fuse_experts

from tests.conftest import FIXTURES


def _fixture(model: str) -> tuple[Qwen35Config, dict[str, tuple[int, ...]]]:
    hf = FIXTURES / model / "hf"
    cfg = Qwen35Config.from_hf(json.loads((hf / "config.json").read_text()))
    with safe_open(hf / "model.safetensors", framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return cfg, shapes


@pytest.mark.parametrize("model", ["qwen35_dense", "qwen35_moe"])
def test_expected_tensors_match_fixture(model):
    cfg, shapes = _fixture(model)
    text = {canonical_name(k): s for k, s in shapes.items() if not k.startswith("model.visual.")}
    assert expected_tensors(cfg, with_mtp=True) == text
    trunk = expected_tensors(cfg, with_mtp=False)
    assert trunk == {k: s for k, s in text.items() if not k.startswith("mtp.")}
    tied = expected_tensors(Qwen35Config(**{**cfg.__dict__, "tie_word_embeddings": True}), with_mtp=False)
    assert "lm_head.weight" not in tied and len(tied) == len(trunk) - 1


def test_canonical_name():
    assert canonical_name("model.language_model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    for same in ("model.norm.weight", "mtp.fc.weight", "lm_head.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert canonical_name(same) == same


def test_fuse_experts_matches_fixture_fused():
    cfg, _ = _fixture("qwen35_moe")
    prefix = "model.language_model.layers.0.mlp.experts"
    with safe_open(FIXTURES / "qwen35_moe" / "hf" / "model.safetensors", framework="pt") as f:
        gate_up, down = f.get_tensor(f"{prefix}.gate_up_proj"), f.get_tensor(f"{prefix}.down_proj")
    i = cfg.moe_intermediate_size
    split = {"other.weight": torch.ones(2)}
    for e in range(cfg.num_experts):
        split[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :i].clone()
        split[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, i:].clone()
        split[f"{prefix}.{e}.down_proj.weight"] = down[e].clone()
    fused = fuse_experts(split, cfg)
    assert set(fused) == {"other.weight", f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    assert torch.equal(fused[f"{prefix}.gate_up_proj"], gate_up) and torch.equal(fused[f"{prefix}.down_proj"], down)
    del split[f"{prefix}.5.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing .*experts\.5\.up_proj\.weight"):
        fuse_experts(split, cfg)
