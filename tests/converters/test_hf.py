"""HF -> unified conversion of the fixture checkpoints and of layout variants built from them.

Oracles: the fixture safetensors themselves (every canonical tensor must equal its source),
hashlib for provenance, and transformers, which must load the converted shards and give the
same logits as when it loads the original checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken.converters.hf as hf
from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.converters.hf import convert_hf
from freetoken.errors import CheckpointError, OutputExistsError, UnsupportedModelError

from tests.conftest import FIXTURES

MODELS = ["qwen35_dense", "qwen35_moe"]


def _src(model: str) -> Path:
    return FIXTURES / model / "hf"


def _canonical_fixture(model: str, *, visual: bool = True) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in load_file(_src(model) / "model.safetensors").items():
        if k.startswith("model.visual.") and not visual:
            continue
        out[k.replace("model.language_model.", "model.", 1)] = v
    return out


def _assert_same(dst: Path, want: dict[str, torch.Tensor]) -> UnifiedCheckpoint:
    ck = UnifiedCheckpoint.open(dst)
    assert sorted(ck.tensor_names()) == sorted(want)
    for name, t in want.items():
        got = ck.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    return ck


def _variant(tmp_path: Path, model: str, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A copy of the fixture directory with other weights (and optionally another config.json)."""
    d = tmp_path / "src"
    shutil.copytree(_src(model), d, ignore=shutil.ignore_patterns("model.safetensors"))
    d.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)
    save_file(tensors, d / "model.safetensors")
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def _config(model: str) -> dict:
    return json.loads((_src(model) / "config.json").read_text())


@pytest.fixture(scope="module", params=MODELS)
def converted(request, tmp_path_factory):
    dst = tmp_path_factory.mktemp(request.param) / "unified"
    return request.param, dst, convert_hf(_src(request.param), dst)


def test_fixture_conversion_is_exact(converted):
    model, dst, manifest = converted
    ck = _assert_same(dst, _canonical_fixture(model))
    assert ck.draft_heads == {"mtp": {"num_layers": 1}} and ck.family == "qwen3_5"
    assert ck.config["model_type"] == _config(model)["model_type"] and ck.config["mtp_num_hidden_layers"] == 1
    assert ck.config["vision_config"] == _config(model)["vision_config"]
    assert ck.manifest.tokenizer["eos_token_ids"] == [1017]
    assert ck.chat_template == (_src(model) / "chat_template.jinja").read_text()
    assert (dst / "tokenizer.json").read_bytes() == (_src(model) / "tokenizer.json").read_bytes()
    sources = {Path(s.path).name: s for s in manifest.provenance.sources}
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        data = (_src(model) / name).read_bytes()
        assert sources[name].sha256 == hashlib.sha256(data).hexdigest() and sources[name].size == len(data)
    assert manifest.provenance.converter == "hf"
    assert "model.language_model.* renamed to model.*" in manifest.provenance.transforms


def test_converted_loads_in_transformers(converted):
    from transformers import AutoModelForCausalLM

    model, dst, manifest = converted
    view = dst.parent / "hf_view"
    shutil.copytree(dst, view)
    shutil.copy(_src(model) / "config.json", view / "config.json")
    index = {"metadata": {}, "weight_map": {n: i["shard"] for n, i in manifest.tensors.items()}}
    (view / "model.safetensors.index.json").write_text(json.dumps(index))
    kw = {"dtype": torch.float32, "experts_implementation": "eager"}
    ours, info = AutoModelForCausalLM.from_pretrained(view, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    theirs = AutoModelForCausalLM.from_pretrained(_src(model), **kw)
    ids = load_file(FIXTURES / model / "ref" / "hf_transformers.safetensors")["seq1.input_ids"].long()[None]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_text_only_drops_vision(tmp_path):
    manifest = convert_hf(_src("qwen35_dense"), tmp_path / "out", text_only=True)
    ck = _assert_same(tmp_path / "out", _canonical_fixture("qwen35_dense", visual=False))
    assert "vision_config" not in ck.config
    assert "model.visual.* dropped (text only)" in manifest.provenance.transforms


def test_per_expert_layout_gives_identical_output(tmp_path):
    cfg = _config("qwen35_moe")["text_config"]
    n, i = cfg["num_experts"], cfg["moe_intermediate_size"]
    split = {}
    for k, v in load_file(_src("qwen35_moe") / "model.safetensors").items():
        if k.endswith("experts.gate_up_proj"):
            base = k.removesuffix("gate_up_proj")
            for e in range(n):
                split[f"{base}{e}.gate_proj.weight"] = v[e, :i].clone()
                split[f"{base}{e}.up_proj.weight"] = v[e, i:].clone()
        elif k.endswith("experts.down_proj"):
            base = k.removesuffix("down_proj")
            for e in range(n):
                split[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            split[k] = v
    manifest = convert_hf(_variant(tmp_path, "qwen35_moe", split), tmp_path / "out")
    _assert_same(tmp_path / "out", _canonical_fixture("qwen35_moe"))
    assert any(t.startswith("experts fused from per-expert") for t in manifest.provenance.transforms)


def test_text_only_checkpoint_with_model_prefix(tmp_path):
    want = _canonical_fixture("qwen35_dense", visual=False)
    text_config = _config("qwen35_dense")["text_config"] | {"architectures": ["Qwen3_5ForCausalLM"]}
    manifest = convert_hf(_variant(tmp_path, "qwen35_dense", want, text_config), tmp_path / "out")
    ck = _assert_same(tmp_path / "out", want)
    assert ck.config["model_type"] == "qwen3_5" and "renamed" not in " ".join(manifest.provenance.transforms)


def test_tied_embeddings(tmp_path):
    tensors = load_file(_src("qwen35_dense") / "model.safetensors")
    del tensors["lm_head.weight"]
    config = _config("qwen35_dense")
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    convert_hf(_variant(tmp_path, "qwen35_dense", tensors, config), tmp_path / "out")
    want = _canonical_fixture("qwen35_dense")
    del want["lm_head.weight"]
    assert _assert_same(tmp_path / "out", want).config["tie_word_embeddings"] is True


def test_tied_flag_with_equal_lm_head_drops_it_and_missing_lm_head_ties(tmp_path):
    tensors = load_file(_src("qwen35_dense") / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    config = _config("qwen35_dense")
    config["tie_word_embeddings"] = True
    (tmp_path / "a").mkdir()
    manifest = convert_hf(_variant(tmp_path / "a", "qwen35_dense", tensors, config), tmp_path / "out_a")
    assert "lm_head.weight" not in manifest.tensors and manifest.config["tie_word_embeddings"] is True
    assert any("lm_head.weight dropped" in t for t in manifest.provenance.transforms)

    del tensors["lm_head.weight"]  # flag false, no lm_head: tie
    (tmp_path / "b").mkdir()
    manifest = convert_hf(_variant(tmp_path / "b", "qwen35_dense", tensors), tmp_path / "out_b")
    assert "lm_head.weight" not in manifest.tensors and manifest.config["tie_word_embeddings"] is True


def test_legacy_rope_fields(tmp_path, converted):
    model, dst, manifest = converted
    config = _config(model)
    rope = config["text_config"].pop("rope_parameters")
    config["text_config"] |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    config["text_config"]["rope_scaling"] = {"rope_type": "default", "mrope_section": rope["mrope_section"]}
    legacy = convert_hf(_variant(tmp_path, model, load_file(_src(model) / "model.safetensors"), config), tmp_path / "out")
    assert legacy.config == manifest.config and legacy.config["mrope_section"] == rope["mrope_section"]


def test_sharded_with_index(tmp_path):
    tensors = load_file(_src("qwen35_moe") / "model.safetensors")
    d = _variant(tmp_path, "qwen35_moe", {})
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for part in range(3):
        file = f"model-{part + 1:05d}-of-00003.safetensors"
        chunk = {n: tensors[n] for n in names[part::3]}
        save_file(chunk, d / file)
        weight_map |= {n: file for n in chunk}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    manifest = convert_hf(d, tmp_path / "out", shard_size=200_000)
    _assert_same(tmp_path / "out", _canonical_fixture("qwen35_moe"))
    assert len({i["shard"] for i in manifest.tensors.values()}) > 1
    assert {Path(s.path).name for s in manifest.provenance.sources} >= set(weight_map.values()) | {"model.safetensors.index.json"}


def test_repo_id_not_in_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match="nobody-xyz/not-a-model: .*not a repo id in the local Hugging Face cache"):
        convert_hf("nobody-xyz/not-a-model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# Bad input: one clear line naming the file and the problem, and nothing written.

def _fails(tmp_path: Path, src: Path, exc: type, match: str, **kw) -> None:
    out = tmp_path / "out"
    with pytest.raises(exc, match=match) as info:
        convert_hf(src, out, **kw)
    assert "\n" not in str(info.value)
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".out")]


def test_missing_path(tmp_path):
    _fails(tmp_path, tmp_path / "nothing", CheckpointError, "nothing: no such file or directory")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    _fails(tmp_path, tmp_path / "empty", CheckpointError, r"empty: not a Hugging Face checkpoint \(no config.json\)")


def test_truncated_safetensors(tmp_path):
    d = _variant(tmp_path, "qwen35_dense", {"x": torch.zeros(1)})
    data = (_src("qwen35_dense") / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails(tmp_path, d, CheckpointError, r"model.safetensors: truncated or corrupt safetensors file")


def test_unknown_extra_tensor(tmp_path):
    tensors = load_file(_src("qwen35_dense") / "model.safetensors") | {"model.language_model.layers.0.mystery.weight": torch.zeros(3)}
    _fails(tmp_path, _variant(tmp_path, "qwen35_dense", tensors), CheckpointError, r"unknown tensors .*model.language_model.layers.0.mystery.weight")


def test_missing_and_misshapen_tensors(tmp_path):
    tensors = load_file(_src("qwen35_dense") / "model.safetensors")
    del tensors["model.language_model.layers.2.linear_attn.A_log"]
    (tmp_path / "a").mkdir()
    _fails(tmp_path / "a", _variant(tmp_path / "a", "qwen35_dense", tensors), CheckpointError, r"missing tensors: model.layers.2.linear_attn.A_log")
    tensors = load_file(_src("qwen35_dense") / "model.safetensors")
    tensors["model.language_model.norm.weight"] = torch.zeros(65, dtype=torch.bfloat16)
    (tmp_path / "b").mkdir()
    _fails(tmp_path / "b", _variant(tmp_path / "b", "qwen35_dense", tensors), CheckpointError, r"model.language_model.norm.weight has shape \[65\], config.json implies \[64\]")


def test_partial_mtp(tmp_path):
    tensors = load_file(_src("qwen35_moe") / "model.safetensors")
    del tensors["mtp.pre_fc_norm_hidden.weight"]
    _fails(tmp_path, _variant(tmp_path, "qwen35_moe", tensors), CheckpointError, r"incomplete MTP head: missing mtp.pre_fc_norm_hidden.weight")


def test_unsupported_model_type(tmp_path):
    config = _config("qwen35_dense") | {"model_type": "llama"}
    config["text_config"]["model_type"] = "llama"
    d = _variant(tmp_path, "qwen35_dense", load_file(_src("qwen35_dense") / "model.safetensors"), config)
    _fails(tmp_path, d, UnsupportedModelError, r"config.json: unsupported model_type 'llama'")


def test_existing_output_without_force(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError, match="out: output exists"):
        convert_hf(_src("qwen35_dense"), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, exc):
    real = hf._stream

    def failing(*args, **kwargs):
        for n, item in enumerate(real(*args, **kwargs)):
            if n == 20:
                raise exc
            yield item

    monkeypatch.setattr(hf, "_stream", failing)
    with pytest.raises(type(exc)):
        convert_hf(_src("qwen35_moe"), tmp_path / "out", shard_size=10_000)
    assert list(tmp_path.iterdir()) == []
