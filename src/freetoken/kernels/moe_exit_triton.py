"""A stacked MoE block's exit in one launch (Triton): the combine, the residual add and the next norm.

Up to moe_triton.COMBINE_IN_DOWN_MAX_TOKENS tokens the down launch can combine (its last program per
feature tile), but that puts two dependent round trips through L2 (the arrival counter, then the
expert rows) at the end of the down launch, on the critical path. The block can instead hand back a
`PendingCombine` (the expert rows and their routing); the decoder's next residual add + zero-centred
RMSNorm (`kernels.add_zc_rms_norm`) then runs here, one program per token, and computes

    y = combine(rows)            as moe_triton._combine_tile: routed products rounded to x.dtype and
                                 added in fp32 in ascending expert id, then the gated shared expert
    s = (y + residual) in x.dtype, h = norm(s) * (1 + w)    as norm_triton._add_zc_rms_norm_kernel.

After its PDL wait it loads the token's expert rows and the residual in one round trip, their
addresses known before the wait:
  routed by the entry   the entry wrote the routing three launches back, so the exit loads it before
                        the wait and orders the routed rows there.
  routed in the GEMMs   (moe_triton.GemmRoute) the stored routing is gate_up's, two launches back, and
                        the down launch between lets this one start before gate_up has ended (down
                        waits on its rows' counters, not on gate_up's grid: pdl.py). The exit reads
                        none of it: down stores each row already weighted (the combine's rounding of
                        the product; the shared expert's by its gate) at its expert's rank among the
                        token's (`PendingCombine.rows_weighted_by_id`), so the exit only adds them.

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

from freetoken.kernels import l2_prefetch, norm_triton, pdl
from freetoken.kernels.compat_triton import mul_rn


@triton.jit
def _combine_add_norm_kernel(
    rows_ptr, experts_ptr, weights_ptr, gate_ptr, r_ptr, w_ptr, sum_ptr, y_ptr,
    H, stride_rows, stride_g, stride_r, stride_s, stride_y, eps, pf_ptr, pf_lines, num_tokens,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, ROW_K: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED_BY_ID: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    if PREFETCH:  # the programs past the launch's rows prefetch the next GEMM's weight (l2_prefetch)
        if tl.program_id(0) >= num_tokens:
            l2_prefetch.run(pf_ptr, pf_lines, num_tokens, PDL)
            return
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    dtype = sum_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # the norm weight, never written
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if WEIGHTED_BY_ID:  # the rows weighted, in ascending expert id, the shared expert's last (down's)
        pdl.sync(PDL)
        for k in tl.static_range(TOP_K):
            acc += tl.load(rows_ptr + (token * ROW_K + k) * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        shared = tl.load(rows_ptr + (token * ROW_K + TOP_K) * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # the entry's routing and shared gate logit, three launches back: read, and the rows ordered, before the wait
        slots = tl.arange(0, TOP_K_POW2)
        big = 2147483647
        ids = tl.load(experts_ptr + token * ROW_K + slots, mask=slots < TOP_K, other=big).to(tl.int32)
        g = tl.load(gate_ptr + token * stride_g).to(tl.float32)
        # The routed slots in ascending expert id (top-k ids are distinct), 4 bits each in one scalar:
        # after the wait the row loads depend on no reduction, so they go out together.
        order = tl.zeros((), dtype=tl.int64)
        prev = -1
        for k in tl.static_range(TOP_K):
            e = tl.min(tl.where(ids > prev, ids, big), 0)
            order |= tl.sum(tl.where(ids == e, slots, 0), 0).to(tl.int64) << (4 * k)
            prev = e
        pdl.sync(PDL)
        for k in tl.static_range(TOP_K):
            slot = (order >> (4 * k)) & 15
            y = tl.load(rows_ptr + (token * ROW_K + slot) * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
            weight = tl.load(weights_ptr + token * TOP_K + slot).to(tl.float32)
            acc += mul_rn(y, weight).to(dtype).to(tl.float32)  # as _combine_tile adds it
        gate = tl.sigmoid(g).to(dtype).to(tl.float32)
        y = tl.load(rows_ptr + (token * ROW_K + TOP_K) * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        shared = mul_rn(gate, y).to(dtype).to(tl.float32)
    x = (acc.to(dtype).to(tl.float32) + shared).to(dtype)
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
    # Routed in the GEMMs (moe_triton.GemmRoute): down stored row token * R + k weighted, the k-th of the
    # token's experts in ascending id (k = top_k: the shared expert, by its gate); experts, weights unread.
    rows_weighted_by_id: bool = False

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
            _combine_add_norm_kernel[(n + extra,)](
                self.rows, self.experts, self.weights, self.shared_gate, residual, weight.contiguous(), s, h,
                hidden, self.rows.stride(0), self.shared_gate.stride(0), residual.stride(0), s.stride(0), h.stride(0), eps,
                num_tokens=n, **pf_args,
                TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), ROW_K=row_k, BLOCK_H=triton.next_power_of_2(hidden),
                WEIGHTED_BY_ID=self.rows_weighted_by_id,
                num_warps=norm_triton.ADD_NORM_WARPS, **pdl.launch_kwargs(),
            )
        return s, h
