"""The CUDA graph of the greedy MTP draft loop computes what the eager loop computes.

Oracle: MTPMethod's eager propose on the same model, KV pool and draft states. On the GPU, over
several successive propose calls (positions advancing by a varying number of accepted rows, block
boundaries crossed), the graph's drafts and the MTP KV rows it writes must equal the eager path's
bit for bit (torch.equal), for batch sizes 1 and 3, k = 1 and 3, dense and MoE heads. On the CPU:
which batches take the graph (greedy without penalties, tables within the padded width), that the
graph's per-call inputs are the ones the eager path builds with build_context, and that the chain
the graph captures (static contexts, padded block table, drafts fed on the device), run without
capture under the Triton CPU interpreter, equals the eager loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.request import Request
from freetoken.engine.runner import RowGroup, build_context
from freetoken.engine.spec_protocol import CommittedRows
from freetoken.forward_context import ForwardMode
from freetoken.kernels.batched import SeqBatch
from freetoken.layers.merge import merge_projections
from freetoken.sampling import SamplingParams, make_generator
from freetoken.spec.mtp import draft_graph
from freetoken.spec.mtp.draft_graph import ChainInputs, DraftGraphs
from freetoken.spec.mtp.method import MTPMethod
from tests.conftest import TinySpec

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[5, 17, 30, 2, 9], [44] * 12, [7, 8, 9, 10, 11, 12, 13]]
BLOCK_SIZE = 8


def _model(tiny_checkpoint, moe: bool, device: str, dtype: torch.dtype):
    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.models.loader import load_model

    _, path = tiny_checkpoint(TinySpec(moe=moe))
    ck = UnifiedCheckpoint.open(path)
    return merge_projections(load_model(ck, ck.family, ck.config, with_mtp=True, device=device, dtype=dtype))


def _pool(model, device: str, dtype: torch.dtype, num_blocks: int = 64) -> KVPool:
    heads, dim = model.kv_head_shape
    return KVPool(model.num_kv_layers, num_blocks, BLOCK_SIZE, heads, dim, dtype, device)


def _requests(prompts, params: SamplingParams, device: str) -> list[Request]:
    requests = [Request(i, list(p), params) for i, p in enumerate(prompts)]
    for r in requests:
        r.generator = make_generator(params, r.request_id, device)
    return requests


def _observe_prompts(method: MTPMethod, requests: list[Request], g: torch.Generator) -> None:
    """The prompts' committed rows, with random target hidden states (the draft's input only)."""
    rows = []
    for r in requests:
        method.kv_pool.grow(r.block_table, len(r.prompt_token_ids) - 1)
        hidden = _hidden(method, len(r.prompt_token_ids) - 1, g)
        rows.append(CommittedRows(r, 0, hidden, r.prompt_token_ids[1:]))
    method.observe(rows)


def _hidden(method: MTPMethod, n: int, g: torch.Generator) -> torch.Tensor:
    w = method.network.fc.weight
    return torch.randn(n, w.shape[1] // 2, generator=g, device=g.device).to(w.device, w.dtype)


def _reserve(method: MTPMethod, requests: list[Request]) -> None:
    """What the scheduler does before a decode step: room for k+1 rows past the committed tokens."""
    for r in requests:
        method.kv_pool.grow(r.block_table, r.draft_state.position + 1 + method.num_draft_tokens + 1)


def _mtp_kv(method: MTPMethod) -> tuple[torch.Tensor, torch.Tensor]:
    index = method.network.layers[0].self_attn.kv_index
    cache = method.kv_pool.cache
    return cache.k[index].clone(), cache.v[index].clone()


def _compare(eager: MTPMethod, graphed: MTPMethod, requests: list[Request]) -> list[list[int]]:
    """One propose through both paths from the same MTP KV; asserts equal drafts and KV rows."""
    _reserve(eager, requests)
    before = _mtp_kv(eager)
    expected = eager.propose(requests).tokens
    after_eager = _mtp_kv(eager)
    index = eager.network.layers[0].self_attn.kv_index
    eager.kv_pool.cache.k[index].copy_(before[0])
    eager.kv_pool.cache.v[index].copy_(before[1])
    proposal = graphed.propose(requests)
    after_graph = _mtp_kv(graphed)
    assert proposal.probs is None
    assert proposal.tokens.device.type == "cpu" and proposal.tokens.dtype == torch.long
    assert proposal.tokens.shape == (len(requests), graphed.num_draft_tokens)
    assert torch.equal(proposal.tokens, expected)
    assert torch.equal(after_graph[0], after_eager[0]) and torch.equal(after_graph[1], after_eager[1])
    if graphed.num_draft_tokens > 1:  # the chain wrote its speculative rows
        assert not torch.equal(after_eager[0], before[0])
    return expected.tolist()


def _accept(method: MTPMethod, requests: list[Request], drafts: list[list[int]], step: int, g: torch.Generator) -> None:
    """Commit a varying number of accepted drafts plus one token per request, as a verify would."""
    k, rows = method.num_draft_tokens, []
    for i, (r, d) in enumerate(zip(requests, drafts)):
        a = (step + i) % (k + 1)
        tokens = d[:a] + [int(torch.randint(200, (1,), generator=g, device=g.device))]
        rows.append(CommittedRows(r, r.draft_state.position + 1, _hidden(method, a + 1, g), tokens))
    method.observe(rows)


CASES = [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("moe,dtype", CASES, ids=["dense-bf16", "moe-bf16", "dense-fp32"])
@torch.no_grad()
def test_graph_drafts_equal_eager(tiny_checkpoint, moe, dtype, batch, k):
    model = _model(tiny_checkpoint, moe, "cuda", dtype)
    pool = _pool(model, "cuda", dtype)
    device = torch.device("cuda")
    eager = MTPMethod(model, pool, k, device)
    graphed = MTPMethod(model, pool, k, device, cuda_graphs=True, max_blocks_per_seq=16)
    assert eager.graphs is None and graphed.graphs is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    requests = _requests(PROMPTS[:batch], SamplingParams(max_new_tokens=64), "cuda")
    _observe_prompts(eager, requests, g)
    for step in range(6):
        drafts = _compare(eager, graphed, requests)
        _accept(eager, requests, drafts, step, g)
    assert list(graphed.graphs.graphs) == [batch]  # captured once, replayed every call


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_graphs_of_several_batch_sizes_share_their_pool(tiny_checkpoint):
    dtype, k = torch.bfloat16, 3
    model = _model(tiny_checkpoint, False, "cuda", dtype)
    pool = _pool(model, "cuda", dtype)
    device = torch.device("cuda")
    eager = MTPMethod(model, pool, k, device)
    graphed = MTPMethod(model, pool, k, device, cuda_graphs=True, max_blocks_per_seq=16)
    g = torch.Generator(device="cuda").manual_seed(1)
    requests = _requests(PROMPTS, SamplingParams(max_new_tokens=64), "cuda")
    _observe_prompts(eager, requests, g)
    for step in range(4):
        subset = requests if step % 2 == 0 else requests[1:]
        drafts = _compare(eager, graphed, subset)
        _accept(eager, subset, drafts, step, g)
    assert sorted(graphed.graphs.graphs) == [2, 3]


# -- CPU: dispatch and inputs --------------------------------------------------------------------


def test_no_graphs_on_cpu_or_when_off(tiny_checkpoint):
    model = _model(tiny_checkpoint, False, "cpu", torch.float32)
    pool = _pool(model, "cpu", torch.float32)
    assert MTPMethod(model, pool, 2, torch.device("cpu"), cuda_graphs=True).graphs is None
    assert MTPMethod(model, pool, 2, torch.device("cpu")).graphs is None
    assert not DraftGraphs.supported(model, torch.device("cpu"))


@pytest.mark.parametrize("case", ["greedy", "sampled", "penalized", "wide_table"])
@torch.no_grad()
def test_only_greedy_batches_within_the_width_take_the_graph(tiny_checkpoint, monkeypatch, case):
    """A stand-in graph records its calls; every other batch gets the eager drafts."""
    k = 3
    model = _model(tiny_checkpoint, False, "cpu", torch.float32)
    pool = _pool(model, "cpu", torch.float32)
    method = MTPMethod(model, pool, k, torch.device("cpu"))
    method.graphs = DraftGraphs(method.network, pool, k, max_blocks_per_seq=1 if case == "wide_table" else 16)
    calls = []

    def run(hidden, tables, positions):
        calls.append((hidden, tables, positions))
        return torch.full((len(hidden), k), 7, dtype=torch.long)

    monkeypatch.setattr(method.graphs, "run", run)
    params = {"sampled": SamplingParams(temperature=0.8, seed=3), "penalized": SamplingParams(presence_penalty=0.5)}.get(case, SamplingParams())
    requests = _requests(PROMPTS, params, "cpu")
    _observe_prompts(method, requests, torch.Generator().manual_seed(0))
    _reserve(method, requests)
    proposal = method.propose(requests)
    if case != "greedy":
        assert not calls
        assert (proposal.probs is not None) == (case == "sampled")
        return
    assert proposal.tokens.tolist() == [[7] * k] * len(requests) and proposal.probs is None
    [(hidden, tables, positions)] = calls
    states = [r.draft_state for r in requests]
    assert all(h is s.hidden for h, s in zip(hidden, states))
    assert tables == [r.block_table for r in requests]
    assert positions == [s.position for s in states] == [len(p) - 2 for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3])
def test_chain_inputs_are_the_eager_step_inputs(k):
    """Row s of each field equals what build_context gives the eager loop's chained step s+1."""
    pool = KVPool(1, 32, 4, 1, 8, torch.float32, "cpu")
    tables = [[3, 9, 1], [20, 5, 6, 7, 30], [11]]
    positions = [8, 13, 1]  # last observed rows; the chain reaches position + k - 1 < 4 * len(table)
    inputs = ChainInputs(len(tables), k - 1, 6, torch.device("cpu"))
    inputs.load([[0, 1, 2, 3, 4, 5]] * 3, [2, 2, 2], pool)  # stale values a later load must cover
    inputs.load(tables, positions, pool)
    d = inputs.on_device
    for s in range(k - 1):
        groups = [RowGroup(t, None, p + s + 1, [0]) for t, p in zip(tables, positions)]
        ctx = build_context(groups, ForwardMode.EXTEND, pool, None, torch.device("cpu"))
        assert torch.equal(d["positions"][s], ctx.positions)
        assert torch.equal(d["slot_mapping"][s], ctx.slot_mapping)
        assert torch.equal(d["context_lens"][s], SeqBatch.from_seqs(ctx.seqs, torch.device("cpu")).context_lens)
    assert d["positions"].shape == (k - 1, 3)
    for i, t in enumerate(tables):
        assert d["block_table"][i, : len(t)].tolist() == t
    assert d["block_table"].dtype == d["context_lens"].dtype == torch.int32


class _Rerun:
    """Stands in for a captured graph: a replay runs the chain again into the captured output."""

    def __init__(self, fn, out: torch.Tensor):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@torch.no_grad()
def _interpreted_chain_check(path: str) -> None:
    """Run in a process with TRITON_INTERPRET=1 and FREETOKEN_KERNELS=triton (see below)."""

    def record(self, fn):
        out = fn()
        return _Rerun(fn, out), out

    draft_graph.DraftGraphs._record = record
    k, cpu = 3, torch.device("cpu")
    model = _model(lambda spec: (None, Path(path)), False, "cpu", torch.float32)
    pool = _pool(model, "cpu", torch.float32)
    eager = MTPMethod(model, pool, k, cpu)
    graphed = MTPMethod(model, pool, k, cpu)
    graphed.graphs = DraftGraphs(graphed.network, pool, k, max_blocks_per_seq=16)
    g = torch.Generator().manual_seed(0)
    requests = _requests(PROMPTS, SamplingParams(max_new_tokens=64), "cpu")
    _observe_prompts(eager, requests, g)
    for step in range(3):
        drafts = _compare(eager, graphed, requests)
        _accept(eager, requests, drafts, step, g)
    assert list(graphed.graphs.graphs) == [len(PROMPTS)]


@pytest.mark.slow
def test_graph_chain_equals_eager_under_the_interpreter(tiny_checkpoint):
    """The Triton kernels read the static buffers; the interpreter must be on before triton is imported,
    hence a fresh process."""
    _, path = tiny_checkpoint(TinySpec())
    code = "import sys; from tests.spec.test_mtp_draft_graph import _interpreted_chain_check as f; f(sys.argv[1])"
    env = dict(os.environ, TRITON_INTERPRET="1", FREETOKEN_KERNELS="triton")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
