"""QSA's Triton selection and sparse attention vs the torch reference (kernels/qsa_ref.py): equal
selections, attention (with its sigmoid output gate) within fp32 rounding, the documented tie order
on a hand case, and each row alone (a decode step) equal, bit for bit, to the same row in a batch (a
verify block, a prefill chunk, next to other sequences); through the model's Indexer too (Triton
path = torch path)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

from freetoken.kernels import activation_ref, qsa_attention_triton, qsa_ref, qsa_select_triton  # noqa: E402
from freetoken.kernels.attention_ref import token_slots  # noqa: E402
from freetoken.kernels.batched import SeqBatch  # noqa: E402

PAGE = 4  # KV page size in tokens
RATIO = 4  # tokens per key block


def case(device):
    """Per sequence (rows, cached tokens): a prefill that turns sparse at its 24th row (CPU), a decode row,
    a verify block of 4 rows, a chunk after a cached prefix; dims (indexer heads, d_i, rotary dim, q
    heads, KV heads, head dim, kept blocks)."""
    if device == "cpu":
        return [26, 1, 4, 5], [0, 130, 23, 37], (2, 32, 16, 4, 2, 32, 5)
    return [300, 1, 4, 4], [0, 3000, 2047, 517], (4, 128, 64, 24, 2, 256, 64)


def setup(device, dtype, num_rows, num_cached, dims, seed=0):
    """Random raw indexer keys, K/V caches, queries and cos/sin tables over shuffled page tables."""
    heads, d, rot, hq, hkv, hd, _ = dims
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(c + n) // PAGE) for c, n in zip(num_cached, num_rows)]
    perm = torch.randperm(sum(pages) + 3, generator=gen)
    tables, used = [], 0
    for p in pages:
        tables.append(perm[used : used + p].to(torch.int32).to(device))
        used += p
    num_slots = (sum(pages) + 3) * PAGE
    n = sum(num_rows)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    batch = SeqBatch(tuple(starts), tuple(num_rows), tuple(num_cached), (-1,) * len(num_rows), tuple(tables), torch.device(device))
    max_blocks = batch.block_table.shape[1] * PAGE // RATIO
    angles = torch.arange(max_blocks)[:, None] * RATIO * (1e4 ** -(torch.arange(rot // 2) / (rot // 2)))[None, :]
    angles = torch.cat([angles, angles], -1)[None]
    return dict(q=rand(n, heads, d), raw_keys=rand(num_slots, 1, d), k_norm_weight=rand(d, scale=0.1), eps=1e-6,
                block_cos=angles.cos().to(dtype).to(device), block_sin=angles.sin().to(dtype).to(device), batch=batch,
                page_size=PAGE, ratio=RATIO, top_blocks=dims[-1]), (rand(n, hq, hd), rand(num_slots, hkv, hd), rand(num_slots, hkv, hd))


@pytest.fixture(params=["shipped", "small"])
def tiles(request, monkeypatch):
    """The shipped tile sizes, and (CPU contexts are short) small ones, so a row's blocks span several
    score programs and select steps, and its key list several partitions and merge steps (kernel and
    reference alike: the partition is qsa_ref's; a GPU dot needs 16 keys at least)."""
    if request.param == "small":
        monkeypatch.setattr(qsa_select_triton, "BLOCK_B", 16)
        monkeypatch.setattr(qsa_select_triton, "SELECT_CHUNK", 8)
        monkeypatch.setattr(qsa_ref, "PARTITION", 8 if INTERPRET else 16)
        monkeypatch.setattr(qsa_ref, "MERGE_PARTS", 2)
    return request.param


def attention(impl, qkv, ids, counts, batch, gate=None):
    q, k_cache, v_cache = qkv
    return impl.qsa_attention(q, k_cache, v_cache, ids, counts, batch, PAGE, RATIO, q.shape[-1] ** -0.5, gate)


def output_gate(q: torch.Tensor, seed: int) -> torch.Tensor:
    """A gate [N, Hq, D] laid out as the model's: the second half of each head's [query | gate] projection."""
    gen = torch.Generator().manual_seed(seed)
    q_gate = (2 * torch.randn(*q.shape[:2], 2 * q.shape[2], generator=gen)).to(q.dtype).to(q.device)
    return q_gate[..., q.shape[2] :]


def alone(args, row, seq, j):
    """The select arguments of one row as a decode step of its own sequence."""
    b = args["batch"]
    one = SeqBatch((0,), (1,), (b.num_cached[seq] + j,), (-1,), (b.block_tables[seq],), b.device)
    return dict(args, q=args["q"][row : row + 1], batch=one)


def reference_scores(args, row: int) -> torch.Tensor:
    """The reference's scores [complete blocks] of one row (qsa_ref's steps for one row)."""
    batch, ratio = args["batch"], args["ratio"]
    seq = max(i for i in range(batch.num_seqs) if batch.row_starts[i] <= row)
    visible = batch.num_cached[seq] + row - batch.row_starts[seq] + 1
    slots = token_slots(batch.block_tables[seq], visible, args["page_size"])
    blocks = qsa_ref.pooled_blocks(args["raw_keys"], slots, visible // ratio, ratio, args["k_norm_weight"], args["eps"], args["block_cos"][0], args["block_sin"][0])
    return torch.relu(args["q"][row].float() @ blocks.float().T).sum(0) / args["q"].shape[-1] ** 0.5


def assert_equal_but_for_rounding_ties(ids: torch.Tensor, want_ids: torch.Tensor, args) -> None:
    """On the GPU the pooled keys' norm (sum order, rsqrt) and the dots round apart from torch's, so two
    blocks whose scores are that close at the cut may swap: every block only one side keeps must score
    within 1e-3 (relative) of the reference's lowest kept score."""
    for row in torch.nonzero((ids != want_ids).any(1)).flatten().tolist():
        scores = reference_scores(args, row)
        cut = scores[want_ids[row].long()].min()
        swapped = set(ids[row].tolist()) ^ set(want_ids[row].tolist())
        assert all(abs(scores[b] - cut) <= 1e-3 * cut + 1e-6 for b in swapped), (row, swapped)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_and_attention_match_reference(device, dtype, tiles):
    num_rows, num_cached, dims = case(device)
    args, qkv = setup(device, dtype, num_rows, num_cached, dims)
    ids, counts = qsa_select_triton.qsa_select(**args)
    want_ids, want_counts = qsa_ref.qsa_select(**args)
    assert torch.equal(counts, want_counts)
    if device == "cpu":
        assert torch.equal(ids, want_ids)
    else:
        assert_equal_but_for_rounding_ties(ids, want_ids, args)
    assert (counts < torch.tensor([c // RATIO for c in args["batch"].context_lens.tolist()], device=device)).any(), "some rows select"
    gate = output_gate(qkv[0], 5)
    got = attention(qsa_attention_triton, qkv, ids, counts, args["batch"], gate)
    want = attention(qsa_ref, qkv, ids, counts, args["batch"], gate)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_batch(device, dtype, tiles):
    if device == "cpu" and tiles == "shipped":
        pytest.skip("CPU contexts fit one step of the shipped tiles; the small tiles cover the steps")
    num_rows, num_cached, dims = case(device)
    args, qkv = setup(device, dtype, num_rows, num_cached, dims, seed=1)
    batch = args["batch"]
    ids, counts = qsa_select_triton.qsa_select(**args)
    gate = output_gate(qkv[0], 6)
    full = attention(qsa_attention_triton, qkv, ids, counts, batch, gate)
    for seq in range(batch.num_seqs):
        for j in sorted({0, batch.num_rows[seq] - 1} if device == "cpu" else range(batch.num_rows[seq])):
            row = batch.row_starts[seq] + j
            one = alone(args, row, seq, j)
            one_ids, one_counts = qsa_select_triton.qsa_select(**one)
            assert torch.equal(one_ids[0], ids[row]) and torch.equal(one_counts[0], counts[row]), (seq, j)
            out = attention(qsa_attention_triton, (qkv[0][row : row + 1], *qkv[1:]), one_ids, one_counts, one["batch"], gate[row : row + 1])
            assert torch.equal(out[0], full[row]), (seq, j)


@pytest.mark.parametrize("device", DEVICES)
def test_launches_split_by_whole_row_groups(device, monkeypatch):
    # A select workspace below one row's (a launch per row group) and an attention workspace of 7 rows
    # (launches that cut sequences apart): the same bits.
    num_rows, num_cached, dims = case(device)
    args, qkv = setup(device, torch.bfloat16, num_rows, num_cached, dims, seed=2)
    whole = qsa_select_triton.qsa_select(**args)
    whole_out = attention(qsa_attention_triton, qkv, *whole, args["batch"])
    monkeypatch.setattr(qsa_select_triton, "WORKSPACE_BYTES", 1)
    q, top_blocks = qkv[0], args["top_blocks"]
    parts = -(-(top_blocks * RATIO + RATIO - 1) // qsa_ref.PARTITION)
    monkeypatch.setattr(qsa_attention_triton, "WORKSPACE_BYTES", 7 * q.shape[1] * parts * (q.shape[2] + 2) * 4)
    split = qsa_select_triton.qsa_select(**args)
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
    assert torch.equal(attention(qsa_attention_triton, qkv, *split, args["batch"]), whole_out)


@pytest.mark.parametrize("device", DEVICES)
def test_equal_scores_keep_the_lowest_blocks(device):
    """Blocks of three kinds, every raw key of a block the same integer vector (so its mean is exact)
    and no rotation: the kinds score high > mid > low = 0 for a one-hot query, and blocks of one kind
    score exactly alike. Two blocks are kept: the lowest-index high ones, or the high one and the
    lowest-index mid one; a zero query scores every block 0 and keeps blocks 0 and 1."""
    d = 16
    kinds = {"high": [4.0] + [1.0] * (d - 1), "mid": [2.0] + [1.0] * (d - 1), "low": [-1.0] + [1.0] * (d - 1)}
    layouts = [["mid", "high", "low", "high", "mid", "high"], ["mid", "low", "mid", "high", "mid", "low"], ["mid", "high", "low", "high", "mid", "high"]]
    raw_keys = torch.zeros(len(layouts) * 7 * PAGE, 1, d, device=device)
    tables = []
    for i, layout in enumerate(layouts):
        first = i * 7 * PAGE  # seven pages per sequence
        for b, kind in enumerate(layout):
            raw_keys[first + b * RATIO : first + (b + 1) * RATIO, 0] = torch.tensor(kinds[kind], device=device)
        raw_keys[first + 24] = 3.0  # the tail token of the longest row (unused by the scores)
        tables.append(torch.arange(first // PAGE, first // PAGE + 7, dtype=torch.int32, device=device))
    q = torch.zeros(3, 1, d, device=device)
    q[:2, 0, 0] = 1.0
    batch = SeqBatch((0, 1, 2), (1, 1, 1), (24, 23, 23), (-1,) * 3, tuple(tables), torch.device(device))
    no_rotation = torch.ones(1, 7, 8, device=device), torch.zeros(1, 7, 8, device=device)
    args = dict(q=q, raw_keys=raw_keys, k_norm_weight=torch.zeros(d, device=device), eps=1e-6, block_cos=no_rotation[0], block_sin=no_rotation[1],
                batch=batch, page_size=PAGE, ratio=RATIO, top_blocks=2)
    for impl in (qsa_ref, qsa_select_triton):
        ids, counts = impl.qsa_select(**args)
        assert ids.tolist() == [[1, 3], [0, 3], [0, 1]] and counts.tolist() == [2, 2, 2], impl.__name__


@pytest.mark.parametrize("device", DEVICES)
def test_attention_hand_case(device):
    """One query over kept block 1 (keys at positions 4..7, score 0) and the tail position 8 (score
    log 4): weights 1/8 each and 1/2 over values 4 and 8 -> 6. Blocks 0 and the rest are not attended."""
    k_cache = torch.zeros(12, 1, 16, device=device)
    v_cache = torch.full((12, 1, 16), 100.0, device=device)
    v_cache[4:8] = 4.0
    k_cache[8, 0, 0] = torch.log(torch.tensor(4.0))
    v_cache[8] = 8.0
    q = torch.zeros(1, 1, 16, device=device)
    q[0, 0, 0] = 1.0
    batch = SeqBatch((0,), (1,), (8,), (-1,), (torch.arange(3, dtype=torch.int32, device=device),), torch.device(device))
    ids, counts = torch.tensor([[1, -1]], dtype=torch.int32, device=device), torch.tensor([1], dtype=torch.int32, device=device)
    for impl in (qsa_ref, qsa_attention_triton):
        out = impl.qsa_attention(q, k_cache, v_cache, ids, counts, batch, PAGE, RATIO, 1.0)
        torch.testing.assert_close(out, torch.full((1, 1, 16), 6.0, device=device), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_model_indexer_triton_path_equals_torch_path(device, dtype, monkeypatch):
    """The qwen4_exp Indexer (its projections, norms, per-forward block cos/sin with an image prompt's
    mRoPE positions, kernels.qsa_select) keeps the same key positions on both paths."""
    from freetoken import kernels
    from tests.models.test_qwen4_exp_qsa import indexer_case

    if device == "cuda" and dtype == torch.bfloat16:
        pytest.skip("the GPU's Triton and torch projections may round q apart by a bf16 ulp, enough to swap two close blocks")
    indexer, x, ctx, cos, sin = indexer_case(dtype, device)
    selections = {}
    for mode in ("torch", "triton"):
        monkeypatch.setattr(kernels, "MODE", mode)
        ctx.__dict__.pop("_qsa_block_rope", None)
        selections[mode] = indexer(x, ctx)
    assert torch.equal(selections["triton"].counts, selections["torch"].counts)
    assert torch.equal(selections["triton"].block_ids, selections["torch"].block_ids)


@pytest.mark.skipif(not INTERPRET, reason="counts the interpreter's launches")
@torch.no_grad()
def test_model_indexer_is_four_launches(monkeypatch):
    """On the Triton path an Indexer step (its block cos/sin already built for the forward) is its
    projection, the query norm + RoPE + raw key store, scoring and selection; no torch op computes."""
    from freetoken import kernels
    from tests.kernels.test_hc_triton import _Launches
    from tests.models.test_qwen4_exp_qsa import indexer_case

    monkeypatch.setattr(kernels, "MODE", "triton")
    indexer, x, ctx, _, _ = indexer_case(torch.float32)
    indexer(x, ctx)  # builds the forward's block cos/sin and sizes the linear's workspace
    with _Launches(monkeypatch) as launches:
        indexer(x, ctx)
    assert launches.kernels == ["_linear_kernel", "_norm_rope_kernel", "_score_kernel", "_select_kernel"]
    assert launches.torch_ops == []


@pytest.mark.parametrize("device", DEVICES)
def test_radix_select_keeps_the_sorted_order_on_crafted_keys(device):
    """The select kernel alone on key rows built to stress each radix digit: keys equal but for their
    lowest digit, or for their highest, only a few values (many ties at the cut), all equal, all zero,
    and random ones; it keeps exactly qsa_ref.top_blocks_of's blocks (larger key first, on equal keys
    the lower block), over several select steps."""
    gen = torch.Generator().manual_seed(3)
    complete, keep, chunk = 40, 7, 16
    rows = [
        0x3F000000 + torch.randint(0, 256, (complete,), generator=gen),  # the lowest digit decides
        (torch.randint(0, 128, (complete,), generator=gen) << 24) + 0x00123456,  # the highest digit decides
        torch.tensor([0x3F800000, 0x3F800001, 0x3F810000, 0x40000000])[torch.randint(0, 4, (complete,), generator=gen)],  # ties at the cut
        torch.full((complete,), 0x3F800000),
        torch.zeros(complete, dtype=torch.int64),
        torch.randint(0, 2**31 - 1, (complete,), generator=gen),
    ]
    keys = torch.stack(rows).to(torch.int32).to(device)
    n = keys.shape[0]
    ids = torch.full((n, keep), -2, dtype=torch.int32, device=device)
    counts = torch.empty(n, dtype=torch.int32, device=device)
    ctx_lens = torch.full((n,), complete * RATIO + 1, dtype=torch.int32, device=device)
    qsa_select_triton._select_kernel[(n,)](keys, ids, counts, ctx_lens, keep, complete, 0, ids.stride(0),
                                           RATIO=RATIO, TOP_PAD=8, CHUNK=chunk, PDL=False)
    for r in range(n):
        assert ids[r].tolist() == qsa_ref.top_blocks_of(keys[r].cpu(), keep).tolist(), r
    assert counts.tolist() == [keep] * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_gate_is_the_product_it_replaced(dtype):
    """qsa_ref's gated output equals, bit for bit, the ungated output times activation_ref's sigmoid of
    the gate, the product in the output dtype (the multiply that followed the attention in qsa.py)."""
    num_rows, num_cached, dims = case("cpu")
    args, qkv = setup("cpu", dtype, num_rows, num_cached, dims, seed=7)
    ids, counts = qsa_ref.qsa_select(**args)
    gate = output_gate(qkv[0], 8)
    plain = attention(qsa_ref, qkv, ids, counts, args["batch"])
    n = plain.shape[0]
    want = plain * activation_ref.sigmoid(gate.reshape(n, -1)).view_as(gate)
    assert torch.equal(attention(qsa_ref, qkv, ids, counts, args["batch"], gate), want)


def test_reference_attention_equals_one_softmax_over_the_key_list(monkeypatch):
    """qsa_ref's partitioned attention (several partitions and merge steps) in fp32 against one softmax
    over each row's attended positions (qsa_ref.selected_positions)."""
    monkeypatch.setattr(qsa_ref, "PARTITION", 4)
    monkeypatch.setattr(qsa_ref, "MERGE_PARTS", 2)
    num_rows, num_cached, dims = case("cpu")
    args, (q, k_cache, v_cache) = setup("cpu", torch.float32, num_rows, num_cached, dims, seed=4)
    ids, counts = qsa_ref.qsa_select(**args)
    batch, scale = args["batch"], q.shape[-1] ** -0.5
    got = attention(qsa_ref, (q, k_cache, v_cache), ids, counts, batch)
    group = q.shape[1] // k_cache.shape[1]
    for seq in range(batch.num_seqs):
        slots = token_slots(batch.block_tables[seq], batch.num_cached[seq] + batch.num_rows[seq], PAGE)
        for j in range(batch.num_rows[seq]):
            row = batch.row_starts[seq] + j
            at = slots[qsa_ref.selected_positions(ids[row], int(counts[row]), batch.num_cached[seq] + j + 1, RATIO)]
            keys, values = (c[at].repeat_interleave(group, dim=1).transpose(0, 1) for c in (k_cache, v_cache))  # [Hq, L, D]
            probs = torch.softmax((keys @ q[row][:, :, None]).squeeze(-1) * scale, dim=-1)
            torch.testing.assert_close(got[row], (probs[:, None, :] @ values).squeeze(1), rtol=1e-5, atol=1e-6)
