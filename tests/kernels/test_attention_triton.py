"""Triton paged attention vs the batched torch reference, and each row alone vs in a batch (bitwise),
for row groups of every size the GQA group allows."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

from freetoken.kernels import attention_triton, batched  # noqa: E402
from freetoken.kernels.batched import SeqBatch  # noqa: E402

BLOCK = 4  # KV block size in tokens


def setup(device, dtype, num_rows, num_cached, heads=(4, 2), d=32, seed=0):
    """A KV pool with random contents, shuffled block tables, and q rows for each sequence."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(num_cached, num_rows)]
    blocks_needed = [-(-t // BLOCK) for t in totals]
    perm = torch.randperm(sum(blocks_needed) + 3, generator=gen)
    tables, used = [], 0
    for b in blocks_needed:
        tables.append(perm[used : used + b].to(torch.int32).to(device))
        used += b
    num_slots = (sum(blocks_needed) + 3) * BLOCK
    k_cache = torch.randn(num_slots, heads[1], d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_slots, heads[1], d, generator=gen).to(dtype).to(device)
    q = torch.randn(sum(num_rows), heads[0], d, generator=gen).to(dtype).to(device)
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    batch = SeqBatch(tuple(starts), tuple(num_rows), tuple(num_cached), (-1,) * len(num_rows), tuple(tables), torch.device(device))
    return q, k_cache, v_cache, batch


def shapes(device):
    # (rows per sequence, cached tokens per sequence): a prefill, a decode, a verify past a BLOCK_N edge.
    return ([5, 1, 4], [0, 9, 62]) if device == "cpu" else ([300, 1, 4, 4], [0, 1000, 62, 4093])


@pytest.fixture(params=["shipped", "small"])
def partition(request, monkeypatch):
    """The shipped partition size, and (CPU contexts are short) 16-key partitions, so rows span
    several partitions and the merge is exercised."""
    if request.param == "small":
        monkeypatch.setattr(attention_triton, "BLOCK_N", 16)
        monkeypatch.setattr(attention_triton, "PARTITION", 16)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(device, dtype, partition):
    num_rows, num_cached = shapes(device)
    heads, d = ((4, 2), 32) if device == "cpu" else ((16, 2), 256)
    q, k_cache, v_cache, batch = setup(device, dtype, num_rows, num_cached, heads, d)
    scale = d**-0.5
    got = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, scale)
    want = batched.paged_attention_batched(q, k_cache, v_cache, batch, BLOCK, scale)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_gate_matches_reference(device, partition):
    num_rows, num_cached = shapes(device)
    q, k_cache, v_cache, batch = setup(device, torch.bfloat16, num_rows, num_cached, seed=2)
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype).to(device)
    got = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, 0.3, gate)
    want = batched.paged_attention_batched(q, k_cache, v_cache, batch, BLOCK, 0.3) * torch.sigmoid(gate)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_row_alone_equals_row_in_batch(device, partition):
    num_rows, num_cached = shapes(device)
    q, k_cache, v_cache, batch = setup(device, torch.bfloat16, num_rows, num_cached, seed=1)
    full = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, 0.2)
    for i in range(batch.num_seqs):
        for j in range(batch.num_rows[i]) if device == "cuda" else {0, batch.num_rows[i] - 1}:
            row = batch.row_starts[i] + j
            alone = SeqBatch((0,), (1,), (batch.num_cached[i] + j,), (-1,), (batch.block_tables[i],), batch.device)
            out = attention_triton.paged_attention(q[row : row + 1], k_cache, v_cache, alone, BLOCK, 0.2)
            assert torch.equal(out[0], full[row]), f"sequence {i} row {j}"


def verify_shapes(device):
    # Verify-like: several sequences with 1..5 rows each (decode rows among them), contexts that start
    # and end at partition edges and across them, and a prefill chunk of one sequence.
    if device == "cpu":
        return [3, 1, 5, 2, 4, 1, 12], [5, 9, 62, 15, 30, 0, 0]
    return [4, 1, 5, 2, 4, 1, 4, 300], [61, 1000, 62, 127, 4093, 0, 64, 20]


def poison_unused(k_cache, v_cache, batch):
    """NaN in every cache slot that holds no token of the batch (unwritten KV)."""
    used = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    for table, c, n in zip(batch.block_tables, batch.num_cached, batch.num_rows):
        pos = torch.arange(c + n, device=k_cache.device)
        used[table[pos // BLOCK].long() * BLOCK + pos % BLOCK] = True
    k_cache[~used] = float("nan")
    v_cache[~used] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_verify_rows_alone_equal_rows_in_batch(device, group, dtype, partition):
    num_rows, num_cached = verify_shapes(device)
    d = 32 if device == "cpu" else 256
    q, k_cache, v_cache, batch = setup(device, dtype, num_rows, num_cached, (2 * group, 2), d, seed=4)
    poison_unused(k_cache, v_cache, batch)
    full = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, 0.2)
    assert full.isfinite().all()
    for i in range(batch.num_seqs):
        for j in range(batch.num_rows[i]):
            row = batch.row_starts[i] + j
            alone = SeqBatch((0,), (1,), (batch.num_cached[i] + j,), (-1,), (batch.block_tables[i],), batch.device)
            out = attention_triton.paged_attention(q[row : row + 1], k_cache, v_cache, alone, BLOCK, 0.2)
            assert torch.equal(out[0], full[row]), f"group {group} sequence {i} row {j}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 3, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_verify_matches_reference(device, group, dtype, partition):
    num_rows, num_cached = verify_shapes(device)
    d = 32 if device == "cpu" else 256
    q, k_cache, v_cache, batch = setup(device, dtype, num_rows, num_cached, (2 * group, 2), d, seed=5)
    got = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, d**-0.5)
    want = batched.paged_attention_batched(q, k_cache, v_cache, batch, BLOCK, d**-0.5)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("gated", [False, True])
def test_merge_in_the_partition_launch_equals_the_merge_launch(device, group, gated, partition, monkeypatch):
    """The last partition program of a (row group, KV head) merging its rows gives the merge launch's bits."""
    num_rows, num_cached = verify_shapes(device)
    d = 32 if device == "cpu" else 256
    q, k_cache, v_cache, batch = setup(device, torch.bfloat16, num_rows, num_cached, (2 * group, 2), d, seed=7)
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q.dtype).to(device) if gated else None
    outs = {}
    for max_groups in (10**6, 0):
        monkeypatch.setattr(attention_triton, "MERGE_IN_PARTITION_MAX_GROUPS", max_groups)
        outs[max_groups] = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, 0.2, gate)
    assert torch.equal(outs[10**6], outs[0])
    counters = __import__("freetoken.kernels.linear_triton", fromlist=["arrival_counters"]).arrival_counters(q.device, 1)
    assert not counters.any(), "the arrival counters are back at zero"


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_launches_split_by_whole_groups(device, monkeypatch):
    # A workspace budget below one row forces a launch per row group: the same bits as one launch.
    num_rows, num_cached = verify_shapes(device)
    q, k_cache, v_cache, batch = setup(device, torch.bfloat16, num_rows, num_cached, (8, 2), seed=6)
    whole = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, 0.2)
    monkeypatch.setattr(attention_triton, "WORKSPACE_BYTES", 1)
    split = attention_triton.paged_attention(q, k_cache, v_cache, batch, BLOCK, 0.2)
    assert torch.equal(split, whole)


def test_row_groups_stay_within_sequences():
    batch = SeqBatch((0, 3, 4, 9), (3, 1, 5, 0), (7, 2, 0, 4), (-1,) * 4, (torch.zeros(1, dtype=torch.int32),) * 4, torch.device("cpu"))
    sizes, groups = batch.row_groups(2)
    assert sizes == (2, 1, 1, 2, 2, 1)
    assert groups.tolist() == [[0, 2], [2, 1], [3, 1], [4, 2], [6, 2], [8, 1]]
    assert batch.row_groups(2)[1] is groups
    assert list(attention_triton._launches(sizes, 3)) == [(0, 2, 0, 3), (2, 4, 3, 6), (4, 6, 6, 9)]


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_hand_case(device):
    # One query, two keys with scores 0 and log(3) -> weights 1/4, 3/4 over values 4 and 8 -> 7.
    k_cache = torch.zeros(8, 1, 16, device=device)
    v_cache = torch.zeros(8, 1, 16, device=device)
    k_cache[5, 0, 0] = 0.0
    k_cache[2, 0, 0] = torch.log(torch.tensor(3.0))
    v_cache[5, 0, :] = 4.0
    v_cache[2, 0, :] = 8.0
    q = torch.zeros(1, 1, 16, device=device)
    q[0, 0, 0] = 1.0
    table = torch.tensor([5, 2], dtype=torch.int32, device=device)  # block size 1: token 0 -> slot 5, token 1 -> slot 2
    batch = SeqBatch((0,), (1,), (1,), (-1,), (table,), torch.device(device))
    out = attention_triton.paged_attention(q, k_cache, v_cache, batch, 1, 1.0)
    torch.testing.assert_close(out, torch.full((1, 1, 16), 7.0, device=device), rtol=1e-5, atol=1e-5)
