"""Decode/verify CUDA graphs that export target layers (DecodeGraphs(export_layers=...), DFlash's taps).

Oracles: the eager forward with the same export_layers, and the engine with graphs off and with
`--spec none`. On the GPU (bf16, the dense fixture): over several replays of one graph, at an exact
bucket and padded to one, the replayed hidden rows and exported layer rows equal the eager forward's
bit for bit, for verify and one-row decode steps, greedy graphs (verify and commit inside) and
forward-only ones (sampler outside, the commit as its own graph); without export_layers a step has
no layer buffer. The DFlash engine with graphs gives the tokens of graphs off and of no spec, its
method observes the same committed rows (hidden and layer rows, bit for bit), and every decode step
was a replay. On the CPU: the engine hands the method's target_layers to its graphs (none without
them), and, under the Triton interpreter with a stand-in that re-runs the captured step on replay,
the DFlash engine on the graph path equals the eager engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from freetoken.engine import cuda_graph
from freetoken.engine.config import EngineConfig
from freetoken.engine.cuda_graph import DecodeGraphs
from freetoken.engine.engine import LLMEngine
from freetoken.engine.runner import RowGroup, build_context
from freetoken.forward_context import ForwardMode
from freetoken.sampling import SamplingParams
from tests.conftest import FIXTURES, convert_unified, fixture_refs, greedy

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_dflash = pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")

PROMPTS = [[5, 17, 300, 2, 9], [44] * 12, list(range(100, 131))]
EXPORTS = [(0, 2), (3, 1)]  # the fixture draft's taps; the last layer and an order that is not sorted
K = 3  # drafts per verify step
STEPS = 4  # replays of one graph per test
MAX_BLOCKS = 8  # the graphs' block-table width (the tests stay within 128 tokens at block size 16)


def _engine(fixture_unified) -> LLMEngine:
    """An eager bf16 engine on the dense fixture: its (merged) model and its pools."""
    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.models.loader import load_model

    ck = UnifiedCheckpoint.open(fixture_unified("qwen35_dense"))
    model = load_model(ck, ck.family, ck.config, with_mtp=False, device="cuda", dtype=torch.bfloat16)
    return LLMEngine(model, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, cuda_graphs=False, max_model_len=256))


def _prefill(engine: LLMEngine, prompts: list[list[int]], rows: int) -> list[RowGroup]:
    """Prompts run eagerly into fresh blocks and state slots -> each one's next group of `rows` rows (token ids to fill)."""
    groups = []
    for prompt in prompts:
        table: list[int] = []
        engine.kv_pool.grow(table, len(prompt) + (STEPS + 1) * rows)
        groups.append(RowGroup(table, engine.state_pool.allocate(), 0, prompt))
    engine.model(build_context(groups, ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device))
    return [replace(g, start=len(g.token_ids), token_ids=[]) for g in groups]


def _eager(engine: LLMEngine, groups: list[RowGroup], mode: ForwardMode, export: tuple[int, ...]):
    """The eager forward of groups, the GDN state left as it was -> (hidden [N, H], layer rows [N, n * H] or None)."""
    state = engine.state_pool.state
    saved = state.conv.clone(), state.recurrent.clone()
    ctx = build_context(groups, mode, engine.kv_pool, engine.state_pool, engine.device)
    hidden, layer_rows = engine.model(ctx, export_layers=export) if export else (engine.model(ctx), None)
    state.conv.copy_(saved[0])
    state.recurrent.copy_(saved[1])
    return hidden, layer_rows


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("batch", [1, 3], ids=["bucket", "padded"])
@pytest.mark.parametrize("greedy_graph", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", [ForwardMode.VERIFY, ForwardMode.EXTEND], ids=["verify", "decode"])
@pytest.mark.parametrize("export", EXPORTS, ids=["taps", "last-unsorted"])
@torch.no_grad()
def test_replayed_layer_rows_equal_the_eager_forward(fixture_unified, export, mode, greedy_graph, batch):
    """Each step: the eager forward, then the graph's replay from the same state; then the state moves
    on as the graph committed it (decode: one row; greedy verify: its accepted rows; sampled verify:
    a varying count through the commit graph), so positions advance, some across a block boundary."""
    engine = _engine(fixture_unified)
    graphs = DecodeGraphs(engine.model, engine.kv_pool, engine.state_pool, engine.device, MAX_BLOCKS, 8, export_layers=export)
    rows = K + 1 if mode is ForwardMode.VERIFY else 1
    hidden_size = engine.model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    pending = _prefill(engine, PROMPTS[:batch], rows)
    for step in range(STEPS):
        groups = [replace(p, token_ids=torch.randint(1000, (rows,), generator=g).tolist()) for p in pending]
        hidden, layer_rows = _eager(engine, groups, mode, export)
        out = graphs.run(groups, mode, greedy_graph)
        n = batch * rows
        assert out.layer_hidden.shape == (graphs.bucket(batch) * rows, len(export) * hidden_size)
        assert torch.equal(out.hidden[:n], hidden), f"hidden, step {step}"
        assert torch.equal(out.layer_hidden[:n], layer_rows), f"layer rows, step {step}"
        if mode is ForwardMode.EXTEND:
            committed = [1] * batch
        elif greedy_graph:
            committed = (out.result[0, :batch] + 1).tolist()
        else:
            committed = [(step + i) % rows + 1 for i in range(batch)]
            graphs.commit(out, torch.tensor(committed, dtype=torch.int32, device=engine.device))
        pending = [replace(p, start=p.start + c) for p, c in zip(pending, committed)]
    assert list(graphs.graphs) == [(graphs.bucket(batch), rows, mode, greedy_graph)]  # captured once, replayed every step


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("greedy_graph", [True, False], ids=["greedy", "sampled"])
@torch.no_grad()
def test_without_export_layers_a_step_has_no_layer_buffer(fixture_unified, greedy_graph):
    engine = _engine(fixture_unified)
    graphs = DecodeGraphs(engine.model, engine.kv_pool, engine.state_pool, engine.device, MAX_BLOCKS, 8)
    groups = [replace(p, token_ids=[7, 8, 9, 10]) for p in _prefill(engine, PROMPTS, K + 1)]
    hidden, _ = _eager(engine, groups, ForwardMode.VERIFY, ())
    out = graphs.run(groups, ForwardMode.VERIFY, greedy_graph)
    assert out.layer_hidden is None
    assert torch.equal(out.hidden[: len(groups) * (K + 1)], hidden)


# -- the DFlash engine ---------------------------------------------------------------------------

DFLASH_NEW_TOKENS = (40, 3, 2, 36, 1, 2, 3)  # 7 requests (bucket 8); those of 1..3 tokens end within 3 steps (bucket 2)


@pytest.fixture(scope="module")
def dflash_checkpoint(tmp_path_factory) -> str:
    """The dense fixture converted with its DFlash draft (as in tests/spec/test_dflash_parity.py)."""
    dst = tmp_path_factory.mktemp("dflash") / "unified"
    return str(convert_unified(FIXTURES / "qwen35_dense" / "hf", dst, dflash=FIXTURES / "qwen35_dense_dflash" / "dflash"))


def _dflash_prompts() -> list[list[int]]:
    """7 prompts of lengths 1..29 cut from the fixture's 33-token sequence (one token: no draft context yet)."""
    ids = fixture_refs("qwen35_dense")["seq2.input_ids"].tolist()
    return [ids[j : j + n] for j, n in enumerate((1, 2, 5, 9, 13, 20, 29))]


def _run(llm, config: EngineConfig, params: list[SamplingParams]):
    """One engine run -> (output tokens, the rows the method observed, the engine's graph steps, the engine).

    Observed rows are copies (request id, first position, hidden, layer rows) in observe order; graph
    steps are (batch size, mode, greedy) of every graphs.run call."""
    engine = llm.make_engine(config)
    observed, graph_steps = [], []
    if engine.spec.target_layers:
        observe = engine.spec.observe

        def recorded_observe(rows):
            observed.extend((r.request.request_id, r.first_position, r.hidden.clone(), r.layer_hidden.clone()) for r in rows)
            observe(rows)

        engine.spec.observe = recorded_observe
    if engine.graphs is not None:
        run = engine.graphs.run

        def recorded_run(groups, mode, greedy, fed_back_rows=None):
            graph_steps.append((len(groups), mode, greedy))
            return run(groups, mode, greedy, fed_back_rows)

        engine.graphs.run = recorded_run
    requests = engine.generate(_dflash_prompts()[: len(params)], params)
    return [r.output_token_ids for r in requests], observed, graph_steps, engine


def _assert_same_rows(observed: list, expected: list, exact: bool) -> None:
    assert [o[:2] for o in observed] == [e[:2] for e in expected]
    for (request_id, position, hidden, layer_rows), (_, _, want_hidden, want_layer_rows) in zip(observed, expected):
        where = f"request {request_id} rows from {position}"
        if exact:
            assert torch.equal(hidden, want_hidden) and torch.equal(layer_rows, want_layer_rows), where
        else:
            torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5, msg=where)
            torch.testing.assert_close(layer_rows, want_layer_rows, rtol=1e-5, atol=1e-5, msg=where)


def _assert_graphed_equals_eager(llm, params: list[SamplingParams], exact: bool) -> tuple[list[list[int]], set[int]]:
    """The DFlash engine with graphs against graphs off: tokens, acceptance, observed rows; every decode
    step a replay of a verify graph exporting the method's layers -> (the tokens, the batch sizes replayed)."""
    graphed, observed, graph_steps, engine = _run(llm, replace(llm.config, cuda_graphs=True), params)
    eager, expected, no_steps, eager_engine = _run(llm, replace(llm.config, cuda_graphs=False), params)
    assert eager_engine.graphs is None and not no_steps
    assert engine.spec.target_layers and engine.graphs is not None and engine.graphs.export_layers == engine.spec.target_layers
    assert graphed == eager
    assert engine.stats.accepted_per_position == eager_engine.stats.accepted_per_position
    _assert_same_rows(observed, expected, exact)
    assert len(graph_steps) == engine.stats.decode_steps > 0
    assert all(mode is ForwardMode.VERIFY for _, mode, _ in graph_steps)
    assert all(key[2] is ForwardMode.VERIFY and key[1] == engine.spec.num_draft_tokens + 1 for key in engine.graphs.graphs)
    return graphed, {batch for batch, _, _ in graph_steps}


@pytest.fixture(scope="module")
def dflash_llm(dflash_checkpoint):
    from freetoken.llm import LLM

    return LLM(dflash_checkpoint, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=128, spec="dflash"))


@pytest.mark.cuda
@needs_cuda
@needs_dflash
@torch.no_grad()
def test_dflash_with_graphs_equals_graphs_off_and_no_spec(dflash_llm):
    params = [greedy(n) for n in DFLASH_NEW_TOKENS]
    graphed, batch_sizes = _assert_graphed_equals_eager(dflash_llm, params, exact=True)
    no_spec, _, _, _ = _run(dflash_llm, dflash_llm.with_spec("none", 0), params)
    assert graphed == no_spec
    assert [len(t) for t in graphed] == list(DFLASH_NEW_TOKENS)
    assert {7, 2} <= batch_sizes  # padded to 8, and at a bucket


@pytest.mark.cuda
@needs_cuda
@needs_dflash
@pytest.mark.parametrize("case", ["sampled", "penalized"])
@torch.no_grad()
def test_dflash_sampled_with_graphs_equals_graphs_off(dflash_llm, case):
    """Non-greedy batches take the forward-only graph, the sampler outside and the commit graph."""
    if case == "sampled":
        params = [SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True) for n in DFLASH_NEW_TOKENS]
    else:
        params = [greedy(n, presence_penalty=0.5) for n in DFLASH_NEW_TOKENS]
    _assert_graphed_equals_eager(dflash_llm, params, exact=True)


# -- CPU -----------------------------------------------------------------------------------------


@needs_dflash
def test_engine_graphs_export_the_method_target_layers(dflash_checkpoint, monkeypatch):
    """With graphs allowed, the engine builds them with the method's target_layers (DFlash's taps), and
    with none for a method that reads no layers."""
    from freetoken.llm import LLM

    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model, device: True))
    llm = LLM(dflash_checkpoint, EngineConfig(max_num_seqs=4, max_model_len=64, spec="dflash"))
    engine = llm.make_engine()
    assert engine.graphs is not None and engine.graphs.export_layers == engine.spec.target_layers == (0, 2)
    plain = llm.make_engine(llm.with_spec("none", 0))
    assert plain.graphs is not None and plain.graphs.export_layers == ()
    assert llm.make_engine(replace(llm.config, cuda_graphs=False)).graphs is None


class _Rerun:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the step again and copies its
    outputs into the captured ones, as a replay rewrites a graph's static outputs."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        fresh = self.fn()
        for captured, new in zip(_tensors(self.out), _tensors(fresh)):
            captured.copy_(new)

    def pool(self):
        return None


def _tensors(out) -> list[torch.Tensor]:
    items = out if isinstance(out, tuple) else (out,)
    return [t for t in items if t is not None]


def _record(fn, pool, restore=lambda: None):
    """record_graph's stand-in: one run for the captured outputs, then the state put back (a capture computes nothing)."""
    out = fn()
    restore()
    return _Rerun(fn, out), out


@torch.no_grad()
def _interpreted_dflash_check(path: str) -> None:
    """Run in a process with TRITON_INTERPRET=1 and FREETOKEN_KERNELS=triton (see below)."""
    from freetoken.llm import LLM

    cuda_graph.record_graph = _record
    DecodeGraphs.supported = staticmethod(lambda model, device: True)
    llm = LLM(path, EngineConfig(max_num_seqs=4, max_model_len=64, spec="dflash"))
    new_tokens = (7, 2, 4)  # 3 requests (bucket 4), then 2 (bucket 2), then 1
    # fp32 on the CPU: torch ops outside the kernels may round a row differently at another batch size
    graphed, batch_sizes = _assert_graphed_equals_eager(llm, [greedy(n) for n in new_tokens], exact=False)
    assert [len(t) for t in graphed] == list(new_tokens)
    assert 3 in batch_sizes  # padded to 4
    sampled = [SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True) for n in new_tokens]
    _assert_graphed_equals_eager(llm, sampled, exact=False)


@pytest.mark.slow
@needs_dflash
def test_dflash_graph_path_equals_eager_under_the_interpreter(dflash_checkpoint):
    """The Triton kernels read the graphs' static buffers; the interpreter must be on before triton is
    imported, hence a fresh process."""
    pytest.importorskip("triton", reason="triton is not installed")
    code = "import sys; from tests.engine.test_cuda_graph_export import _interpreted_dflash_check as f; f(sys.argv[1])"
    env = dict(os.environ, TRITON_INTERPRET="1", FREETOKEN_KERNELS="triton")
    proc = subprocess.run([sys.executable, "-c", code, dflash_checkpoint], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
