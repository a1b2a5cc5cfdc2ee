"""A Gated DeltaNet layer's output: the gated RMSNorm and out_proj in one launch (Triton).

y = gated_rms_norm(core, z) @ W^T with core, z [N, Hv, D] (the recurrence's output and the gate) and
W [Nout, Hv * D]. Program (m, n, s) owns BLOCK_M rows x BLOCK_N output features x HEADS consecutive
value heads of K: for each of its heads in order it normalises the rows' D values (the casts of
norm_triton's gated form), gates them and multiplies them into the fp32 tile [BLOCK_N, BLOCK_M], the
weight tile the dot's left operand as in linear_triton. The SPLIT = Hv / HEADS slices of K are added
as the split-K linear adds its own (`linear_triton.store_tile`: the last program of a tile adds them
in slice order, or the next residual add + norm does, `PendingSplitK`). The configuration depends on
(Hv, D, Nout) alone and a row's norm reads only that row, so a row's bits never depend on the batch.

Waiting per head (`HeadReady`): the recurrence (gdn_triton.gdn_fused with head_ready) raises a
counter per value head as each of its programs stores its outputs. A launch given those counters
loads its weight tiles and the norm weight (never written by a kernel, pdl.py), lets the next
kernel launch, and then waits only for its own heads' counters instead of the whole recurrence, so
its weight streams in while the recurrence runs. Past its wait each program raises its heads'
counters, which takes each to the next multiple of PERIOD over one use (pdl.wait_count), and it
ends waiting for the recurrence's grid (pdl.finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freetoken.kernels import linear_triton, pdl
from freetoken.kernels.compat_triton import INTERPRET
from freetoken.kernels.linear_triton import BLOCK_M, LinearConfig, PendingSplitK

BLOCK_N = 64
NUM_WARPS = 8
MAX_HEADS = 1024  # value heads a layer may have (the counters per device)
# A head counter's rise over one use (recurrence + this launch), fixed so that it never depends on the
# batch; the int32 counters wrap at a multiple of it.
PERIOD = 1 << 20
_ACTS = {"silu": 0, "sigmoid": 1}


@dataclass(frozen=True)
class HeadReady:
    """The counters the recurrence raises per value head, and how many of its programs raise each
    (num_seqs * gdn_triton.value_tiles(D)): `gated_out_proj` waits for each head's count."""

    counters: torch.Tensor  # [MAX_HEADS] int32, a multiple of PERIOD between uses
    target: int


_head_ready: dict[torch.device, torch.Tensor] = {}


def head_ready_counters(device: torch.device) -> torch.Tensor:
    """int32 [MAX_HEADS]: a counter per value head, shared by the GDN layers of a step one after
    another, a multiple of PERIOD between uses; one set per device, made on first use (before any
    graph capture). A CUDA device without an index is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _head_ready:
        _head_ready[device] = torch.zeros(MAX_HEADS, dtype=torch.int32, device=device)
    return _head_ready[device]


def config_for(num_heads: int, head_dim: int) -> LinearConfig:
    """The launch configuration: K in slices of HEADS heads, HEADS the largest of 4, 2, 1 dividing Hv."""
    heads = next(h for h in (4, 2, 1) if num_heads % h == 0)
    return LinearConfig(BLOCK_N, heads * head_dim, num_heads // heads, num_warps=NUM_WARPS, num_stages=1)


@triton.jit
def _gated_head(o_ptrs, z_ptrs, row_ok, norm_w, eps, D: tl.constexpr, ACT: tl.constexpr, Y_F32: tl.constexpr):
    """The dot's right operand [D, BLOCK_M] of one value head from its core and gate tiles o_ptrs,
    z_ptrs [D, BLOCK_M]: the rows' gated norm in core's dtype, norm_triton's gated form with its casts
    (w * norm(o) rounded to the norm's output dtype: fp32 if Y_F32, else core's), norm_w [D] fp32."""
    o_raw = tl.load(o_ptrs, mask=row_ok[None, :], other=0.0)
    o = o_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)  # [BLOCK_M]
    y = norm_w[:, None] * (o * rstd[None, :]).to(o_raw.dtype).to(tl.float32)
    if not Y_F32:
        y = y.to(o_raw.dtype).to(tl.float32)
    z = tl.load(z_ptrs, mask=row_ok[None, :], other=0.0).to(tl.float32)
    if ACT == 0:
        y = y * (z * tl.sigmoid(z))
    else:
        y = y * tl.sigmoid(z)
    return y.to(o_raw.dtype)


@triton.jit
def _dot(w, x, acc, DOT_F32: tl.constexpr):
    """acc + w @ x in fp32 (DOT_F32: the operands upcast, for the interpreter)."""
    if DOT_F32:
        w, x = w.to(tl.float32), x.to(tl.float32)
    return tl.dot(w, x, acc, input_precision="ieee")


@triton.jit(do_not_specialize=["M", "target"])
def _gated_out_kernel(
    core_ptr, z_ptr, norm_w_ptr, w_ptr, y_ptr, part_ptr, lock_ptr,
    ready_ptr, target,  # WAIT: wait for each head's counter to reach target (mod PERIOD)
    M, N, eps,
    stride_cm, stride_ch, stride_zm, stride_zh, stride_wn, stride_ym,
    D: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DEFER: tl.constexpr,
    ACT: tl.constexpr, Y_F32: tl.constexpr, DOT_F32: tl.constexpr, WAIT: tl.constexpr, PERIOD: tl.constexpr, PDL: tl.constexpr,
):
    head0 = tl.program_id(2) * HEADS
    rows, cols, row_ok, col_ok = linear_triton.tile_rows_cols(M, N, BLOCK_M, BLOCK_N)
    ds = tl.arange(0, D)
    # Weights: read before the wait (pdl.py), so that they stream in while the recurrence runs.
    w_tile = w_ptr + cols[:, None] * stride_wn + head0 * D + ds[None, :]  # [BLOCK_N, D] of head head0
    w0 = tl.load(w_tile, mask=col_ok[:, None], other=0.0)
    if HEADS > 1:
        w1 = tl.load(w_tile + D, mask=col_ok[:, None], other=0.0)
    if HEADS > 2:
        w2 = tl.load(w_tile + 2 * D, mask=col_ok[:, None], other=0.0)
        w3 = tl.load(w_tile + 3 * D, mask=col_ok[:, None], other=0.0)
    norm_w = tl.load(norm_w_ptr + ds).to(tl.float32)
    if WAIT:  # only this program's heads of the recurrence, not its whole grid (pdl.py)
        pdl.release(PDL)
        for j in tl.static_range(HEADS):
            pdl.wait_count(ready_ptr + head0 + j, target, PERIOD)
        # Past the wait: together the programs of a head take its counter to the next multiple of PERIOD.
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        rise = tl.where(first, PERIOD - target - tl.num_programs(0) * tl.num_programs(1) + 1, 1)
        for j in tl.static_range(HEADS):
            tl.atomic_add(ready_ptr + head0 + j, rise, sem="relaxed", scope="gpu")
    else:
        pdl.sync(PDL)
    o_tile = core_ptr + rows[None, :] * stride_cm + head0 * stride_ch + ds[:, None]  # [D, BLOCK_M] of head head0
    z_tile = z_ptr + rows[None, :] * stride_zm + head0 * stride_zh + ds[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _dot(w0, _gated_head(o_tile, z_tile, row_ok, norm_w, eps, D, ACT, Y_F32), acc, DOT_F32)
    if HEADS > 1:
        acc = _dot(w1, _gated_head(o_tile + stride_ch, z_tile + stride_zh, row_ok, norm_w, eps, D, ACT, Y_F32), acc, DOT_F32)
    if HEADS > 2:
        acc = _dot(w2, _gated_head(o_tile + 2 * stride_ch, z_tile + 2 * stride_zh, row_ok, norm_w, eps, D, ACT, Y_F32), acc, DOT_F32)
        acc = _dot(w3, _gated_head(o_tile + 3 * stride_ch, z_tile + 3 * stride_zh, row_ok, norm_w, eps, D, ACT, Y_F32), acc, DOT_F32)
    linear_triton.store_tile(acc, y_ptr, part_ptr, lock_ptr, rows, cols, row_ok, col_ok, M, N, stride_ym, BLOCK_M, BLOCK_N, SPLIT, DEFER)
    if WAIT:
        pdl.finish(PDL)


def gated_out_proj(
    core: torch.Tensor,  # [N, Hv, D], D a power of two >= 16
    z: torch.Tensor,  # [N, Hv, D], any row and head strides
    norm_weight: torch.Tensor,  # [D]
    eps: float,
    act: str,  # "silu" or "sigmoid"
    weight: torch.Tensor,  # [Nout, Hv * D], core's dtype
    defer_sum: bool = False,
    ready: HeadReady | None = None,
) -> torch.Tensor | PendingSplitK:  # [N, Nout] core.dtype
    """out_proj(gated_rms_norm(core, z)) as `norm_triton.gated_rms_norm` then `linear_triton.linear`
    round it (the same casts; the dot's summation order is this launch's own). defer_sum: with a K
    split and at most DEFER_SUM_MAX_ROWS rows the slices' partials (`PendingSplitK`), as `linear`
    gives them. ready: the recurrence's head counters to wait on (one launch: at most
    MAX_ROWS_PER_LAUNCH rows); None waits for the previous launch as a whole."""
    m, num_heads, d = core.shape
    n = weight.shape[0]
    assert z.shape == core.shape and norm_weight.shape == (d,) and weight.shape[1] == num_heads * d, "gated_out_proj: shapes"
    assert core.dtype == weight.dtype and d >= 16 and d & (d - 1) == 0, f"gated_out_proj: {core.dtype} core, {weight.dtype} weight, head dim {d}"
    y_dtype = torch.promote_types(core.dtype, norm_weight.dtype)  # the gated norm's output dtype
    assert y_dtype in (core.dtype, torch.float32)
    cfg = config_for(num_heads, d)
    defer = defer_sum and cfg.split > 1 and 0 < m <= linear_triton.DEFER_SUM_MAX_ROWS
    y = torch.empty((cfg.split, m, n) if defer else (m, n), dtype=torch.float32 if defer else core.dtype, device=core.device)
    if m == 0:
        return y
    if ready is not None:
        programs = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
        assert m <= linear_triton.MAX_ROWS_PER_LAUNCH and num_heads <= ready.counters.numel() and ready.target + programs <= PERIOD
    core = core if core.stride(-1) == 1 else core.contiguous()
    z = z if z.stride(-1) == 1 else z.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    for r0 in range(0, m, linear_triton.MAX_ROWS_PER_LAUNCH):  # deferred or waiting: one launch
        rows = min(linear_triton.MAX_ROWS_PER_LAUNCH, m - r0)
        part, locks = (y, y) if defer or cfg.split == 1 else linear_triton.launch_workspace(core.device, rows, n, cfg)
        _gated_out_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N), cfg.split)](
            core[r0:], z[r0:], norm_weight.contiguous(), weight, y[r0:], part, locks,
            y if ready is None else ready.counters, 0 if ready is None else ready.target,  # an unread stand-in without
            rows, n, eps, core.stride(0), core.stride(1), z.stride(0), z.stride(1), weight.stride(0), y.stride(-2),
            D=d, HEADS=cfg.block_k // d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=cfg.split, DEFER=defer,
            ACT=_ACTS[act], Y_F32=y_dtype != core.dtype, DOT_F32=INTERPRET, WAIT=ready is not None, PERIOD=PERIOD,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(),
        )
    return PendingSplitK(y, core.dtype) if defer else y
