"""A stacked MoE block's exit in one launch (Triton): the combine, the residual add and the next norm.

Up to moe_triton.COMBINE_IN_DOWN_MAX_TOKENS tokens the down launch can combine (its last program per
feature tile), but that puts two dependent round trips through L2 (the arrival counter, then the
expert rows) at the end of the down launch, on the critical path. The block can instead hand back a
`PendingCombine` (the expert rows and their routing); the decoder's next residual add + zero-centred
RMSNorm (`kernels.add_zc_rms_norm`) then runs here, one program per token: before its PDL wait it
loads the norm weight, the shared gate logit and the token's routing, and orders the routed rows;
after it, the token's expert rows and the residual in one round trip. It computes

    y = combine(rows)            as moe_triton._combine_tile: routed products rounded to x.dtype and
                                 added in fp32 in ascending expert id, then the gated shared expert
    s = (y + residual) in x.dtype, h = norm(s) * (1 + w)    as norm_triton._add_zc_rms_norm_kernel.

The routing is the entry's, three launches back, when the entry routes. Routed in the expert GEMMs
(moe_triton.GemmRoute) the stored routing is gate_up's, two launches back, and the down launch between
lets this one start before gate_up has ended (down waits on its rows' counters, not on gate_up's grid:
pdl.py); so the exit routes the token again from the entry's router logits (`routing_triton.top_k`,
the bits gate_up stores) and never reads gate_up's.

Both steps are elementwise per (token, feature) but the norm's one reduction, which is
`_add_zc_rms_norm_kernel`'s (`norm_triton.zc_norm`, the same block, warps and load pattern: BLOCK_D,
norm_triton.ADD_NORM_WARPS): y, s and h have the bits of the down launch's combine followed by
`add_zc_rms_norm`, whatever the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels import l2_prefetch, norm_triton, pdl, routing_triton


@triton.jit
def _slot_order(ids, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr):
    """The routed slots of a token's expert ids [TOP_K_POW2] (past TOP_K: ignored) in ascending id (top-k
    ids are distinct), 4 bits each in one int64: the row loads after the wait then depend on no reduction."""
    slots = tl.arange(0, TOP_K_POW2)
    big = 2147483647
    ids = tl.where(slots < TOP_K, ids, big)
    order = tl.zeros((), dtype=tl.int64)
    prev = -1
    for k in tl.static_range(TOP_K):
        e = tl.min(tl.where(ids > prev, ids, big), 0)
        order |= tl.sum(tl.where(ids == e, slots, 0), 0).to(tl.int64) << (4 * k)
        prev = e
    return order


@triton.jit
def _combine_add_norm_kernel(
    rows_ptr, experts_ptr, weights_ptr, logits_ptr, gate_ptr, r_ptr, w_ptr, sum_ptr, y_ptr,
    H, E, stride_rows, stride_l, stride_g, stride_r, stride_s, stride_y, eps, pf_ptr, pf_lines, num_tokens,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, ROW_K: tl.constexpr, BLOCK_H: tl.constexpr,
    ROUTE_HERE: tl.constexpr, BLOCK_E: tl.constexpr, REP: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    if PREFETCH:  # the programs past the launch's rows prefetch the next GEMM's weight (l2_prefetch)
        if tl.program_id(0) >= num_tokens:
            l2_prefetch.run(pf_ptr, pf_lines, num_tokens, PDL)
            return
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    slots = tl.arange(0, TOP_K_POW2)
    # Written by the block's entry three launches back, or never (the norm weight): read before the wait.
    g = tl.load(gate_ptr + token * stride_g).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUTE_HERE:  # gate_up's stored routing may still be in flight: the token routed again, as gate_up did
        logits = routing_triton.router_logits(logits_ptr, token, stride_l, E, BLOCK_E, REP)
        ids, route_w = routing_triton.top_k(logits, E, TOP_K, TOP_K_POW2, BLOCK_E)
        ids = tl.max(ids, 0)  # its copies are equal
        route_w = tl.max(route_w, 0).to(weights_ptr.dtype.element_ty).to(tl.float32)  # as gate_up stores them
    else:  # the entry's routing
        ids = tl.load(experts_ptr + token * ROW_K + slots, mask=slots < TOP_K, other=0)
        route_w = tl.load(weights_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0.0).to(tl.float32)
    order = _slot_order(ids, TOP_K, TOP_K_POW2)
    pdl.sync(PDL)
    dtype = sum_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = (order >> (4 * k)) & 15
        y = tl.load(rows_ptr + (token * ROW_K + slot) * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        weight = tl.sum(tl.where(slots == slot, route_w, 0.0), 0)  # the weight in that slot, exactly
        # As _combine_tile adds it: the select keeps a product of x.dtype = fp32 from fusing into the add.
        acc += tl.where(slot < TOP_K, (y * weight).to(dtype).to(tl.float32), 0.0)
    gate = tl.sigmoid(g).to(dtype).to(tl.float32)
    shared = tl.load(rows_ptr + (token * ROW_K + TOP_K) * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
    x = (acc.to(dtype).to(tl.float32) + (gate * shared).to(dtype).to(tl.float32)).to(dtype)
    r = tl.load(r_ptr + token * stride_r + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded like a torch add
    tl.store(sum_ptr + token * stride_s + cols, s, mask=mask)
    tl.store(y_ptr + token * stride_y + cols, norm_triton.zc_norm(s, w, H, eps).to(y_ptr.dtype.element_ty), mask=mask)


class PendingCombine(NamedTuple):
    """A stacked MoE block's output before its combine: what `add_zc_rms_norm` needs to finish it."""

    rows: torch.Tensor  # [N * R, H] x.dtype: flat row token * R + column through its expert (column top_k: the shared expert)
    experts: torch.Tensor  # [N, R] int32, contiguous
    weights: torch.Tensor  # [N, top_k] x.dtype, contiguous
    shared_gate: torch.Tensor  # [N, 1] shared-expert gate logits
    # Routed in the expert GEMMs (moe_triton.GemmRoute): its router logits [N, E + 1] (the last column the
    # shared gate's), from which the exit routes each token again; None: the entry's routing above.
    router_logits: torch.Tensor | None = None

    def add_zc_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float, prefetch: l2_prefetch.Span | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s) * (1 + w)) with s = block output + residual [N, H], as `norm_triton.add_zc_rms_norm`
        gives them for the block output the down launch's combine writes. prefetch: queued by extra
        programs of the launch (l2_prefetch)."""
        n, row_k = self.experts.shape
        hidden = self.rows.shape[1]
        top_k = self.weights.shape[1]
        assert residual.shape == (n, hidden), f"add_zc_rms_norm: residual {tuple(residual.shape)} for a block output of {(n, hidden)}"
        assert triton.next_power_of_2(hidden) <= 4096, "add_zc_rms_norm: one row of at most 4096 features per program (norm_triton.ADD_NORM_WARPS)"
        assert row_k <= 16, "add_zc_rms_norm: a token's slots are packed 4 bits each"
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        s = torch.empty_like(residual)
        h = torch.empty_like(residual)
        if n:
            extra, pf_args = l2_prefetch.launch_args(prefetch, 1, s)
            from freetoken.kernels import moe_triton  # imports this module; the switch gate_up routes by

            route_here = self.router_logits is not None
            logits = self.router_logits if route_here else self.weights  # an unread stand-in without
            num_experts = logits.shape[1] - 1 if route_here else 0
            assert logits.stride(1) == 1, "add_zc_rms_norm: router logits with unit column stride"
            _combine_add_norm_kernel[(n + extra,)](
                self.rows, self.experts, self.weights, logits, self.shared_gate, residual, weight.contiguous(), s, h,
                hidden, num_experts, self.rows.stride(0), logits.stride(0), self.shared_gate.stride(0), residual.stride(0), s.stride(0), h.stride(0), eps,
                num_tokens=n, **pf_args,
                TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), ROW_K=row_k, BLOCK_H=triton.next_power_of_2(hidden),
                ROUTE_HERE=route_here, BLOCK_E=triton.next_power_of_2(max(num_experts, 1)), REP=norm_triton.ADD_NORM_WARPS if moe_triton.ROUTE_PER_WARP else 1,
                num_warps=norm_triton.ADD_NORM_WARPS, **pdl.launch_kwargs(),
            )
        return s, h
