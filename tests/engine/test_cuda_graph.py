"""CUDA graphs replay exactly what the eager forward computes (GPU only).

Oracle: the same engine with graphs off. Greedy outputs must be identical token for token, with and
without MTP speculative decoding, in bf16, and spec must still equal no-spec with graphs on (the
verify and its commit both replayed as graphs), for the dense and the MoE family. Overlapped greedy
decode (engine.py) gives the tokens of overlap off, with graphs and without.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 300, 2, 9], [44] * 12, [7, 8, 9], list(range(100, 131)), [1000, 3, 77, 512, 6, 6, 6]]


def _run(model, graphs: bool, spec: str = "none", k: int = 0, params: SamplingParams | None = None) -> list[list[int]]:
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, spec=spec, num_draft_tokens=k, cuda_graphs=graphs, max_model_len=256)
    engine = LLMEngine(model, config)
    reqs = engine.generate(PROMPTS, params or SamplingParams(max_new_tokens=48, ignore_eos=True))
    if graphs:
        assert engine.graphs is not None and engine.graphs.graphs, "no graph was captured"
    return [r.output_token_ids for r in reqs]


def _model(fixture_unified, family: str):
    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.models.loader import load_model

    ck = UnifiedCheckpoint.open(fixture_unified(family))
    return load_model(ck, ck.family, ck.config, with_mtp=True, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("family", ["qwen35_dense", "qwen35_moe"])
def test_graphs_equal_eager_and_spec_equals_no_spec(fixture_unified, family):
    model = _model(fixture_unified, family)
    eager = _run(model, graphs=False)
    assert _run(model, graphs=True) == eager
    for k in (1, 3):
        assert _run(model, graphs=True, spec="mtp", k=k) == eager


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_and_penalized_requests_replay_like_eager(fixture_unified, k):
    """Non-greedy batches take the forward-only graph with the sampler outside (and the commit graph)."""
    model = _model(fixture_unified, "qwen35_dense")
    spec = "mtp" if k else "none"
    for params in (SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
                   SamplingParams(max_new_tokens=24, presence_penalty=0.5, ignore_eos=True)):
        assert _run(model, graphs=True, spec=spec, k=k, params=params) == _run(model, graphs=False, spec=spec, k=k, params=params)


def test_shrinking_batches_run_at_bucket_sizes(fixture_unified):
    """Requests of different lengths: the batch shrinks 5 -> 1 and runs padded to the buckets 8, 4, 2, 1,
    with the tokens of the eager engine."""
    model = _model(fixture_unified, "qwen35_dense")
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 12, 18, 24, 30)]
    outputs = {}
    for graphs in (False, True):
        config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, cuda_graphs=graphs, max_model_len=256)
        engine = LLMEngine(model, config)
        outputs[graphs] = [r.output_token_ids for r in engine.generate(PROMPTS, params)]
        if graphs:
            assert sorted({key[0] for key in engine.graphs.graphs}) == [1, 2, 4, 8]
    assert outputs[True] == outputs[False]


def _overlap_run(model, prompts, params, graphs: bool, overlap: bool):
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, cuda_graphs=graphs, overlap=overlap, max_model_len=256)
    engine = LLMEngine(model, config)
    requests = engine.generate(prompts, params)
    assert (engine.stats.overlapped_steps > 0) == overlap
    assert engine.stats.generated_tokens == sum(len(r.output_token_ids) for r in requests)
    if graphs:
        assert engine.graphs is not None and engine.graphs.graphs, "no graph was captured"
    return [(r.output_token_ids, r.finish_reason) for r in requests]


@pytest.mark.parametrize("batch", [1, 3])
def test_overlap_equals_no_overlap(fixture_unified, batch):
    """Greedy decode steps launched before the previous one is read back, their input tokens fed back
    on the device (inside the graphs, or gathered eagerly), give the tokens and finish reasons of
    overlap off. One request stops mid-run on a stop token (its next step is launched in vain); with 3
    requests another ends on its length, so the batch shrinks through the buckets 4, 2, 1 and those
    graphs are captured while a step is in flight."""
    model = _model(fixture_unified, "qwen35_dense")
    prompts = PROMPTS[:batch]
    free = _overlap_run(model, prompts, [SamplingParams(max_new_tokens=40, ignore_eos=True)] * batch, graphs=False, overlap=False)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(max_new_tokens=40, ignore_eos=True, stop_token_ids=(free[0][0][12],))
    if batch == 3:
        params[2] = SamplingParams(max_new_tokens=17, ignore_eos=True)
    expected = _overlap_run(model, prompts, params, graphs=False, overlap=False)
    assert expected[0][1] == "stop" and len(expected[0][0]) < 40
    assert _overlap_run(model, prompts, params, graphs=True, overlap=True) == expected
    assert _overlap_run(model, prompts, params, graphs=True, overlap=False) == expected
    assert _overlap_run(model, prompts, params, graphs=False, overlap=True) == expected


@pytest.mark.parametrize("family", ["qwen35_dense", "qwen35_moe"])
def test_l2_prefetches_change_no_token(fixture_unified, family, monkeypatch):
    """Every launch that queues an L2 prefetch (kernels/l2_prefetch.py) is in these steps: the out and
    input projections, the MLP's gate_up or the shared expert's; off, the tokens are the same."""
    from freetoken.kernels import l2_prefetch

    model = _model(fixture_unified, family)
    with_prefetch = _run(model, graphs=True, spec="mtp", k=3)
    for site in ("OUT_PROJ_BYTES", "INPUT_BYTES", "MLP_BYTES"):
        monkeypatch.setattr(l2_prefetch, site, 0)
    assert _run(model, graphs=True, spec="mtp", k=3) == with_prefetch == _run(model, graphs=False)
