"""The target's exported layer outputs (what a DFlash draft reads) against the dflash package's.

Oracle: the fixture's `target_features` (qwen35_dense_dflash/ref/dflash.safetensors), computed by the
PyPI `dflash` package's `extract_context_feature` on transformers' forward of the same target: the
outputs of decoder layers 0 and 2 (after both residual adds), concatenated. Exporting must not
change the forward: the post-norm hidden is the same bits with and without it.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FIXTURES, fixture_refs, load_unified, num_sequences

pytestmark = pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")
TAPS = (0, 2)  # the fixture draft's target_layer_ids


@torch.no_grad()
def _forward(model, ids: list[int], export_layers: tuple[int, ...] = ()):
    """One EXTEND forward of a fresh sequence (its own engine pools)."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=64))
    table: list[int] = []
    engine.kv_pool.grow(table, len(ids))
    ctx = build_context([RowGroup(table, engine.state_pool.allocate(), 0, ids)], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    return model(ctx, export_layers=export_layers)


@pytest.fixture(scope="module")
def dense(fixture_unified):
    return load_unified(fixture_unified("qwen35_dense"), with_mtp=False)


def test_exported_layers_match_the_dflash_package(dense):
    refs = fixture_refs("qwen35_dense_dflash", "dflash")
    for i in range(num_sequences(refs)):
        ids = refs[f"seq{i}.input_ids"].tolist()
        hidden, features = _forward(dense, ids, TAPS)
        assert torch.equal(hidden, _forward(dense, ids))  # exporting changes nothing
        expected = refs[f"seq{i}.target_features"]
        assert features.shape == expected.shape
        torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


def test_export_order_and_last_layer(dense):
    """Layers come back in the order asked; the last layer's output is the stream the final norm normalises."""
    ids = fixture_refs("qwen35_dense_dflash", "dflash")["seq1.input_ids"].tolist()
    _, both = _forward(dense, ids, (2, 0))
    _, zero = _forward(dense, ids, (0,))
    _, two = _forward(dense, ids, (2,))
    assert torch.equal(both, torch.cat([two, zero], dim=-1))
    hidden, last = _forward(dense, ids, (3,))
    norm = dense.model.norm
    x = last.double()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.double())
    torch.testing.assert_close(hidden.double(), expected, rtol=1e-5, atol=1e-5)
