"""The prefix cache must not change what a request generates, nor what its drafts are.

Oracle: the same engine with the cache off, on the fixture families (qwen35_dense, qwen35_moe,
qwen4_exp; DFlash on qwen35_dense with its fixture draft), greedy and sampled with a fixed seed,
fp32 and bf16 on CPU. The prompts share a 70-token system prompt (a snapshot at 64, the GDN chunk),
one of them only its first 64 tokens and then another token: with MTP its page ending at 64 holds
a draft row written for the others' next token, so it must not hit there (lookahead keys). Every
run also asserts that the cache was used (cached prompt tokens), so "equal" never means "unused".
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.llm import LLM
from freetoken.sampling import SamplingParams
from freetoken.spec.mtp.method import MTPMethod
from tests.conftest import FIXTURES, convert_unified, greedy

SYSTEM = [(i * 37 + 11) % 900 + 20 for i in range(70)]
SUFFIXES = [[(i * 13 + j * 101) % 900 + 20 for i in range(n)] for j, n in enumerate((4, 9, 17, 30))]
PROMPTS = [SYSTEM + s for s in SUFFIXES] + [SYSTEM[:64] + [7] + SUFFIXES[1], [(i * 7) % 900 + 20 for i in range(40)]]
NEW_TOKENS = 8


@lru_cache(maxsize=None)
def _llm(path: str, dtype: str, spec: str) -> LLM:
    k = 0 if spec == "none" else 2
    return LLM(path, EngineConfig(dtype=dtype, max_num_seqs=4, max_model_len=160, spec=spec, num_draft_tokens=k))


def _run(llm: LLM, params, prompts=PROMPTS, **cfg):
    """-> (outputs, accepted lens, the engine) of one generate with config fields `cfg` changed."""
    engine = llm.make_engine(replace(llm.config, **cfg))
    requests = engine.generate(prompts, params)
    return [r.output_token_ids for r in requests], [r.accepted_lens for r in requests], engine


def _prefilled(llm: LLM, **cfg):
    """Step an engine with a seat for each request until every one is past its prompt (none finished) -> (requests, engine)."""
    engine = llm.make_engine(replace(llm.config, max_num_seqs=5, **cfg))
    requests = [engine.add_request(p, greedy(40)) for p in PROMPTS[:5]]
    while any(r.in_prefill or r.num_cached_tokens == 0 for r in requests):
        engine.step()
    return requests, engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", ["none", "mtp"])
@pytest.mark.parametrize("family", ["qwen35_dense", "qwen35_moe", "qwen4_exp"])
def test_greedy_with_cache_equals_without(family, spec, dtype, fixture_unified):
    llm = _llm(str(fixture_unified(family)), dtype, spec)
    expected, expected_accepted, _ = _run(llm, greedy(NEW_TOKENS))
    got, accepted, engine = _run(llm, greedy(NEW_TOKENS), prefix_cache=True)
    assert all(len(e) == NEW_TOKENS for e in expected)
    assert got == expected
    assert accepted == expected_accepted  # the drafts after a hit are the drafts without the cache
    stats = engine.prefix_cache.stats
    # the first request computes the shared prefix and 3 wait for it; the 5th hits too unless pages hold draft rows
    hits = 4 if spec == "none" else 3
    assert (stats.hits, stats.cached_tokens) == (hits, 64 * hits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_draft_state_after_a_hit_is_the_one_without_cache(dtype, fixture_unified, monkeypatch):
    llm = _llm(str(fixture_unified("qwen35_moe")), dtype, "mtp")
    off, _ = _prefilled(llm)
    on, engine = _prefilled(llm, prefix_cache=True)
    assert engine.prefix_cache.stats.hits == 3
    for a, b in zip(off, on):
        assert a.draft_state.position == b.draft_state.position and torch.equal(a.draft_state.hidden, b.draft_state.hidden)

    monkeypatch.setattr(MTPMethod, "pages_hold_draft_rows", False)  # pages keyed without their next token
    unkeyed, engine = _prefilled(llm, prefix_cache=True)
    assert engine.prefix_cache.stats.hits == 4
    assert not torch.equal(unkeyed[4].draft_state.hidden, off[4].draft_state.hidden)  # a draft row for another next token


@pytest.fixture(scope="module")
def dflash_checkpoint(tmp_path_factory) -> str:
    dst = tmp_path_factory.mktemp("dflash") / "unified"
    return str(convert_unified(FIXTURES / "qwen35_dense" / "hf", dst, dflash=FIXTURES / "qwen35_dense_dflash" / "dflash"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash_with_cache_equals_without_and_restores_the_draft_context(dtype, dflash_checkpoint):
    llm = _llm(dflash_checkpoint, dtype, "dflash")
    expected, expected_accepted, _ = _run(llm, greedy(NEW_TOKENS))
    got, accepted, engine = _run(llm, greedy(NEW_TOKENS), prefix_cache=True)
    assert got == expected and accepted == expected_accepted
    assert engine.prefix_cache.stats.hits == 4 and engine.prefix_cache.context_bytes > 0

    off, _ = _prefilled(llm)
    on, _ = _prefilled(llm, prefix_cache=True)
    for a, b in zip(off, on):
        (ka, va), (kb, vb) = a.draft_state.rows(), b.draft_state.rows()
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_sampled_with_cache_equals_without(fixture_unified):
    llm = _llm(str(fixture_unified("qwen35_moe")), "float32", "mtp")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, presence_penalty=0.3)
    expected, _, _ = _run(llm, params, seed=7)
    got, _, engine = _run(llm, params, seed=7, prefix_cache=True)
    assert got == expected and engine.prefix_cache.stats.hits == 3
    assert _run(llm, params, seed=8)[0] != expected  # the seed matters: the outputs are really sampled


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_small_pool_reclaims_cached_pages_and_preempts_exactly(spec, fixture_unified):
    llm = _llm(str(fixture_unified("qwen35_dense")), "float32", spec)
    expected, _, _ = _run(llm, greedy(24))
    # 4 running requests of up to 8 blocks (16 tokens each) in a pool of 16: cached pages are reclaimed, requests preempted
    got, _, engine = _run(llm, greedy(24), prefix_cache=True, num_kv_blocks=16)
    assert got == expected
    assert engine.stats.num_preemptions > 0 and engine.prefix_cache.stats.evicted_pages > 0 and engine.prefix_cache.stats.hits > 0
    assert engine.kv_pool.num_free_blocks + engine.prefix_cache.num_pages == engine.kv_pool.num_blocks  # nothing leaked


def test_snapshot_budget_bounds_the_snapshots(fixture_unified):
    llm = _llm(str(fixture_unified("qwen35_dense")), "float32", "none")
    other = [(i * 53 + 3) % 900 + 20 for i in range(70)]  # a second system prompt
    prompts = [p for s in SUFFIXES for p in (SYSTEM + s, other + s)]
    expected, _, _ = _run(llm, greedy(4), prompts)
    none, _, engine = _run(llm, greedy(4), prompts, prefix_cache=True, prefix_snapshot_mib=0.0)
    assert none == expected and engine.prefix_cache.stats.hits == 0  # no snapshot: no hit on a hybrid model
    one_slot = engine.state_pool.slot_bytes / 2**20
    got, _, engine = _run(llm, greedy(4), prompts, prefix_cache=True, prefix_snapshot_mib=one_slot)
    snapshots = engine.prefix_cache.snapshots
    assert got == expected and snapshots.num_slots == 1 and snapshots.held_bytes <= engine.state_pool.slot_bytes
    assert engine.prefix_cache.stats.hits > 0
