"""Target + DFlash draft -> one unified checkpoint (`convert(..., dflash=DIR)`).

Oracles: the draft fixture's own files (its safetensors read with safetensors, its config.json
read as JSON here), a conversion of the same target without the draft, hashlib for provenance,
and the taps of published z-lab drafts for the default `build_target_layer_ids`
(`../shared/reference/dflash.md` §1.1). Bad drafts are copies of the fixture with one edit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.converters import convert
from freetoken.converters.dflash import DFlashConfig, DFlashDraft, build_target_layer_ids
from freetoken.errors import CheckpointError, FreetokenError, UnsupportedModelError

from tests.conftest import FIXTURES

TARGET = FIXTURES / "qwen35_dense" / "hf"
TARGET_GGUF = FIXTURES / "qwen35_dense" / "gguf" / "qwen35-dense-f32.gguf"
DRAFT = FIXTURES / "qwen35_dense_dflash" / "dflash"
DRAFT2 = FIXTURES / "qwen35_dense_dflash" / "dflash2"
HEAD_KEYS = {
    "architecture", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_theta", "block_size", "mask_token_id", "target_layer_ids",
    "layer_types", "sliding_window", "causal", "attention_bias",
}


def _draft_config(root: Path = DRAFT) -> dict:
    return json.loads((root / "config.json").read_text())


def _draft_tensors(root: Path = DRAFT) -> dict[str, torch.Tensor]:
    return load_file(root / "model.safetensors")


def _draft_copy(tmp_path: Path, edit: Callable[[dict], None] | None = None, tensors: dict[str, torch.Tensor] | None = None, root: Path = DRAFT) -> Path:
    """A writable copy of the fixture draft `root`, with config.json edited in place by `edit` and/or other weights."""
    d = tmp_path / "draft"
    shutil.copytree(root, d)
    d.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)
    if edit is not None:
        config = _draft_config(d)
        edit(config)
        (d / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _target_tensors(ck: UnifiedCheckpoint) -> list[str]:
    return [n for n in ck.tensor_names() if not n.startswith("dflash.")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[UnifiedCheckpoint, UnifiedCheckpoint]:
    """(target + draft, the same target alone), both from the HF fixture."""
    root = tmp_path_factory.mktemp("dflash")
    convert(TARGET, root / "with", dflash=DRAFT)
    convert(TARGET, root / "without")
    return UnifiedCheckpoint.open(root / "with"), UnifiedCheckpoint.open(root / "without")


def test_draft_tensors_are_bit_identical(converted):
    ck, _ = converted
    want = _draft_tensors()
    assert sorted(n for n in ck.tensor_names() if n.startswith("dflash.")) == sorted("dflash." + n for n in want)
    assert "dflash.fc.weight" in ck and "dflash.layers.0.self_attn.q_proj.weight" in ck
    for name, t in want.items():
        got = ck.get("dflash." + name)
        assert got.dtype == t.dtype == torch.bfloat16 and torch.equal(got, t), name


def test_manifest_entry_equals_the_fixture_config(converted):
    ck, _ = converted
    head, raw = ck.draft_heads["dflash"], _draft_config()
    assert set(head) == HEAD_KEYS
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "layer_types", "sliding_window", "attention_bias"):
        assert head[key] == raw[key], key
    assert head["architecture"] == raw["architectures"][0] == "DFlashDraftModel"
    assert head["rope_theta"] == raw["rope_parameters"]["rope_theta"] and isinstance(head["rope_theta"], float)
    assert head["block_size"] == raw["block_size"] == 4
    assert head["mask_token_id"] == raw["dflash_config"]["mask_token_id"] == 1023
    assert head["target_layer_ids"] == raw["dflash_config"]["target_layer_ids"] == [0, 2]
    assert head["causal"] == [False, False] and "is_causal" not in raw  # full layers without is_causal: bidirectional
    assert DFlashConfig.from_dict(head).to_dict() == head


def test_target_is_unchanged_by_the_draft(converted):
    ck, alone = converted
    assert sorted(_target_tensors(ck)) == sorted(alone.tensor_names())
    for name in alone.tensor_names():
        a, b = ck.get(name), alone.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ck.config == alone.config and ck.family == alone.family and ck.manifest.tokenizer == alone.manifest.tokenizer
    assert ck.draft_heads["mtp"] == alone.draft_heads["mtp"] and set(ck.draft_heads) == {"mtp", "dflash"}


def test_provenance_records_the_draft(converted):
    ck, alone = converted
    p = ck.manifest.provenance
    assert p.converter == alone.manifest.provenance.converter == "hf"
    assert p.sources[: len(alone.manifest.provenance.sources)] == alone.manifest.provenance.sources
    by_path = {Path(s.path): s for s in p.sources}
    for name in ("config.json", "model.safetensors"):
        data = (DRAFT / name).read_bytes()
        entry = by_path[(DRAFT / name).absolute()]
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.size == len(data)
    assert p.transforms == (*alone.manifest.provenance.transforms, f"DFlash draft from {DRAFT.absolute()} under dflash.*")


def test_dtype_casts_the_draft_like_the_target(tmp_path):
    convert(TARGET, tmp_path / "out", dflash=DRAFT, dtype=torch.float32)
    ck = UnifiedCheckpoint.open(tmp_path / "out")
    for name, t in _draft_tensors().items():
        got = ck.get("dflash." + name)
        assert got.dtype == torch.float32 and torch.equal(got, t.float()), name
    assert {ck.get(n).dtype for n in _target_tensors(ck)} == {torch.float32}


def test_gguf_target_with_draft(tmp_path):
    """The GGUF target comes out as without the draft (bfloat16 by default); an f32 draft stays f32."""
    draft = _draft_copy(tmp_path, tensors={n: t.float() for n, t in _draft_tensors().items()})
    convert(TARGET_GGUF, tmp_path / "with", dflash=draft)
    convert(TARGET_GGUF, tmp_path / "without")
    ck, alone = UnifiedCheckpoint.open(tmp_path / "with"), UnifiedCheckpoint.open(tmp_path / "without")
    assert sorted(_target_tensors(ck)) == sorted(alone.tensor_names())
    for name in alone.tensor_names():
        a, b = ck.get(name), alone.get(name)
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
    for name, t in _draft_tensors().items():
        got = ck.get("dflash." + name)
        assert got.dtype == torch.float32 and torch.equal(got, t.float()), name
    assert ck.manifest.provenance.converter == "gguf" and ck.draft_heads["dflash"]["target_layer_ids"] == [0, 2]
    assert ck.config == alone.config


# ---------------------------------------------------------------- config variants


@pytest.mark.parametrize(("num_target", "num_draft", "published"), [
    (36, 5, [1, 9, 17, 25, 33]),  # z-lab/Qwen3-8B-DFlash-b16
    (40, 5, [1, 10, 19, 28, 37]),  # z-lab/Qwen3.6-35B-A3B-DFlash (Apr)
    (64, 5, [1, 16, 31, 46, 61]),  # z-lab/Qwen3.6-27B-DFlash
    (40, 8, [1, 6, 11, 16, 22, 27, 32, 37]),  # z-lab/Qwen3.6-35B-A3B-DFlash rev c69b185: needs round(), not int()
    (64, 1, [32]),  # one draft layer: the middle layer
])
def test_default_taps_match_published_drafts(num_target, num_draft, published):
    assert build_target_layer_ids(num_target, num_draft) == published


def _head(tmp_path: Path, edit: Callable[[dict], None]) -> dict:
    convert(TARGET, tmp_path / "out", dflash=_draft_copy(tmp_path, edit))
    return UnifiedCheckpoint.open(tmp_path / "out").draft_heads["dflash"]


def test_default_taps_when_the_config_has_none(tmp_path):
    def edit(c):
        del c["dflash_config"]["target_layer_ids"]
        c["num_target_layers"] = 5  # taps from the draft's num_target_layers, still inside the 4-layer target
    assert _head(tmp_path, edit)["target_layer_ids"] == build_target_layer_ids(5, 2) == [1, 2]


def test_block_size_and_mask_lookup_order(tmp_path):
    def edit(c):
        c["dflash_config"]["block_size"] = 8  # dflash_config wins over the top level
        c["mask_token_id"] = c["dflash_config"].pop("mask_token_id")  # top-level fallback
    (tmp_path / "a").mkdir()
    head = _head(tmp_path / "a", edit)
    assert head["block_size"] == 8 and head["mask_token_id"] == 1023
    (tmp_path / "b").mkdir()
    assert _head(tmp_path / "b", lambda c: c.pop("block_size"))["block_size"] == 16  # the package's default


def test_causal_and_sliding_layers(tmp_path):
    def mixed(c):
        c["layer_types"] = ["sliding_attention", "full_attention"]
        c["sliding_window"] = 8
    (tmp_path / "a").mkdir()
    head = _head(tmp_path / "a", mixed)
    assert head["causal"] == [True, False] and head["sliding_window"] == 8
    assert head["layer_types"] == ["sliding_attention", "full_attention"]
    (tmp_path / "b").mkdir()
    head = _head(tmp_path / "b", lambda c: mixed(c) or c.update(is_causal=False))
    assert head["causal"] == [False, False]
    (tmp_path / "c").mkdir()
    assert _head(tmp_path / "c", lambda c: c.update(is_causal=True))["causal"] == [True, True]


# ---------------------------------------------------------------- bad input: one line naming the file, nothing written


def _fails(tmp_path: Path, exc: type, file: Path, match: str, *, src: Path = TARGET, dflash: Path | None = None) -> None:
    out = tmp_path / "out"
    with pytest.raises(exc, match=match) as info:
        convert(src, out, dflash=dflash)
    message = str(info.value)
    assert message.startswith(f"{file}: ") and "\n" not in message, message
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_file(tmp_path, name):
    d = _draft_copy(tmp_path)
    (d / name).unlink()
    _fails(tmp_path, CheckpointError, d / name, "missing", dflash=d)


def test_no_such_draft(tmp_path):
    _fails(tmp_path, CheckpointError, tmp_path / "nothing", "no such file or directory", dflash=tmp_path / "nothing")


def test_a_target_is_not_a_draft(tmp_path):
    _fails(tmp_path, CheckpointError, TARGET / "config.json", r"not a DFlash draft \(architectures \['Qwen3_5ForConditionalGeneration'\]", dflash=TARGET)


def test_draft_passed_as_the_target(tmp_path):
    _fails(tmp_path, CheckpointError, DRAFT, "a DFlash draft, not a target: pass it with --dflash", src=DRAFT)
    _fails(tmp_path, CheckpointError, DRAFT, "a DFlash draft, not a target", src=DRAFT, dflash=DRAFT)


def _set(**values) -> Callable[[dict], None]:
    return lambda c: c.update(values)


def _set_nested(**values) -> Callable[[dict], None]:
    return lambda c: c["dflash_config"].update(values)


@pytest.mark.parametrize(("edit", "exc", "match"), [
    (_set(architectures=["Qwen3ForCausalLM"]), CheckpointError, r"not a DFlash draft \(architectures \['Qwen3ForCausalLM'\]"),
    (_set(architectures=None), CheckpointError, "not a DFlash draft"),
    (_set(model_type="llama"), UnsupportedModelError, "unsupported DFlash backbone model_type 'llama'"),
    (_set(hidden_size=32), CheckpointError, "hidden_size 32 differs from the target's 64"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), CheckpointError, "no mask_token_id"),
    (_set_nested(mask_token_id=1024), CheckpointError, r"mask_token_id 1024 is outside the target's vocabulary \(1024 tokens\)"),
    (_set_nested(target_layer_ids=[0, 4]), CheckpointError, r"target_layer_ids \[0, 4\] reach outside the target's layers 0..3"),
    (_set_nested(target_layer_ids=[-1, 2]), CheckpointError, r"target_layer_ids \[-1, 2\] reach outside"),
    (_set(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}), UnsupportedModelError, "rope type 'yarn' is not supported"),
    (_set(rope_scaling={"type": "linear", "factor": 2.0}), UnsupportedModelError, "rope_scaling rope type 'linear' is not supported"),
    (_set(attention_bias=True), UnsupportedModelError, "attention_bias true is not supported"),
    (_set(layer_types=["sliding_attention", "full_attention"], sliding_window=None), CheckpointError, "sliding_attention layers need a positive sliding_window"),
    (_set(layer_types=["full_attention"]), CheckpointError, "layer_types .* must list 2 of"),
    (lambda c: c.pop("num_hidden_layers"), CheckpointError, "missing or bad field 'num_hidden_layers'"),
])
def test_bad_config(tmp_path, edit, exc, match):
    d = _draft_copy(tmp_path, edit)
    _fails(tmp_path, exc, d / "config.json", match, dflash=d)


def test_bad_config_fails_with_a_gguf_target_too(tmp_path):
    d = _draft_copy(tmp_path, _set(hidden_size=32))
    _fails(tmp_path, CheckpointError, d / "config.json", "hidden_size 32 differs", src=TARGET_GGUF, dflash=d)


def test_missing_tensor(tmp_path):
    tensors = _draft_tensors()
    del tensors["layers.1.mlp.up_proj.weight"]
    d = _draft_copy(tmp_path, tensors=tensors)
    _fails(tmp_path, CheckpointError, d / "model.safetensors", r"missing tensors: layers.1.mlp.up_proj.weight$", dflash=d)


def test_unexpected_tensors_lists_five(tmp_path):
    extra = {f"extra.{i}.weight": torch.zeros(2) for i in range(6)} | {"embed_tokens.weight": torch.zeros(4, 64)}
    d = _draft_copy(tmp_path, tensors=_draft_tensors() | extra)
    _fails(tmp_path, CheckpointError, d / "model.safetensors",
           r"unexpected tensors \(not part of a DFlash draft\): embed_tokens.weight, extra.0.weight, extra.1.weight, extra.2.weight, extra.3.weight \(\+2 more\)$", dflash=d)


@pytest.mark.parametrize(("name", "shape", "implied"), [
    ("fc.weight", (64, 192), (64, 128)),  # three taps' worth of input, the config lists two
    ("layers.0.self_attn.q_proj.weight", (32, 64), (64, 64)),
    ("layers.1.self_attn.k_proj.weight", (64, 64), (32, 64)),
    ("layers.0.self_attn.v_proj.weight", (32, 32), (32, 64)),
    ("layers.0.self_attn.o_proj.weight", (64, 32), (64, 64)),
    ("layers.1.self_attn.q_norm.weight", (32,), (16,)),
    ("layers.0.self_attn.k_norm.weight", (64,), (16,)),
    ("layers.0.mlp.gate_proj.weight", (64, 64), (128, 64)),
    ("layers.1.mlp.up_proj.weight", (128, 32), (128, 64)),
    ("layers.0.mlp.down_proj.weight", (128, 64), (64, 128)),
    ("hidden_norm.weight", (128,), (64,)),
    ("layers.1.post_attention_layernorm.weight", (63,), (64,)),
])
def test_wrong_shape(tmp_path, name, shape, implied):
    tensors = _draft_tensors() | {name: torch.zeros(shape, dtype=torch.bfloat16)}
    d = _draft_copy(tmp_path, tensors=tensors)
    _fails(tmp_path, CheckpointError, d / "model.safetensors",
           rf"tensor {name} has shape \[{', '.join(map(str, shape))}\], config.json implies \[{', '.join(map(str, implied))}\]", dflash=d)


def test_integer_tensor(tmp_path):
    d = _draft_copy(tmp_path, tensors=_draft_tensors() | {"norm.weight": torch.zeros(64, dtype=torch.int32)})
    _fails(tmp_path, CheckpointError, d / "model.safetensors", "tensor norm.weight has dtype I32", dflash=d)


def test_truncated_safetensors(tmp_path):
    d = _draft_copy(tmp_path)
    data = (DRAFT / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    _fails(tmp_path, CheckpointError, d / "model.safetensors", "truncated or corrupt safetensors file", dflash=d)


def test_corrupt_safetensors_header(tmp_path):
    d = _draft_copy(tmp_path)
    data = bytearray((DRAFT / "model.safetensors").read_bytes())
    data[8:12] = b"\xff\xfe{{"
    (d / "model.safetensors").write_bytes(bytes(data))
    _fails(tmp_path, CheckpointError, d / "model.safetensors", "corrupt safetensors file", dflash=d)


def test_failure_while_writing_the_draft_leaves_nothing(tmp_path, monkeypatch):
    real = DFlashDraft.tensors

    def failing(self):
        for n, item in enumerate(real(self)):
            if n == 3:
                raise RuntimeError("disk on fire")
            yield item

    monkeypatch.setattr(DFlashDraft, "tensors", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(TARGET, tmp_path / "out", dflash=DRAFT, shard_size=10_000)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- DFlash2


def test_dflash2_draft_converts(tmp_path):
    convert(TARGET, tmp_path / "out", dflash=DRAFT2)
    ck, raw, want = UnifiedCheckpoint.open(tmp_path / "out"), _draft_config(DRAFT2), _draft_tensors(DRAFT2)
    assert sorted(n for n in ck.tensor_names() if n.startswith("dflash.")) == sorted("dflash." + n for n in want)
    for name, t in want.items():
        assert torch.equal(ck.get("dflash." + name), t), name
    head = ck.draft_heads["dflash"]
    assert set(head) == HEAD_KEYS | {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "vocab_size"}
    assert head["architecture"] == "DFlash2DraftModel" and head["vocab_size"] == ck.config["vocab_size"] == 1024
    for key in ("block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        assert head[key] == raw["dflash_config"][key], key
    assert head["layer_types"] == ["sliding_attention"] * 2 and head["sliding_window"] == 8 and head["causal"] == [False, False]
    assert "DFlash2 draft from" in ck.manifest.provenance.transforms[-1]


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c["dflash_config"].pop("selector_top_k"), r"a DFlash2 draft needs a positive int selector_top_k \(in dflash_config\), got None"),
    (_set_nested(conv_kernel_size=0), "a DFlash2 draft needs a positive int conv_kernel_size"),
    (_set_nested(conv_group_size=48), "conv_group_size 48 does not divide hidden_size 64"),
    (_set_nested(selector_top_k=4096), r"selector_top_k 4096 exceeds the vocabulary \(1024 tokens\)"),
])
def test_bad_dflash2_config(tmp_path, edit, match):
    d = _draft_copy(tmp_path, edit, root=DRAFT2)
    _fails(tmp_path, CheckpointError if "needs" in match else FreetokenError, d / "config.json", match, dflash=d)


def test_dflash2_tensors(tmp_path):
    tensors = _draft_tensors(DRAFT2)
    missing = {n: t for n, t in tensors.items() if n != "layers.1.mlp_conv.base_kernel"}
    d = _draft_copy(tmp_path / "a", tensors=missing, root=DRAFT2)
    _fails(tmp_path / "a", CheckpointError, d / "model.safetensors", "missing tensors: layers.1.mlp_conv.base_kernel$", dflash=d)
    short = tensors | {"candidate_selector.successor_codebook": torch.zeros(1000, 8, dtype=torch.bfloat16)}
    d = _draft_copy(tmp_path / "b", tensors=short, root=DRAFT2)
    _fails(tmp_path / "b", CheckpointError, d / "model.safetensors",
           r"tensor candidate_selector.successor_codebook has 1000 rows, one per token of the target's vocabulary \(1024\) expected", dflash=d)
    d = _draft_copy(tmp_path / "c", tensors=_draft_tensors(DRAFT2) | {"layers.0.attention_conv.kernel_projection.weight": torch.zeros(8, 64)}, root=DRAFT2)
    _fails(tmp_path / "c", CheckpointError, d / "model.safetensors",
           r"tensor layers.0.attention_conv.kernel_projection.weight has shape \[8, 64\], config.json implies \[16, 64\]", dflash=d)
    d = _draft_copy(tmp_path / "d", tensors=_draft_tensors(DRAFT) | {"layers.0.mlp_conv.base_kernel": torch.zeros(2, 2, 64)})
    _fails(tmp_path / "d", CheckpointError, d / "model.safetensors", r"unexpected tensors \(not part of a DFlash draft\): layers.0.mlp_conv.base_kernel$", dflash=d)
