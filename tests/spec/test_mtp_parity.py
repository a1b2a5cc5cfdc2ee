"""Lossless MTP speculative decoding: greedy with spec equals greedy without, token for token.

The acceptance criterion: both fixture families (converted from their HF checkpoints), a batch
of 8 prompts of different lengths, k in {1, 2, 3, 4}, 64 new tokens, fp32 and bf16. Oracle: the
same engine without speculative decoding (every token a plain decode step).

The random fixture MTP heads almost never guess right, so the accept path is forced separately:
an oracle drafter proposes the known greedy continuation (every draft accepted), and corrupted
drafters (always wrong, random) exercise every rejection position. Stops (EOS, stop token,
max_new_tokens) falling inside an accepted block must end the output where plain decoding does.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.spec_protocol import Proposal
from freetoken.llm import LLM
from freetoken.spec.mtp.method import MTPMethod
from tests.conftest import FIXTURE_MODELS, fixture_refs, greedy

NEW_TOKENS = 64


def _prompts(model: str) -> list[list[int]]:
    """8 prompts of lengths 1..29 cut from the fixture's 33-token sequence."""
    ids = fixture_refs(model)["seq2.input_ids"].tolist()
    return [ids[j : j + n] for j, n in enumerate((1, 2, 4, 6, 9, 13, 20, 29))]


@lru_cache(maxsize=None)
def _llm(path: str, dtype: str) -> LLM:
    return LLM(path, EngineConfig(dtype=dtype, max_num_seqs=8, max_model_len=128, spec="mtp", num_draft_tokens=1))  # loads the MTP head


def _run(llm: LLM, prompts, params, k: int):
    spec = "mtp" if k else "none"
    requests, stats = llm.generate_ids(prompts, params, llm.with_spec(spec, k))
    return requests, stats


@lru_cache(maxsize=None)
def _baseline(path: str, dtype: str, model: str) -> tuple[tuple[int, ...], ...]:
    requests, _ = _run(_llm(path, dtype), _prompts(model), greedy(NEW_TOKENS), 0)
    return tuple(tuple(r.output_token_ids) for r in requests)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_greedy_spec_equals_no_spec(model, dtype, k, fixture_unified):
    path = str(fixture_unified(model))
    expected = _baseline(path, dtype, model)
    requests, stats = _run(_llm(path, dtype), _prompts(model), greedy(NEW_TOKENS), k)
    assert all(len(e) == NEW_TOKENS for e in expected)
    assert [tuple(r.output_token_ids) for r in requests] == list(expected)
    assert stats.num_draft_tokens == k and all(r.accepted_lens for r in requests)


def _patch_drafts(monkeypatch, make_drafts):
    """Replace the MTP proposal's tokens by make_drafts(request, k) (greedy: q is one-hot, probs None)."""
    original = MTPMethod.propose

    def propose(self, requests):
        proposal = original(self, requests)  # keep the method's own bookkeeping
        tokens = torch.tensor([make_drafts(r, self.num_draft_tokens) for r in requests], dtype=torch.long)
        return Proposal(tokens, None)

    monkeypatch.setattr(MTPMethod, "propose", propose)


def _continuation(expected, request, k: int) -> list[int]:
    done = len(request.output_token_ids)
    nxt = list(expected[request.request_id][done : done + k])
    return nxt + [0] * (k - len(nxt))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_oracle_drafter_is_fully_accepted(model, dtype, fixture_unified, monkeypatch):
    path, k = str(fixture_unified(model)), 4
    expected = _baseline(path, dtype, model)
    _patch_drafts(monkeypatch, lambda r, k: _continuation(expected, r, k))
    requests, stats = _run(_llm(path, dtype), _prompts(model), greedy(NEW_TOKENS), k)
    assert [tuple(r.output_token_ids) for r in requests] == list(expected)
    for r in requests:
        assert r.accepted_lens[:-1] == [k] * (len(r.accepted_lens) - 1)  # the last block may pass max_new_tokens
        assert r.num_target_steps == -(-NEW_TOKENS // (k + 1))
    assert stats.acceptance_per_position[-1] == 1.0


@pytest.mark.parametrize("kind", ["always_wrong", "random", "wrong_at_2"])
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_corrupted_drafts_change_nothing(model, kind, fixture_unified, monkeypatch):
    path, dtype, k = str(fixture_unified(model)), "bfloat16", 3
    expected = _baseline(path, dtype, model)
    vocab = _llm(path, dtype).model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def drafts(r, k):
        good = _continuation(expected, r, k)
        if kind == "always_wrong":
            return [(t + 1) % vocab for t in good]
        if kind == "random":
            return torch.randint(vocab, (k,), generator=g).tolist()
        return good[:2] + [(t + 1) % vocab for t in good[2:]]  # first two accepted, then rejected

    _patch_drafts(monkeypatch, drafts)
    n = 24  # a prefix of the 64-token baseline is the greedy output for 24 tokens
    requests, _ = _run(_llm(path, dtype), _prompts(model), greedy(n), k)
    assert [tuple(r.output_token_ids) for r in requests] == [e[:n] for e in expected]
    if kind == "always_wrong":
        assert all(set(r.accepted_lens) == {0} for r in requests)
    if kind == "wrong_at_2":
        assert all(set(r.accepted_lens[:-1]) == {2} for r in requests)


@pytest.mark.parametrize("oracle", [True, False], ids=["oracle_drafts", "mtp_drafts"])
def test_stops_inside_an_accepted_block(oracle, fixture_unified, monkeypatch):
    model, dtype, k = "qwen35_dense", "float32", 3
    path = str(fixture_unified(model))
    expected = _baseline(path, dtype, model)
    if oracle:
        _patch_drafts(monkeypatch, lambda r, k: _continuation(expected, r, k))
    llm = _llm(path, dtype)
    prompts = _prompts(model)

    # A stop token whose first occurrence is not the last token of a (k+1)-token block.
    index, stop = next((i, t) for i, t in enumerate(expected[3]) if i % (k + 1) != k and i > 4 and expected[3].index(t) == i)
    for params in (greedy(index + 4, stop_token_ids=(stop,)), greedy(10)):  # 10 is not a multiple of k + 1
        base, _ = _run(llm, prompts, params, 0)
        spec, _ = _run(llm, prompts, params, k)
        assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in base]
    assert base[3].output_token_ids == list(expected[3][:10]) and spec[3].output_token_ids == list(expected[3][:10])

    eos_model = LLM(path, EngineConfig(dtype=dtype, max_num_seqs=8, max_model_len=128, spec="mtp", num_draft_tokens=k))
    eos_model.model.config = dataclasses.replace(eos_model.model.config, eos_token_ids=(stop,))
    params = greedy(index + 4, ignore_eos=False)
    base = LLMEngine(eos_model.model, dataclasses.replace(eos_model.config, spec="none", num_draft_tokens=0)).generate(prompts, params)
    spec = LLMEngine(eos_model.model, eos_model.config).generate(prompts, params)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in base]
    assert spec[3].output_token_ids == list(expected[3][: index + 1]) and spec[3].finish_reason == "stop"
