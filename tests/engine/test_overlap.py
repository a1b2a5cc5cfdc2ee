"""Overlapped greedy decode (step n+1 launched before step n is read back) must not change what a
request generates.

Oracle: the same engine with overlap off, where every step is read back before the next one is
scheduled: outputs, finish reasons and token counts are identical under length limits, stop tokens,
admission while decoding, preemption and sampled requests in the batch (CPU, eager path; the CUDA
graph path is in test_cuda_graph.py).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.request import RequestStatus
from freetoken.sampling import SamplingParams
from tests.conftest import TinySpec, greedy, load_unified

PROMPTS = [[i * 7 % 256 for i in range(n)] for n in (1, 2, 3, 5, 8, 13, 4, 9, 6, 11)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_unified(tiny_checkpoint(TinySpec())[1], with_mtp=False)


def _run(model, prompts, params, overlap: bool, **cfg):
    """-> ([(output, finish reason)] in prompt order, stats); checks that every request finished and was
    reported finished exactly once, that the token count is the outputs' length, and that a step in
    flight always has a running request (loops on scheduler.has_work, as bench does, drain it)."""
    engine = LLMEngine(model, EngineConfig(overlap=overlap, **{"max_model_len": 64, **cfg}))
    reported = []

    def on_step(finished):
        reported.extend(finished)
        assert engine.in_flight is None or engine.scheduler.has_work

    requests = engine.generate(prompts, params, on_step=on_step)
    assert engine.in_flight is None and not engine.has_work
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert sorted(r.request_id for r in reported) == [r.request_id for r in requests]
    assert engine.stats.generated_tokens == sum(len(r.output_token_ids) for r in requests)
    assert all(r.num_target_steps == len(r.output_token_ids) for r in requests)
    return [(r.output_token_ids, r.finish_reason) for r in requests], engine.stats


def _on_equals_off(model, prompts, params, **cfg):
    """Run with overlap on and off; assert equal results -> (results, stats on, stats off)."""
    on, on_stats = _run(model, prompts, params, True, **cfg)
    off, off_stats = _run(model, prompts, params, False, **cfg)
    assert on == off
    assert off_stats.overlapped_steps == 0
    return on, on_stats, off_stats


def test_requests_ending_at_different_lengths(model):
    """All requests at once, each with its own max_new_tokens: every decode step after the first is
    launched before the previous one is read back, and no step is wasted (length ends are known)."""
    params = [greedy(n) for n in (1, 2, 3, 5, 8, 13, 4, 9, 6, 11)]
    results, on, off = _on_equals_off(model, PROMPTS, params)
    assert [len(out) for out, _ in results] == [p.max_new_tokens for p in params]
    assert all(reason == "length" for _, reason in results)
    assert on.decode_steps == off.decode_steps == 13
    assert on.overlapped_steps == on.decode_steps - 1


def test_stop_tokens_mid_generation(model):
    """Each request stops on a token its free run emits mid-way; the step launched after the stop is
    dropped (a lone request: one decode step more than without overlap, no token more)."""
    free, _ = _run(model, PROMPTS, greedy(24), False)
    stops = [out[2 + i % 7] for i, (out, _) in enumerate(free)]
    params = [greedy(24, stop_token_ids=(s,)) for s in stops]
    results, on, off = _on_equals_off(model, PROMPTS, params)
    for (out, reason), (full, _), stop in zip(results, free, stops):
        assert reason == "stop" and out == full[: full.index(stop) + 1]
    assert on.overlapped_steps > on.decode_steps // 2

    (result,), on, off = _on_equals_off(model, PROMPTS[5:6], params[5:6])
    assert result[1] == "stop" and len(result[0]) < 24
    assert on.decode_steps == off.decode_steps + 1 and on.generated_tokens == off.generated_tokens


def test_max_model_len(model):
    """Requests run into the model length before max_new_tokens."""
    results, on, _ = _on_equals_off(model, PROMPTS, greedy(24), max_model_len=16)
    assert [len(out) for out, _ in results] == [16 - len(p) for p in PROMPTS]
    assert all(reason == "length" for _, reason in results)
    assert on.overlapped_steps > 0


def test_admission_while_decoding(model):
    """More prompts than seats, arriving over several steps: new requests are admitted while others decode."""
    params = [greedy(n) for n in (7, 3, 12, 5, 9, 2, 11, 4, 8, 6)]
    _, on, _ = _on_equals_off(model, PROMPTS, params, max_num_seqs=3, max_num_batched_tokens=8)
    assert on.overlapped_steps > 0


def test_preemption(model):
    """A pool too small for the batch: requests are preempted and recomputed with overlap on too."""
    prompts = [[(i * 29 + n) % 256 for i in range(n)] for n in (3, 7, 5, 10, 2, 8)]
    _, on, off = _on_equals_off(model, prompts, greedy(20), max_num_seqs=6, block_size=4, num_kv_blocks=12)
    assert on.num_preemptions > 0 and off.num_preemptions > 0
    assert on.overlapped_steps > 0


def test_sampled_and_penalized_requests_in_the_batch(model):
    """A batch with a sampled or a penalized request is read back every step; once they are done the
    greedy rest overlaps. Same seeds, same tokens as with overlap off."""
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    penalized = SamplingParams(max_new_tokens=10, presence_penalty=0.5, ignore_eos=True)
    for other in (sampled, penalized):
        _, on, _ = _on_equals_off(model, PROMPTS[:4], [greedy(6), other, greedy(6), greedy(8)])
        assert on.overlapped_steps == 0  # the other request outlives the greedy ones
        _, on, _ = _on_equals_off(model, PROMPTS[:4], [greedy(12), other, greedy(14), greedy(16)])
        assert 0 < on.overlapped_steps <= 16 - 10


def test_staging_fills_two_host_buffers_in_turn():
    """Consecutive loads fill different host buffers (the previous copy may still be queued); the device
    buffer holds the last load, with the fed-back rows (-1: the row's own token)."""
    from freetoken.engine.cuda_graph import _Staging
    from freetoken.engine.kv_pool import KVPool
    from freetoken.engine.runner import RowGroup

    kv = KVPool(1, 8, 4, 1, 8, torch.float32, "cpu")
    staging = _Staging(3, 1, 2, torch.device("cpu"))
    first = staging.on_host
    staging.load([RowGroup([1], 0, 2, [5]), RowGroup([2], 1, 3, [6])], kv)
    assert staging.on_host is not first
    staging.load([RowGroup([1], 0, 3, [-1]), RowGroup([2, 4], 1, 4, [-1])], kv, fed_back_rows=[1, 0])
    assert staging.on_host is first
    d = staging.on_device
    assert d["input_ids"][:2].tolist() == [-1, -1] and d["fed_back_rows"].tolist() == [1, 0, -1]
    assert d["positions"][:2].tolist() == [3, 4]


def test_take_fed_back():
    from freetoken.kernels import take_fed_back

    input_ids = torch.tensor([-1, -1, 0, 9])
    take_fed_back(input_ids, torch.tensor([2, 0, -1, -1]), torch.tensor([40, 41, 42, 43]))
    assert input_ids.tolist() == [42, 40, 0, 9]
