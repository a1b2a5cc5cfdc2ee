"""The hyper-connections' elementwise steps (Triton), as hc_ref.py: three launches where torch takes a
dozen.

- `_gates_kernel`, program (row): silu(d / S) of the merged down/inject projection's first r columns
  and 2 sigmoid(i / S) of the rest (the injection weights).
- `_mix_mean_kernel`, program (row, block of H): u = mean_s(sigmoid(up_s) * xn_s), the products
  added in stream order s = 0, 1, ... and divided by S.
- `_inject_kernel`, program (row, stream s): X_s + iw_s * y, and (NORM) the zero-centred norm of the
  sum with the stream's slice of the next hyper-connection's norm weight (`norm_triton.zc_norm`, the
  grouped norm's formula), so the next block reads its input without a launch of its own.

Every step rounds to the input dtype where hc_ref's torch op does: the quotients by S, each sigmoid
and silu, each product (compat_triton.mul_rn, so that no product is contracted into the sum after it),
each partial sum. Divisions are IEEE (div_rn); the kernels differ from the reference only in exp's
last bits. Every program reads one row, and its shapes are constants of the launch, so a row's bits
do not depend on the other rows of the call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import norm_triton, pdl
from freetoken.kernels.compat_triton import mul_rn  # (importing compat_triton applies its interpreter fix-up)

NUM_WARPS = 4
MIX_BLOCK_H = 1024  # features of H per mean program


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) of fp32 x, IEEE division (activation_ref's formula)."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))


@triton.jit
def _gates_kernel(
    a_ptr, g_ptr, w_ptr,
    R, K, stride_a, stride_g, stride_w, streams,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + row * stride_a + cols, mask=cols < R + K, other=0.0)
    dtype = a.dtype
    v = tl.div_rn(a.to(tl.float32), tl.full(cols.shape, 1.0, tl.float32) * streams).to(dtype).to(tl.float32)
    silu = tl.div_rn(v, 1.0 + tl.exp(-v)).to(dtype)
    tl.store(g_ptr + row * stride_g + cols, silu, mask=cols < R)
    weight = (2.0 * _sigmoid(v).to(dtype).to(tl.float32)).to(dtype)
    tl.store(w_ptr + row * stride_w + cols - R, weight, mask=(cols >= R) & (cols < R + K))


@triton.jit
def _mix_mean_kernel(
    up_ptr, xn_ptr, u_ptr,
    H, stride_up, stride_xn, stride_u,
    S: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in tl.static_range(S):
        up = tl.load(up_ptr + row * stride_up + s * H + cols, mask=mask, other=0.0)
        xn = tl.load(xn_ptr + row * stride_xn + s * H + cols, mask=mask, other=0.0)
        dtype = xn.dtype
        gate = _sigmoid(up.to(tl.float32)).to(dtype)
        product = mul_rn(gate.to(tl.float32), xn.to(tl.float32)).to(dtype).to(tl.float32)
        if s == 0:
            acc = product
        else:
            acc = (acc + product).to(dtype).to(tl.float32)
    u = tl.div_rn(acc, tl.full(acc.shape, 1.0, tl.float32) * S)
    tl.store(u_ptr + row * stride_u + cols, u.to(u_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _inject_kernel(
    x_ptr, y_ptr, w_ptr, norm_w_ptr, out_ptr, xn_ptr,
    H, stride_x, stride_y, stride_w, stride_out, stride_xn, eps,
    NORM: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    at = stream * H + cols
    x = tl.load(x_ptr + row * stride_x + at, mask=mask, other=0.0)
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    weight = tl.load(w_ptr + row * stride_w + stream)
    dtype = x.dtype
    added = mul_rn(y.to(tl.float32), weight.to(tl.float32)).to(dtype).to(tl.float32)
    total = (x.to(tl.float32) + added).to(dtype)
    tl.store(out_ptr + row * stride_out + at, total, mask=mask)
    if NORM:
        norm_w = tl.load(norm_w_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(xn_ptr + row * stride_xn + at, norm_triton.zc_norm(total, norm_w, H, eps).to(dtype), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (the kernels step rows by their stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def gates(down_inject: torch.Tensor, rank: int, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As hc_ref.gates: down_inject [N, rank + k] -> (silu(d / S) [N, rank], 2 sigmoid(i / S) [N, k])."""
    down_inject = _rows(down_inject)
    n, width = down_inject.shape
    g = torch.empty((n, rank), dtype=down_inject.dtype, device=down_inject.device)
    w = torch.empty((n, width - rank), dtype=down_inject.dtype, device=down_inject.device)
    if n:
        _gates_kernel[(n,)](
            down_inject, g, w, rank, width - rank, down_inject.stride(0), g.stride(0), w.stride(0), float(streams),
            BLOCK=triton.next_power_of_2(width), num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
    return g, w


def mix_mean(up: torch.Tensor, xn: torch.Tensor, streams: int) -> torch.Tensor:
    """As hc_ref.mix_mean: up, xn [N, S*H] -> mean_s(sigmoid(up_s) * xn_s) [N, H]."""
    up, xn = _rows(up), _rows(xn)
    n, wide = xn.shape
    h = wide // streams
    u = torch.empty((n, h), dtype=xn.dtype, device=xn.device)
    if n:
        block = min(MIX_BLOCK_H, triton.next_power_of_2(h))
        _mix_mean_kernel[(n, triton.cdiv(h, block))](
            up, xn, u, h, up.stride(0), xn.stride(0), u.stride(0), S=streams, BLOCK_H=block, num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
    return u


def inject(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As hc_ref.inject (norm_weight None: (X, None)) or hc_ref.inject_norm: x [N, S*H], y [N, H],
    weights [N, S], norm_weight [S*H] -> (X [N, S*H], its per-stream norm [N, S*H] or None)."""
    x, y, weights = _rows(x), _rows(y), _rows(weights)
    n, streams = weights.shape
    h = y.shape[1]
    norm = norm_weight is not None
    out = torch.empty_like(x)
    xn = torch.empty_like(x) if norm else None
    if n:
        norm_w, xn_out = (norm_weight.contiguous(), xn) if norm else (x, out)  # without a norm: pointers never read
        _inject_kernel[(n, streams)](
            x, y, weights, norm_w, out, xn_out, h, x.stride(0), y.stride(0), weights.stride(0), out.stride(0), xn_out.stride(0), eps,
            NORM=norm, BLOCK_H=triton.next_power_of_2(h), num_warps=norm_triton._row_warps(h, NUM_WARPS), **pdl.launch_kwargs(),
        )
    return out, xn
