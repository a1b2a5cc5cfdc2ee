"""examples/train_dflash_demo.py: its packed training forward is DFlashDraft.forward, and it runs end to end.

Oracles: `DFlashDraft.forward` (checked against the dflash package in tests/spec/test_dflash_draft.py)
run block by block over the context rows `DFlashDraft.context_kv` makes of positions < the anchor;
the mask rule of reference/dflash.md §1.4 (a block sees the context before its anchor and itself);
`converters/dflash.py` reading the written draft directory.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from freetoken.spec.dflash.config import DFlashConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_dflash_demo.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_dflash_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_dflash_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


tdd = _load_script()

TINY = DFlashConfig(
    architecture="DFlashDraftModel", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, block_size=4, mask_token_id=7, target_layer_ids=(0, 2),
    layer_types=("full_attention",) * 2, sliding_window=None, causal=(False, False), attention_bias=False,
)


def _inputs(W: int = 2, L: int = 20, n: int = 3):
    g = torch.Generator().manual_seed(0)
    features = torch.randn(W, L, 2 * TINY.hidden_size, generator=g)
    embeds = torch.randn(W, n, TINY.block_size, TINY.hidden_size, generator=g)
    anchors = torch.tensor([[1, 7, 16], [3, 4, 12]])  # adjacent blocks overlap in position; 16 = L - B, the last
    return features, embeds, anchors


def test_mask_sees_earlier_context_and_its_own_block():
    m = tdd.packed_mask(torch.tensor([[2, 5]]), 6, 2)[0, 0]
    want = torch.tensor([
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)  # fmt: skip
    assert torch.equal(m, want)


def test_packed_forward_equals_the_draft_block_by_block():
    draft = tdd.new_draft(TINY, seed=3)
    features, embeds, anchors = _inputs()
    with torch.no_grad():
        got = tdd.packed_forward(draft, features, embeds, anchors)
        for w in range(anchors.shape[0]):
            for b, a in enumerate(anchors[w].tolist()):
                ctx_k, ctx_v = draft.context_kv(draft.context(features[w, :a]), torch.arange(a))
                want = draft(embeds[w, b], torch.arange(a, a + TINY.block_size), ctx_k, ctx_v, torch.arange(a))
                torch.testing.assert_close(got[w, b], want, rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 0.1


def test_every_parameter_gets_a_gradient():
    draft = tdd.new_draft(TINY, seed=3)
    features, embeds, anchors = _inputs()
    tdd.packed_forward(draft, features, embeds, anchors).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in draft.parameters())


def test_training_is_deterministic():
    cfg = replace(tdd.SMOKE, seq_len=20, num_windows=3, windows_per_step=2, anchors_per_window=3, steps=3, block_size=TINY.block_size)
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(16, TINY.hidden_size, generator=g)
    feats, hidden = torch.randn(3, 20, 2 * TINY.hidden_size, generator=g), torch.randn(3, 20, TINY.hidden_size, generator=g)
    tokens = torch.randint(0, 16, (3, 20), generator=g)
    runs = []
    for _ in range(2):
        draft = tdd.new_draft(TINY, seed=cfg.seed)
        curve = tdd.train(draft, embed, feats, hidden, tokens, cfg, TINY.mask_token_id)
        runs.append((curve[-1]["loss"], [p.detach().clone() for p in draft.parameters()]))
    assert runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.skipif(not (REPO / "src" / "freetoken" / "assets" / "default-model" / "manifest.json").is_file(), reason="no embedded model")
def test_smoke_run_writes_a_draft_the_converter_accepts(tmp_path):
    from freetoken.checkpoint import UnifiedCheckpoint
    from freetoken.converters.dflash import read_dflash
    from freetoken.llm import DEFAULT_MODEL_DIR

    out = tmp_path / "draft"
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    try:
        log = tdd.main(["--out", str(out), "--smoke", "--threads", "1"])
    finally:  # main() sets them for the whole process
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    target = UnifiedCheckpoint.open(DEFAULT_MODEL_DIR)
    draft = read_dflash(out, target.config)
    assert draft.config.hidden_size == target.config["hidden_size"] and draft.config.mask_token_id == 5118
    assert draft.config.target_layer_ids == tdd.SMOKE.target_layers and draft.config.causal == (False,)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert json.loads((out / "train_log.json").read_text())["acceptance"]["k1"]["num_draft_tokens"] == 1
    assert log["corpus"]["train_files_dropped_for_prompts"] >= 0 and log["final_loss"] > 0
