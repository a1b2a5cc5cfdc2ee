"""The DFlash method's context pool and bucketed block step against each request's block run alone.

Oracle: the draft network (itself checked against the dflash package in test_dflash_draft.py and
test_dflash2_draft.py) run on one request at a time, over exactly that request's context rows
computed at once from all its features (no pool, no padding, no bucket): its hidden at slots 1..k,
their logits through the fixture target's lm_head, and the argmax (DFlash) or the selector's greedy
walk (DFlash2). The method under test writes rows piecewise into the shared pool, in batches of
requests of different lengths, and runs all blocks at once at a bucketed batch size and context
length (contexts on both sides of the 256-row bucket boundary); requests are released, their slots
reused, and a preempted request rebuilds its context from position 0. fp32 on the CPU: the hidden
agrees within 5e-6 (the padded rows get no weight, the batched matmuls round differently).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from freetoken.engine.request import Request
from freetoken.engine.spec_protocol import CommittedRows
from freetoken.sampling import SamplingParams
from freetoken.spec.dflash.block_step import BlockInputs, batch_bucket
from freetoken.spec.dflash.context_pool import context_buckets
from freetoken.spec.dflash.context_pool import ContextPool
from freetoken.spec.dflash.draft_graph import DraftGraphs
from freetoken.spec.dflash.method import DFlashMethod
from tests.conftest import FIXTURES
from tests.spec import test_dflash2_draft as v2
from tests.spec import test_dflash_draft as v1

pytestmark = pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")
K = 3  # the fixture drafts' block holds 4
MAX_BLOCKS, BLOCK = 40, 16  # contexts of up to 640 rows: buckets 256, 512, 640


class FixtureTarget:
    """What DFlashMethod reads of a target: the draft, the fixture target's embedding table and lm_head."""

    def __init__(self, draft, device: str = "cpu", dtype: torch.dtype = torch.float32):
        embed, head = v1._target_embed_head()
        self.draft, self.table, self.head = draft, embed.to(device, dtype), head.to(device, dtype)

    def draft_network(self, name: str):
        return self.draft if name == "dflash" else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, H]
        return F.embedding(ids, self.table)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V] fp32
        return F.linear(hidden, self.head).float()


def make_method(version: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **kw) -> DFlashMethod:
    draft = (v2 if version == "dflash2" else v1)._draft(dtype, device)
    return DFlashMethod(FixtureTarget(draft, device, dtype), SimpleNamespace(num_blocks=8, block_size=BLOCK), K, torch.device(device),
                        max_blocks_per_seq=MAX_BLOCKS, **kw)


class Stream:
    """One request and its features: row p of `features` [T, n_taps * H] is the target's taps at position p."""

    def __init__(self, request_id: int, length: int, g: torch.Generator, method: DFlashMethod, params: SamplingParams | None = None):
        cfg = method.draft.config
        dtype, device = method.draft.norm.weight.dtype, method.device
        self.features = torch.randn(length, cfg.num_taps * cfg.hidden_size, generator=g).to(device, dtype)
        tokens = torch.randint(cfg.mask_token_id, (length + 1,), generator=g).tolist()
        self.request = Request(request_id, tokens, params or SamplingParams(max_new_tokens=8))

    def commit(self, method: DFlashMethod, rows: int) -> CommittedRows:
        """The next `rows` rows as the target would commit them; the request's anchor moves past them."""
        r = self.request
        start = r.num_cached_tokens
        r.num_cached_tokens += rows
        return CommittedRows(r, start, self.features[start : start + rows], [], self.features[start : start + rows])


@torch.no_grad()
def reference(method: DFlashMethod, stream: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's block alone over its context computed at once -> (hidden [k, H], drafts [k])."""
    draft, r = method.draft, stream.request
    a, size = r.num_cached_tokens, draft.config.block_size
    device = method.device
    keys, values = draft.context_kv(draft.context(stream.features[:a]), torch.arange(a, device=device))
    ids = torch.tensor([r.last_token_id] + [draft.config.mask_token_id] * (size - 1), device=device)
    target = FixtureTarget(draft, device.type, draft.norm.weight.dtype)
    hidden = draft(target.embed(ids), torch.arange(a, a + size, device=device), keys, values, torch.arange(a, device=device))[1 : 1 + K]
    logits = target.compute_logits(hidden)
    if draft.candidate_selector is None:
        return hidden, logits.argmax(-1)
    anchor = torch.tensor([r.last_token_id], device=device)
    return hidden, draft.candidate_selector.greedy_walk(hidden[None], logits[None], anchor)[0]


@torch.no_grad()
def check_batch(method: DFlashMethod, streams: list[Stream]) -> None:
    """The method's hidden (through the bucketed step) and drafts for the batch equal each block alone."""
    requests = [s.request for s in streams]
    inputs, n = method._load(requests)
    assert n == method.step.context_bucket(max(r.num_cached_tokens for r in requests)) >= max(r.num_cached_tokens for r in requests)
    hidden = method.step.hidden(inputs.on_device, n)
    assert hidden.shape[0] == batch_bucket(len(streams))
    eager = method.step.greedy_drafts(inputs.on_device, n)[: len(streams)].cpu()
    drafts = method.propose(requests).tokens  # through the graphs where the method has them
    assert torch.equal(drafts, eager)
    for i, s in enumerate(streams):
        want_hidden, want_drafts = reference(method, s)
        torch.testing.assert_close(hidden[i], want_hidden, rtol=0, atol=5e-6)
        assert drafts[i].tolist() == want_drafts.tolist(), f"request {s.request.request_id}"


def test_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 17)] == [1, 2, 4, 4, 8, 8, 16, 24]
    assert context_buckets(640) == (256, 512, 640)
    assert context_buckets(512) == (256, 512)
    assert context_buckets(144) == (144,)


@pytest.mark.parametrize("version", ["dflash", "dflash2"])
def test_pool_blocks_equal_blocks_alone(version):
    """Contexts of 0, 5, 40, 250 and 300 rows in one batch (bucket 512, batch bucket 8), rows written in
    prefill pieces and then by verify-like steps of 1..k+1 rows, across the 256 boundary; then a
    release, a slot reused by a new request, and a preempted request rebuilt from position 0."""
    method = make_method(version)
    g = torch.Generator().manual_seed(0)
    streams = [Stream(i, n, g, method) for i, n in enumerate((600, 600, 600, 600, 600))]
    method.observe([s.commit(method, n) for s, n in zip(streams[1:], (5, 24, 200, 256))])  # request 0: a one-token prompt, no rows
    method.observe([s.commit(method, n) for s, n in zip(streams[2:], (16, 50, 44))])
    assert [s.request.num_cached_tokens for s in streams] == [0, 5, 40, 250, 300]
    check_batch(method, streams)
    for step in range(4):  # verify-like: 1..k+1 rows a request; request 3 crosses 256
        method.observe([s.commit(method, (step + i) % (K + 1) + 1) for i, s in enumerate(streams)])
        check_batch(method, streams)
    assert streams[3].request.num_cached_tokens > 256
    check_batch(method, streams[3:4])  # alone: batch bucket 1, context bucket 512

    freed = streams[2].request.draft_state.slot
    method.release(streams[2].request)
    late = Stream(7, 100, g, method)
    method.observe([late.commit(method, 30)])
    assert late.request.draft_state.slot == freed  # reused: its earlier holder's rows lie past 30, masked
    survivors = [streams[0], streams[1], late, streams[4]]
    check_batch(method, survivors)

    preempted = streams[4].request
    method.release(preempted)
    preempted.num_cached_tokens = 0
    method.observe([streams[4].commit(method, 64)])
    method.observe([streams[4].commit(method, 9), late.commit(method, 2)])
    check_batch(method, survivors)


def test_pool_grows_keeping_rows_and_reuses_slots():
    pool = ContextPool(2, 2, 8, 4, torch.float32, "cpu")
    a = pool.acquire()
    rows = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    pool.write(torch.tensor([a.slot] * 3), torch.tensor([0, 1, 2]), *rows)
    a.num_rows = 3
    b, c = pool.acquire(), pool.acquire()
    assert (a.slot, b.slot, c.slot) == (0, 1, 2) and pool.num_slots == 4 and pool.generation == 2
    assert torch.equal(a.rows()[0], rows[0]) and torch.equal(a.rows()[1], rows[1])
    pool.release(b)
    assert pool.acquire().slot == 1
    keys, values = pool.gather(torch.tensor([2, 0]), 3)
    assert keys.shape == (2, 2, 2, 3, 4) and torch.equal(keys[:, 1], rows[0]) and not keys[:, 0].any()


def test_capacity_follows_the_longest_context():
    """Rows per slot start at the smallest bucket and grow to the bucket of the longest row written,
    the held rows kept; the slots' count and the capacity grow independently."""
    pool = ContextPool(1, 1, 640, 2, torch.float32, "cpu")
    assert pool.capacity == 256
    a = pool.acquire()
    early = torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2)
    pool.write(torch.tensor([a.slot] * 5), torch.arange(5), *early)
    a.num_rows = 5
    pool.reserve(256)
    assert pool.capacity == 256 and pool.generation == 0
    pool.reserve(300)
    assert pool.capacity == 512 and pool.generation == 1
    late = torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2)
    pool.write(torch.tensor([a.slot]), torch.tensor([299]), *late)
    b = pool.acquire()  # a second slot: the count doubles at the current capacity
    assert pool.num_slots == 2 and pool.capacity == 512 and b.slot == 1
    keys, values = pool.gather(torch.tensor([a.slot]), 512)
    assert torch.equal(keys[:, 0, :, :5], early[0][:, :, :5]) and torch.equal(values[:, 0, :, 299:300], late[1])
    pool.reserve(641 - 1)
    assert pool.capacity == 640


def test_a_method_keeps_only_the_rows_its_requests_reach():
    method = make_method("dflash")
    s = Stream(0, 700, torch.Generator().manual_seed(4), method)
    method.observe([s.commit(method, 40)])
    assert method.pool.capacity == 256
    method.observe([s.commit(method, 300)])
    assert method.pool.capacity == 512
    check_batch(method, [s])


def test_observe_checks_positions_and_room():
    method = make_method("dflash")
    s = Stream(0, 700, torch.Generator().manual_seed(1), method)
    rows = s.commit(method, 4)
    rows.first_position = 2
    with pytest.raises(RuntimeError, match="committed rows start at 2, its DFlash context holds 0"):
        method.observe([rows])
    s.request.num_cached_tokens = 0
    with pytest.raises(RuntimeError, match="past the 640 a context holds"):
        method.observe([s.commit(method, 641)])
    s.request.num_cached_tokens = 3
    with pytest.raises(RuntimeError, match="holds 0 rows, its anchor is at 3"):
        method.propose([s.request])


@pytest.mark.parametrize("version", ["dflash", "dflash2"])
@torch.no_grad()
def test_sampled_batches_run_the_same_step(version):
    """A sampled request's drafts come from the same bucketed step: its q is the softmax of the
    logits of the alone-run hidden (DFlash), or the walk's one-hot / sampled q over candidates."""
    method = make_method(version)
    g = torch.Generator().manual_seed(2)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    streams = [Stream(0, 40, g, method), Stream(1, 40, g, method, params)]
    streams[1].request.generator = torch.Generator().manual_seed(5)
    method.observe([streams[0].commit(method, 12), streams[1].commit(method, 30)])
    proposal = method.propose([s.request for s in streams])
    assert proposal.tokens.shape == (2, K) and proposal.probs.shape[:2] == (2, K)
    _, drafts = reference(method, streams[0])
    assert proposal.tokens[0].tolist() == drafts.tolist()  # the greedy request of the mixed batch
    torch.testing.assert_close(proposal.probs[1].sum(-1), torch.ones(K), rtol=0, atol=1e-5)
    if version == "dflash":
        want = torch.softmax(method.step.compute_logits(reference(method, streams[1])[0]), -1)
        torch.testing.assert_close(proposal.probs[1], want, rtol=0, atol=1e-6)


def test_block_inputs_pad_with_zeros():
    inputs = BlockInputs(4, torch.device("cpu"))
    inputs.load([9, 8, 7, 6], [1, 2, 3, 4], [3, 2, 1, 0])
    inputs.load([5, 6], [10, 11], [2, 3])  # the other host buffer: its stale entries must not leak
    inputs.load([1], [12], [1])
    d = inputs.on_device
    assert d["anchors"].tolist() == [1, 0, 0, 0] and d["starts"].tolist() == [12, 0, 0, 0] and d["slots"].tolist() == [1, 0, 0, 0]


class _Rerun:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the step again into the captured output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@pytest.mark.parametrize("version", ["dflash", "dflash2"])
@torch.no_grad()
def test_graph_path_without_capture(version, monkeypatch):
    """On the CPU no graphs are built; with a stand-in for the capture, the graph path (static inputs
    re-uploaded each call, one entry per (batch bucket, context bucket), dropped when the pool
    reallocates) gives the eager drafts."""
    assert make_method(version, cuda_graphs=True).graphs is None
    assert not DraftGraphs.supported(FixtureTarget(None), torch.device("cpu"))
    method = make_method(version)
    graphs = method.graphs = DraftGraphs(method.step)
    monkeypatch.setattr(graphs, "_record", lambda fn: (lambda out: (_Rerun(fn, out), out))(fn()))
    g = torch.Generator().manual_seed(3)
    streams = [Stream(i, 600, g, method) for i in range(3)]
    method.observe([streams[0].commit(method, 254)])
    assert method.pool.generation == 0
    for step in range(4):
        for batch in (streams[:1], streams):
            if batch[-1].request.draft_state is None:
                method.observe([s.commit(method, 20 + s.request.request_id) for s in batch[1:]])
            check_batch(method, batch)
        method.observe([s.commit(method, (step + i) % (K + 1) + 1) for i, s in enumerate(streams)])
    assert method.pool.generation == 3  # 1 -> 2 -> 4 slots, 256 -> 512 rows a slot
    assert sorted(graphs.graphs) == [(1, 512), (4, 512)]  # the 256-row graphs went with the capacity growth
