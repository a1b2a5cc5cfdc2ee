"""A sparse MoE block's routing and the row layout of its routed experts in Triton, with no host sync.

Nothing here reads device data on the host, so the whole block can be captured in a CUDA graph:
every buffer, grid size and layout choice follows from N (tokens), top_k, E (router experts) and C
(experts held by this rank). Routing is `route` after the merged router | shared-gate linear, or
(in the model) `moe_gate_triton.add_norm_route`, which fuses it with the residual add, the norm and
that linear; then the expert GEMMs (moe_triton) take the routed rows in the layout below (align
first above DIRECT_MAX_ROWS routed rows).

Layout (R = top_k, or top_k + 1 with the shared expert; T = N * R rows, flat row t = token * R + column).
The grouped GEMMs take the rows in blocks of BLOCK_M (`RowBlocks`): `sorted_ids` [blocks * BLOCK_M]
holds each block's flat row ids, T marking padding (masked in every load and store), and
`block_expert` [blocks] the held expert of the block's rows minus `first`, C for a block to skip
(its programs return at once). Which of two layouts is used follows from T alone (`is_direct`):
  direct    T <= DIRECT_MAX_ROWS (small decode and verify batches): one block per row, blocks = T.
            Block t holds row t (sorted_ids[t * BLOCK_M] = t, its other BLOCK_M - 1 entries T);
            block_expert[t] = the row's expert minus first if this rank holds it, else C. The route
            kernel writes it as it routes (given first and C), so no align launch; for experts from elsewhere
            `_direct_blocks_kernel` writes it (one program per token). With the shared expert stacked
            the blocks may be left unwritten (`moe_triton.GemmRoute`): each gate_up and down program then routes
            its own row from the router logits (`_routed_row`: `_top_k`, route's code). An expert chosen by several
            tokens (the stacked shared expert: by all) is read once per row, which is what bounds
            DIRECT_MAX_ROWS.
  aligned   T > DIRECT_MAX_ROWS: `_align_kernel`, one program per held expert, counts every held
            expert's rows (`tl.histogram` over the keys, BLOCK_T at a time), takes its first row
            block from the prefix of ceil(count / BLOCK_M), then writes in ascending t the flat ids
            of its rows (padding to its last block = T) and the expert of its blocks; the surplus
            blocks up to max_blocks = min(C, T) + T // BLOCK_M + 1 get C.

Kernels:
  route     `_route_kernel`, one program per token: softmax of the router logits in fp32, top_k by
            iterative max (ties to the lower expert id), weights renormalised in fp32 then rounded
            to x.dtype -> experts [N, R] int32 (column top_k = E, the shared expert, when R = top_k + 1),
            weights [N, top_k]; and the token's R direct blocks when T <= DIRECT_MAX_ROWS.
  align     `_align_kernel` (aligned layout only, above).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels import pdl

BLOCK_M = 16  # routed rows per GEMM tile (aligned layout: each expert's rows padded to a multiple of it)
# Up to this many routed rows (T = N * R) the direct layout: route writes the row blocks, no align launch.
# Measured on the H200 at the Qwen3.5-35B-A3B shape, stacked (R = 8 + 1; bench/moe_speed.py layouts):
# direct vs aligned (align included) 30 vs 35 us at 1 token, 43 vs 50 at 2, 62 vs 68 at 3, but 80 vs 77
# at 4 and 118 vs 109 at 7 tokens, where reading the shared expert (and repeats) once per row costs
# more than the align launch saves.
DIRECT_MAX_ROWS = 32
BLOCK_T = 1024  # routed rows scanned per step by the align kernel


@triton.jit
def _direct_blocks(sorted_ids_ptr, block_expert_ptr, rows, experts, mask, T, first, C, BLOCK_M: tl.constexpr):
    """The direct layout's blocks of the flat rows `rows` (global ids `experts`) where `mask`: block r
    holds row r and T (padding) after it; its expert is the local id, or C when not held."""
    local = experts - first
    local = tl.where((local >= 0) & (local < C), local, C)
    tl.store(block_expert_ptr + rows, local.to(tl.int32), mask=mask)
    col = tl.arange(0, BLOCK_M)
    ids = tl.where(col[None, :] == 0, rows[:, None], T)
    tl.store(sorted_ids_ptr + rows[:, None] * BLOCK_M + col[None, :], ids.to(tl.int32), mask=mask[:, None])


@triton.jit
def _top_k(logits, E, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's fp32 router logits [REP, BLOCK_E] (REP copies of the row; -inf past E) -> (ids
    [REP, TOP_K_POW2] int32, weights [REP, TOP_K_POW2] fp32 renormalised; slots past TOP_K 0), each row
    the same: softmax, then top_k by iterative max. Every reduction runs along a row, so with one copy
    per warp (REP = num_warps, `moe_triton.ROUTE_PER_WARP`) it stays inside the warp (shuffles, no barrier), and a
    row's sums take the same order as a one-warp launch's. (All eight picks in one tl.reduce with a
    bitonic top-8 merge measured slower in the 35B-A3B step: 2.346 against 2.332 ms,
    logs/variants-35b-topk-network-c5a2dae.jsonl.)"""
    cols = tl.arange(0, BLOCK_E)[None, :]
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    # One int64 key per expert, so that each pick is one reduction: a probability (>= +0) orders as its
    # fp32 bits, and the low word (BLOCK_E - 1 - id) makes the lowest id win among equal probabilities.
    # Padding (-1) never wins, even over probabilities that underflow to 0.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)
    key = tl.where(cols < E, key, -1)
    slots = tl.arange(0, TOP_K_POW2)[None, :]
    ids = tl.zeros((logits.shape[0], TOP_K_POW2), dtype=tl.int32)
    w = tl.zeros((logits.shape[0], TOP_K_POW2), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, 1)[:, None]
        e = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        ids = tl.where(slots == k, e, ids)
        w = tl.where(slots == k, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), w)
        key = tl.where(cols == e, -1, key)
    return ids, w / tl.sum(w, 1)[:, None]


@triton.jit
def _router_logits(logits_ptr, token, stride_l, E, BLOCK_E: tl.constexpr, REP: tl.constexpr):
    """Token `token`'s router logits as _top_k takes them: fp32 [REP, BLOCK_E], -inf past E."""
    cols = tl.arange(0, BLOCK_E)[None, :] + 0 * tl.arange(0, REP)[:, None]
    return tl.load(logits_ptr + token.to(tl.int64) * stride_l + cols, mask=cols < E, other=-float("inf")).to(tl.float32)


@triton.jit
def _store_routing(experts_ptr, weights_ptr, token, ids, w, E, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, ROW_K: tl.constexpr):
    """A token's experts row (the shared expert E in column TOP_K when ROW_K > TOP_K) and weights row,
    from _top_k's first copy of ids and w [REP, TOP_K_POW2]."""
    copy = tl.arange(0, ids.shape[0])[:, None]
    slots = tl.arange(0, TOP_K_POW2)[None, :] + 0 * copy
    mine = (copy == 0) & (slots < TOP_K)
    tl.store(experts_ptr + token * ROW_K + slots, ids, mask=mine)
    if ROW_K > TOP_K:  # the shared expert, held as expert E
        tl.store(experts_ptr + token * ROW_K + TOP_K, E)
    tl.store(weights_ptr + token * TOP_K + slots, w.to(weights_ptr.dtype.element_ty), mask=mine)


@triton.jit
def _route_token(
    logits, token, experts_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, E, T, first, C,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, ROW_K: tl.constexpr, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr,
):
    """Route one token from its fp32 router logits [REP, BLOCK_E] (_router_logits): softmax, top_k,
    renormalised weights, and its direct row blocks when DIRECT (module docstring, route)."""
    ids, w = _top_k(logits, E, TOP_K, TOP_K_POW2, BLOCK_E)
    _store_routing(experts_ptr, weights_ptr, token, ids, w, E, TOP_K, TOP_K_POW2, ROW_K)
    slots = tl.arange(0, TOP_K_POW2)
    if DIRECT:  # this token's row blocks of the direct layout
        ids = tl.max(ids, 0)  # its copies are equal
        _direct_blocks(sorted_ids_ptr, block_expert_ptr, token * ROW_K + slots, ids, slots < TOP_K, T, first, C, BLOCK_M)
        if ROW_K > TOP_K:
            _direct_blocks(sorted_ids_ptr, block_expert_ptr, token * ROW_K + TOP_K + slots, E + 0 * slots, slots == 0, T, first, C, BLOCK_M)


@triton.jit(do_not_specialize=["T"])
def _route_kernel(
    logits_ptr, experts_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    E, stride_lm, T, first, C,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, ROW_K: tl.constexpr,
    BLOCK_M: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    token = tl.program_id(0).to(tl.int64)
    logits = _router_logits(logits_ptr, token, stride_lm, E, BLOCK_E, 1)  # one warp
    _route_token(logits, token, experts_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, E, T, first, C, TOP_K, TOP_K_POW2, BLOCK_E, ROW_K, BLOCK_M, DIRECT)


@triton.jit(do_not_specialize=["T"])
def _direct_blocks_kernel(
    experts_ptr, sorted_ids_ptr, block_expert_ptr,
    T, first, C,
    ROW_K: tl.constexpr, ROW_K_POW2: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, ROW_K_POW2)
    rows = token * ROW_K + slots
    experts = tl.load(experts_ptr + rows, mask=slots < ROW_K, other=0)
    _direct_blocks(sorted_ids_ptr, block_expert_ptr, rows, experts, slots < ROW_K, T, first, C, BLOCK_M)


@triton.jit(do_not_specialize=["T", "num_blocks"])
def _align_kernel(
    experts_ptr, sorted_ids_ptr, block_expert_ptr,
    T, first, C, num_blocks,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)
    counts = tl.zeros((BLOCK_C,), dtype=tl.int32)  # rows per held expert
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs
        key = tl.load(experts_ptr + t, mask=t < T, other=-1).to(tl.int32) - first
        counts += tl.histogram(key, BLOCK_C, mask=(t < T) & (key >= 0) & (key < C))
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    mine = tl.arange(0, BLOCK_C) == e
    end_block = tl.sum(tl.where(mine, tl.cumsum(blocks, 0), 0), 0)
    first_block = end_block - tl.sum(tl.where(mine, blocks, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    base = first_block * BLOCK_M
    if count > 0:
        seen = 0
        for t0 in range(0, T, BLOCK_T):  # this expert's rows in ascending t
            t = t0 + offs
            hit = (tl.load(experts_ptr + t, mask=t < T, other=-1).to(tl.int32) - first == e).to(tl.int32)
            pos = base + seen + tl.cumsum(hit, 0) - hit
            tl.store(sorted_ids_ptr + pos, t, mask=hit != 0)
            seen += tl.sum(hit, 0)
    pad = base + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + pad, T + tl.zeros_like(pad), mask=pad < end_block * BLOCK_M)
    for b0 in range(first_block, end_block, BLOCK_T):
        b = b0 + offs
        tl.store(block_expert_ptr + b, e + tl.zeros_like(b), mask=b < end_block)
    for b0 in range(tl.sum(blocks, 0) + e * BLOCK_T, num_blocks, C * BLOCK_T):  # surplus blocks, shared out
        b = b0 + offs
        tl.store(block_expert_ptr + b, C + tl.zeros_like(b), mask=b < num_blocks)


@triton.jit
def _routed_row(logits_ptr, stride_l, row, E, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, ROW_K: tl.constexpr, REP: tl.constexpr):
    """Flat row `row` of the direct layout routed from its token's router logits (`moe_triton.GemmRoute`) ->
    (token, its expert: the slot's pick of `_top_k`, E for the shared expert's slot, ids, weights
    [REP, TOP_K_POW2])."""
    token = row // ROW_K
    slot = row % ROW_K
    ids, w = _top_k(_router_logits(logits_ptr, token, stride_l, E, BLOCK_E, REP), E, TOP_K, TOP_K_POW2, BLOCK_E)
    e = tl.max(tl.sum(tl.where(tl.arange(0, TOP_K_POW2)[None, :] == slot, ids, 0), 1), 0)  # its copies are equal
    return token, tl.where(slot < TOP_K, e, E), ids, w


class RowBlocks(NamedTuple):
    """The row blocks the grouped GEMMs run over (module docstring, Layout)."""

    sorted_ids: torch.Tensor  # [blocks * BLOCK_M] int32 flat row ids; `rows` = padding
    block_expert: torch.Tensor  # [blocks] int32 held expert minus `first`; `count` = skipped
    rows: int  # T, the routed rows they cover
    first: int  # the held experts are [first, first + count)
    count: int


def is_direct(rows: int) -> bool:
    """Whether `rows` routed rows take the direct layout (one block per row) rather than the aligned one."""
    return rows <= DIRECT_MAX_ROWS


def max_blocks(num_experts: int, rows: int) -> int:
    """Upper bound on the row blocks of `rows` routed rows over `num_experts` experts, aligned (host-side)."""
    return min(num_experts, rows) + rows // BLOCK_M + 1


def _direct_buffers(rows: int, first: int, count: int, device: torch.device) -> RowBlocks:
    sorted_ids = torch.empty((rows * BLOCK_M,), dtype=torch.int32, device=device)
    return RowBlocks(sorted_ids, torch.empty((rows,), dtype=torch.int32, device=device), rows, first, count)


class RouteOutputs(NamedTuple):
    """The buffers a routing launch (`route`, or the fused MoE entry) writes, and its arguments."""

    experts: torch.Tensor  # [N, R] int32
    weights: torch.Tensor  # [N, top_k] dtype
    blocks: RowBlocks | None  # the direct layout's row blocks (T <= DIRECT_MAX_ROWS), else None
    rows: int  # T = N * R
    count: int  # C: the held experts are [first, first + count)
    meta: dict  # `_route_token`'s constexprs: TOP_K, TOP_K_POW2, BLOCK_E, ROW_K, BLOCK_M, DIRECT

    @property
    def block_ptrs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted_ids, block_expert) as the kernels take them (unread stand-ins without direct blocks)."""
        return (self.blocks.sorted_ids, self.blocks.block_expert) if self.blocks else (self.experts, self.experts)


def route_outputs(n: int, num_experts: int, top_k: int, dtype: torch.dtype, with_shared: bool, first: int, count: int | None, device: torch.device,
                  direct_blocks: bool = True) -> RouteOutputs:
    """The outputs of routing n tokens over num_experts router experts, for the held experts
    [first, first + count) (default: all, E + with_shared); no direct row blocks unless direct_blocks
    (the routing launch then writes experts and weights only)."""
    row_k = top_k + int(with_shared)
    count = num_experts + int(with_shared) if count is None else count
    rows = n * row_k
    blocks = _direct_buffers(rows, first, count, device) if direct_blocks and is_direct(rows) else None
    meta = dict(TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts), ROW_K=row_k,
                BLOCK_M=BLOCK_M, DIRECT=blocks is not None)
    experts = torch.empty((n, row_k), dtype=torch.int32, device=device)
    return RouteOutputs(experts, torch.empty((n, top_k), dtype=dtype, device=device), blocks, rows, count, meta)


def route(
    logits: torch.Tensor,  # [N, E] router logits, unit column stride
    top_k: int,
    dtype: torch.dtype,
    with_shared: bool = False,
    first: int = 0,
    count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RowBlocks | None]:  # experts [N, top_k (+ 1)] int32, weights [N, top_k] dtype, blocks
    """Softmax in fp32, top_k (descending, ties to the lower id), weights renormalised then cast to dtype.
    with_shared: experts gets a column top_k = E, the shared expert held as one more expert.
    For T = N * (top_k + with_shared) <= DIRECT_MAX_ROWS the same launch writes the direct row blocks
    for the experts [first, first + count) (default: all, E + with_shared) and returns them; else None."""
    n, num_experts = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = route_outputs(n, num_experts, top_k, dtype, with_shared, first, count, logits.device)
    if n:
        _route_kernel[(n,)](
            logits, out.experts, out.weights, *out.block_ptrs,
            num_experts, logits.stride(0), out.rows, first, out.count, num_warps=1, **out.meta, **pdl.launch_kwargs(),
        )
    return out.experts, out.weights, out.blocks


def direct_blocks(experts: torch.Tensor, first: int, count: int) -> RowBlocks:
    """experts [N, R] global ids (contiguous) -> the direct layout: block t holds flat row t alone."""
    n, row_k = experts.shape
    blocks = _direct_buffers(n * row_k, first, count, experts.device)
    if n:
        _direct_blocks_kernel[(n,)](
            experts, blocks.sorted_ids, blocks.block_expert, n * row_k, first, count,
            ROW_K=row_k, ROW_K_POW2=triton.next_power_of_2(row_k), BLOCK_M=BLOCK_M, num_warps=1, **pdl.launch_kwargs(),
        )
    return blocks


def align(experts: torch.Tensor, first: int, count: int) -> RowBlocks:
    """experts [N, R] global ids (contiguous) -> the aligned layout: each held expert's rows in ascending
    flat id, padded to whole blocks. Only the rows of real blocks (block_expert < count) are written;
    the surplus blocks' rows are not read."""
    rows = experts.numel()
    nb = max_blocks(count, rows)
    sorted_ids = torch.empty((nb * BLOCK_M,), dtype=torch.int32, device=experts.device)
    block_expert = torch.empty((nb,), dtype=torch.int32, device=experts.device)
    _align_kernel[(count,)](
        experts, sorted_ids, block_expert, rows, first, count, nb,
        BLOCK_T=BLOCK_T, BLOCK_C=triton.next_power_of_2(count), BLOCK_M=BLOCK_M, num_warps=4, **pdl.launch_kwargs(),
    )
    return RowBlocks(sorted_ids, block_expert, rows, first, count)


def row_blocks(experts: torch.Tensor, first: int, count: int) -> RowBlocks:
    """experts [N, R] global ids (contiguous) -> their row blocks in the layout T = N * R calls for."""
    return direct_blocks(experts, first, count) if is_direct(experts.numel()) else align(experts, first, count)
