"""Preemption (recompute) under a KV pool too small for the batch must not change outputs.

Oracle: the same prompts in an uncontended engine (a pool large enough for all of them), greedy,
without speculative decoding.
"""

from __future__ import annotations

import pytest

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from tests.conftest import TinySpec, greedy, load_unified

PROMPTS = [[(i * 29 + n) % 256 for i in range(n)] for n in (3, 7, 5, 10, 2, 8)]
NEW_TOKENS = 20


def _outputs(model, **cfg):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=6, max_model_len=64, **cfg))
    requests = engine.generate(PROMPTS, greedy(NEW_TOKENS))
    return [r.output_token_ids for r in requests], engine.stats


@pytest.mark.parametrize("spec,k", [("none", 0), ("mtp", 2)])
def test_preempted_requests_equal_an_uncontended_run(spec, k, tiny_checkpoint):
    model = load_unified(tiny_checkpoint(TinySpec(moe=True))[1], with_mtp=True)
    expected, free_stats = _outputs(model, block_size=4)
    assert free_stats.num_preemptions == 0
    # The longest request needs (10 + 20 + k + 1) / 4 = 8 blocks; 6 running requests would need ~40.
    got, stats = _outputs(model, block_size=4, num_kv_blocks=12, spec=spec, num_draft_tokens=k)
    assert stats.num_preemptions > 0
    assert got == expected


def test_recompute_gives_a_prompt_of_whole_chunks_the_same_gdn_state(tiny_checkpoint):
    """A 128-token prompt: its first prefill covers 127 rows (the last token is decoded), so positions
    64..126 run the recurrence; the recompute after a preemption also covers the generated tokens and
    must give those positions the same rule, hence the same state bits (fp32, CPU)."""
    import torch

    model = load_unified(tiny_checkpoint(TinySpec())[1], with_mtp=False)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, overlap=False))
    request = engine.add_request([(i * 37 + 11) % 256 for i in range(128)], greedy(10))
    while len(request.output_token_ids) < 5:
        engine.step()
    state, num_tokens = engine.state_pool.state.recurrent[:, request.state_slot].clone(), request.num_cached_tokens
    engine.scheduler.preempt(request)
    while request.in_prefill or request.num_cached_tokens < num_tokens:
        engine.step()
    assert request.num_cached_tokens == num_tokens
    assert torch.equal(engine.state_pool.state.recurrent[:, request.state_slot], state)
