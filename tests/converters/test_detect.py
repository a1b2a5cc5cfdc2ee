"""Source format detection on the fixture files and on hand-made non-checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.converters.detect import detect_format, resolve_source
from freetoken.errors import CheckpointError

FIXTURES = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures"


def test_fixture_formats():
    assert detect_format(FIXTURES / "qwen35_dense" / "hf") == "hf"
    assert detect_format(FIXTURES / "qwen35_moe" / "gguf" / "qwen35-moe-q8_0.gguf") == "gguf"
    assert detect_format(FIXTURES / "qwen35_dense_dflash" / "dflash") == "dflash"
    assert detect_format(FIXTURES / "qwen35_dense_dflash" / "dflash2") == "dflash"


def test_unified(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "freetoken-unified", "format_version": 1}))
    assert detect_format(tmp_path) == "unified"


def test_errors(tmp_path):
    with pytest.raises(CheckpointError, match="gone: no such file or directory"):
        detect_format(tmp_path / "gone")
    with pytest.raises(CheckpointError, match=r"not a checkpoint: no manifest.json, no config.json"):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"config.json but no \*.safetensors"):
        detect_format(tmp_path)
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(CheckpointError, match="fake.gguf: not a GGUF file"):
        detect_format(tmp_path / "fake.gguf")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="notes.txt: not a checkpoint"):
        detect_format(tmp_path / "notes.txt")


def test_resolve_source(tmp_path, monkeypatch):
    import huggingface_hub.constants

    assert resolve_source(tmp_path) == tmp_path
    cache = tmp_path / "cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    # the documented cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = cache / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40) / "config.json").write_text("{}")
    assert resolve_source("acme/tiny") == repo / "snapshots" / ("a" * 40)
    with pytest.raises(CheckpointError, match="org/model: no such path, and not a repo id in the local Hugging Face cache"):
        resolve_source("org/model")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve_source(str(tmp_path / "a" / "b" / "c"))
