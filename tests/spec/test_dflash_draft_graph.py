"""The CUDA graphs of the greedy DFlash draft step compute what the eager step computes.

Oracles: the eager step (`BlockStep.greedy_drafts`, the same code uncaptured) on the same pool and
inputs, bit for bit (torch.equal); the engine with graphs off and with no speculative decoding,
token for token. On the GPU in bf16, for DFlash and DFlash2 (the fixture drafts over the fixture
target's embedding and lm_head), batch 1 and 3 with uneven contexts, over successive steps whose
committed rows move the longest context across the 256-row bucket boundary: every replay's drafts
equal the eager step's, each (batch bucket, context bucket) is captured once, and the drafts also
equal each block run alone within bf16 agreement. The engine on the fixture target with its DFlash
or DFlash2 draft, graphs on, gives the tokens and acceptance of graphs off, and the tokens of no
spec, with every greedy propose a draft-graph replay. The graph path's non-capture parts run on the
CPU in test_dflash_pool.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.spec.dflash.block_step import batch_bucket
from freetoken.spec.dflash.draft_graph import DraftGraphs
from tests.conftest import FIXTURES, convert_unified, greedy
from tests.spec.test_dflash_pool import K, Stream, make_method

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [pytest.mark.cuda, needs_cuda, pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("version", ["dflash", "dflash2"])
@torch.no_grad()
def test_graph_drafts_equal_eager(version, batch):
    method = make_method(version, "cuda", torch.bfloat16)
    graphs = method.graphs = DraftGraphs(method.step)
    g = torch.Generator().manual_seed(batch)
    streams = [Stream(i, 600, g, method) for i in range(3)][:batch]
    method.observe([s.commit(method, n) for s, n in zip(streams, (250, 31, 7))])
    seen = set()
    for step in range(8):
        requests = [s.request for s in streams]
        inputs, n = method._load(requests)
        eager = method.step.greedy_drafts(inputs.on_device, n)[:batch].cpu()
        proposal = method.propose(requests)
        assert proposal.probs is None and proposal.tokens.device.type == "cpu"
        assert torch.equal(proposal.tokens, eager), f"step {step}"
        seen.add((batch_bucket(batch), n))
        method.observe([s.commit(method, (step + i) % (K + 1) + 1) for i, s in enumerate(streams)])
    assert streams[0].request.num_cached_tokens > 256
    assert seen == {(batch_bucket(batch), 256), (batch_bucket(batch), 512)}
    assert set(graphs.graphs) == seen  # captured once each, replayed every later step


@pytest.mark.parametrize("version", ["dflash", "dflash2"])
@torch.no_grad()
def test_graph_drafts_follow_the_blocks_alone(version):
    """Graph drafts against each block run alone (no pool, no padding): bf16 rounds the two apart now
    and then, so most, not all, slots agree."""
    from tests.spec.test_dflash_pool import reference

    method = make_method(version, "cuda", torch.bfloat16)
    method.graphs = DraftGraphs(method.step)
    g = torch.Generator().manual_seed(7)
    streams = [Stream(i, 300, g, method) for i in range(3)]
    method.observe([s.commit(method, n) for s, n in zip(streams, (120, 30, 3))])
    drafts = method.propose([s.request for s in streams]).tokens
    alone = torch.stack([reference(method, s)[1].cpu() for s in streams])
    assert (drafts == alone).float().mean() >= 0.8


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def llm(request, tmp_path_factory):
    from freetoken.llm import LLM

    dst = tmp_path_factory.mktemp(request.param) / "unified"
    path = convert_unified(FIXTURES / "qwen35_dense" / "hf", dst, dflash=FIXTURES / "qwen35_dense_dflash" / request.param)
    return LLM(str(path), EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=128, spec="dflash"))


def _prompts() -> list[list[int]]:
    from tests.conftest import fixture_refs

    ids = fixture_refs("qwen35_dense")["seq2.input_ids"].tolist()
    return [ids[j : j + n] for j, n in enumerate((1, 2, 5, 9, 13, 20, 29))]


def _run(llm, config: EngineConfig, new_tokens: tuple[int, ...]):
    """-> (outputs, accepted per position, draft-graph replays, greedy proposes)."""
    engine = llm.make_engine(config)
    replays, proposes = [], []
    graphs = getattr(engine.spec, "graphs", None)
    if graphs is not None:
        run = graphs.run

        def recorded(inputs, n):
            replays.append(n)
            return run(inputs, n)

        graphs.run = recorded
    if config.spec == "dflash":
        propose = engine.spec.propose

        def counted(requests):
            proposes.append(len(requests))
            return propose(requests)

        engine.spec.propose = counted
    requests = engine.generate(_prompts()[: len(new_tokens)], [greedy(n) for n in new_tokens])
    return [r.output_token_ids for r in requests], engine.stats.accepted_per_position, replays, proposes


@pytest.mark.parametrize("k", [1, 3])
@torch.no_grad()
def test_engine_graphs_on_equal_graphs_off_and_no_spec(llm, k):
    new_tokens = (40, 3, 2, 36, 1, 2, 3)
    config = llm.with_spec("dflash", k)
    graphed, accepted, replays, proposes = _run(llm, replace(config, cuda_graphs=True), new_tokens)
    eager, eager_accepted, no_replays, _ = _run(llm, replace(config, cuda_graphs=False), new_tokens)
    plain, _, _, _ = _run(llm, llm.with_spec("none", 0), new_tokens)
    assert graphed == eager == plain
    assert [len(t) for t in graphed] == list(new_tokens)
    assert accepted == eager_accepted  # the same drafts, step for step
    assert not no_replays and len(replays) == len(proposes) > 0
