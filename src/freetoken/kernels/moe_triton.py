"""A sparse MoE block's routed experts in Triton, with no host sync: the grouped expert GEMMs and the combine.

Nothing here reads device data on the host, so the whole block can be captured in a CUDA graph:
every buffer, grid size and layout choice follows from N (tokens), top_k, E (router experts) and C
(experts held by this rank). Routing is `moe_route_triton.route` after the merged router | shared-gate linear, or
(in the model) `moe_gate_triton.add_norm_route`, which fuses it with the residual add, the norm and
that linear; then gate_up and down, which combines up to COMBINE_IN_DOWN_MAX_TOKENS tokens (above
that a combine launch; align too above moe_route_triton.DIRECT_MAX_ROWS routed rows). When
the block holds its shared expert as expert E of the stacked weights [E + 1, ...]
(`moe_experts_with_shared`), the shared expert is one more routed row of every token and needs no
launches of its own; otherwise (`moe_experts`) it runs as a dense MLP before the combine.

The grouped GEMMs take the rows in blocks of BLOCK_M (`RowBlocks`), in the direct or the aligned
layout (R, T, BLOCK_M and both layouts: moe_route_triton's docstring, Layout).
The GEMM tiles are transposed, [features, rows]: the weight tile is the dot's left operand, so on
sm_90 the dot is a wgmma reading the weights from shared memory (with the rows on the left it is an
mma.sync fed through ldmatrix, whose waits ncu showed stalling the decode GEMMs). A row's result
has the same bits in either layout and at any position in its block: a column of a tl.dot output
depends only on the left operand and that column of the right one, and both layouts run the same
kernels with the same tiles. (Not so under TRITON_INTERPRET: there tl.dot is NumPy's sgemm, which
can round a tile's later rows differently; the first row of a tile agrees.)

Kernels:
  gate_up   `_gate_up_kernel`: per (row block, feature tile of I) the gate and up tiles of that
            block's expert, then silu(gate) * up -> hidden [blocks * BLOCK_M, I], with the roundings
            of the dense MLP (linear to x.dtype, silu to x.dtype, product to x.dtype).
  down      `_down_kernel`: hidden @ down[e]^T -> out [T, H] in x.dtype, scattered back to flat rows.
            Routed here with the combine deferred (`GemmRoute`, `defer_combine`), each row is stored
            already weighted as the combine weights it, at its expert's rank among the token's
            (`WEIGHTED_BY_ID`), so that the exit (moe_exit_triton) reads no routing.
  combine   `_combine_tile`: per token, its routed (first top_k) experts held here in ascending
            id, weight * out added in fp32 (each product rounded to x.dtype first, as the reference
            does; compat_triton.mul_rn keeps it out of an fma). Given the shared expert's output (a
            tensor, or the token's row of `out` for expert E) and gate logit it writes the block output in x.dtype,
            acc.to(dtype) + (sigmoid(g).to(dtype) * shared).to(dtype); otherwise the fp32 partial
            (expert parallel: the ranks' partials are added before the shared expert). Up to
            COMBINE_IN_DOWN_MAX_TOKENS tokens the down launch runs it: each program bumps its feature
            tile's arrival counter after storing its rows, and the last to arrive combines the tile
            for every token (as the split-K linear finishes a tile); above that `_combine_kernel`.
            A stacked block may instead leave it to the next residual add + norm (moe_exit_triton,
            `moe_experts_with_shared(defer_combine=True)`). Elementwise per (token, feature), so all
            give the same bits.

Row invariance (DESIGN.md invariant 5): every GEMM tile walks K from 0 upwards in BLOCK_K steps with
fp32 accumulation and one configuration per dtype, the token count is not specialised on, routing is
per token, and a row's values never mix with another row's, so a token gets the same bits whatever
shares the launch, in either layout. Decode reads only the selected experts' weights, over enough
programs (row blocks x feature tiles) to fill the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels import linear_triton, moe_route_triton, pdl
from freetoken.kernels.moe_exit_triton import PendingCombine
from freetoken.kernels.compat_triton import INTERPRET, mul_rn
from freetoken.kernels.moe_route_triton import RowBlocks, _routed_row, _store_routing, is_direct, row_blocks

# GEMM tiles (any fixed choice keeps rows invariant): output features, K step, warps, pipeline stages.
# Chosen in the 35B-A3B decode step on the H200 (bench/variants.py): gate_up at 64 features a program
# 2.710 ms against 2.729 at 32 and 2.912 at 16 (logs/variants-tiles-35b-24f6731.jsonl); down at 128-wide
# K steps and 3 stages 2.571 against 2.590 at 64 and 5 (logs/variants-35b-899fab2.jsonl). Narrower
# masked tiles that give every SM the same work were slower (logs/variants-35b-1f1fad3.jsonl).
GATE_UP_BLOCK_N, GATE_UP_BLOCK_K, GATE_UP_WARPS, GATE_UP_STAGES = 64, 128, 4, 5
DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_WARPS, DOWN_STAGES = 64, 128, 4, 3
# With the routing in the GEMMs (GemmRoute), each down program waits for its own row's gate_up tiles
# instead of the whole gate_up grid, so down starts on the rows that are done while the last gate_up
# tiles stream: a counter per routed row (`row_ready_counters`) that each gate_up program raises by one
# once its tile is stored; down's programs wait for it to reach gate_up's tile count and then raise it
# up to the next multiple of PERIOD = next_pow2(gate_up tiles + down tiles), where every use leaves it
# (pdl.wait_count). 35B-A3B decode step cut to 24 layers on an H100: 1.836 / 1.834 ms with it against
# 1.855 / 1.848 without (logs/variants-35b-l24-switches-e0ac495-h100.jsonl).
DOWN_WAITS_FOR_ROW = True
# The expert GEMMs' routing (GemmRoute) with a copy of the token's logits per warp, so that each of its
# eleven reductions stays inside a warp (moe_route_triton._top_k), instead of one copy across the warps
# (two barriers each). H200, 35B-A3B decode step: 2.298 / 2.299 ms against 2.307 / 2.307 (logs/variants-35b-route-per-warp-3cf1193.jsonl).
ROUTE_PER_WARP = True
FP32_BLOCK_K = 32  # K step of both GEMMs on fp32 inputs
BLOCK_TOK = 16  # tokens per combine program (and per step of the combine in the down launch)
BLOCK_H = 128  # hidden features per combine program
# Up to this many tokens the down launch combines: the last of its programs to finish a feature tile
# combines that tile for every token, so the block needs no combine launch.
COMBINE_IN_DOWN_MAX_TOKENS = 64
# Up to that many tokens, a stacked block asked to defer its combine (`moe_experts_with_shared`) leaves
# it to the next residual add + norm (moe_exit_triton), which takes it off the down launch's tail.
COMBINE_IN_NEXT_NORM = True


@triton.jit
def _weight_row(e, slot_ptr, SLOTTED: tl.constexpr):
    """The row of the weights that holds expert e: e itself, or (SLOTTED) its slot."""
    if SLOTTED:
        return tl.load(slot_ptr + e).to(tl.int64)
    return e.to(tl.int64)


@triton.jit(do_not_specialize=["T"])
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr,
    T, H, I, C,
    stride_xm, stride_we, stride_wn, stride_hm,
    # routing here (ROUTE_HERE, `GemmRoute`): the router logits, and the routing this launch writes
    logits_ptr, experts_ptr, weights_ptr, stride_l, E,
    ready_ptr,  # ROW_READY: a counter per routed row, raised once per stored tile
    slot_ptr,  # SLOTTED: [C] int32, expert id -> its row of the weights
    ROW_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    ROUTE_HERE: tl.constexpr, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, ROW_READY: tl.constexpr,
    REP: tl.constexpr, SLOTTED: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROUTE_HERE:  # block pid_m holds flat row pid_m alone (direct layout, every expert held)
        token, e, route_ids, route_w = _routed_row(logits_ptr, stride_l, pid_m, E, TOP_K, TOP_K_POW2, BLOCK_E, ROW_K, REP)
        ids = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, T)
    else:
        e = tl.load(block_expert_ptr + pid_m)
        if e >= C:
            return
        ids = tl.load(sorted_ids_ptr + rows)
    valid = ids < T
    tokens = (ids // ROW_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + _weight_row(e, slot_ptr, SLOTTED) * stride_we
    # Transposed tiles [BLOCK_N, BLOCK_M]: the weight tile is the dot's left operand (wgmma on sm_90).
    acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + tokens[None, :] * stride_xm + kk[:, None], mask=valid[None, :] & (kk[:, None] < H), other=0.0)
        w_mask = (cols[:, None] < I) & (kk[None, :] < H)
        wg = tl.load(w + cols[:, None] * stride_wn + kk[None, :], mask=w_mask, other=0.0)
        wu = tl.load(w + (cols[:, None] + I) * stride_wn + kk[None, :], mask=w_mask, other=0.0)
        if DOT_F32:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_gate = tl.dot(wg, x, acc_gate, input_precision="ieee")
        acc_up = tl.dot(wu, x, acc_up, input_precision="ieee")
    # The rounding steps of the reference (and of the dense MLP's linear + silu_mul): gate/up to
    # x.dtype, silu to x.dtype, product to x.dtype.
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + rows[None, :] * stride_hm + cols[:, None], (act * up).to(dtype), mask=cols[:, None] < I)
    # The token's routing, for the combine: in the down launch the last program of a feature tile reads
    # every token's, ordered after this store by the row counter's release below.
    if ROUTE_HERE:
        if (pid_n == 0) & (pid_m % ROW_K == 0):
            _store_routing(experts_ptr, weights_ptr, token, route_ids, route_w, E, TOP_K, TOP_K_POW2, ROW_K)
    if ROW_READY:  # this tile of row pid_m is stored: down's programs of the row count it (pdl.wait_count)
        tl.debug_barrier()  # every thread's part of the tile (and the routing) is stored before the counter moves
        tl.atomic_add(ready_ptr + pid_m, 1, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["T", "N"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    T, H, I, C,
    stride_hm, stride_we, stride_wn, stride_om,
    # the combine, when COMBINE: as _combine_kernel's, plus the per-feature-tile arrival counters
    experts_ptr, weights_ptr, shared_ptr, gate_ptr, y_ptr, counter_ptr,
    N, first, stride_sm, stride_gm, stride_ym,
    logits_ptr, stride_l, E,  # routing here (ROUTE_HERE, `GemmRoute`)
    ready_ptr, up_tiles,  # ROW_READY: wait for row pid_m's counter to reach gate_up's feature tiles (mod PERIOD)
    slot_ptr,  # SLOTTED: [C] int32, expert id -> its row of the weights
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    COMBINE: tl.constexpr, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, ROW_K: tl.constexpr, BLOCK_TOK: tl.constexpr, SHARED: tl.constexpr,
    ROUTE_HERE: tl.constexpr, BLOCK_E: tl.constexpr, ROW_READY: tl.constexpr, PERIOD: tl.constexpr,
    WEIGHTED_BY_ID: tl.constexpr, REP: tl.constexpr, SLOTTED: tl.constexpr, PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_weight = 1.0
    # Written before gate_up (the row blocks, or the router logits and shared gate): read, and routed, before the wait (pdl.py).
    if ROUTE_HERE:
        token, e, route_ids, route_w = _routed_row(logits_ptr, stride_l, pid_m, E, TOP_K, TOP_K_POW2, BLOCK_E, ROW_K, REP)
        dest = pid_m
        if WEIGHTED_BY_ID:  # the row weighted as the combine weights it, stored at its expert's rank among the token's
            slot = pid_m % ROW_K
            slots = tl.arange(0, TOP_K_POW2)[None, :]
            rank = tl.max(tl.sum(tl.where((slots < TOP_K) & (route_ids < e), 1, 0), 1), 0)  # the shared expert (E): TOP_K
            slot_w = tl.max(tl.sum(tl.where(slots == slot, route_w, 0.0), 1), 0)  # its copies are equal
            gate = tl.sigmoid(tl.load(gate_ptr + token * stride_gm).to(tl.float32))
            row_weight = tl.where(slot < TOP_K, slot_w.to(weights_ptr.dtype.element_ty).to(tl.float32), gate.to(out_ptr.dtype.element_ty).to(tl.float32))
            dest = token * ROW_K + rank
        ids = tl.where(tl.arange(0, BLOCK_M) == 0, dest, T)
    else:
        e = tl.load(block_expert_ptr + pid_m)
        ids = tl.load(sorted_ids_ptr + rows)
    if ROW_READY:  # only this row's gate_up tiles, not the whole gate_up grid (pdl.py)
        pdl.release(PDL)
        pdl.wait_count(ready_ptr + pid_m, up_tiles, PERIOD)
        # Past the wait: together the row's programs take its counter to the next multiple of PERIOD.
        tl.atomic_add(ready_ptr + pid_m, tl.where(pid_n == 0, PERIOD - up_tiles - tl.num_programs(1) + 1, 1), sem="relaxed", scope="gpu")
    else:
        pdl.sync(PDL)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if e < C:
        valid = ids < T
        ks = tl.arange(0, BLOCK_K)
        w = w_ptr + _weight_row(e, slot_ptr, SLOTTED) * stride_we
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed, as in gate_up
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + ks
            a = tl.load(h_ptr + rows[None, :] * stride_hm + kk[:, None], mask=valid[None, :] & (kk[:, None] < I), other=0.0)
            wd = tl.load(w + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < H) & (kk[None, :] < I), other=0.0)
            if DOT_F32:
                a, wd = a.to(tl.float32), wd.to(tl.float32)
            acc = tl.dot(wd, a, acc, input_precision="ieee")
        y = acc.to(out_ptr.dtype.element_ty)
        if WEIGHTED_BY_ID:  # as _combine_tile rounds it (the routed rows' and the shared expert's product)
            y = (y.to(tl.float32) * row_weight).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ids[None, :].to(tl.int64) * stride_om + cols[:, None], y, mask=valid[None, :] & (cols[:, None] < H))
    if COMBINE:  # the last program of this feature tile to finish combines it for every token
        tl.debug_barrier()  # every thread's rows are stored before the counter moves
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.debug_barrier()
            for t0 in range(0, N, BLOCK_TOK):
                _combine_tile(
                    out_ptr, experts_ptr, weights_ptr, shared_ptr, gate_ptr, y_ptr,
                    t0 + tl.arange(0, BLOCK_TOK), cols, N, H, first, C, stride_om, stride_sm, stride_gm, stride_ym,
                    TOP_K, TOP_K_POW2, ROW_K, SHARED, ".cg",
                )
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    if ROW_READY:
        pdl.finish(PDL)


@triton.jit
def _combine_tile(
    out_ptr, experts_ptr, weights_ptr, shared_ptr, gate_ptr, y_ptr,
    tokens, cols,  # [BLOCK_TOK] token ids, [BLOCK_H] hidden features
    N, H, first, C, stride_om, stride_sm, stride_gm, stride_ym,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, ROW_K: tl.constexpr, SHARED: tl.constexpr, OUT_CACHE: tl.constexpr,
):
    """The block output of `tokens` x `cols` from their expert rows in `out` (module docstring, combine).
    Elementwise per (token, feature): the same bits whatever the tile's shape."""
    tokens = tokens.to(tl.int64)
    slots = tl.arange(0, TOP_K_POW2)
    big = 2147483647
    live = tokens < N
    routed = live[:, None] & (slots[None, :] < TOP_K)
    ids = tl.load(experts_ptr + tokens[:, None] * ROW_K + slots[None, :], mask=routed, other=big).to(tl.int32)
    weights = tl.load(weights_ptr + tokens[:, None] * TOP_K + slots[None, :], mask=routed, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((tokens.shape[0], cols.shape[0]), dtype=tl.float32)
    prev = tl.full(tokens.shape, -1, tl.int32)
    for _ in tl.static_range(TOP_K):  # each token's experts in ascending id (top-k ids are distinct)
        e = tl.min(tl.where(ids > prev[:, None], ids, big), 1)  # [BLOCK_TOK]
        slot = tl.sum(tl.where(ids == e[:, None], slots[None, :], 0), 1)
        prev = e
        held = live & (e >= first) & (e < first + C)
        row = tokens * ROW_K + slot
        y = tl.load(out_ptr + row[:, None] * stride_om + cols[None, :], mask=held[:, None] & (cols[None, :] < H), other=0.0, cache_modifier=OUT_CACHE).to(tl.float32)
        w = tl.sum(tl.where(slots[None, :] == slot[:, None], weights, 0.0), 1)  # the weight in that slot, exactly
        acc += tl.where(held[:, None], mul_rn(y, w[:, None]).to(dtype).to(tl.float32), 0.0)
    mask = live[:, None] & (cols[None, :] < H)
    if SHARED:  # the torch path's rounding: sigmoid to dtype, its product with shared to dtype, the sum to dtype
        g = tl.load(gate_ptr + tokens * stride_gm, mask=live, other=0.0).to(tl.float32)
        gate = tl.sigmoid(g).to(dtype).to(tl.float32)
        shared = tl.load(shared_ptr + tokens[:, None] * stride_sm + cols[None, :], mask=mask, other=0.0, cache_modifier=OUT_CACHE).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) + mul_rn(gate[:, None], shared).to(dtype).to(tl.float32)
    tl.store(y_ptr + tokens[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _combine_kernel(
    out_ptr, experts_ptr, weights_ptr, shared_ptr, gate_ptr, y_ptr,
    N, H, first, C,
    stride_om, stride_sm, stride_gm, stride_ym,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, ROW_K: tl.constexpr, BLOCK_TOK: tl.constexpr, BLOCK_H: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    _combine_tile(
        out_ptr, experts_ptr, weights_ptr, shared_ptr, gate_ptr, y_ptr,
        tl.program_id(0) * BLOCK_TOK + tl.arange(0, BLOCK_TOK), tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H),
        N, H, first, C, stride_om, stride_sm, stride_gm, stride_ym, TOP_K, TOP_K_POW2, ROW_K, SHARED, "",
    )


class GemmRoute(NamedTuple):
    """Routing left to the expert GEMMs (direct layout, every expert held, the shared expert stacked):
    each gate_up and down program routes its own row from its token's router logits
    (`moe_route_triton._top_k`, as route does), and gate_up's first program of a token writes the
    token's experts and weights for the combine. Takes the routing's arrival counter and second round
    trip off the MoE entry."""

    logits: torch.Tensor  # [N, E + 1] router logits, then the shared gate's (the entry's), unit column stride
    num_experts: int  # E
    rows: int  # T = N * (top_k + 1)
    first: int  # 0
    count: int  # E + 1


_row_ready: dict[tuple[torch.device, int], torch.Tensor] = {}


def row_ready_counters(device: torch.device, period: int) -> torch.Tensor:
    """int32 [DIRECT_MAX_ROWS]: a counter per routed row of the `GemmRoute` gate_up and down launches,
    a multiple of `period` between them (DOWN_WAITS_FOR_ROW); one set per (device, period), so MoE
    shapes of other periods never share them; made on first use, before any graph capture. A CUDA
    device without an index is the current one ("cuda" and "cuda:0" are one set of counters)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, period)
    if key not in _row_ready:
        _row_ready[key] = torch.zeros(moe_route_triton.DIRECT_MAX_ROWS, dtype=torch.int32, device=device)
    return _row_ready[key]


class _Combine(NamedTuple):
    """What the combine reads besides the expert rows, and where it writes (module docstring, combine)."""

    experts: torch.Tensor  # [N, R], the first top_k columns routed, contiguous
    weights: torch.Tensor  # [N, top_k] contiguous
    shared: torch.Tensor | None  # [N, H] unit column stride (None: y is the fp32 partial)
    shared_gate: torch.Tensor | None  # [N, 1]
    y: torch.Tensor  # [N, H] the result
    first: int
    count: int

    def launch_args(self) -> tuple:
        """As the kernels take them: pointers (experts, weights, shared, gate, y), sizes (N, H, first, C),
        strides (shared, gate, y rows) and the constexprs but the tile's (unread stand-ins for shared and gate without them)."""
        n, hidden = self.y.shape
        top_k = self.weights.shape[1]
        shared, gate = (self.shared, self.shared_gate) if self.shared is not None else (self.y, self.y)  # unread stand-ins
        meta = dict(TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), ROW_K=self.experts.shape[1], SHARED=self.shared is not None)
        return (self.experts, self.weights, shared, gate, self.y), (n, hidden, self.first, self.count), (shared.stride(0), gate.stride(0), self.y.stride(0)), meta


def _expert_rows(
    x: torch.Tensor,  # [N, H]
    gate_up: torch.Tensor,  # [C, 2I, H] contiguous
    down: torch.Tensor,  # [C, H, I] contiguous
    blocks: RowBlocks | GemmRoute | None,  # these experts' row blocks (route's, or forced by a test), or routing left to the GEMMs; None: blocks made here
    out: torch.Tensor,  # [N * R, H] x.dtype: flat row t = token * R + column through its expert (rows of other ranks' experts unwritten)
    combine: _Combine,
    defer: bool = False,
    slot_of: torch.Tensor | None = None,  # [count] int32 contiguous: expert id -> its row of gate_up / down; None: the id
) -> bool:  # whether down stored the rows weighted, in expert order (WEIGHTED_BY_ID: deferred, routed here)
    """The row blocks (direct or align launch) unless given, gate_up, down and the combine: in the down
    launch up to COMBINE_IN_DOWN_MAX_TOKENS tokens (its last program per feature tile), else its own
    launch; none when `defer` (the caller's next launch combines, moe_exit_triton). Either way each
    (token, feature) of y gets the same bits (`_combine_tile`)."""
    n, hidden = x.shape
    two_i = gate_up.shape[1]
    count = combine.count  # the experts held: gate_up's rows, or slot_of's ids
    experts, first = combine.experts, combine.first
    row_k = experts.shape[1]
    inter = two_i // 2
    rows = n * row_k
    if blocks is None:
        blocks = row_blocks(experts, first, count)
    assert blocks[2:] == (rows, first, count), f"row blocks for (rows, first, count) = {tuple(blocks[2:])}, not {(rows, first, count)}"
    ptrs, sizes, strides, meta = combine.launch_args()
    route_here = isinstance(blocks, GemmRoute)
    assert slot_of is None or not route_here, "slotted weights need the routing before the GEMMs"
    slotted = dict(SLOTTED=slot_of is not None)
    if route_here:
        assert is_direct(rows) and first == 0 and count == blocks.num_experts + 1 and row_k == meta["TOP_K"] + 1, "GemmRoute: direct, stacked, all experts"
        nb, logits, num_experts = rows, blocks.logits, blocks.num_experts
        sorted_ids = block_expert = logits  # unread stand-ins
    else:
        sorted_ids, block_expert = blocks.sorted_ids, blocks.block_expert
        nb, logits, num_experts = block_expert.shape[0], x, count  # unread stand-ins
    routing = dict(TOP_K=meta["TOP_K"], TOP_K_POW2=meta["TOP_K_POW2"], BLOCK_E=triton.next_power_of_2(num_experts), ROUTE_HERE=route_here)
    row_ready = route_here and DOWN_WAITS_FOR_ROW
    up_tiles = triton.cdiv(inter, GATE_UP_BLOCK_N)
    feature_tiles = triton.cdiv(hidden, DOWN_BLOCK_N)
    period = triton.next_power_of_2(up_tiles + feature_tiles)
    ready = row_ready_counters(x.device, period) if row_ready else logits  # an unread stand-in without
    slots = logits if slot_of is None else slot_of  # an unread stand-in without
    fp32 = x.dtype == torch.float32
    hidden_rows = torch.empty((nb * moe_route_triton.BLOCK_M, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(nb, up_tiles)](
        x, gate_up, hidden_rows, sorted_ids, block_expert,
        rows, hidden, inter, count,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden_rows.stride(0),
        logits, combine.experts, combine.weights, logits.stride(0), num_experts, ready, slots,
        ROW_K=row_k, BLOCK_M=moe_route_triton.BLOCK_M, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=FP32_BLOCK_K if fp32 else GATE_UP_BLOCK_K, DOT_F32=INTERPRET,
        **routing, ROW_READY=row_ready, REP=GATE_UP_WARPS if ROUTE_PER_WARP else 1, **slotted,
        num_warps=GATE_UP_WARPS, num_stages=GATE_UP_STAGES, **pdl.launch_kwargs(),
    )
    in_down = n <= COMBINE_IN_DOWN_MAX_TOKENS and not defer
    weighted_by_id = route_here and defer
    counters = linear_triton.arrival_counters(x.device, feature_tiles)
    _down_kernel[(nb, feature_tiles)](
        hidden_rows, down, out, sorted_ids, block_expert,
        rows, hidden, inter, count,
        hidden_rows.stride(0), down.stride(0), down.stride(1), out.stride(0),
        *ptrs, counters, n, first, *strides, logits, logits.stride(0), num_experts, ready, up_tiles, slots,
        BLOCK_M=moe_route_triton.BLOCK_M, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=FP32_BLOCK_K if fp32 else DOWN_BLOCK_K, DOT_F32=INTERPRET,
        COMBINE=in_down, BLOCK_TOK=BLOCK_TOK, **meta, ROUTE_HERE=route_here, BLOCK_E=routing["BLOCK_E"], ROW_READY=row_ready,
        PERIOD=period, WEIGHTED_BY_ID=weighted_by_id, REP=DOWN_WARPS if ROUTE_PER_WARP else 1, **slotted,
        num_warps=DOWN_WARPS, num_stages=DOWN_STAGES, **pdl.launch_kwargs(),
    )
    if not in_down and not defer:
        _combine_kernel[(triton.cdiv(n, BLOCK_TOK), triton.cdiv(hidden, BLOCK_H))](
            out, *ptrs, *sizes, out.stride(0), *strides,
            BLOCK_TOK=BLOCK_TOK, BLOCK_H=BLOCK_H, **meta, num_warps=4, **pdl.launch_kwargs(),
        )
    return weighted_by_id


def moe_experts(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, top_k] global expert ids
    weights: torch.Tensor,  # [N, top_k] renormalised router weights, x.dtype
    gate_up: torch.Tensor,  # [C, 2I, H] experts [first, first + C), gate rows first
    down: torch.Tensor,  # [C, H, I]
    first: int = 0,
    shared: torch.Tensor | None = None,  # [N, H] shared expert output, x.dtype
    shared_gate: torch.Tensor | None = None,  # [N, 1] shared expert gate logit, x.dtype
    blocks: RowBlocks | None = None,  # these experts' row blocks (route's); None: made here
    slot_of: torch.Tensor | None = None,  # [C] int: expert id (first = 0) -> its row of gate_up / down, every routed id held
) -> torch.Tensor:  # [N, H]: fp32 sum over the held experts of weight * expert(x); x.dtype block output with shared
    """Routed experts; given `shared` and `shared_gate`, acc.to(x.dtype) + sigmoid(shared_gate) * shared.
    slot_of: the weights hold the experts in slots (an expert cache); the rows, their blocks and the
    combine are those of the experts [0, C) by id, so every row gets the bits of the unslotted call."""
    assert x.dtype == gate_up.dtype == down.dtype, f"moe_experts: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}"
    with_shared = shared is not None
    y = torch.empty(x.shape, dtype=x.dtype if with_shared else torch.float32, device=x.device)
    if x.shape[0] == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    experts = experts.contiguous()
    if with_shared:
        shared = shared if shared.stride(1) == 1 else shared.contiguous()
    out = torch.empty((experts.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    assert slot_of is None or first == 0, "slotted experts are ids [0, C)"
    count = gate_up.shape[0] if slot_of is None else slot_of.numel()
    combine = _Combine(experts, weights.contiguous(), shared, shared_gate, y, first, count)
    _expert_rows(x, gate_up.contiguous(), down.contiguous(), blocks, out, combine, slot_of=_slots(slot_of))
    return y


def _slots(slot_of: torch.Tensor | None) -> torch.Tensor | None:
    return None if slot_of is None else slot_of.to(torch.int32).contiguous()


def moe_experts_with_shared(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, top_k + 1] expert ids, column top_k = E (the shared expert)
    weights: torch.Tensor,  # [N, top_k] renormalised router weights, x.dtype
    gate_up: torch.Tensor,  # [E + 1, 2I, H] the routed experts, then the shared expert; gate rows first
    down: torch.Tensor,  # [E + 1, H, I]
    shared_gate: torch.Tensor,  # [N, 1] shared expert gate logit, x.dtype
    blocks: RowBlocks | None = None,  # these experts' row blocks (route's); None: made here
    defer_combine: bool = False,
    slot_of: torch.Tensor | None = None,  # [E + 1] int: expert id -> its row of gate_up / down, every routed id held; None: the id
) -> torch.Tensor | PendingCombine:  # [N, H] x.dtype
    """The block output acc.to(x.dtype) + sigmoid(shared_gate) * shared, the shared expert run as expert E
    of the grouped GEMMs (its row of `out` is `shared`); acc sums the top_k routed experts only.
    With defer_combine, up to COMBINE_IN_DOWN_MAX_TOKENS tokens (and COMBINE_IN_NEXT_NORM), the expert
    rows and their routing instead: the next `add_zc_rms_norm` combines (moe_exit_triton)."""
    assert x.dtype == gate_up.dtype == down.dtype, f"moe_experts_with_shared: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}"
    assert experts.shape[1] == weights.shape[1] + 1, f"moe_experts_with_shared: experts {tuple(experts.shape)}, weights {tuple(weights.shape)}"
    n, hidden = x.shape
    if n == 0:
        return torch.empty((0, hidden), dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    experts = experts.contiguous()
    row_k = experts.shape[1]
    out = torch.empty((n * row_k, hidden), dtype=x.dtype, device=x.device)
    shared = out.view(n, row_k, hidden)[:, row_k - 1]  # [N, H], row stride row_k * H
    defer = defer_combine and COMBINE_IN_NEXT_NORM and n <= COMBINE_IN_DOWN_MAX_TOKENS
    y = shared if defer else torch.empty((n, hidden), dtype=x.dtype, device=x.device)  # deferred: no combine writes y (an unread stand-in)
    count = gate_up.shape[0] if slot_of is None else slot_of.numel()
    combine = _Combine(experts, weights.contiguous(), shared, shared_gate, y, 0, count)
    weighted_by_id = _expert_rows(x, gate_up.contiguous(), down.contiguous(), blocks, out, combine, defer, _slots(slot_of))
    return PendingCombine(out, experts, combine.weights, shared_gate, weighted_by_id) if defer else y
