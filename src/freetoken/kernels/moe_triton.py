"""Routed experts of a sparse MoE block as a grouped GEMM (Triton), with no host sync.

Nothing here reads device data on the host, so the whole op can be captured in a CUDA graph: every
buffer and grid size follows from N (tokens), top_k and C (experts held by this rank).

Layout of one call (T = N * top_k routed rows, flat row t = token * top_k + slot):
  align     keys (local expert id, C for experts another rank holds) are counted per expert;
            each expert's rows are padded to BLOCK_M and given consecutive row blocks.
            `_align_kernel` (one program per expert) writes, in ascending t, the flat ids of the
            expert's rows (`sorted_ids`, padding = T) and the expert of each block
            (`block_expert`, C = surplus block). Blocks are bounded by min(C, T) + T // BLOCK_M + 1.
  gate_up   `_gate_up_kernel`: per (row block, BLOCK_N features of I) the gate and up tiles of
            that block's expert, then silu(gate) * up -> hidden [rows, I].
  down      `_down_kernel`: hidden @ down[e]^T -> out [T, H], scattered back to flat rows.
  combine   `_combine_kernel`: per token, its held experts in ascending id, weight * out added in
            fp32 (each product rounded to x.dtype first, as the reference does).

Row invariance (DESIGN.md invariant 5): every tile walks K from 0 upwards in BLOCK_K steps with fp32
accumulation and one configuration per dtype, the token count is not specialised on, and a row's
values never mix with another row's, so a token gets the same bits whatever shares the launch.
Decode reads only the selected experts' weights, once per row block (one block per expert for up to
BLOCK_M rows), over enough programs (row blocks x feature tiles) to fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.compat_triton import INTERPRET

BLOCK_M = 16  # rows per tile; each expert's rows are padded to a multiple of it
BLOCK_N = 32  # output features per tile
BLOCK_T = 128  # routed rows scanned per step by the align kernel
BLOCK_TOK = 16  # tokens per combine program
BLOCK_H = 128  # hidden features per combine program


@triton.jit(do_not_specialize=["T"])
def _align_kernel(key_ptr, block_start_ptr, sorted_ids_ptr, block_expert_ptr, T, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    e = tl.program_id(0)
    first_block = tl.load(block_start_ptr + e)
    end_block = tl.load(block_start_ptr + e + 1)
    offs = tl.arange(0, BLOCK_T)
    seen = 0
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs
        hit = (tl.load(key_ptr + t, mask=t < T, other=-1) == e).to(tl.int32)
        pos = first_block * BLOCK_M + seen + tl.cumsum(hit, 0) - hit
        tl.store(sorted_ids_ptr + pos, t, mask=hit != 0)
        seen += tl.sum(hit, 0)
    for b0 in range(first_block, end_block, BLOCK_T):
        b = b0 + offs
        tl.store(block_expert_ptr + b, e + tl.zeros_like(b), mask=b < end_block)


@triton.jit(do_not_specialize=["T"])
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr,
    T, H, I, C,
    stride_xm, stride_we, stride_wn, stride_hm,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= C:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    valid = ids < T
    tokens = (ids // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + e.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + kk[None, :], mask=valid[:, None] & (kk[None, :] < H), other=0.0)
        w_mask = (cols[None, :] < I) & (kk[:, None] < H)
        wg = tl.load(w + cols[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w + (cols[None, :] + I) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        if DOT_F32:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
    # The rounding steps of the reference: gate/up to x.dtype, silu to x.dtype, product to x.dtype.
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], (act * up).to(dtype), mask=cols[None, :] < I)


@triton.jit(do_not_specialize=["T"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    T, H, I, C,
    stride_hm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= C:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    valid = ids < T
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + ks
        a = tl.load(h_ptr + rows[:, None] * stride_hm + kk[None, :], mask=valid[:, None] & (kk[None, :] < I), other=0.0)
        wd = tl.load(w + cols[None, :] * stride_wn + kk[:, None], mask=(cols[None, :] < H) & (kk[:, None] < I), other=0.0)
        if DOT_F32:
            a, wd = a.to(tl.float32), wd.to(tl.float32)
        acc = tl.dot(a, wd, acc, input_precision="ieee")
    y = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ids[:, None].to(tl.int64) * stride_om + cols[None, :], y, mask=valid[:, None] & (cols[None, :] < H))


@triton.jit(do_not_specialize=["N"])
def _combine_kernel(
    out_ptr, experts_ptr, weights_ptr, acc_ptr,
    N, H, first, C,
    stride_om, stride_am,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_TOK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_TOK + tl.arange(0, BLOCK_TOK)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, TOP_K_POW2)
    big = 2147483647
    live = tokens < N
    ids = tl.load(experts_ptr + tokens[:, None] * TOP_K + slots[None, :], mask=live[:, None] & (slots[None, :] < TOP_K), other=big).to(tl.int32)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_TOK, BLOCK_H), dtype=tl.float32)
    prev = tl.full((BLOCK_TOK,), -1, tl.int32)
    for _ in tl.static_range(TOP_K):  # each token's experts in ascending id (top-k ids are distinct)
        e = tl.min(tl.where(ids > prev[:, None], ids, big), 1)  # [BLOCK_TOK]
        slot = tl.sum(tl.where(ids == e[:, None], slots[None, :], 0), 1)
        prev = e
        held = live & (e >= first) & (e < first + C)
        row = (tokens * TOP_K + slot).to(tl.int64)
        y = tl.load(out_ptr + row[:, None] * stride_om + cols[None, :], mask=held[:, None] & (cols[None, :] < H), other=0.0).to(tl.float32)
        w = tl.load(weights_ptr + row, mask=held, other=0.0).to(tl.float32)
        acc += tl.where(held[:, None], (y * w[:, None]).to(dtype).to(tl.float32), 0.0)
    tl.store(acc_ptr + tokens[:, None] * stride_am + cols[None, :], acc, mask=live[:, None] & (cols[None, :] < H))


def max_blocks(num_experts: int, rows: int) -> int:
    """Upper bound on the row blocks of `rows` routed rows over `num_experts` experts (host-side)."""
    return min(num_experts, rows) + rows // BLOCK_M + 1


def align(experts: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [N, top_k] global ids -> sorted_ids [blocks * BLOCK_M] (flat rows, T = padding), block_expert [blocks]."""
    rows = experts.numel()
    local = experts.reshape(-1) - first
    key = torch.where((local >= 0) & (local < count), local, count)  # [T]; count = held by another rank
    counts = torch.zeros(count + 1, dtype=torch.int64, device=experts.device).scatter_add_(0, key, torch.ones_like(key))
    blocks = (counts[:count] + BLOCK_M - 1) // BLOCK_M
    block_start = torch.cat([blocks.new_zeros(1), torch.cumsum(blocks, 0)]).to(torch.int32)  # [C + 1]
    nb = max_blocks(count, rows)
    sorted_ids = torch.full((nb * BLOCK_M,), rows, dtype=torch.int32, device=experts.device)
    block_expert = torch.full((nb,), count, dtype=torch.int32, device=experts.device)
    _align_kernel[(count,)](key.to(torch.int32), block_start, sorted_ids, block_expert, rows, BLOCK_T=BLOCK_T, BLOCK_M=BLOCK_M)
    return sorted_ids, block_expert


def moe_experts(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, top_k] global expert ids
    weights: torch.Tensor,  # [N, top_k] renormalised router weights, x.dtype
    gate_up: torch.Tensor,  # [C, 2I, H] experts [first, first + C), gate rows first
    down: torch.Tensor,  # [C, H, I]
    first: int = 0,
) -> torch.Tensor:  # [N, H] fp32: sum over the held experts of weight * expert(x)
    assert x.dtype == gate_up.dtype == down.dtype, f"moe_experts: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}"
    n, hidden = x.shape
    top_k = experts.shape[1]
    count, two_i, _ = gate_up.shape
    inter = two_i // 2
    acc = torch.empty((n, hidden), dtype=torch.float32, device=x.device)
    if n == 0:
        return acc
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    experts, weights = experts.contiguous(), weights.contiguous()
    rows = n * top_k
    sorted_ids, block_expert = align(experts, first, count)
    nb = block_expert.shape[0]
    block_k = 32 if x.dtype == torch.float32 else 64
    hidden_rows = torch.empty((nb * BLOCK_M, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(nb, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, hidden_rows, sorted_ids, block_expert,
        rows, hidden, inter, count,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden_rows.stride(0),
        TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, DOT_F32=INTERPRET, num_warps=4,
    )
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(nb, triton.cdiv(hidden, BLOCK_N))](
        hidden_rows, down, out, sorted_ids, block_expert,
        rows, hidden, inter, count,
        hidden_rows.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, DOT_F32=INTERPRET, num_warps=4,
    )
    _combine_kernel[(triton.cdiv(n, BLOCK_TOK), triton.cdiv(hidden, BLOCK_H))](
        out, experts, weights, acc,
        n, hidden, first, count,
        out.stride(0), acc.stride(0),
        TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), BLOCK_TOK=BLOCK_TOK, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return acc
