"""qwen4_exp (Qwen3.8-Flash-Next) HF and GGUF checkpoints -> unified checkpoint, and inspect.

Oracles: the fixture safetensors written by transformers (every unified tensor must equal its
source, with the shards and experts joined here by torch.cat / torch.stack), the GGUF written by
llama.cpp's converter (after undoing its conventions every tensor must equal the HF one exactly,
since the file is the f32 upcast of the bf16 checkpoint), and the HF config. llama.cpp's converter
at the fixture's commit drops the qwen4exp MTP block, so the MTP test builds one from the HF
`mtp.*` tensors in the layout its later export writes (shared/reference/gguf.md §4); that test
checks the name table and the undo steps against that description, not against a llama.cpp file.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import freetoken.converters.gguf as gguf_converter
from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.cli import app
from freetoken.converters import convert
from freetoken.errors import CheckpointError, UnsupportedModelError
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig

from tests.conftest import FIXTURES

HF = FIXTURES / "qwen4_exp" / "hf"
GGUF = FIXTURES / "qwen4_exp" / "gguf" / "qwen4-exp-f32.gguf"
TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding.weight"
SHARD = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_{}.weight"
MULTIPLIERS = "model.language_model.layers.1.ple.ple_embedding.layer_multipliers"
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _expected_unified() -> dict[str, torch.Tensor]:
    """The fixture's tensors as the unified checkpoint must hold them, joined here independently."""
    out, experts, shards = {}, {}, {}
    for name, t in load_file(HF / "model.safetensors").items():
        name = name.replace("model.language_model.", "model.", 1)
        if t.dtype == torch.int64:
            continue
        if m := _EXPERT.match(name):
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        elif m := re.match(r"^(.+\.ngram_embedding)\.shard_(\d+)\.weight$", name):
            shards.setdefault(f"{m[1]}.weight", {})[int(m[2])] = t
        else:
            out[name] = t
    for prefix, group in experts.items():
        n = len(group) // 3
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([group[(e, "gate")], group[(e, "up")]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([group[(e, "down")] for e in range(n)])
    for name, group in shards.items():
        out[name] = torch.cat([group[k] for k in range(len(group))])
    return out


@pytest.fixture(scope="module")
def gguf_unified(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("q4gguf") / "unified"
    convert(GGUF, dst)
    return dst


def test_hf_conversion_equals_the_source(hf_unified):
    ck = UnifiedCheckpoint.open(hf_unified)
    want = _expected_unified()
    assert sorted(ck.tensor_names()) == sorted(want)
    for name, t in want.items():
        got = ck.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    m = ck.manifest
    raw = json.loads((HF / "config.json").read_text())
    assert m.family == "qwen4_exp"
    assert m.config == Qwen4ExpConfig.from_hf(raw).to_dict() | {"vision_config": raw["vision_config"]}
    assert m.draft_heads == {"mtp": {"num_layers": 1}}
    transforms = "\n".join(m.provenance.transforms)
    for what in ("model.language_model.* renamed", "experts fused from per-expert tensors (8 layers)",
                 f"{TABLE} joined on dim 0 from 2 shards", "checked equal and dropped", "layer_multipliers"):
        assert what in transforms
    assert {Path(s.path).name for s in m.provenance.sources} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_hf_table_reaches_the_writer_in_pieces():
    from freetoken.checkpoint import ChunkedTensor
    from freetoken.converters.hf import read_hf

    stream = dict(read_hf(HF).tensors)
    table = stream[TABLE]
    assert isinstance(table, ChunkedTensor) and table.shape == (4096, 16)
    pieces = list(table.chunks())
    assert [tuple(p.shape) for p in pieces] == [(2048, 16), (2048, 16)]
    assert not any(isinstance(t, ChunkedTensor) for n, t in stream.items() if n != TABLE)


def test_gguf_conversion_equals_the_hf_conversion(hf_unified, gguf_unified):
    hf, gg = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(gguf_unified)
    text = {n for n in hf.tensor_names() if not n.startswith(("mtp.", "model.visual."))}
    assert set(gg.tensor_names()) == text  # the GGUF has no MTP block and no vision tower
    worst = 0.0
    for name in sorted(text):
        a, b = hf.get(name), gg.get(name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    assert worst == 0.0
    differ = {k for k in hf.manifest.config if hf.manifest.config[k] != gg.manifest.config.get(k)}
    assert differ == {"mtp_num_hidden_layers", "vision_config"}  # seed, n-gram base and divisor recovered exactly
    assert gg.manifest.family == "qwen4_exp" and gg.manifest.draft_heads == {}
    transforms = "\n".join(gg.manifest.provenance.transforms)
    assert "indexer.q_proj + indexer.k_proj joined into index_qk_proj (2 layers)" in transforms
    assert "subtracted llama.cpp's +1 (28 tensors)" in transforms


def test_gguf_streams_large_tensors_in_row_blocks(hf_unified, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_converter, "STREAM_ABOVE_BYTES", 4096)  # the table and the embeddings go in pieces
    convert(GGUF, tmp_path / "out")
    hf, gg = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(tmp_path / "out")
    for name in gg.tensor_names():
        assert torch.equal(hf.get(name), gg.get(name)), name


# ---------------------------------------------------------------- bad inputs


def _variant(tmp_path: Path, tensors: dict[str, torch.Tensor] | None = None, text_config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    d = tmp_path / "src"
    shutil.copytree(HF, d)
    if tensors is not None or drop:
        sd = load_file(HF / "model.safetensors")
        sd = {k: v for k, v in sd.items() if k not in drop} | (tensors or {})
        (d / "model.safetensors").unlink()
        save_file(sd, d / "model.safetensors")
    if text_config is not None:
        raw = json.loads((HF / "config.json").read_text())
        raw["text_config"] = {k: v for k, v in (raw["text_config"] | text_config).items() if v is not None}
        (d / "config.json").write_text(json.dumps(raw))
    return d


def _fails(tmp_path: Path, src: Path, exc: type[Exception], match: str) -> None:
    dst = tmp_path / "out"
    with pytest.raises(exc, match=match) as info:
        convert(src, dst)
    assert "\n" not in str(info.value)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_shard(tmp_path):
    src = _variant(tmp_path, drop=(SHARD.format(1),))
    _fails(tmp_path, src, CheckpointError, r"src: missing shard\(s\) of 2 \(config.json\): .*ngram_embedding\.shard_1\.weight$")


def test_wrong_shape(tmp_path):
    name = "model.language_model.layers.2.attn_hyper_connection.hc_norm.weight"
    src = _variant(tmp_path, {name: torch.zeros(255, dtype=torch.bfloat16)})
    _fails(tmp_path, src, CheckpointError, rf"src: tensor {re.escape(name)} has shape \[255\], config.json implies \[256\]")


def test_tampered_multipliers(tmp_path):
    stored = load_file(HF / "model.safetensors")[MULTIPLIERS]
    src = _variant(tmp_path, {MULTIPLIERS: stored + torch.tensor([0, 2, 0])})
    _fails(tmp_path, src, CheckpointError, rf"model.safetensors: tensor {re.escape(MULTIPLIERS)} is \[.*\], but config.json implies \[{stored[0]}, {stored[1]}, {stored[2]}\]")


def test_unknown_tensor(tmp_path):
    src = _variant(tmp_path, {"model.language_model.layers.0.ple.key_proj.weight": torch.zeros(256, 64, dtype=torch.bfloat16)})
    _fails(tmp_path, src, CheckpointError, r"src: unknown tensors \(not part of a qwen4_exp checkpoint\): model.language_model.layers.0.ple.key_proj.weight")


def test_ple_on_an_attention_layer(tmp_path):
    src = _variant(tmp_path, text_config={"ple_layer_ids": [4]})
    _fails(tmp_path, src, UnsupportedModelError, r"config.json: ple_layer_ids \[4\] are not linear-attention layers")


def test_partial_indexer_config(tmp_path):
    src = _variant(tmp_path, text_config={"indexer_budget": None})
    _fails(tmp_path, src, UnsupportedModelError, r"config.json: QSA config is missing indexer_budget")


def _rewrite_gguf(dst: Path, *, meta: dict | None = None, add: dict[str, np.ndarray] | None = None, quantize: str | None = None) -> Path:
    """A copy of the fixture GGUF with some metadata replaced, tensors added, or 2-D weights quantized."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize as quantize_array

    reader = GGUFReader(GGUF)
    writer = GGUFWriter(dst, "qwen4exp")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (meta or {}).get(key, field.contents())
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None)
    for key, value in (meta or {}).items():
        if key not in reader.fields:  # new keys here are counts
            writer.add_key_value(key, value, GGUFValueType.UINT32)
    qtype = GGMLQuantizationType[quantize] if quantize else None
    for t in reader.tensors:
        data = np.array(t.data)
        keep_f32 = data.ndim < 2 or data.shape[-1] % 32 or t.name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight"))
        if qtype is not None and not keep_f32:
            writer.add_tensor(t.name, quantize_array(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    for name, data in (add or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_gguf_unknown_tensor(tmp_path):
    src = _rewrite_gguf(tmp_path / "extra.gguf", add={"blk.0.ple_gate.weight": np.zeros((4, 8), dtype=np.float32)})
    _fails(tmp_path, src, CheckpointError, r"extra.gguf: unexpected tensor blk.0.ple_gate.weight for architecture qwen4exp")


def test_gguf_tampered_hash_constants(tmp_path):
    src = _rewrite_gguf(tmp_path / "primes.gguf", meta={"qwen4exp.ple.head_vocab_sizes": [1009, 1013, 1019, 1031]})
    _fails(tmp_path, src, CheckpointError, r"primes.gguf: qwen4exp.ple.head_vocab_sizes is \[1009, 1013, 1019, 1031\], the config rebuilt from the metadata implies \[1009, 1013, 1019, 1021\]")


def test_gguf_lost_compress_ratios(tmp_path):
    src = _rewrite_gguf(tmp_path / "dense.gguf", meta={"qwen4exp.attention.compress_ratios": [0] * 8})
    _fails(tmp_path, src, UnsupportedModelError, r"dense.gguf: attention.compress_ratios is 0 on every attention layer")


def test_gguf_q8_0_goes_through_the_dequantizer(hf_unified, tmp_path):
    src = _rewrite_gguf(tmp_path / "q8.gguf", quantize="Q8_0")
    convert(src, tmp_path / "out", dtype=torch.float32)
    hf, q8 = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(tmp_path / "out")
    assert "dequantized Q8_0" in "\n".join(q8.manifest.provenance.transforms)
    for name in q8.tensor_names():
        a, b = hf.get(name).float(), q8.get(name)
        step = a.abs().max() / 127  # a block's scale is at most this; Q8_0 is within one step (half, plus the fp16 scale's rounding)
        assert (a - b).abs().max() <= step, name


# ---------------------------------------------------------------- inspect


@pytest.mark.parametrize("which", ["hf", "gguf", "unified"])
def test_inspect_shows_qwen4_specifics(which, hf_unified):
    path = {"hf": HF, "gguf": GGUF, "unified": hf_unified}[which]
    result = CliRunner().invoke(app, ["inspect", str(path)], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    out = result.output
    if which == "gguf":
        for text in ("qwen4exp", "4 streams, rank 16", "[1] (0-indexed)", "4096x16", "budget 8, compress ratios [0, 0, 0, 4, 0, 0, 0, 4]"):
            assert text in out, text
    else:
        for text in ("qwen4_exp", "4 streams x 64, mixer rank 16", "[1] (0-indexed)", "layer 1: 4096x16", "budget 8 tokens, block (compress ratio) 4"):
            assert text in out, text


# ---------------------------------------------------------------- MTP block


def _mtp_block(n_layer: int) -> dict[str, np.ndarray]:
    """The fixture's HF `mtp.*` tensors laid out as llama.cpp's qwen4exp MTP export describes them
    (shared/reference/gguf.md §4): block `blk.{n_layer}`, norms stored as 1 + w, experts split into
    gate / up, the indexer's q and k rows apart, `nextn.eh_proj` = [fc_embedding | fc_hidden]."""
    hf = {k: v.float() for k, v in load_file(HF / "model.safetensors").items() if k.startswith("mtp.")}
    b, m = f"blk.{n_layer}.", "mtp.layers.0."
    out = {
        "nextn.eh_proj.weight": torch.cat([hf["mtp.fc_embedding.weight"], hf["mtp.fc_hidden.weight"]], dim=1),
        "nextn.enorm.weight": hf["mtp.pre_fc_norm_embedding.weight"] + 1,
        "nextn.hnorm.weight": hf["mtp.pre_fc_norm_hidden.weight"] + 1,
        "nextn.hc_head_norm.weight": hf["mtp.hyper_connection_mixer.hc_norm.weight"] + 1,
        "nextn.hc_head_down.weight": hf["mtp.hyper_connection_mixer.input_mix_weight_down.weight"],
        "nextn.hc_head_up.weight": hf["mtp.hyper_connection_mixer.input_mix_weight_up.weight"],
        "attn_q.weight": hf[m + "self_attn.q_proj.weight"], "attn_k.weight": hf[m + "self_attn.k_proj.weight"],
        "attn_v.weight": hf[m + "self_attn.v_proj.weight"], "attn_output.weight": hf[m + "self_attn.o_proj.weight"],
        "attn_q_norm.weight": hf[m + "self_attn.q_norm.weight"] + 1, "attn_k_norm.weight": hf[m + "self_attn.k_norm.weight"] + 1,
        "indexer.q_proj.weight": hf[m + "self_attn.indexer.index_qk_proj.weight"][:64],
        "indexer.k_proj.weight": hf[m + "self_attn.indexer.index_qk_proj.weight"][64:],
        "indexer.q_norm.weight": hf[m + "self_attn.indexer.q_layernorm.weight"] + 1,
        "indexer.k_norm.weight": hf[m + "self_attn.indexer.k_layernorm.weight"] + 1,
        "ffn_gate_inp.weight": hf[m + "mlp.gate.weight"],
        "ffn_gate_exps.weight": hf[m + "mlp.experts.gate_up_proj"][:, :32], "ffn_up_exps.weight": hf[m + "mlp.experts.gate_up_proj"][:, 32:],
        "ffn_down_exps.weight": hf[m + "mlp.experts.down_proj"],
        "ffn_gate_shexp.weight": hf[m + "mlp.shared_expert.gate_proj.weight"], "ffn_up_shexp.weight": hf[m + "mlp.shared_expert.up_proj.weight"],
        "ffn_down_shexp.weight": hf[m + "mlp.shared_expert.down_proj.weight"], "ffn_gate_inp_shexp.weight": hf[m + "mlp.shared_expert_gate.weight"],
    }
    for side, hc in (("attn", "attn_hyper_connection"), ("ffn", "mlp_hyper_connection")):
        out |= {f"hc_{side}_norm.weight": hf[f"{m}{hc}.hc_norm.weight"] + 1, f"hc_{side}_down.weight": hf[f"{m}{hc}.input_mix_weight_down.weight"],
                f"hc_{side}_up.weight": hf[f"{m}{hc}.input_mix_weight_up.weight"], f"hc_{side}_inject.weight": hf[f"{m}{hc}.block_inject_weight.weight"]}
    return {b + k: v.contiguous().numpy() for k, v in out.items()}


def test_gguf_mtp_block_becomes_mtp(hf_unified, tmp_path):
    meta = {"qwen4exp.block_count": 9, "qwen4exp.nextn_predict_layers": 1,
            "qwen4exp.attention.recurrent_layers": [True, True, True, False, True, True, True, False, False],
            "qwen4exp.attention.compress_ratios": [0, 0, 0, 4, 0, 0, 0, 4, 0]}
    src = _rewrite_gguf(tmp_path / "mtp.gguf", meta=meta, add=_mtp_block(8))
    manifest = convert(src, tmp_path / "out")
    assert manifest.draft_heads == {"mtp": {"num_layers": 1}}
    assert "blk.8.nextn.eh_proj.weight split along its columns into mtp.fc_embedding | mtp.fc_hidden" in manifest.provenance.transforms
    hf, gg = UnifiedCheckpoint.open(hf_unified), UnifiedCheckpoint.open(tmp_path / "out")
    assert set(gg.tensor_names()) == {n for n in hf.tensor_names() if not n.startswith("model.visual.")}
    for name in gg.tensor_names():
        assert torch.equal(hf.get(name), gg.get(name)), name
