"""Row-invariant linear layer y = x W^T (Triton), split-K with a fixed-order reduction.

The launch configuration is a function of (N, K, dtype) alone, never of M: every row goes through
the same tile shape, the same K split and the same summation order, so its result depends on its
own inputs only — decode (1 row), verify (k+1 rows) and prefill (many rows) agree bit for bit.

Decode is memory bound: the whole weight must stream from HBM once per step, so the grid must fill
the GPU even when N is small. Each program owns BLOCK_M rows x BLOCK_N features x one of SPLIT
slices of K. With SPLIT > 1 every program writes its fp32 partial tile to a workspace and bumps a
per-tile counter; the program that arrives last adds the SPLIT partials in slice order 0, 1, ...
(a fixed order, whoever arrives last) and stores the result, then resets the counter for the next
launch. The M tiles of one (feature, slice) block are adjacent in the launch order, so at batch
sizes above BLOCK_M the weight tile is re-read from L2, not HBM.

Calls with more than MAX_ROWS_PER_LAUNCH rows are cut into launches of that many rows (same
kernel, same configuration: the cut changes no bits), which bounds the workspace.

At decode sizes a caller whose output feeds a residual add + norm may leave the slices' sum to that
launch (`defer_sum`): the programs store their partials [SPLIT, M, N] and end, without the arrival
counter and the reload of the partials, two dependent round trips at the end of the launch; the
norm's launch adds them in slice order as it loads the row (`PendingSplitK`, norm_triton.load_row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels import pdl
from freetoken.kernels.compat_triton import INTERPRET

BLOCK_M = 16
MAX_ROWS_PER_LAUNCH = 1024
TARGET_PROGRAMS = 256  # programs per launch at M <= BLOCK_M: about two per SM on an H200 (bench/linear_graph_sweep.py)
NUM_WARPS = 4  # warps a program (a setting for bench/variants.py: decode keeps one to two programs an SM busy)
# K step on 16-bit weights (a setting for bench/variants.py; another K step sums in another order).
# H200, 35B-A3B decode step: 2.300 ms against 2.398 at 256 (logs/variants-35b-k-steps-f22e5a5.jsonl).
BLOCK_K = 128
# A Gated DeltaNet decode step runs its convolution in the input projection's launch (`linear_conv`),
# not a launch of its own.
CONV_IN_PROJECTION = True
# Up to this many rows a split-K linear asked to (`linear(defer_sum=True)`) leaves its slices' sum to
# the next residual add + norm, which loads the row anyway (`PendingSplitK`); 0: never.
DEFER_SUM_MAX_ROWS = 64


class PendingSplitK(NamedTuple):
    """A split-K linear's output before its slices are added: the consumer adds them in slice order
    in fp32 and rounds to `dtype`, as the last program of a tile would (the same bits)."""

    partials: torch.Tensor  # [SPLIT, M, N] fp32
    dtype: torch.dtype

    def add_zc_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float, prefetch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s) * (1 + w)) with s = this output + residual: `norm_triton.add_zc_rms_norm`, which adds
        the slices (and queues `prefetch`, an l2_prefetch.Span)."""
        from freetoken.kernels import norm_triton

        return norm_triton.add_zc_rms_norm(self, residual, weight, eps, prefetch)


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    split: int  # slices of K
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows [BLOCK_M] (axis 0) and features [BLOCK_N] (axis 1), and their in-range masks."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, k_begin, k_end, stride_xm, stride_wn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """The fp32 y^T tile [BLOCK_N, BLOCK_M] of features `cols` x rows `rows` over K in [k_begin, k_end),
    BLOCK_K at a time from k_begin up: the weight is the dot's wide (left) operand."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < k_end
        w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rows[None, :] * stride_xm + kk[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, lock_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DEFER: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    pid_s = tl.program_id(2)
    rows, cols, row_ok, col_ok = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = _tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, k_begin, k_end, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
    out_ptrs = y_ptr + rows[None, :] * stride_ym + cols[:, None]
    out_mask = row_ok[None, :] & col_ok[:, None]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    elif DEFER:  # the partial of slice pid_s, [SPLIT, M, N]: the consumer adds the slices
        tl.store(part_ptr + (pid_s * M + rows[None, :].to(tl.int64)) * N + cols[:, None], acc, mask=out_mask)
    else:
        tile = tl.program_id(1) * tl.cdiv(M, BLOCK_M) + tl.program_id(0)
        tile_ptrs = part_ptr + (tile * SPLIT) * (BLOCK_N * BLOCK_M) + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(tile_ptrs + pid_s * (BLOCK_N * BLOCK_M), acc)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            total = tl.load(tile_ptrs, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                total += tl.load(tile_ptrs + s * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
            tl.store(out_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _linear_conv_kernel(
    x_ptr, w_ptr, y_ptr, win_ptr, conv_w_ptr, slots_ptr,
    M, N, K, C,
    stride_xm, stride_wn, stride_ym, win_slot, win_t, conv_wc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    rows, cols, row_ok, col_ok = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N)
    conv = (cols < C)[:, None] & row_ok[None, :]  # [BLOCK_N, BLOCK_M] the convolved features
    # The rows' slots (host copies), the conv weights and the windows (this layer's, written a step
    # back): read before the wait, and the window's three taps summed while the previous kernel runs.
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    win = win_ptr + slot[None, :] * win_slot + cols[:, None]
    cw = conv_w_ptr + cols[:, None] * conv_wc
    x1 = tl.load(win + win_t, mask=conv, other=0.0)
    x2 = tl.load(win + 2 * win_t, mask=conv, other=0.0)
    acc_conv = tl.load(win, mask=conv, other=0.0).to(tl.float32) * tl.load(cw, mask=conv, other=0.0).to(tl.float32)
    acc_conv = acc_conv + x1.to(tl.float32) * tl.load(cw + 1, mask=conv, other=0.0).to(tl.float32)
    acc_conv = acc_conv + x2.to(tl.float32) * tl.load(cw + 2, mask=conv, other=0.0).to(tl.float32)
    w3 = tl.load(cw + 3, mask=conv, other=0.0).to(tl.float32)
    pdl.sync(PDL)
    acc = _tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, 0, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
    x3 = acc.to(y_ptr.dtype.element_ty)
    acc_conv = acc_conv + x3.to(tl.float32) * w3
    y = tl.where(conv, (acc_conv * tl.sigmoid(acc_conv)).to(y_ptr.dtype.element_ty), x3)
    tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], y, mask=row_ok[None, :] & col_ok[:, None])
    tl.store(win, x1, mask=conv)
    tl.store(win + win_t, x2, mask=conv)
    tl.store(win + 2 * win_t, x3.to(x1.dtype), mask=conv)


def config_for(n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """The launch configuration of an [N, K] weight: a function of the weight's shape and dtype only."""
    block_n, block_k = (64, 32) if dtype == torch.float32 else (64, BLOCK_K)
    n_tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = max(1, min(k_blocks // 4, TARGET_PROGRAMS // n_tiles))  # each slice keeps >= 4 K blocks
    # Fewer programs than the target, each with a long K loop: each keeps more loads in flight
    # (pipelining changes no bits). At K = 2048 three stages measured faster.
    stages = 5 if n_tiles * split < TARGET_PROGRAMS and k_blocks // split >= 32 else 3
    return LinearConfig(block_n, block_k, split, num_warps=NUM_WARPS, num_stages=stages)


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, partial_floats: int, num_locks: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(fp32 partials, int32 counters kept at zero between launches), grown on demand, never shrunk;
    the partials are made only once some launch needs them."""
    part, locks = _workspaces.get(device, (None, None))
    if partial_floats and (part is None or part.numel() < partial_floats):
        part = torch.empty(max(partial_floats, 1 << 20), dtype=torch.float32, device=device)
    if locks is None or locks.numel() < num_locks:
        locks = torch.zeros(max(num_locks, 1 << 14), dtype=torch.int32, device=device)
    _workspaces[device] = (part, locks)
    return part, locks


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """[>= count] int32 counters, zero between launches: the split-K tiles' here, and any other kernel
    whose last program to arrive finishes a tile (launches on a stream run one after another, and each
    resets the counters it used before it ends)."""
    return _workspace(device, 0, count)[1]


def reserve_workspace(device: torch.device, weights: list[torch.Tensor]) -> None:
    """Allocate the split-K workspace for these weights up front (before CUDA-graph capture)."""
    for w in weights:
        _launch_workspace(device, MAX_ROWS_PER_LAUNCH, w.shape[0], config_for(w.shape[0], w.shape[1], w.dtype))


def _launch_workspace(device: torch.device, m: int, n: int, cfg: LinearConfig):
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, cfg.block_n)
    return _workspace(device, tiles * cfg.split * cfg.block_n * BLOCK_M, tiles)


def conv_fusable(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, conv_weight: torch.Tensor) -> bool:
    """Whether `linear_conv` takes these: the projection in one launch a row block (no K split, a
    batch of at most MAX_ROWS_PER_LAUNCH rows) and a window of 3 (kernel 4), and CONV_IN_PROJECTION on."""
    n, k = weight.shape
    return (CONV_IN_PROJECTION and conv_weight.shape[1] == 4 and windows.shape[-2] == 3 and x.shape[0] <= MAX_ROWS_PER_LAUNCH
            and x.dtype == weight.dtype and config_for(n, k, weight.dtype).split == 1)


def linear_conv(
    x: torch.Tensor,  # [M, K], one decode row per sequence
    weight: torch.Tensor,  # [N, K], its first C output features the convolution's channels
    windows: torch.Tensor,  # [slots, 3, C] the convolution's window pool (raw inputs), advanced in place
    conv_weight: torch.Tensor,  # [C, 4]
    slots: torch.Tensor,  # [M] int32, each row's window slot
) -> torch.Tensor:  # [M, N] x.dtype
    """x @ weight^T with the decode step of the causal convolution on its first C features: those are
    silu(conv) as `conv_triton.causal_conv1d` gives them (same taps, same order; the window shifts
    in), the rest the plain linear's. Each feature tile is the plain linear's tile (same
    configuration), so the bits of both results are the unfused ops'. Requires `conv_fusable`."""
    m, k = x.shape
    n = weight.shape[0]
    c = conv_weight.shape[0]
    assert windows.shape[-1] == c and windows.stride(-1) == 1 and c <= n, f"linear_conv: windows {tuple(windows.shape)} for {c} of {n} features"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    conv_weight = conv_weight if conv_weight.stride(1) == 1 else conv_weight.contiguous()
    cfg = config_for(n, k, weight.dtype)
    _linear_conv_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n))](
        x, weight, y, windows, conv_weight, slots, m, n, k, c,
        x.stride(0), weight.stride(0), y.stride(0), windows.stride(0), windows.stride(1), conv_weight.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_F32=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(),
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, cfg: LinearConfig | None = None, defer_sum: bool = False) -> torch.Tensor | PendingSplitK:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x.dtype, fp32 accumulation. defer_sum: with a K split and
    at most DEFER_SUM_MAX_ROWS rows, the slices' partials instead (only `add_zc_rms_norm` and the MoE
    entry take them)."""
    assert x.dtype == weight.dtype, f"linear: x is {x.dtype}, weight is {weight.dtype}"
    m, k = x.shape
    n = weight.shape[0]
    cfg = cfg or config_for(n, k, weight.dtype)
    defer = defer_sum and cfg.split > 1 and 0 < m <= DEFER_SUM_MAX_ROWS
    # deferred: the partials [SPLIT, M, N] are the output, written directly (no workspace, no counters)
    y = torch.empty((cfg.split, m, n) if defer else (m, n), dtype=torch.float32 if defer else x.dtype, device=x.device)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split) * cfg.block_k
    for r0 in range(0, m, MAX_ROWS_PER_LAUNCH):  # deferred: one launch (m <= DEFER_SUM_MAX_ROWS)
        rows = min(MAX_ROWS_PER_LAUNCH, m - r0)
        part, locks = (y, y) if defer or cfg.split == 1 else _launch_workspace(x.device, rows, n, cfg)
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, cfg.block_n), cfg.split)
        _linear_kernel[grid](
            x[r0:], weight, y[r0:], part, locks, rows, n, k, k_per_split,
            x.stride(0), weight.stride(0), y.stride(-2),
            BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split, DEFER=defer, DOT_F32=INTERPRET,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(),
        )
    return PendingSplitK(y, x.dtype) if defer else y
