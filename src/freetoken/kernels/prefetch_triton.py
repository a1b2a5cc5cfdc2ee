"""Read a weight into L2 ahead of its GEMM, on a side stream, while the decode step's latency-bound
kernels leave HBM idle.

Between a GDN layer's input projection and its output projection run the convolution, the
recurrence and the gated norm, and between an attention layer's qkv projection and o_proj the
norm + RoPE and the attention: short kernels that wait on latency, not bandwidth. `prefetch` forks
a side stream there and queues an L2 prefetch of every 128-byte line of the output projection's
weight (`prefetch.global.L2::evict_last`, no register result), so that projection streams from L2.
The side stream joins the step's stream at the end of the captured step (`join`), never before a
kernel of the step, so no kernel of the step waits for it and the PDL chain is untouched. Values
do not change: a prefetch only moves data into the cache.

Only on CUDA (the interpreter has no L2) and for small row counts (decode and verify: prefill
re-reads each weight tile from L2 anyway). PREFETCH = 0 turns it off (bench/variants.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PREFETCH = 1
MAX_ROWS = 64  # rows of a step up to which the layers prefetch
LINE = 128  # bytes an L2 prefetch covers
BYTES_PER_PROGRAM = 256 << 10
BLOCK_LINES = 1024  # lines a program queues per step of its loop

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_pending: set[torch.device] = set()


@triton.jit
def _prefetch_kernel(base_ptr, num_lines, LINES_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * LINES_PER_PROGRAM
    for i in tl.static_range(0, LINES_PER_PROGRAM, BLOCK):
        lines = first + i + tl.arange(0, BLOCK)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr + lines * 128, (lines < num_lines).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )


def applies(x: torch.Tensor) -> bool:
    """Whether a layer running on rows x [N, ...] prefetches its output projection."""
    return bool(PREFETCH) and x.is_cuda and x.shape[0] <= MAX_ROWS


def prefetch(weight: torch.Tensor) -> None:
    """Queue an L2 prefetch of all of `weight` (contiguous, on CUDA) on the device's side stream,
    after the work queued so far on the current stream."""
    device = weight.device
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    num_lines = triton.cdiv(weight.numel() * weight.element_size(), LINE)
    lines_per_program = BYTES_PER_PROGRAM // LINE
    base = weight.view(torch.uint8).view(-1) if weight.is_contiguous() else None
    if base is None:
        return
    with torch.cuda.stream(side):
        _prefetch_kernel[(triton.cdiv(num_lines, lines_per_program),)](base, num_lines, LINES_PER_PROGRAM=lines_per_program, BLOCK=BLOCK_LINES, num_warps=4)
    _pending.add(device)


def join() -> None:
    """Make each device's current stream wait for the prefetches queued on its side stream (a CUDA
    graph capture must end with its side streams joined)."""
    for device in list(_pending):
        torch.cuda.current_stream(device).wait_stream(_side_streams[device])
        _pending.discard(device)
