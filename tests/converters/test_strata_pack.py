"""`freetoken convert TARGET DST --mtp PACK.gguf` with a Strata MTP pack (shared/reference/gguf.md §3).

The packs are built here from the fixture's HF `mtp.*` tensors as Strata's `mtp_pack.py` lays them
out: arch `qwen4exp-mtp`, the four `strata.mtp.*` keys, raw HF names, 1-D F32, dense BF16, fused
experts BF16 / Q8_0 / Q4_0 / Q2_0 quantized along the input axis. gguf 0.19's writer has no Q2_0 (type 42),
but it writes `raw_dtype` verbatim as the tensor-info type id and only looks the type up to turn a
uint8 byte shape into an element shape; passing the element shape (`raw_shape`) and the bytes as
int8 skips that look-up, so the entry is the one a Q2_0-aware writer makes. The Q2_0 blocks follow
the layout test_dequant.py checks (fp16 d, 2-bit codes LSB first, value (code - 1) * d). The
fixture's down_proj input width (32) is half a Q2_0 block, so the Q2_0 pack keeps it in Q8_0.

Oracles: the HF fixture's tensors (BF16 and F32 exactly; Q8_0 / Q4_0 / Q2_0 within each block's scale),
the HF fixture's own conversion (MTP logits equal), `freetoken parity --spec mtp`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import freetoken.converters.gguf as gguf_converter
from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.cli import app
from freetoken.converters import convert
from freetoken.converters.gguf import open_gguf
from freetoken.converters.gguf_quants import type_name
from freetoken.errors import CheckpointError, UnsupportedModelError
from tests.conftest import FIXTURES, fixture_refs, load_unified
from tests.converters.test_qwen4_exp_convert import GGUF, HF, _mtp_block, _rewrite_gguf

EXPERTS = ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj")
KEYS = {"strata.mtp.source": "fixtures/qwen4_exp/hf", "strata.mtp.source_sha256": "0" * 64, "strata.mtp.expert_format": "bf16", "strata.mtp.expert_quantizer": "none"}
Q2_0 = 42
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}  # bytes of a block, the first two its fp16 scale d


def _hf_mtp() -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(HF / "model.safetensors").items() if k.startswith("mtp.")}


def _q2_0(a: np.ndarray) -> np.ndarray:
    """[..., K] float32 (K a multiple of 64) -> Q2_0 bytes [..., K // 64 * 18]; d covers [-d, 2d], codes round to nearest."""
    b = a.reshape(-1, 64)
    d = np.maximum(-b.min(1), b.max(1) / 2).astype(np.float16)
    step = np.where(d > 0, d.astype(np.float32), 1)[:, None]
    codes = np.clip(np.rint(b / step) + 1, 0, 3).astype(np.uint8).reshape(-1, 16, 4)
    qs = (codes << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(-1, dtype=np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1).reshape(*a.shape[:-1], -1)


def _scales(raw: np.ndarray, size: int) -> np.ndarray:
    """Per-block fp16 scale d of blocks of `size` bytes (Q8_0: 34, Q4_0 and Q2_0: 18): bytes 0-1 of each block."""
    return raw.reshape(-1, size)[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)


def make_pack(path: Path, experts: str = "BF16", *, arch: str = "qwen4exp-mtp", tensors: dict[str, torch.Tensor] | None = None) -> dict[str, np.ndarray]:
    """Write a pack; returns the per-block scales of its quantized tensors."""
    writer = GGUFWriter(path, arch)
    for key, value in KEYS.items():
        writer.add_string(key, value if key != "strata.mtp.expert_format" else experts.lower())
    scales = {}
    for name, t in (tensors if tensors is not None else _hf_mtp()).items():
        a = t.float().numpy()
        kind = experts if name in EXPERTS else "BF16"
        if kind == "Q2_0" and a.shape[-1] % 64:
            kind = "Q8_0"
        if a.ndim == 1:
            writer.add_tensor(name, a)
        elif kind == "Q2_0":
            raw = _q2_0(a)
            writer.add_tensor(name, raw.view(np.int8), raw_shape=a.shape, raw_dtype=Q2_0)
            scales[name] = _scales(raw, 18)
        else:
            raw = quantize(a, T[kind])
            writer.add_tensor(name, raw, raw_dtype=T[kind])
            if kind in BLOCK_BYTES:
                scales[name] = _scales(raw, BLOCK_BYTES[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return scales


@pytest.fixture(scope="module")
def bf16_pack(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pack") / "mtp-bf16.gguf"
    make_pack(path)
    return path


@pytest.fixture(scope="module")
def gguf_with_pack(tmp_path_factory, bf16_pack) -> Path:
    dst = tmp_path_factory.mktemp("gp") / "unified"
    convert(GGUF, dst, mtp=bf16_pack)
    return dst


def test_bf16_pack_on_gguf_target_equals_hf(hf_unified, gguf_with_pack, bf16_pack):
    hf, got = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(gguf_with_pack)
    assert set(got.tensor_names()) == {n for n in hf.tensor_names() if not n.startswith("model.visual.")}
    for name in got.tensor_names():
        assert torch.equal(hf.get(name), got.get(name)), name
    m = got.manifest
    assert m.draft_heads == {"mtp": {"num_layers": 1}} and m.config["mtp_num_hidden_layers"] == 1
    notes = "\n".join(m.provenance.transforms)
    assert "from Strata pack mtp-bf16.gguf (strata.mtp.source=fixtures/qwen4_exp/hf, strata.mtp.source_sha256=" in notes
    assert "strata.mtp.expert_format=bf16" in notes and "BF16 x" in notes and "F32 x" in notes
    assert str(bf16_pack.absolute()) in {s.path for s in m.provenance.sources}


@pytest.mark.parametrize("experts", ["Q8_0", "Q4_0", "Q2_0"])
def test_quantized_experts_within_one_step(experts, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_converter, "STREAM_ABOVE_BYTES", 4096)  # the experts reach the writer one expert at a time
    scales = make_pack(tmp_path / "pack.gguf", experts)
    assert set(scales) == set(EXPERTS)
    stored = open_gguf(tmp_path / "pack.gguf").tensors
    want = {"Q8_0": ("Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0"), "Q2_0": ("Q2_0", "Q8_0")}[experts]  # down_proj's input width 32 is half a Q2_0 block
    assert tuple(type_name(stored[n].type_id) for n in EXPERTS) == want
    convert(GGUF, tmp_path / "out", mtp=tmp_path / "pack.gguf", dtype=torch.float32)
    got = UnifiedCheckpoint.open(tmp_path / "out")
    for name, want in _hf_mtp().items():
        have = got.get(name)
        if name not in scales:
            assert torch.equal(have, want.float()), name
            continue
        err = (have - want.float()).reshape(len(scales[name]), -1).abs().amax(1)
        assert (err <= torch.from_numpy(scales[name]).abs()).all(), name  # one step (|d|: Q4_0 signs it) per block
        assert err.max() > 0, name  # really quantized
    assert "dequantized to the output dtype: BF16 x" in "\n".join(got.manifest.provenance.transforms)


def test_hf_target_without_mtp(hf_unified, bf16_pack, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(HF, src)
    sd = {k: v for k, v in load_file(HF / "model.safetensors").items() if not k.startswith("mtp.")}
    (src / "model.safetensors").unlink()
    save_file(sd, src / "model.safetensors")
    manifest = convert(src, tmp_path / "out", mtp=bf16_pack)
    hf, got = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(tmp_path / "out")
    assert manifest.draft_heads == {"mtp": {"num_layers": 1}} and manifest.config == hf.manifest.config
    assert sorted(got.tensor_names()) == sorted(hf.tensor_names())
    for name in got.tensor_names():
        assert torch.equal(hf.get(name), got.get(name)), name


def test_pack_replaces_an_embedded_mtp_block(hf_unified, bf16_pack, tmp_path):
    """As an explicit mtp-*.gguf sidecar does, a pack replaces the target's own nextn block."""
    meta = {"qwen4exp.block_count": 9, "qwen4exp.nextn_predict_layers": 1,
            "qwen4exp.attention.recurrent_layers": [True, True, True, False, True, True, True, False, False],
            "qwen4exp.attention.compress_ratios": [0, 0, 0, 4, 0, 0, 0, 4, 0]}
    block = {k: np.zeros_like(v) if k.endswith("nextn.eh_proj.weight") else v for k, v in _mtp_block(8).items()}
    src = _rewrite_gguf(tmp_path / "with-mtp.gguf", meta=meta, add=block)
    manifest = convert(src, tmp_path / "out", mtp=bf16_pack)
    assert "the target's own MTP block blk.8.* replaced by the pack's head" in manifest.provenance.transforms
    hf, got = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(tmp_path / "out")
    assert manifest.draft_heads == {"mtp": {"num_layers": 1}}
    for name in got.tensor_names():
        assert torch.equal(hf.get(name), got.get(name)), name


@torch.no_grad()
def test_mtp_logits_equal_the_hf_conversion(hf_unified, gguf_with_pack):
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode
    from tests.models.test_qwen4_exp_vs_hf import new_engine

    refs = fixture_refs("qwen4_exp")
    ids, wide = refs["seq0.input_ids"].tolist(), refs["seq0.wide_last"][:-1]
    logits = []
    for path in (hf_unified, gguf_with_pack):
        model = load_unified(path, with_mtp=True)
        engine = new_engine(model)
        table: list[int] = []
        engine.kv_pool.grow(table, len(ids))
        ctx = build_context([RowGroup(table, None, 0, ids[1:])], ForwardMode.EXTEND, engine.kv_pool, None, engine.device)
        logits.append(model.mtp.compute_logits(model.mtp(ctx, wide)))
    assert logits[0].shape[0] == len(ids) - 1 and torch.equal(logits[0], logits[1])


def test_cli_convert_and_parity(bf16_pack, tmp_path):
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(GGUF), str(out), "--mtp", str(bf16_pack)])
    assert result.exit_code == 0, result.output
    report = tmp_path / "parity.json"
    args = ["parity", str(out), "--spec", "mtp", "-k", "1", "-k", "2", "-n", "10", "-p", "def f(x):", "-p", "x = [", "--json", str(report)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(report.read_text())["runs"]
    assert set(runs) == {"k=1", "k=2"} and all(r["passed"] is True and r["num_tokens"] == 20 for r in runs.values())


# ---------------------------------------------------------------- bad packs and targets


def _fails(tmp_path: Path, src: Path, pack: Path, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match) as info:
        convert(src, tmp_path / "out", mtp=pack)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_tensor(tmp_path):
    hf = _hf_mtp()
    del hf["mtp.layers.0.self_attn.indexer.k_layernorm.weight"]
    make_pack(tmp_path / "p.gguf", tensors=hf)
    _fails(tmp_path, GGUF, tmp_path / "p.gguf", CheckpointError, r"p.gguf: MTP pack lacks 1 tensors of the head, e.g. mtp.layers.0.self_attn.indexer.k_layernorm.weight$")


def test_wrong_shape(tmp_path):
    make_pack(tmp_path / "p.gguf", tensors=_hf_mtp() | {"mtp.fc_hidden.weight": torch.zeros(64, 32, dtype=torch.bfloat16)})
    _fails(tmp_path, GGUF, tmp_path / "p.gguf", CheckpointError, r"p.gguf: tensor mtp.fc_hidden.weight has shape \[64, 32\], the target's config implies \[64, 64\]$")


def test_unknown_tensor(tmp_path):
    make_pack(tmp_path / "p.gguf", tensors=_hf_mtp() | {"mtp.norm.weight": torch.ones(64)})
    _fails(tmp_path, GGUF, tmp_path / "p.gguf", CheckpointError, r"p.gguf: unknown tensor mtp.norm.weight \(not part of a qwen4_exp MTP head; 1 in all\)$")


@pytest.mark.parametrize("target", [FIXTURES / "qwen35_dense" / "gguf" / "qwen35-dense-trunk-f32.gguf", FIXTURES / "qwen35_dense" / "hf"])
def test_non_qwen4_target(target, bf16_pack, tmp_path):
    _fails(tmp_path, target, bf16_pack, UnsupportedModelError, r"mtp-bf16.gguf: a Strata MTP pack \(qwen4exp-mtp\) belongs to a qwen4_exp target, not qwen3_5$")


def test_hf_target_with_its_own_head(bf16_pack, tmp_path):
    _fails(tmp_path, HF, bf16_pack, CheckpointError, r"the checkpoint already has an MTP head \(mtp.\*\); an MTP pack is for a target without one$")


def test_pack_as_the_source(bf16_pack, tmp_path):
    with pytest.raises(Exception, match="this is an MTP pack, not a target"):
        convert(bf16_pack, tmp_path / "out")
    assert not (tmp_path / "out").exists()
