"""Triton MoE routing and the expert GEMMs' row blocks vs their torch references.

Route: experts exactly equal to the torch path's (softmax fp32, torch.topk), weights within rounding,
on logits without near-ties (each row a shuffle of well-spaced values), a column-strided view (the
router columns of the merged [E + 1] projection) and an expert count that is not a power of two;
equal logits go to the lower expert ids; a row's bits alone == inside a batch; with the shared
expert appended, column top_k is E and the routed columns and weights are unchanged.
Direct layout (T <= DIRECT_MAX_ROWS routed rows): the blocks the route kernel writes, and those of
`direct_blocks` for experts from elsewhere, equal one block per flat row (the row, then padding T;
its expert minus first, or C when not held), with and without the shared expert and on an
expert-parallel slice; above the threshold route writes none and `row_blocks` aligns.
Align: sorted row ids and block experts equal to an expert-by-expert grouping, for one token, many tokens
on few experts, more rows than one scan step, and expert-parallel slices (down to a rank that holds
none of the routed experts, whose surplus blocks are spread over several programs).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import moe_ref, moe_route_triton  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3}  # weights: fp32 sum order; one bf16 ulp


def spaced_logits(n, num_experts, dtype, device, seed, columns=None):
    """[n, num_experts] logits, each row a shuffle of values 0.05 apart (no near-ties, even in bf16);
    a view of the first num_experts of `columns` columns when given."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.arange(num_experts) - num_experts / 2) * 0.05
    rows = torch.stack([values[torch.randperm(num_experts, generator=gen)] for _ in range(n)])
    if columns is not None:
        rows = torch.cat([rows, torch.randn(n, columns - num_experts, generator=gen)], dim=1)
    return rows.to(dtype).to(device)[:, :num_experts]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_reference(device, dtype):
    cases = [(1, 8, 2, None), (9, 8, 2, 9), (5, 12, 3, None)] if device == "cpu" else [(1, 256, 8, None), (37, 256, 8, 257)]
    for seed, (n, num_experts, top_k, columns) in enumerate(cases):
        logits = spaced_logits(n, num_experts, dtype, device, seed, columns)
        experts, weights, _ = moe_route_triton.route(logits, top_k, dtype)
        assert experts.shape == weights.shape == (n, top_k) and weights.dtype == dtype
        want_experts, want_weights = moe_ref.route(logits.cpu(), top_k, dtype)
        assert torch.equal(experts.cpu().long(), want_experts), f"{n} x {num_experts}: experts differ"
        torch.testing.assert_close(weights.cpu(), want_weights, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_route_picks_the_largest_lowest_id_first_among_many_ties(device):
    """Logits drawn from a few well-spaced values (many exact ties): the picks are the experts sorted by
    (value descending, id ascending), for every top_k the one-reduction pick takes (<= 8) and the
    iterative one (> 8), E below, at and past a power of two."""
    gen = torch.Generator().manual_seed(3)
    for num_experts, top_k in ((8, 8), (12, 1), (12, 5), (40, 8), (40, 11)):
        logits = (torch.randint(0, 4, (6, num_experts), generator=gen) * 0.25).to(device)
        experts, weights, _ = moe_route_triton.route(logits, top_k, torch.float32)
        order = torch.stack([torch.tensor(sorted(range(num_experts), key=lambda e: (-float(row[e]), e))[:top_k]) for row in logits.cpu()])
        assert torch.equal(experts.cpu().long(), order), f"{num_experts} experts, top {top_k}"
        p = torch.softmax(logits.cpu(), dim=-1).gather(1, order)
        torch.testing.assert_close(weights.cpu(), p / p.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_route_ties_go_to_lower_ids(device):
    experts, weights, _ = moe_route_triton.route(torch.zeros(3, 8, device=device), 3, torch.float32)
    assert torch.equal(experts.cpu(), torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32))
    assert torch.equal(weights.cpu(), torch.full((3, 3), 1 / 3))


@pytest.mark.parametrize("device", DEVICES)
def test_route_rows_are_invariant_to_batch(device):
    num_experts, top_k = (8, 2) if device == "cpu" else (256, 8)
    logits = torch.randn(13, num_experts, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    experts, weights, _ = moe_route_triton.route(logits, top_k, torch.bfloat16)
    for i in (0, 6, 12):
        alone = moe_route_triton.route(logits[i : i + 1], top_k, torch.bfloat16)
        assert torch.equal(alone[0], experts[i : i + 1]) and torch.equal(alone[1], weights[i : i + 1])


@pytest.mark.parametrize("device", DEVICES)
def test_route_appends_the_shared_expert(device):
    num_experts, top_k = (8, 2) if device == "cpu" else (256, 8)
    logits = spaced_logits(6, num_experts, torch.bfloat16, device, seed=9, columns=num_experts + 1)
    experts, weights, _ = moe_route_triton.route(logits, top_k, torch.bfloat16)
    with_shared, same, _ = moe_route_triton.route(logits, top_k, torch.bfloat16, with_shared=True)
    assert with_shared.shape == (6, top_k + 1) and same.shape == (6, top_k)
    assert torch.equal(with_shared[:, :top_k], experts) and torch.equal(same, weights)
    assert torch.equal(with_shared[:, top_k].cpu(), torch.full((6,), num_experts, dtype=torch.int32))
    want, _ = moe_ref.route(logits.cpu(), top_k, torch.bfloat16, with_shared=True)
    assert torch.equal(with_shared.cpu().long(), want)


def direct_reference(experts, first, count):
    """(sorted_ids, block_expert) of one block per flat row: the row then padding, its held expert or count."""
    flat = experts.reshape(-1).long() - first
    rows = flat.numel()
    sorted_ids = torch.full((rows, moe_route_triton.BLOCK_M), rows, dtype=torch.int32)
    sorted_ids[:, 0] = torch.arange(rows)
    block_expert = torch.where((flat >= 0) & (flat < count), flat, count).to(torch.int32)
    return sorted_ids.flatten(), block_expert


@pytest.mark.parametrize("device", DEVICES)
def test_route_writes_direct_blocks(device):
    """Up to DIRECT_MAX_ROWS routed rows the route launch writes the direct layout; direct_blocks
    writes the same from given experts; above it route writes none and row_blocks aligns."""
    num_experts, top_k = (8, 2) if device == "cpu" else (256, 8)
    limit = moe_route_triton.DIRECT_MAX_ROWS
    cases = [  # (tokens, with_shared, first, count): count None = every expert (E, or E + 1 with the shared one)
        (1, False, 0, None),
        (1, True, 0, None),
        (limit // (top_k + 1), True, 0, None),  # the most tokens the direct layout takes with the shared expert
        (limit // top_k, False, num_experts // 2, num_experts // 2),  # exactly DIRECT_MAX_ROWS rows; a rank's half
    ]
    for seed, (n, shared, first, count) in enumerate(cases):
        logits = spaced_logits(n, num_experts, torch.bfloat16, device, seed)
        experts, weights, blocks = moe_route_triton.route(logits, top_k, torch.bfloat16, shared, first, count)
        count = num_experts + shared if count is None else count
        rows = n * (top_k + shared)
        assert blocks is not None and blocks[2:] == (rows, first, count), f"case {n, shared, first}: {blocks}"
        want_ids, want_experts = direct_reference(experts.cpu(), first, count)
        assert torch.equal(blocks.sorted_ids.cpu(), want_ids), f"case {n, shared, first}: row ids differ"
        assert torch.equal(blocks.block_expert.cpu(), want_experts), f"case {n, shared, first}: block experts differ"
        assert (want_experts == count).any() == (first > 0), "the expert-parallel case skips some rows, the others none"
        same, same_weights, _ = moe_route_triton.route(logits, top_k, torch.bfloat16, shared)
        assert torch.equal(same, experts) and torch.equal(same_weights, weights), "the layout changed the routing"
        for given in (experts, experts.long()):  # experts from elsewhere, int32 or int64
            direct = moe_route_triton.direct_blocks(given, first, count)
            assert direct[2:] == blocks[2:] and torch.equal(direct.sorted_ids, blocks.sorted_ids) and torch.equal(direct.block_expert, blocks.block_expert)
            assert torch.equal(moe_route_triton.row_blocks(given, first, count).sorted_ids, blocks.sorted_ids)
    n = limit // top_k + 1  # past the threshold
    logits = spaced_logits(n, num_experts, torch.bfloat16, device, seed=7)
    experts, _, blocks = moe_route_triton.route(logits, top_k, torch.bfloat16)
    assert blocks is None and not moe_route_triton.is_direct(n * top_k)
    aligned = moe_route_triton.row_blocks(experts, 0, num_experts)
    assert aligned.block_expert.shape[0] == moe_route_triton.max_blocks(num_experts, n * top_k)
    want_ids, want_blocks = align_reference(experts.cpu(), 0, num_experts, aligned.block_expert.shape[0])
    assert torch.equal(aligned.block_expert.cpu(), want_blocks) and torch.equal(aligned.sorted_ids[: want_ids.shape[0]].cpu(), want_ids)


def align_reference(experts, first, count, num_blocks):
    """(sorted_ids of the real blocks, block_expert [num_blocks]) by grouping expert by expert."""
    flat = experts.reshape(-1).long() - first
    rows = flat.numel()
    sorted_ids, block_expert = [], []
    for e in range(count):
        mine = (flat == e).nonzero().flatten().tolist()  # ascending
        blocks = -(-len(mine) // moe_route_triton.BLOCK_M)
        sorted_ids += mine + [rows] * (blocks * moe_route_triton.BLOCK_M - len(mine))
        block_expert += [e] * blocks
    block_expert += [count] * (num_blocks - len(block_expert))
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(block_expert, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_align_matches_grouping(device):
    num_experts, top_k = (8, 2) if device == "cpu" else (256, 8)
    gen = torch.Generator().manual_seed(2)
    many = moe_route_triton.BLOCK_T // top_k + 37  # more rows than one scan step
    cases = [
        (torch.randperm(num_experts, generator=gen)[:top_k][None], 0, num_experts),
        (torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(19)]), 0, num_experts),
        (torch.arange(top_k).repeat(40, 1), 0, num_experts),  # every token on the same experts: several blocks each
        (torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(many)]), 0, num_experts),
        (torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(many)]), num_experts // 2, num_experts // 2),
        (torch.arange(top_k).repeat(8200, 1), num_experts // 2, num_experts // 2),  # held by no row; > BLOCK_T surplus blocks
    ]
    for experts, first, count in cases:
        sorted_ids, block_expert, rows, *held = moe_route_triton.align(experts.to(torch.int32).to(device), first, count)
        want_ids, want_blocks = align_reference(experts, first, count, block_expert.shape[0])
        assert (rows, *held) == (experts.numel(), first, count)
        assert block_expert.shape[0] == moe_route_triton.max_blocks(count, experts.numel())
        assert torch.equal(block_expert.cpu(), want_blocks), f"{experts.shape}, first {first}: block experts differ"
        assert torch.equal(sorted_ids[: want_ids.shape[0]].cpu(), want_ids), f"{experts.shape}, first {first}: row ids differ"
