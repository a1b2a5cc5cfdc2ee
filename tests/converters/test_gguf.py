"""GGUF import against independent oracles.

The GGUF files in shared/fixtures were written by llama.cpp's own converter from the HF checkpoints
beside them, so a correct import gives back the HF tensors: exactly for F32 files (the bf16
checkpoint upcast exactly, written back as bf16), within one Q8_0 step (block amax / 127 of the
HF values) for Q8_0 files. The HF side is read straight from `hf/model.safetensors` with the
prefix rule `model.language_model.` -> `model.` (vision tower dropped). Also: trunk + MTP sidecar ==
full file, tokenizer ids == the HF tokenizer's on the probe text, and bad inputs fail in one line
with nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from freetoken.checkpoint.reader import UnifiedCheckpoint
from freetoken.converters.gguf import _undo, convert_gguf, describe_gguf
from freetoken.errors import CheckpointError, FreetokenError, OutputExistsError, UnsupportedModelError
from freetoken.models.qwen3_5.config import Qwen35Config

from tests.conftest import FIXTURES

MODELS = {"qwen35_dense": "qwen35-dense", "qwen35_moe": "qwen35-moe"}


def gguf_path(model: str, kind: str) -> Path:
    stem = MODELS[model]
    name = f"mtp-{stem}-f32.gguf" if kind == "mtp" else f"{stem}-{kind}.gguf"
    return FIXTURES / model / "gguf" / name


def hf_tensors(model: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in load_file(FIXTURES / model / "hf" / "model.safetensors").items():
        if k.startswith("model.visual."):
            continue
        out["model." + k.removeprefix("model.language_model.") if k.startswith("model.language_model.") else k] = v
    return out


def convert(tmp_path: Path, src: Path, name: str = "out", **kw) -> UnifiedCheckpoint:
    convert_gguf(src, tmp_path / name, **kw)
    return UnifiedCheckpoint.open(tmp_path / name)


def only_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    return d


# ---------------------------------------------------------------- fixtures convert to the HF weights


@pytest.mark.parametrize("model", list(MODELS))
def test_f32_gguf_equals_hf_exactly(tmp_path, model):
    ck = convert(tmp_path, gguf_path(model, "f32"))
    hf = hf_tensors(model)
    assert set(ck.tensor_names()) == set(hf)
    for name, want in hf.items():
        got = ck.get(name)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, name
        assert torch.equal(got, want), name
    assert ck.draft_heads == {"mtp": {"num_layers": 1}}

    # config: independent reading of the HF config.json
    ref = Qwen35Config.from_hf(json.loads((FIXTURES / model / "hf" / "config.json").read_text()))
    got_cfg = Qwen35Config.from_dict(ck.config)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "rope_theta", "partial_rotary_factor", "mrope_section", "rms_norm_eps", "tie_word_embeddings",
                  "mtp_num_hidden_layers", "max_position_embeddings", "eos_token_ids", "model_type"):
        assert getattr(got_cfg, field) == getattr(ref, field), field


@pytest.mark.parametrize("model,kind", [("qwen35_dense", "q8_0"), ("qwen35_moe", "q8_0"), ("qwen35_moe", "gateup-q8_0")])
def test_q8_0_gguf_within_one_block_step_of_hf(tmp_path, model, kind):
    ck = convert(tmp_path, gguf_path(model, kind), dtype=torch.float32)
    hf = hf_tensors(model)
    assert set(ck.tensor_names()) == set(hf)
    rounded = 0
    for name, want in hf.items():
        want = want.float()
        got = ck.get(name)
        assert got.shape == want.shape, name
        if want.dim() == 1 or want.shape[-1] % 32:
            assert torch.allclose(got, want, rtol=0, atol=1e-6), name  # kept F32 in the file
            continue
        blocks = want.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127  # the Q8_0 scale of each block
        err = (got.reshape(-1, 32) - blocks).abs()
        assert bool((err <= step * 1.001 + 1e-12).all()), name
        rounded += int((err > 0).any())
    assert rounded > 10  # the matrices really went through Q8_0


@pytest.mark.parametrize("model", list(MODELS))
def test_trunk_plus_sidecar_equals_full_file(tmp_path, model):
    full = convert(tmp_path, gguf_path(model, "f32"), "full")
    # the trunk sits beside exactly one mtp-*.gguf in the fixtures: discovered automatically
    paired = convert(tmp_path, gguf_path(model, "trunk-f32"), "paired")
    explicit = convert(tmp_path, gguf_path(model, "trunk-f32"), "explicit", mtp=gguf_path(model, "mtp"))
    assert set(paired.tensor_names()) == set(full.tensor_names())
    assert any(n.startswith("mtp.") for n in full.tensor_names())
    for name in full.tensor_names():
        assert torch.equal(paired.get(name), full.get(name)), name
        assert torch.equal(explicit.get(name), full.get(name)), name
    assert paired.draft_heads == full.draft_heads == {"mtp": {"num_layers": 1}}
    sources = [Path(s.path).name for s in paired.manifest.provenance.sources]
    assert sources == [gguf_path(model, "trunk-f32").name, gguf_path(model, "mtp").name]


def test_trunk_only_converts_without_heads(tmp_path):
    src = only_dir(tmp_path, "alone") / "t.gguf"
    shutil.copy(gguf_path("qwen35_moe", "trunk-f32"), src)
    ck = convert(tmp_path, src)
    assert ck.draft_heads == {}
    assert not any(n.startswith("mtp.") for n in ck.tensor_names())
    assert ck.config["mtp_num_hidden_layers"] == 0
    hf = hf_tensors("qwen35_moe")
    assert {n for n in hf if not n.startswith("mtp.")} == set(ck.tensor_names())
    assert torch.equal(ck.get("model.layers.2.linear_attn.in_proj_qkv.weight"), hf["model.layers.2.linear_attn.in_proj_qkv.weight"])


def test_split_gguf_equals_single_file(tmp_path):
    src = gguf_path("qwen35_dense", "f32")
    split_dir = only_dir(tmp_path, "split")
    _rewrite(src, split_dir / "m.gguf", split_max_tensors=40)
    shards = sorted(p.name for p in split_dir.iterdir())
    assert shards[0] == "m-00001-of-00002.gguf" and len(shards) == 2
    a = convert(tmp_path, split_dir / shards[0], "a")
    b = convert(tmp_path, src, "b")
    assert set(a.tensor_names()) == set(b.tensor_names())
    assert all(torch.equal(a.get(n), b.get(n)) for n in b.tensor_names())
    with pytest.raises(CheckpointError, match="first shard"):
        convert_gguf(split_dir / shards[1], tmp_path / "c")


def test_tokenizer_reproduces_hf_ids(tmp_path):
    from tokenizers import Tokenizer

    probe = json.loads((FIXTURES / "manifest.json").read_text())["models"]["qwen35_dense"]["hf_tokenizer_probe"]
    convert(tmp_path, gguf_path("qwen35_dense", "q8_0"))
    ours = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    hf = Tokenizer.from_file(str(FIXTURES / "qwen35_dense" / "hf" / "tokenizer.json"))
    assert ours.encode(probe["text"]).ids == probe["ids"]
    chat = "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>"
    assert ours.encode(chat).ids == hf.encode(chat).ids
    assert ours.decode(probe["ids"]) == probe["text"]
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>"
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == (FIXTURES / "qwen35_dense" / "hf" / "chat_template.jinja").read_text()


def test_v_head_reorder_by_hand():
    # nk=2, nv=4: GGUF (tiled) order K0v0 K1v0 K0v1 K1v1 -> HF (grouped) K0v0 K0v1 K1v0 K1v1
    cfg = Qwen35Config(vocab_size=8, hidden_size=4, num_hidden_layers=1, layer_types=("linear_attention",),
                       num_attention_heads=1, num_key_value_heads=1, head_dim=4, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=1, linear_value_head_dim=2, intermediate_size=4)
    tiled = torch.tensor([10.0, 11.0, 12.0, 13.0])
    assert _undo(tiled, ("vrows:1:0",), cfg).tolist() == [10.0, 12.0, 11.0, 13.0]
    # width 2 with the q|k offset (2 * nk * dk = 4 rows untouched)
    rows = torch.arange(12.0).reshape(12, 1)
    got = _undo(rows, ("vrows:dv:kd2",), cfg).flatten().tolist()
    assert got == [0, 1, 2, 3, 4, 5, 8, 9, 6, 7, 10, 11]
    cols = torch.arange(8.0).reshape(1, 8)
    assert _undo(cols, ("vcols:dv",), cfg).flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert _undo(torch.tensor([-2.0]), ("neg_exp",), cfg).item() == pytest.approx(np.log(2.0))


def test_describe_gguf():
    d = describe_gguf(gguf_path("qwen35_moe", "q8_0"))
    r = gguf.GGUFReader(gguf_path("qwen35_moe", "q8_0"))
    assert d["architecture"] == "qwen35moe" and d["block_count"] == 5 and d["nextn_predict_layers"] == 1
    assert d["trunk_layers"] == 4 and d["has_mtp_block"] and not d["mtp_only"]
    assert d["tensor_count"] == len(r.tensors)
    assert d["quant_types"] == {"F32": sum(t.tensor_type.name == "F32" for t in r.tensors), "Q8_0": sum(t.tensor_type.name == "Q8_0" for t in r.tensors)}
    assert d["file_size"] == gguf_path("qwen35_moe", "q8_0").stat().st_size
    assert describe_gguf(gguf_path("qwen35_moe", "mtp"))["mtp_only"]


# ---------------------------------------------------------------- bad input: one line, nothing written


def _rewrite(src: Path, dst: Path, *, arch: str | None = None, edit_meta=None, split_max_tensors: int = 0) -> None:
    """Copy a GGUF with gguf-py's writer, optionally changing the architecture or metadata."""
    r = gguf.GGUFReader(src)
    old_arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch or old_arch, split_max_tensors=split_max_tensors)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        if edit_meta is not None:
            value = edit_meta(key, value)
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, f.types[0], sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=tuple(reversed([int(x) for x in t.shape])), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_nothing_written(tmp_path: Path, dst: Path) -> None:
    assert not dst.exists()
    assert not any(p.name.startswith(f".{dst.name}.tmp") for p in dst.parent.iterdir())


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_truncated_gguf(tmp_path):
    src = gguf_path("qwen35_dense", "f32")
    data = src.read_bytes()
    for n, what in ((len(data) - 100, "truncated"), (200, "truncated|corrupt")):
        bad = tmp_path / f"cut{n}.gguf"
        bad.write_bytes(data[:n])
        with pytest.raises(CheckpointError) as e:
            convert_gguf(bad, tmp_path / "out")
        assert bad.name in _one_line(e) and any(w in str(e.value) for w in what.split("|"))
        _assert_nothing_written(tmp_path, tmp_path / "out")


def test_unknown_architecture(tmp_path):
    bad = only_dir(tmp_path, "a") / "llama.gguf"
    _rewrite(gguf_path("qwen35_dense", "f32"), bad, arch="llama")
    with pytest.raises(UnsupportedModelError) as e:
        convert_gguf(bad, tmp_path / "out")
    assert "llama" in _one_line(e) and "llama.gguf" in str(e.value)
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_unknown_quant_type(tmp_path):
    data = bytearray(gguf_path("qwen35_dense", "f32").read_bytes())
    name = b"blk.0.ssm_a"
    at = data.index(len(name).to_bytes(8, "little") + name + (1).to_bytes(4, "little"))
    type_at = at + 8 + len(name) + 4 + 8  # after n_dims and the one dim
    assert int.from_bytes(data[type_at : type_at + 4], "little") == 0  # F32
    data[type_at : type_at + 4] = (34).to_bytes(4, "little")  # TQ1_0: known to ggml, not read here
    bad = tmp_path / "tq.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        convert_gguf(bad, tmp_path / "out")
    assert "blk.0.ssm_a" in _one_line(e) and "TQ1_0" in str(e.value)
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_head_from_a_different_model(tmp_path):
    head = only_dir(tmp_path, "h") / "mtp-other.gguf"
    _rewrite(gguf_path("qwen35_dense", "mtp"), head,
             edit_meta=lambda k, v: 5 if k == "qwen35.ssm.conv_kernel" else v)
    with pytest.raises(FreetokenError) as e:
        convert_gguf(gguf_path("qwen35_dense", "trunk-f32"), tmp_path / "out", mtp=head)
    msg = _one_line(e)
    assert "qwen35.ssm.conv_kernel" in msg and "5" in msg and "4" in msg
    assert "mtp-other.gguf" in msg and "qwen35-dense-trunk-f32.gguf" in msg
    _assert_nothing_written(tmp_path, tmp_path / "out")
    # a MoE head on a dense trunk: the architecture differs
    with pytest.raises(FreetokenError, match="general.architecture.*qwen35moe.*qwen35"):
        convert_gguf(gguf_path("qwen35_dense", "trunk-f32"), tmp_path / "out", mtp=gguf_path("qwen35_moe", "mtp"))
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_head_with_a_different_vocabulary(tmp_path):
    head = only_dir(tmp_path, "h") / "mtp-vocab.gguf"
    _rewrite(gguf_path("qwen35_dense", "mtp"), head,
             edit_meta=lambda k, v: [t if t != "<|video_pad|>" else "<|video_pbd|>" for t in v] if k == "tokenizer.ggml.tokens" else v)
    with pytest.raises(FreetokenError) as e:
        convert_gguf(gguf_path("qwen35_dense", "trunk-f32"), tmp_path / "out", mtp=head)
    assert "vocabulary" in _one_line(e) and "mtp-vocab.gguf" in str(e.value)
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_mtp_only_file_as_target_and_existing_output(tmp_path):
    with pytest.raises(FreetokenError, match="MTP-only"):
        convert_gguf(gguf_path("qwen35_dense", "mtp"), tmp_path / "out")
    _assert_nothing_written(tmp_path, tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError):
        convert_gguf(gguf_path("qwen35_dense", "f32"), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_reads_tensor_types_gguf_py_does_not_know(tmp_path):
    """A Q2_0 (type 42) tensor in a file: gguf 0.19 cannot parse the type, our table reads it.

    Built by relabelling the Q8_0 `output.weight` [1024, 64] as Q2_0: its first 1024 * 18 bytes
    are then read as Q2_0 blocks; the oracle decodes those bytes per the documented layout.
    """
    from freetoken.converters.gguf import open_gguf

    src = gguf_path("qwen35_dense", "q8_0")
    data = bytearray(src.read_bytes())
    name = b"output.weight"
    at = data.index(len(name).to_bytes(8, "little") + name + (2).to_bytes(4, "little"))
    type_at = at + 8 + len(name) + 4 + 16
    assert int.from_bytes(data[type_at : type_at + 4], "little") == 8  # Q8_0
    data[type_at : type_at + 4] = (42).to_bytes(4, "little")
    bad = tmp_path / "q2.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        gguf.GGUFReader(bad)  # gguf-py itself rejects the type id
    g = open_gguf(bad)
    t = g.tensors["output.weight"]
    assert t.type_id == 42 and t.shape == (1024, 64) and t.nbytes == 1024 * 18
    raw = np.frombuffer(bytes(data[t.offset : t.offset + t.nbytes]), dtype=np.uint8).reshape(-1, 18)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)  # [N, 1]
    codes = (raw[:, 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3  # [N, 16, 4]: element j = byte j//4, bits 2*(j%4)
    with np.errstate(invalid="ignore"):
        want = ((codes.reshape(-1, 64).astype(np.float32) - 1) * d).reshape(1024, 64)
    assert np.array_equal(g.load("output.weight").numpy(), want, equal_nan=True)  # misaligned bytes: some d are NaN
