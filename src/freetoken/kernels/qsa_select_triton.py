"""QSA key-block scoring and top-k selection (Triton); the reference and the layouts are qsa_ref.py.

Two launches, shapes set by the row layout and the block table's width only (no host read of a
per-row value, so the pair can be captured in a CUDA graph):

1. `_score_kernel`, program (g, t): row group g (up to R = M // H_PAD consecutive rows of one
   sequence; the row at position pos takes tile pos % R of the dot's M = max(16, R * H_PAD) rows, so
   a row always sits in the same rows of the dot), key blocks t*BLOCK_B .. t*BLOCK_B + BLOCK_B - 1.
   It pools those blocks on the fly from the raw keys in the paged extra KV rows: the c raw keys
   summed in fp32 in index order and divided by c (IEEE division: the reference's bits), cast to the
   cache dtype, zero-centred RMS-normed in fp32 and cast, then rotated with the block's cos/sin
   table row, each rotation product rounded to the cache dtype alone before the sum (as torch
   rounds them). The partner channel of the rotation is pooled and normed from its own loads. One
   dot [M, d_i] x [d_i, BLOCK_B] gives every (row, head) score; relu, the sum over the row's heads,
   the division by sqrt(d_i) and the int32 key of qsa_ref.score_keys follow. Keys are stored for the
   rows that select (more complete blocks than top_blocks) and their complete blocks only, into a
   workspace [rows, max_blocks]. A row's keys depend on its own q and the blocks only.
2. `_select_kernel`, one program per row: a row with at most top_blocks complete blocks keeps them
   all; another finds the top_blocks-th largest key T by a radix select, four passes over its keys
   (keys are >= 0): pass i counts, in a 256-bin histogram, digit i (bits 24 - 8i .. 31 - 8i) of the
   keys whose higher digits equal T's found so far, and T's digit i is the largest digit
   with at least as many such keys at or above it as are still to be kept. A last pass keeps, in
   ascending block order, the blocks with key > T and the lowest-index blocks with key == T until
   top_blocks are kept (qsa_ref's tie order). The counts are integers, so T is exact.

The pooled keys differ from the reference's only through the norm's sum of squares (its order) and
the dot's summation order, so a score can differ in its last bits; a selection then differs only
where two blocks' scores are that close at the top_blocks-th place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl
from freetoken.kernels.batched import SeqBatch
from freetoken.kernels.compat_triton import INTERPRET

BLOCK_B = 32  # key blocks per score program
SELECT_CHUNK = 1024  # keys a select program reads per step
RADIX = tl.constexpr(256)  # bins of one radix-select digit (8 bits)
WORKSPACE_BYTES = 64 << 20  # score keys of one launch; more rows go in several launches
NUM_WARPS = 4


@triton.jit
def _score_kernel(
    q_ptr, raw_ptr, w_ptr, cos_ptr, sin_ptr, key_ptr,
    group_ptr, row_seq_ptr, ctx_len_ptr, table_ptr,
    H, D, eps, sqrt_d, page_size, top_blocks, max_blocks, row0,
    q_row, q_head, raw_slot, rope_seq, rope_block, table_row,
    RATIO: tl.constexpr, ROT: tl.constexpr, R: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    g = tl.program_id(0)
    t = tl.program_id(1)
    first = tl.load(group_ptr + 2 * g).to(tl.int64)
    count = tl.load(group_ptr + 2 * g + 1)
    pos0 = tl.load(ctx_len_ptr + first) - 1
    tiles = tl.arange(0, R)
    j = (tiles + R - pos0 % R) % R  # [R]: the group's row in each tile
    mr = j < count
    rows = first + j
    complete = tl.load(ctx_len_ptr + rows, mask=mr, other=0) // RATIO  # [R]
    selecting = mr & (complete > top_blocks)
    group_complete = tl.max(tl.where(selecting, complete, 0), axis=0)
    b0 = t * BLOCK_B
    if b0 < group_complete:
        seq = tl.load(row_seq_ptr + first).to(tl.int64)
        bs = b0 + tl.arange(0, BLOCK_B)
        mb = bs < group_complete
        ds = tl.arange(0, D_PAD)
        md = ds < D
        half = ROT // 2
        partner = tl.where(ds < half, ds + half, tl.where(ds < ROT, ds - half, ds))
        acc = tl.zeros((BLOCK_B, D_PAD), dtype=tl.float32)
        acc_p = tl.zeros((BLOCK_B, D_PAD), dtype=tl.float32)
        for jj in tl.static_range(RATIO):
            pos = bs * RATIO + jj
            page = tl.load(table_ptr + seq * table_row + pos // page_size, mask=mb, other=0).to(tl.int64)
            slot = page * page_size + pos % page_size
            m2 = mb[:, None] & md[None, :]
            x = tl.load(raw_ptr + slot[:, None] * raw_slot + ds[None, :], mask=m2, other=0.0).to(tl.float32)
            xp = tl.load(raw_ptr + slot[:, None] * raw_slot + partner[None, :], mask=m2, other=0.0).to(tl.float32)
            if jj == 0:
                acc, acc_p = x, xp
            else:
                acc, acc_p = acc + x, acc_p + xp
        raw_dtype = raw_ptr.dtype.element_ty
        mean = tl.div_rn(acc, tl.full(acc.shape, RATIO, tl.float32)).to(raw_dtype).to(tl.float32)
        mean_p = tl.div_rn(acc_p, tl.full(acc.shape, RATIO, tl.float32)).to(raw_dtype).to(tl.float32)
        ms = tl.div_rn(tl.sum(mean * mean, axis=1), tl.full((BLOCK_B,), D, tl.float32)) + eps
        rstd = tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms))[:, None]
        w = tl.load(w_ptr + ds, mask=md, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=md, other=0.0).to(tl.float32)
        y = (mean * rstd * (1.0 + w[None, :])).to(raw_dtype).to(tl.float32)
        yp = (mean_p * rstd * (1.0 + wp[None, :])).to(raw_dtype).to(tl.float32)
        yp = tl.where((ds < half)[None, :], -yp, yp)  # rotate_half: [-x2, x1]
        mrot = mb[:, None] & (ds < ROT)[None, :]
        rope_at = seq * rope_seq + bs[:, None] * rope_block + ds[None, :]
        cos = tl.load(cos_ptr + rope_at, mask=mrot, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + rope_at, mask=mrot, other=0.0).to(tl.float32)
        a = compat_triton.mul_rn(y, cos).to(raw_dtype).to(tl.float32)  # each product rounded alone, as torch
        b = compat_triton.mul_rn(yp, sin).to(raw_dtype).to(tl.float32)
        k = tl.where((ds < ROT)[None, :], (a + b).to(raw_dtype), y.to(raw_dtype))  # [BLOCK_B, D_PAD]
        es = tl.arange(0, R * H_PAD)
        e_rows = first + (es // H_PAD + R - pos0 % R) % R
        me = ((es // H_PAD + R - pos0 % R) % R < count) & (es % H_PAD < H)
        q = tl.load(q_ptr + e_rows[:, None] * q_row + (es % H_PAD)[:, None] * q_head + ds[None, :], mask=me[:, None] & md[None, :], other=0.0)
        if DOT_F32:
            q, k = q.to(tl.float32), k.to(tl.float32)
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)  # [R * H_PAD, BLOCK_B]
        total = tl.sum(tl.reshape(s, (R, H_PAD, BLOCK_B)), axis=1)  # [R, BLOCK_B]
        score = tl.div_rn(total, tl.full(total.shape, sqrt_d, tl.float32))
        keys = score.to(tl.int32, bitcast=True)
        keys = tl.where(keys == -2147483648, 0, keys)  # -0.0 -> +0.0
        store = selecting[:, None] & (bs[None, :] < complete[:, None])
        tl.store(key_ptr + (rows - row0)[:, None] * max_blocks + bs[None, :], keys, mask=store)


@triton.jit
def _select_kernel(
    key_ptr, ids_ptr, count_ptr, ctx_len_ptr,
    top_blocks, max_blocks, row0, ids_row,
    RATIO: tl.constexpr, TOP_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    r = row0 + tl.program_id(0).to(tl.int64)
    complete = tl.load(ctx_len_ptr + r) // RATIO
    keep = tl.minimum(complete, top_blocks)
    tl.store(count_ptr + r, keep)
    cols = tl.arange(0, TOP_PAD)
    if complete <= top_blocks:
        tl.store(ids_ptr + r * ids_row + cols, tl.where(cols < complete, cols, -1), mask=cols < top_blocks)
    else:
        row_keys = key_ptr + (r - row0) * max_blocks
        offs = tl.arange(0, CHUNK)
        digits = tl.arange(0, RADIX)
        threshold = 0  # the keep-th largest key, its digits found from the top
        decided = 0  # the mask of its digits found so far
        ties_kept = keep  # of the keys that share the decided digits, how many are kept
        for level in tl.static_range(4):
            shift = 24 - 8 * level
            hist = tl.zeros((RADIX,), dtype=tl.int32)
            for c0 in range(0, complete, CHUNK):
                k = tl.load(row_keys + c0 + offs, mask=c0 + offs < complete, other=-1)
                match = (c0 + offs < complete) & ((k & decided) == threshold)
                hist += tl.histogram((k >> shift) & (RADIX - 1), RADIX, mask=match)
            at_or_above = tl.cumsum(hist, axis=0, reverse=True)  # [RADIX]: matching keys with this digit or a larger one
            digit = tl.max(tl.where(at_or_above >= ties_kept, digits, 0), axis=0)
            ties_kept -= tl.sum(tl.where(digits > digit, hist, 0), axis=0)
            threshold = threshold | (digit << shift)
            decided = decided | (((RADIX - 1) << shift) & 0x7FFFFFFF)
        kept = 0
        ties_seen = 0
        for c0 in range(0, complete, CHUNK):
            k = tl.load(row_keys + c0 + offs, mask=c0 + offs < complete, other=-1)
            tie = (k == threshold).to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie  # ties before this block
            chosen = ((k > threshold) | ((tie == 1) & (tie_rank < ties_kept))).to(tl.int32)
            at = kept + tl.cumsum(chosen, axis=0) - chosen
            tl.store(ids_ptr + r * ids_row + at, c0 + offs, mask=chosen == 1)
            kept += tl.sum(chosen, axis=0)
            ties_seen += tl.sum(tie, axis=0)


def qsa_select(
    q: torch.Tensor,  # [N, H, d_i]
    raw_keys: torch.Tensor,  # [num_slots, d_i] or [num_slots, 1, d_i]
    k_norm_weight: torch.Tensor,  # [d_i]
    eps: float,
    block_cos: torch.Tensor,  # [S or 1, max_blocks, rotary_dim]
    block_sin: torch.Tensor,  # [S or 1, max_blocks, rotary_dim]
    batch: SeqBatch,
    page_size: int,
    ratio: int,
    top_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As qsa_ref.qsa_select: (block ids [N, top_blocks] int32 ascending, -1 padded; counts [N] int32)."""
    n, num_heads, d = q.shape
    raw = raw_keys.reshape(raw_keys.shape[0], -1)
    assert raw.shape[1] == d and raw.stride(1) == 1 and block_cos.stride() == block_sin.stride() and block_cos.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    ids = torch.empty((n, top_blocks), dtype=torch.int32, device=q.device)
    counts = torch.empty(n, dtype=torch.int32, device=q.device)
    if n == 0:
        return ids, counts
    table = batch.block_table
    max_blocks = table.shape[1] * page_size // ratio
    assert block_cos.shape[1] >= max_blocks, "a cos/sin row for every block the block table can hold"
    h_pad = triton.next_power_of_2(num_heads)
    per_group = max(1, 16 // h_pad)
    sizes, groups = batch.row_groups(per_group)
    rows_per_launch = max(per_group, WORKSPACE_BYTES // (4 * max(max_blocks, 1)))
    keys = torch.empty((min(n, rows_per_launch), max(max_blocks, 1)), dtype=torch.int32, device=q.device)
    rope_seq = block_cos.stride(0) if block_cos.shape[0] > 1 else 0
    for g0, g1, r0, r1 in _launches(sizes, rows_per_launch):
        _score_kernel[(g1 - g0, triton.cdiv(max(max_blocks, 1), BLOCK_B))](
            q, raw, k_norm_weight, block_cos, block_sin, keys, groups[g0:], batch.row_seq, batch.context_lens, table,
            num_heads, d, eps, d**0.5, page_size, top_blocks, max_blocks, r0,
            q.stride(0), q.stride(1), raw.stride(0), rope_seq, block_cos.stride(1), table.stride(0),
            RATIO=ratio, ROT=block_cos.shape[-1], R=per_group, H_PAD=h_pad, D_PAD=max(16, triton.next_power_of_2(d)),
            BLOCK_B=BLOCK_B, DOT_F32=INTERPRET, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
        _select_kernel[(r1 - r0,)](
            keys, ids, counts, batch.context_lens, top_blocks, max_blocks, r0, ids.stride(0),
            RATIO=ratio, TOP_PAD=triton.next_power_of_2(top_blocks), CHUNK=SELECT_CHUNK, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
    return ids, counts


def _launches(sizes: tuple[int, ...], max_rows: int):
    """Runs of whole row groups of at most max_rows rows (one group if it alone is larger) ->
    (first group, end group, first row, end row)."""
    g0 = r0 = 0
    while g0 < len(sizes):
        g1, r1 = g0 + 1, r0 + sizes[g0]
        while g1 < len(sizes) and r1 + sizes[g1] - r0 <= max_rows:
            r1 += sizes[g1]
            g1 += 1
        yield g0, g1, r0, r1
        g0, r0 = g1, r1
