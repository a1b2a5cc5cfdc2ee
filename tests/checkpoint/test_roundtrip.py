"""Unified checkpoint writer and reader: round trip, sharding, slicing, atomicity, corrupt input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from freetoken.checkpoint import (
    FORMAT_NAME, MANIFEST_FILE, Manifest, Provenance, SourceFile, UnifiedCheckpoint, hash_file, is_unified_checkpoint, write_checkpoint,
)
from freetoken.errors import CheckpointError, OutputExistsError

PROV = Provenance("train", "0.0", (SourceFile("/x/model.bin", "ab" * 32, 3),), ("nothing",))


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.experts.gate_up_proj", torch.randn(4, 8, 16, generator=g)),
        ("model.layers.0.linear_attn.A_log", torch.randn(4, generator=g).to(torch.float16)),
        ("ids", torch.arange(-5, 20, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.5)),
    ]


def _write(dst: Path, tensors=None, **kw) -> Manifest:
    return write_checkpoint(
        dst, family="qwen3_5", config={"hidden_size": 16, "eos_token_ids": [7]}, tensors=iter(tensors if tensors is not None else _tensors()),
        draft_heads={"mtp": {"num_layers": 1}}, tokenizer_files={"tokenizer.json": b"{}", "chat_template.jinja": b"{{ x }}"},
        provenance=PROV, **kw,
    )


def test_round_trip_bit_identical(tmp_path):
    manifest = _write(tmp_path / "ck")
    ck = UnifiedCheckpoint.open(tmp_path / "ck")
    assert ck.manifest == manifest and ck.family == "qwen3_5" and ck.draft_heads == {"mtp": {"num_layers": 1}}
    assert ck.tensor_names() == [n for n, _ in _tensors()]
    for name, t in _tensors():
        got = ck.get(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))  # bit for bit
    assert "ids" in ck and "nope" not in ck
    assert ck.tokenizer_path == tmp_path / "ck" / "tokenizer.json" and ck.tokenizer_path.read_bytes() == b"{}"
    assert ck.chat_template == "{{ x }}" and ck.manifest.tokenizer["eos_token_ids"] == [7]
    assert is_unified_checkpoint(tmp_path / "ck") and not is_unified_checkpoint(tmp_path)
    # the shards are plain safetensors: the library's own reader sees the same tensors
    info = manifest.tensors["model.embed_tokens.weight"]
    with safe_open(tmp_path / "ck" / info["shard"], framework="pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), _tensors()[0][1])
    assert info["dtype"] == "bfloat16" and info["shape"] == [64, 16]


def test_shard_size_splits_and_get_slice(tmp_path):
    tensors = _tensors()
    manifest = _write(tmp_path / "ck", shard_size=1024)  # 2048-byte embed and gate_up alone; the rest packed
    shards = sorted({i["shard"] for i in manifest.tensors.values()})
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:
        size = (tmp_path / "ck" / shard).stat().st_size
        with safe_open(tmp_path / "ck" / shard, framework="pt") as f:
            payload = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
            assert payload <= 1024 or len(list(f.keys())) == 1
        assert size > 8
    ck = UnifiedCheckpoint.open(tmp_path / "ck")
    full = dict(tensors)["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(ck.get_slice("model.layers.0.mlp.experts.gate_up_proj", 1, 2, 6), full[:, 2:6])
    assert torch.equal(ck.get_slice("model.layers.0.mlp.experts.gate_up_proj", -1, 0, 5), full[..., :5])
    assert torch.equal(ck.get_slice("model.embed_tokens.weight", 0, 10, 20), dict(tensors)["model.embed_tokens.weight"][10:20])


def test_dtype_casts_floats_only(tmp_path):
    manifest = _write(tmp_path / "ck", dtype=torch.float32)
    ck = UnifiedCheckpoint.open(tmp_path / "ck")
    for name, t in _tensors():
        want = t.float() if t.is_floating_point() else t
        assert ck.get(name).dtype == want.dtype and torch.equal(ck.get(name), want)
    assert manifest.tensors["ids"]["dtype"] == "int64"


def test_progress_counts_bytes(tmp_path):
    seen: list[int] = []
    _write(tmp_path / "ck", progress=seen.append)
    assert seen == [t.numel() * t.element_size() for _, t in _tensors()]


def test_output_exists_and_force(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "keep").write_text("old")
    calls = []

    def tensors():
        calls.append(1)
        yield from _tensors()

    with pytest.raises(OutputExistsError, match="ck: output exists"):
        _write(tmp_path / "ck", tensors=tensors())
    assert not calls and (tmp_path / "ck" / "keep").exists()  # checked before any work
    _write(tmp_path / "ck", force=True)
    assert not (tmp_path / "ck" / "keep").exists() and is_unified_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing(tmp_path, exc):
    def tensors():
        yield from _tensors()[:3]
        raise exc

    with pytest.raises(type(exc)):
        _write(tmp_path / "ck", tensors=tensors(), shard_size=100)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_force_keeps_old_checkpoint(tmp_path):
    _write(tmp_path / "ck")
    before = (tmp_path / "ck" / MANIFEST_FILE).read_text()

    def tensors():
        yield _tensors()[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _write(tmp_path / "ck", tensors=tensors(), force=True)
    assert (tmp_path / "ck" / MANIFEST_FILE).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_duplicate_names_rejected(tmp_path):
    t = torch.zeros(2)
    with pytest.raises(CheckpointError, match="duplicate tensor name 'a'"):
        _write(tmp_path / "ck", tensors=[("a", t), ("a", t)])
    assert list(tmp_path.iterdir()) == []


def test_hash_file_matches_hashlib(tmp_path):
    import hashlib

    data = bytes(range(256)) * 1000
    (tmp_path / "f").write_bytes(data)
    sf = hash_file(tmp_path / "f")
    assert sf.sha256 == hashlib.sha256(data).hexdigest() and sf.size == len(data)


def test_open_errors(tmp_path):
    with pytest.raises(CheckpointError, match="missing.*no such file"):
        UnifiedCheckpoint.open(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a unified checkpoint"):
        UnifiedCheckpoint.open(tmp_path)
    manifest = _write(tmp_path / "ck", shard_size=1024)
    mpath = tmp_path / "ck" / MANIFEST_FILE
    good = mpath.read_text()

    d = json.loads(good)
    d["format_version"] = 99
    mpath.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="manifest.json: unsupported format_version 99"):
        UnifiedCheckpoint.open(tmp_path / "ck")
    mpath.write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: manifest is not valid JSON"):
        UnifiedCheckpoint.open(tmp_path / "ck")
    d = json.loads(good)
    del d["tensors"]
    mpath.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="malformed manifest"):
        UnifiedCheckpoint.open(tmp_path / "ck")
    mpath.write_text(good)
    assert json.loads(good)["format"] == FORMAT_NAME

    shard = tmp_path / "ck" / manifest.tensors["model.embed_tokens.weight"]["shard"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated or corrupt"):
        UnifiedCheckpoint.open(tmp_path / "ck")
    shard.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        UnifiedCheckpoint.open(tmp_path / "ck")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {shard.name}"):
        UnifiedCheckpoint.open(tmp_path / "ck")
    shard.write_bytes(data)
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        UnifiedCheckpoint.open(tmp_path / "ck").get("nope")
