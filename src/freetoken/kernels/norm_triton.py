"""RMSNorm variants (Triton): zero-centred, plain, gated and residual-add + zero-centred; one program per row.

The zero-centred form also normalises grouped rows (`grouped_zc_rms_norm`: one RMS per group of a
wide row, each group with its own slice of the weight) as rows of one group each, whose weight
slice is their row index modulo the groups.

The residual-add form (and the MoE entry, moe_gate_triton) also takes a split-K linear's deferred
output (linear_triton.PendingSplitK) and adds its slices as it loads the row (`load_row`).

Each program normalises one row of D elements with a single fp32 reduction over a fixed
BLOCK_D = next_pow2(D) block, so a row's bits never depend on how many rows the launch has. The
casts follow `norm_ref`: the zero-centred form multiplies by (1 + w) in fp32 and casts once; the
plain and gated forms cast the normalised value to the input dtype, multiply by w (rounded to the
output dtype), and the gated form then multiplies by act(z) in fp32 and casts again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, l2_prefetch, pdl  # noqa: F401  (compat_triton: interpreter fix-up)

_ACTS = {"silu": 0, "sigmoid": 1}
# The gated form's warps (rows of at most 4096; the GDN output heads are 128 wide). H200, 35B-A3B decode step
# (logs/variants-35b-small-kernels.jsonl): 2.515 ms at one warp against 2.525 at four, 2.523 at two.
GATED_WARPS = 1
# `add_zc_rms_norm` at D <= 4096, and the MoE entry (moe_gate_triton), so their h has the same bits. H200,
# 35B-A3B decode step (logs/variants-35b-add-norm-warps.jsonl): 2.529 ms at 4 warps, 2.543 at 8, 2.566 at 2 or 16.
ADD_NORM_WARPS = 4


def _row_warps(d: int, warps: int) -> int:
    """A row kernel's warps: `warps` up to 4096 features, 8 above."""
    return warps if d <= 4096 else 8


@triton.jit
def _rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr,
    D, stride_x, stride_z, stride_y, eps,
    z_heads, z_head_stride,  # z row r is at (r // z_heads) * stride_z + (r % z_heads) * z_head_stride
    w_groups,  # row r reads weight[(r % w_groups) * D :][:D] (1: every row reads the whole weight)
    MODE: tl.constexpr,  # 0 zero-centred, 1 plain, 2 gated
    ACT: tl.constexpr,  # 0 silu, 1 sigmoid (gated only)
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    n = x * rstd
    w = tl.load(w_ptr + (row % w_groups) * D + cols, mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        y = n * (1.0 + w)
    else:
        y = (w * n.to(x_raw.dtype).to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
        if MODE == 2:
            z = tl.load(z_ptr + (row // z_heads) * stride_z + (row % z_heads) * z_head_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if ACT == 0:
                y = y * (z * tl.sigmoid(z))
            else:
                y = y * tl.sigmoid(z)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float, mode: int, act: int, out_dtype: torch.dtype,
            d: int | None = None) -> torch.Tensor:
    """The row kernel over x viewed as rows of d (default: its last dim) features; weight [w_groups * d]."""
    d = d or x.shape[-1]
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    z_heads, z_head_stride = 1, 0
    if z is not None and z.dim() == 3 and z.stride(-1) == 1:  # e.g. a column slice of a merged projection, viewed per head
        z2, z_heads, z_head_stride = z, z.shape[1], z.stride(1)
    else:
        z2 = x2 if z is None else z.reshape(-1, d)
        z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, z2, weight.contiguous(), y, d, x2.stride(0), z2.stride(0), y.stride(0), eps, z_heads, z_head_stride, weight.numel() // d,
            MODE=mode, ACT=act, BLOCK_D=triton.next_power_of_2(d), num_warps=_row_warps(d, GATED_WARPS if mode == 2 else 4), **pdl.launch_kwargs(),
        )
    return y.view(x.shape)


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = norm(x) * (1 + w) in x.dtype; x [..., D], weight [D]."""
    return _launch(x, None, weight, eps, 0, 0, x.dtype)


def grouped_zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """y = norm(x) * (1 + w) in x.dtype with one RMS per `group`-wide slice; x [..., G * group], weight [G * group]."""
    assert x.shape[-1] == weight.numel() and x.shape[-1] % group == 0
    return _launch(x, None, weight, eps, 0, 0, x.dtype, d=group)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * norm(x).to(x.dtype); x [..., D], weight [D]."""
    return _launch(x, None, weight, eps, 1, 0, torch.promote_types(x.dtype, weight.dtype))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "silu") -> torch.Tensor:
    """y = (w * norm(x).to(x.dtype)) * act(gate) in x.dtype; x, gate [..., D], weight [D]."""
    y = _launch(x, gate, weight, eps, 2, _ACTS[act], torch.promote_types(x.dtype, weight.dtype))
    return y.to(x.dtype)


@triton.jit
def load_row(x_ptr, row, cols, mask, stride_x, stride_xs, X_SPLIT: tl.constexpr, dtype: tl.constexpr):
    """Row `row` of x at `cols` in fp32: x's own values, or (X_SPLIT slices of a deferred split-K linear,
    linear_triton.PendingSplitK) the slices added in order in fp32 and rounded to dtype, as the
    linear's last program rounds them."""
    if X_SPLIT == 0:
        xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, X_SPLIT):
            xf += tl.load(x_ptr + s * stride_xs + row * stride_x + cols, mask=mask, other=0.0)
        xf = xf.to(dtype).to(tl.float32)
    return xf


@triton.jit
def zc_norm(s, w, D, eps):
    """The zero-centred norm of one row s [BLOCK_D] (the residual sum, rounded) -> norm(s) * (1 + w) in
    fp32. One definition, so every kernel that adds and normalises a row (here, the MoE entry and
    exit) gives it the same bits."""
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / D + eps)
    return sf * rstd * (1.0 + w)


def row_source(x) -> tuple[torch.Tensor, int, int, int]:
    """(pointer tensor, row stride, slice stride, X_SPLIT) of a row-kernel input: a tensor [N, D], or a
    deferred split-K linear's partials [SPLIT, N, D]."""
    from freetoken.kernels.linear_triton import PendingSplitK

    if isinstance(x, PendingSplitK):
        split, n, d = x.partials.shape
        return x.partials, d, n * d, split
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, x.stride(0), 0, 0


@triton.jit
def _add_zc_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, sum_ptr, y_ptr,
    D, stride_x, stride_xs, stride_r, stride_s, stride_y, eps, pf_ptr, pf_lines, num_rows,
    X_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    if PREFETCH:  # the programs past the launch's rows prefetch the next GEMM's weight (l2_prefetch)
        if tl.program_id(0) >= num_rows:
            l2_prefetch.run(pf_ptr, pf_lines, num_rows, PDL)
            return
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xf = load_row(x_ptr, row, cols, mask, stride_x, stride_xs, X_SPLIT, sum_ptr.dtype.element_ty)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    s = (xf + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded like a torch add
    tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, zc_norm(s, w, D, eps).to(y_ptr.dtype.element_ty), mask=mask)


def add_zc_rms_norm(x, residual: torch.Tensor, weight: torch.Tensor, eps: float, prefetch: l2_prefetch.Span | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) * (1 + w)) with s = x + residual in residual.dtype; x [N, D] (or a deferred split-K
    linear's output, linear_triton.PendingSplitK), residual [N, D]. prefetch: queued by extra programs
    of the launch (l2_prefetch)."""
    n, d = residual.shape
    x, stride_x, stride_xs, x_split = row_source(x)
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    s = torch.empty_like(residual)
    y = torch.empty_like(residual)
    if n:
        extra, pf_args = l2_prefetch.launch_args(prefetch, 1, s)
        _add_zc_rms_norm_kernel[(n + extra,)](
            x, residual, weight.contiguous(), s, y, d, stride_x, stride_xs, residual.stride(0), s.stride(0), y.stride(0), eps,
            num_rows=n, **pf_args, X_SPLIT=x_split, BLOCK_D=triton.next_power_of_2(d), num_warps=_row_warps(d, ADD_NORM_WARPS), **pdl.launch_kwargs(),
        )
    return s, y


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, I, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf * tl.sigmoid(gf)).to(g.dtype)  # F.silu rounds to the input dtype before the product
    tl.store(y_ptr + row * stride_y + cols, (act.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [N, 2I] = [gate | up] -> [N, I]."""
    n, two_i = gate_up.shape
    i = two_i // 2
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    y = torch.empty((n, i), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = min(1024, triton.next_power_of_2(i))
        _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up, y, i, gate_up.stride(0), y.stride(0), BLOCK=block, num_warps=4, **pdl.launch_kwargs())
    return y
