"""qwen4_exp canonical tensors and n-gram hash constants.

Oracles: the names, shapes and int64 buffers that transformers' `save_pretrained` wrote into the
fixture checkpoint, and transformers' own `_build_layer_multipliers` / `_find_nth_prime_after` for
the real model's sizes.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from safetensors import safe_open

from freetoken.models.qwen4_exp.config import Qwen4ExpConfig
from freetoken.models.qwen4_exp.weights import (
    canonical_name,
    derived_buffers,
    expected_tensors,
    ngram_head_offsets,
    ngram_head_vocab_sizes,
    ngram_layer_multipliers,
    ngram_table_rows,
)

from tests.conftest import FIXTURES

HF = FIXTURES / "qwen4_exp" / "hf"
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARD = re.compile(r"^(.+\.ngram_embedding)\.shard_\d+\.weight$")


@pytest.fixture(scope="module")
def cfg() -> Qwen4ExpConfig:
    return Qwen4ExpConfig.from_hf(json.loads((HF / "config.json").read_text()))


def _fixture_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Fixture name -> (dtype, shape), text and MTP only."""
    with safe_open(HF / "model.safetensors", "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys() if not k.startswith("model.visual.")}


def _canonical_fixture_shapes() -> dict[str, tuple[int, ...]]:
    """The fixture's tensors as the unified checkpoint holds them: experts stacked, shards joined, buffers gone."""
    out: dict[str, tuple[int, ...]] = {}
    experts: dict[str, dict[str, list[tuple[int, ...]]]] = {}
    for name, (dtype, shape) in _fixture_tensors().items():
        name = name.replace("model.language_model.", "model.", 1)
        if dtype == "I64":
            continue
        if m := _EXPERT.match(name):
            experts.setdefault(m[1], {}).setdefault(m[3], []).append(shape)
        elif m := _SHARD.match(name):
            rows = out.get(f"{m[1]}.weight", (0,))[0]
            out[f"{m[1]}.weight"] = (rows + shape[0], shape[1])
        else:
            out[name] = shape
    for prefix, kinds in experts.items():
        (i, h), n = kinds["gate"][0], len(kinds["gate"])
        out[f"{prefix}.gate_up_proj"] = (n, 2 * i, h)
        out[f"{prefix}.down_proj"] = (n, *kinds["down"][0])
    return out


def test_expected_tensors_match_fixture(cfg):
    want = _canonical_fixture_shapes()
    assert expected_tensors(cfg, with_mtp=True) == want
    assert expected_tensors(cfg, with_mtp=False) == {n: s for n, s in want.items() if not n.startswith("mtp.")}
    tied = expected_tensors(replace(cfg, tie_word_embeddings=True), with_mtp=False)
    assert "lm_head.weight" not in tied and "model.norm.weight" not in tied


def test_dense_attention_has_no_indexer(cfg):
    dense = replace(cfg, indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None, indexer_compress_ratio=None)
    names = expected_tensors(dense, with_mtp=True)
    assert not any(".indexer." in n for n in names)
    assert "model.layers.3.self_attn.q_proj.weight" in names


def test_buffers_equal_the_fixture(cfg):
    stored = {}
    with safe_open(HF / "model.safetensors", "pt") as f:
        for k in f.keys():
            if f.get_slice(k).get_dtype() == "I64":
                stored[canonical_name(k)] = f.get_tensor(k).tolist()
    assert derived_buffers(cfg) == stored
    assert ngram_table_rows(cfg) == ngram_table_rows(cfg, 0) == _canonical_fixture_shapes()["model.layers.1.ple.ple_embedding.ngram_embedding.weight"][0]


def test_hash_constants_equal_transformers_at_real_size(cfg):
    modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    real = replace(cfg, vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000, seed=1234, ple_layer_ids=(2, 6))
    for ple_index in (0, 1):
        assert ngram_layer_multipliers(real, ple_index) == modeling._build_layer_multipliers(248320, 3, ple_index, 1234).tolist()
        heads = real.num_ngram_heads
        want = [modeling._find_nth_prime_after(20_000_000 - 1, ple_index * heads + h + 1) for h in range(heads)]
        assert ngram_head_vocab_sizes(real, ple_index) == want
        assert ngram_head_offsets(real, ple_index) == [sum(want[:h]) for h in range(heads)]
    with pytest.raises(ValueError, match="needs ple_index"):
        ngram_table_rows(real)


def test_canonical_name_aliases():
    assert canonical_name("model.language_model.layers.1.ple.key_proj.weight") == "model.layers.1.ple.key_proj.weight"
    assert canonical_name("language_model.model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert canonical_name("language_model.lm_head.weight") == "lm_head.weight"
    assert canonical_name("model.mtp.fc_hidden.weight") == "mtp.fc_hidden.weight"
    for same in ("lm_head.weight", "mtp.layers.0.self_attn.q_proj.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert canonical_name(same) == same
