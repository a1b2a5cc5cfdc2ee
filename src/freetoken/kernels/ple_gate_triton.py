"""The PLE layer's gated value (Triton): gv and its per-stream norm gvn, as `ple_ref.gated_value`.

Program (row, s) owns stream s of one row: g = <k_s, q_s> / sqrt(H) as one fp32 reduction over a
fixed BLOCK_H block (so a row's bits never depend on how many rows the launch has), rounded to the
input dtype like the reference; g <- sign(g) sqrt_rn(max(|g|, 1e-6)) rounded again;
gv_s = sigmoid(g) v rounded; gvn_s = the zero-centred norm of gv_s with the stream's weight slice
(`norm_triton.zc_norm`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, norm_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)

NUM_WARPS = 4


@triton.jit
def _gated_value_kernel(
    k_ptr, q_ptr, v_ptr, w_ptr, gv_ptr, gvn_ptr,
    H, stride_k, stride_q, stride_v, stride_gv, stride_gvn, inv_sqrt_h, eps,
    BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    at = stream * H + cols
    k = tl.load(k_ptr + row * stride_k + at, mask=mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + row * stride_q + at, mask=mask, other=0.0).to(tl.float32)
    v_raw = tl.load(v_ptr + row * stride_v + cols, mask=mask, other=0.0)
    dtype = v_raw.dtype
    g = (tl.sum(k * q, axis=0) * inv_sqrt_h).to(dtype).to(tl.float32)
    root = tl.sqrt_rn(tl.maximum(tl.abs(g), 1e-6)).to(dtype).to(tl.float32)
    g = tl.where(g > 0, root, tl.where(g < 0, -root, 0.0))
    gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    gv = (gate * v_raw.to(tl.float32)).to(dtype)
    tl.store(gv_ptr + row * stride_gv + at, gv, mask=mask)
    w = tl.load(w_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(gvn_ptr + row * stride_gvn + at, norm_triton.zc_norm(gv, w, H, eps).to(dtype), mask=mask)


def gated_value(k: torch.Tensor, q: torch.Tensor, v: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """k, q [N, S*H] (normed key and query streams), v [N, H], norm_weight [S*H] -> gv, gvn [N, S*H] in v.dtype."""
    n, h = v.shape
    streams = k.shape[1] // h
    k, q, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, q, v))
    gv = torch.empty((n, streams * h), dtype=v.dtype, device=v.device)
    gvn = torch.empty_like(gv)
    if n:
        _gated_value_kernel[(n, streams)](
            k, q, v, norm_weight.contiguous(), gv, gvn, h, k.stride(0), q.stride(0), v.stride(0), gv.stride(0), gvn.stride(0),
            1.0 / math.sqrt(h), eps, BLOCK_H=triton.next_power_of_2(h), num_warps=NUM_WARPS, **pdl.launch_kwargs(),
        )
    return gv, gvn
