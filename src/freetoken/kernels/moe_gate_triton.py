"""A sparse MoE block's entry in one launch (Triton): residual add + zero-centred RMSNorm, the router
and shared-expert gate logits, and the routing.

Unfused, the block starts with three launches: `add_zc_rms_norm` (s = x + residual, h = norm(s)), the
linear of the merged [E + 1, H] gates weight (router | shared gate) and `moe_route_triton.route`. At decode
each is short and the launches' ramps cost more than their bytes. Here program (token, g) recomputes
the token's add + norm (one row: cheap), writes s and h if g == 0, and computes GATE_ROWS of the
token's E + 1 gate logits; the program that arrives last for the token (a per-token counter, as in
the split-K linear) reads all of them back and routes the token (`moe_route_triton._route_token`, so the
experts, weights and direct row blocks are those of `route`). In the direct layout with the shared
expert stacked (ROUTE_IN_GEMMS) the entry ends once its logits are stored instead, and the expert
GEMMs route (`moe_triton.GemmRoute`): that takes the counter and the logits' reload off the step.

x may also be the mixer's output projection with its split-K sum deferred (linear_triton.PendingSplitK):
each program adds the slices as it loads the row (norm_triton.load_row), with the linear's bits.

Precision follows the unfused ops: s is rounded to x.dtype like a torch add, h exactly as
`_add_zc_rms_norm_kernel` computes it (same block, same warps: norm_triton.ADD_NORM_WARPS, so the same reduction), and each logit
is the fp32 dot of h with its weight row, rounded to x.dtype as the linear's output is (its summation
order differs from the linear kernel's, so logits may differ from the unfused path in the last bit).
One token per program and a launch configuration fixed by the shapes: a token's bits never depend on
the other tokens of the launch (row invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import l2_prefetch, moe_route_triton, moe_triton, norm_triton, pdl

GATE_ROWS = 4  # gate logits per program: 65 programs per token at E = 256. H200, 35B-A3B decode step in one
# run (bench/variants.py): 2.6655 ms at 4 rows, 2.6786 at 2, 2.6823 at 8, 2.8909 at 16 (logs/variants-gate-rows-35b-a26586a.jsonl)
MAX_TOKENS_PER_LAUNCH = 1024  # bounds the per-token counters; longer calls are cut (no bits change)
# In the direct layout with the shared expert stacked, leave the routing to the expert GEMMs
# (moe_triton.GemmRoute): the entry then ends once its logits are stored.
ROUTE_IN_GEMMS = True

_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit(do_not_specialize=["T"])
def _add_norm_route_kernel(
    x_ptr, r_ptr, norm_w_ptr, s_ptr, h_ptr,
    gates_ptr, logits_ptr, count_ptr,
    experts_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    H, G, E, eps, stride_x, stride_xs, stride_r, stride_s, stride_h, stride_g, stride_l, T, first, C, pf_ptr, pf_lines, num_tokens,
    X_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, GATE_ROWS: tl.constexpr,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, ROW_K: tl.constexpr, REP: tl.constexpr,
    BLOCK_M: tl.constexpr, DIRECT: tl.constexpr, ROUTE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    if PREFETCH:  # the programs past the launch's rows prefetch the next GEMM's weight (l2_prefetch)
        if tl.program_id(0) >= num_tokens:
            l2_prefetch.run(pf_ptr, pf_lines, num_tokens, PDL)
            return
    token = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    rows = pid_g * GATE_ROWS + tl.arange(0, GATE_ROWS)
    # The weights are never written by a kernel: loaded before the wait, while the previous kernel runs.
    gw = tl.load(gates_ptr + rows[:, None] * stride_g + cols[None, :], mask=(rows[:, None] < G) & mask[None, :], other=0.0)
    w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.sync(PDL)
    xf = norm_triton.load_row(x_ptr, token, cols, mask, stride_x, stride_xs, X_SPLIT, s_ptr.dtype.element_ty)
    r = tl.load(r_ptr + token * stride_r + cols, mask=mask, other=0.0)
    s = (xf + r.to(tl.float32)).to(s_ptr.dtype.element_ty)  # rounded like a torch add
    h = norm_triton.zc_norm(s, w, H, eps).to(h_ptr.dtype.element_ty)
    if pid_g == 0:
        tl.store(s_ptr + token * stride_s + cols, s, mask=mask)
        tl.store(h_ptr + token * stride_h + cols, h, mask=mask)
    logits = tl.sum(gw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + token * stride_l + rows, logits.to(logits_ptr.dtype.element_ty), mask=rows < G)
    if not ROUTE:  # the expert GEMMs route (moe_triton.GemmRoute)
        return
    tl.debug_barrier()  # every thread's logits are written before the counter moves
    arrived = tl.atomic_add(count_ptr + token, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:  # the token's last program: all its logits are in
        tl.debug_barrier()
        experts = tl.arange(0, BLOCK_E)
        experts = experts[None, :] + 0 * tl.arange(0, REP)[:, None]
        router = tl.load(logits_ptr + token * stride_l + experts, mask=experts < E, other=-float("inf"), cache_modifier=".cg").to(tl.float32)
        moe_route_triton._route_token(router, token, experts_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, E, T, first, C,
                                      TOP_K, TOP_K_POW2, BLOCK_E, ROW_K, BLOCK_M, DIRECT)
        tl.atomic_xchg(count_ptr + token, 0, sem="relaxed", scope="gpu")


def _token_counters(device: torch.device) -> torch.Tensor:
    """int32 [MAX_TOKENS_PER_LAUNCH] kept at zero between launches (made on first use, before any graph capture)."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TOKENS_PER_LAUNCH, dtype=torch.int32, device=device)
    return _counters[device]


def add_norm_route(
    x,  # [N, H] the mixer's output (or its deferred split-K partials, linear_triton.PendingSplitK)
    residual: torch.Tensor,  # [N, H]
    norm_weight: torch.Tensor,  # [H] zero-centred (post-attention) norm
    eps: float,
    gates: torch.Tensor,  # [E + 1, H] router rows, then the shared-expert gate row
    top_k: int,
    with_shared: bool = False,
    first: int = 0,
    count: int | None = None,
    prefetch: l2_prefetch.Span | None = None,  # queued by extra programs of the launch (l2_prefetch)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, moe_route_triton.RowBlocks | moe_triton.GemmRoute | None]:
    """-> (s = x + residual, h = norm(s) * (1 + w), experts [N, top_k (+ 1)] int32, weights [N, top_k],
    shared-gate logits [N, 1], row blocks): `add_zc_rms_norm`, the gates linear and `moe_route_triton.route`
    (its arguments, its results) in one launch. With ROUTE_IN_GEMMS, in the direct layout with the
    shared expert stacked, the blocks are a `moe_triton.GemmRoute` instead: experts and weights are
    written by the gate_up launch that takes it."""
    n, hidden = residual.shape
    num_gates = gates.shape[0]
    num_experts = num_gates - 1
    assert gates.shape[1] == hidden and gates.stride(1) == 1, f"add_norm_route: gates {tuple(gates.shape)} for hidden {hidden}"
    assert triton.next_power_of_2(hidden) <= 4096, "add_norm_route: one row of at most 4096 features per program (norm_triton.ADD_NORM_WARPS)"
    x, stride_x, stride_xs, x_split = norm_triton.row_source(x)
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    dtype, device = residual.dtype, residual.device
    gemm_route = ROUTE_IN_GEMMS and with_shared and first == 0 and count in (None, num_gates) and moe_route_triton.is_direct(n * (top_k + 1))
    out = moe_route_triton.route_outputs(n, num_experts, top_k, dtype, with_shared, first, count, device, direct_blocks=not gemm_route)
    s, h = torch.empty_like(residual), torch.empty_like(residual)
    # Rows 16-aligned, so that the routing's loads of a row vectorise: that gives each warp whole rows
    # of its copy of the logits (moe_route_triton._top_k), with no barrier in the routing's reductions.
    logits = torch.empty((n, triton.cdiv(num_gates, 16) * 16), dtype=dtype, device=device)[:, :num_gates]
    counters = _token_counters(device)
    gate_programs = triton.cdiv(num_gates, GATE_ROWS)
    for t0 in range(0, n, MAX_TOKENS_PER_LAUNCH):  # direct blocks (T <= DIRECT_MAX_ROWS) take one launch
        tokens = min(MAX_TOKENS_PER_LAUNCH, n - t0)
        extra, pf_args = l2_prefetch.launch_args(prefetch if t0 == 0 else None, gate_programs, s)
        _add_norm_route_kernel[(tokens + extra, gate_programs)](
            x[t0:] if not x_split else x[:, t0:], residual[t0:], norm_weight, s[t0:], h[t0:],
            gates, logits[t0:], counters,
            out.experts[t0:], out.weights[t0:], *out.block_ptrs,
            hidden, num_gates, num_experts, eps, stride_x, stride_xs, residual.stride(0), s.stride(0), h.stride(0), gates.stride(0), logits.stride(0),
            out.rows, first, out.count, num_tokens=tokens, **pf_args,
            X_SPLIT=x_split, BLOCK_H=triton.next_power_of_2(hidden), GATE_ROWS=GATE_ROWS, ROUTE=not gemm_route,
            REP=norm_triton.ADD_NORM_WARPS if moe_triton.ROUTE_PER_WARP else 1, num_warps=norm_triton.ADD_NORM_WARPS, **out.meta, **pdl.launch_kwargs(),
        )
    blocks = moe_triton.GemmRoute(logits, num_experts, out.rows, first, out.count) if gemm_route else out.blocks
    return s, h, out.experts, out.weights, logits[:, num_experts:], blocks
