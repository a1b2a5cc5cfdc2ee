"""L2 prefetch of a weight from a latency-bound launch, for the GEMM a launch or two later.

At decode a layer alternates weight-streaming GEMMs with short kernels that wait on latency, not
bandwidth: the GDN recurrence and its gated norm, the q/k norm + RoPE and the attention, the residual
add + norm (with a MoE block's combine or routing). While those run, HBM is idle. Such a launch can
take extra programs, appended past its own on grid axis 0, that wait for the previous kernel like
every program (`pdl.sync`), queue `prefetch.global.L2` of their share of the next GEMM's weight
(no register result: nothing waits for the lines) and end. The GEMM then finds the first bytes of its
weight in L2.

Where each prefetch is issued (the layers build the `Span`s):
  the GDN recurrence           -> out_proj                                          (OUT_PROJ_BYTES)
  the q/k norm + RoPE          -> o_proj                                            (OUT_PROJ_BYTES)
  a layer's input add + norm   -> its mixer's input projection                      (INPUT_BYTES)
  the MLP's add + norm         -> the dense gate_up, or the shared expert's gate_up (MLP_BYTES)

A launch only ends when its prefetch programs' lines have arrived, so a prefetch pays only while it
fits in the launch's own few microseconds: a few MiB. Measured on the H200 (bench/variants.py, one
process, two rounds; logs/variants-*-l2-prefetch-*.jsonl), 35B-A3B decode step: 2.373 ms without,
2.322-2.326 ms with out 4 / input 4 / MLP 4 MiB, and input 2 MiB 3-4 us faster than 4 (with MLP 4);
whole weights cost time instead (out_proj's 16 MiB: 2.40 ms; the input projection's first 32 MiB:
2.45 ms). At the 9B shape, whose GEMMs are long and near the bandwidth floor already, it gains
nothing: 4.316-4.318 ms without, 4.325-4.328 with 4 / 4 / 4 MiB, 4.312 with input 2 MiB alone.

The prefetch programs wait before they touch memory, so the weight's stream never competes with the
previous kernel's (streaming ahead of the wait measured slower; pdl.py). A prefetch moves no value:
the results are the same bits with and without it. Only on CUDA with PDL (the interpreter has no
L2 and no inline PTX) and for launches of at most MAX_ROWS rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freetoken.kernels import pdl

# Bytes of each weight prefetched (from its start) at each site; 0 turns the site off (bench/variants.py).
OUT_PROJ_BYTES = 4 << 20
INPUT_BYTES = 2 << 20
MLP_BYTES = 4 << 20
MAX_ROWS = 16  # rows of a launch up to which it prefetches (decode and verify at small batch)
PROGRAMS = 32  # at least this many prefetch programs a launch (128 measured slower at 35B-A3B)
LINE = 128  # bytes a prefetch covers (the literal 128 in `run`)


def site_bytes(site: str) -> int:
    """The bytes prefetched at a site (module docstring), read at each call (the switches may change)."""
    return {"out_proj": OUT_PROJ_BYTES, "input": INPUT_BYTES, "mlp": MLP_BYTES}[site]


@dataclass(frozen=True)
class Span:
    """The first bytes of a weight to prefetch into L2."""

    bytes: torch.Tensor  # [>= num_lines * LINE - LINE + 1] uint8 view of the weight's storage
    num_lines: int


def span(weight: torch.Tensor | None, rows: int, max_bytes: int) -> Span | None:
    """The prefetch of weight's first max_bytes by a launch over `rows` rows, or None where it does
    not apply (no weight, off, more than MAX_ROWS rows, not a contiguous CUDA tensor, no PDL)."""
    if weight is None or max_bytes <= 0 or rows == 0 or rows > MAX_ROWS or not weight.is_cuda or not weight.is_contiguous() or not pdl.enabled():
        return None
    flat = weight.view(-1).view(torch.uint8)
    nbytes = min(flat.numel(), max_bytes)
    return Span(flat, triton.cdiv(nbytes, LINE))


def launch_args(prefetch: Span | None, programs_per_row: int, fallback: torch.Tensor) -> tuple[int, dict]:
    """(rows to append to a launch's grid axis 0, whose other axes hold programs_per_row programs;
    the kernel arguments pf_ptr, pf_lines and PREFETCH) of an optional prefetch."""
    if prefetch is None:
        return 0, {"pf_ptr": fallback, "pf_lines": 0, "PREFETCH": False}
    return triton.cdiv(PROGRAMS, programs_per_row), {"pf_ptr": prefetch.bytes, "pf_lines": prefetch.num_lines, "PREFETCH": True}


@triton.jit
def run(pf_ptr, pf_lines, main_rows, PDL: tl.constexpr):
    """The body of a prefetch program (grid axis 0 at or past main_rows): wait like every program,
    then queue L2 prefetches of its share of the pf_lines lines of 128 bytes at pf_ptr."""
    np1 = tl.num_programs(1)
    np2 = tl.num_programs(2)
    share = ((tl.program_id(0) - main_rows) * np1 + tl.program_id(1)) * np2 + tl.program_id(2)
    num_shares = (tl.num_programs(0) - main_rows) * np1 * np2
    per_share = tl.cdiv(pf_lines, num_shares)
    first = share.to(tl.int64) * per_share
    end = tl.minimum(first + per_share, pf_lines)
    pdl.sync(PDL)
    for line0 in range(first, end, 256):  # 256 lines a step
        lines = line0 + tl.arange(0, 256)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [pf_ptr + lines * 128, (lines < end).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )
