"""Lossless DFlash and DFlash2 speculative decoding, and the draft context the method keeps.

Target and draft: the fixture `qwen35_dense` with its DFlash draft (`qwen35_dense_dflash/dflash`,
block size 4) or its DFlash2 draft (`.../dflash2`, block size 4, sliding window 8, the candidate
selector), converted together; every test runs with each. Oracles: the same engine without speculative decoding (greedy,
token for token, fp32 and bf16); for the draft's context rows, a fresh forward of the target over
the committed tokens through the draft's `context_kv` (itself checked against the dflash package in
test_dflash_draft.py), so rows appended piecewise by prefill chunks and verify steps must equal rows
computed at once. The random fixture draft is rarely right, so the accept path is driven with a
degenerate pair (reference/dflash.md §5): the target's final norm zeroed (its hidden is 0, so it
always picks token 0 whatever its lm_head), and the draft's sublayers silenced (attention and MLP
output projections zero), so every mask slot's hidden is the same vector h, with the lm_head's
row 0 set to h and the others to 0: token 0 is every slot's unique best logit and, with the
DFlash2 selector's predecessor codebook zero, its walk's best score too. Every draft is accepted.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.errors import FreetokenError
from freetoken.llm import LLM
from tests.conftest import FIXTURES, convert_unified, fixture_refs, greedy

pytestmark = pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")
NEW_TOKENS = 40
BLOCK = 4  # the fixture draft's block size


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def checkpoint(request, tmp_path_factory) -> str:
    dst = tmp_path_factory.mktemp(request.param) / "unified"
    return str(convert_unified(FIXTURES / "qwen35_dense" / "hf", dst, dflash=FIXTURES / "qwen35_dense_dflash" / request.param))


def _prompts() -> list[list[int]]:
    """7 prompts of lengths 1..29 cut from the fixture's 33-token sequence (one token: no context row yet)."""
    ids = fixture_refs("qwen35_dense")["seq2.input_ids"].tolist()
    return [ids[j : j + n] for j, n in enumerate((1, 2, 5, 9, 13, 20, 29))]


@lru_cache(maxsize=None)
def _llm(path: str, dtype: str) -> LLM:
    return LLM(path, EngineConfig(dtype=dtype, max_num_seqs=8, max_model_len=128, spec="dflash"))


def _outputs(llm: LLM, spec: str, k: int, n: int = NEW_TOKENS):
    requests, stats = llm.generate_ids(_prompts(), greedy(n), llm.with_spec(spec, k))
    return [r.output_token_ids for r in requests], requests, stats


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_dflash_equals_no_spec(checkpoint, dtype, k):
    llm = _llm(checkpoint, dtype)
    expected, _, _ = _outputs(llm, "none", 0)
    actual, requests, stats = _outputs(llm, "dflash", k)
    assert all(len(e) == NEW_TOKENS for e in expected)
    assert actual == expected
    assert stats.num_draft_tokens == k and all(r.accepted_lens for r in requests)


def test_default_k_is_the_block_less_the_anchor(checkpoint):
    assert _llm(checkpoint, "float32").config.num_draft_tokens == BLOCK - 1


@torch.no_grad()
def _fresh_context(llm: LLM, tokens: list[int]):
    """The draft's context rows of `tokens` from one target forward over all of them -> (K, V) [L, kv, n, hd]."""
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    engine = llm.make_engine(llm.with_spec("none", 0))
    table: list[int] = []
    engine.kv_pool.grow(table, len(tokens))
    ctx = build_context([RowGroup(table, engine.state_pool.allocate(), 0, tokens)], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    draft = llm.model.draft_network("dflash")
    _, features = llm.model(ctx, export_layers=draft.config.target_layer_ids)
    return draft.context_kv(draft.context(features), torch.arange(len(tokens)))


def _check_contexts(llm: LLM, engine, steps: int) -> int:
    """Step the engine, then compare every running request's draft context with fresh rows; -> requests checked."""
    for _ in range(steps):
        engine.step()
    checked = 0
    for r in engine.scheduler.running:
        state = r.draft_state
        if state is None:
            continue
        assert state.num_rows == r.num_cached_tokens
        keys, values = _fresh_context(llm, r.token_ids[: r.num_cached_tokens])
        torch.testing.assert_close(state.keys[:, :, : state.num_rows], keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.values[:, :, : state.num_rows], values, rtol=1e-5, atol=1e-5)
        checked += 1
    return checked


def test_context_rows_equal_rows_computed_at_once(checkpoint):
    llm = _llm(checkpoint, "float32")
    engine = llm.make_engine(llm.with_spec("dflash", 3))
    for p in _prompts():
        engine.add_request(p, greedy(NEW_TOKENS))
    assert _check_contexts(llm, engine, 6) == len(_prompts())


@pytest.fixture
def degenerate(checkpoint):
    """The fp32 LLM edited so that target and draft always pick token 0 (module docstring), restored after."""
    llm = _llm(checkpoint, "float32")
    model, draft = llm.model, llm.model.draft_network("dflash")
    silenced = [w for layer in draft.layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    if draft.candidate_selector is not None:
        silenced.append(draft.candidate_selector.predecessor_codebook)
    edited = [model.model.norm.weight, model.lm_head.weight, *silenced]
    saved = [w.clone() for w in edited]
    with torch.no_grad():
        model.model.norm.weight.fill_(-1.0)  # zero-centred: scale 1 + w = 0
        for w in silenced:
            w.zero_()
        mask = torch.tensor([draft.config.mask_token_id])
        h = draft.norm(model.embed(mask))[0]  # every mask slot's hidden now
        model.lm_head.weight.zero_()
        model.lm_head.weight[0] = h
    yield llm
    with torch.no_grad():
        for w, s in zip(edited, saved):
            w.copy_(s)


@pytest.mark.parametrize("k", [1, 3])
def test_every_draft_accepted_with_a_perfect_draft(degenerate, k):
    expected, _, _ = _outputs(degenerate, "none", 0, n=13)
    actual, requests, stats = _outputs(degenerate, "dflash", k, n=13)
    assert actual == expected == [[0] * 13] * len(_prompts())
    for r in requests:
        assert r.accepted_lens[:-1] == [k] * (len(r.accepted_lens) - 1)  # the last block may pass max_new_tokens
        assert r.num_target_steps == -(-13 // (k + 1))
    assert stats.acceptance_per_position[-1] == 1.0


def test_context_rows_after_full_acceptance(degenerate):
    engine = degenerate.make_engine(degenerate.with_spec("dflash", 3))
    for p in _prompts():
        engine.add_request(p, greedy(NEW_TOKENS))
    assert _check_contexts(degenerate, engine, 5) == len(_prompts())


def test_errors(checkpoint, fixture_unified):
    with pytest.raises(FreetokenError, match="no DFlash draft"):
        LLM(str(fixture_unified("qwen35_dense")), EngineConfig(spec="dflash"))
    llm = _llm(checkpoint, "float32")
    with pytest.raises(FreetokenError, match="drafts 1 to 3 tokens"):
        llm.make_engine(llm.with_spec("dflash", 4))
