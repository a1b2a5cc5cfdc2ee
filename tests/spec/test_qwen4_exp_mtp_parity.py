"""Lossless MTP speculative decoding on qwen4_exp: greedy with spec equals greedy without, token for token.

The converted fixture checkpoint (`qwen4_exp/hf`, trunk + MTP head), 4 prompts of different lengths
(one with an EOS inside, so the PLE hash restarts), k in {1, 2, 3}, fp32 and bf16. Oracle: the same
engine without speculative decoding (every token a plain decode step).

The random MTP head rarely guesses right, so accepted drafts are forced too: an oracle drafter
proposes the known greedy continuation, every draft is accepted and each commit folds k+1 rows into
the GDN and PLE state; a drafter right for two tokens, then wrong, commits 3 of k+1 rows.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.spec_protocol import Proposal
from freetoken.llm import LLM
from freetoken.spec.mtp.method import MTPMethod
from tests.conftest import fixture_refs, greedy

MODEL = "qwen4_exp"
NEW_TOKENS = 32


def _prompts() -> list[list[int]]:
    refs = fixture_refs(MODEL)
    long = refs["seq2.input_ids"].tolist()
    return [long[:1], long[3:9], refs["seq3.input_ids"].tolist(), long[:17]]


@lru_cache(maxsize=None)
def _llm(path: str, dtype: str) -> LLM:
    return LLM(path, EngineConfig(dtype=dtype, max_num_seqs=4, max_model_len=64, spec="mtp", num_draft_tokens=1))


def _run(llm: LLM, k: int, n: int = NEW_TOKENS):
    requests, stats = llm.generate_ids(_prompts(), greedy(n), llm.with_spec("mtp" if k else "none", k))
    return [tuple(r.output_token_ids) for r in requests], requests, stats


@lru_cache(maxsize=None)
def _baseline(path: str, dtype: str) -> tuple[tuple[int, ...], ...]:
    return tuple(_run(_llm(path, dtype), 0)[0])


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_spec_equals_no_spec(dtype, k, fixture_unified):
    path = str(fixture_unified(MODEL))
    expected = _baseline(path, dtype)
    outputs, requests, stats = _run(_llm(path, dtype), k)
    assert all(len(e) == NEW_TOKENS for e in expected)
    assert outputs == list(expected)
    assert stats.num_draft_tokens == k and all(r.accepted_lens for r in requests)


def _patch_drafts(monkeypatch, make_drafts):
    """Replace the MTP proposal's tokens by make_drafts(request, k); the method still runs its network."""
    original = MTPMethod.propose

    def propose(self, requests):
        original(self, requests)
        return Proposal(torch.tensor([make_drafts(r, self.num_draft_tokens) for r in requests], dtype=torch.long), None)

    monkeypatch.setattr(MTPMethod, "propose", propose)


@pytest.mark.parametrize("right", [None, 2], ids=["all_right", "right_for_2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accepted_drafts_commit_gdn_and_ple_state(dtype, right, fixture_unified, monkeypatch):
    path, k = str(fixture_unified(MODEL)), 3
    expected = _baseline(path, dtype)
    vocab = _llm(path, dtype).model.config.vocab_size

    def drafts(request, k):
        done = len(request.output_token_ids)
        good = list(expected[request.request_id][done : done + k]) + [0] * k
        return good[:k] if right is None else good[:right] + [(t + 1) % vocab for t in good[right:k]]

    _patch_drafts(monkeypatch, drafts)
    outputs, requests, stats = _run(_llm(path, dtype), k)
    assert outputs == list(expected)
    want = k if right is None else right
    for r in requests:
        assert r.accepted_lens[:-1] == [want] * (len(r.accepted_lens) - 1)  # the last block may pass max_new_tokens
    assert stats.acceptance_per_position[want - 1] == 1.0


@pytest.mark.parametrize("k", [0, 2])
def test_preemption_recomputes_exactly(k, fixture_unified):
    """A KV pool too small for the batch preempts (frees blocks, slot and PLE windows) and recomputes;
    the outputs equal the uncontended run's."""
    llm = _llm(str(fixture_unified(MODEL)), "float32")
    expected = _baseline(str(fixture_unified(MODEL)), "float32")
    config = llm.with_spec("mtp" if k else "none", k)
    requests, stats = llm.generate_ids(_prompts(), greedy(NEW_TOKENS), replace(config, block_size=4, num_kv_blocks=14))
    assert stats.num_preemptions > 0
    assert [tuple(r.output_token_ids) for r in requests] == list(expected)
