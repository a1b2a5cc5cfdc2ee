"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and later GPUs.

A decode step is a few hundred short kernels; between two of them the GPU pays the next kernel's
launch. With PDL every kernel is launched with the programmatic-stream-serialization attribute and
starts with `sync(PDL)`: `griddepcontrol.wait` (the previous kernel has finished and its writes are
visible) and then `griddepcontrol.launch_dependents` (the next kernel may be launched now). So the
launch of kernel i + 1 overlaps the work of kernel i while every kernel still starts its work after
the previous one ended, as without PDL: no result changes. Stream capture keeps the programmatic
edges in a CUDA graph. A kernel that follows a non-PDL kernel (a torch op) simply waits for it.

A kernel may load, before `sync`, what the launch just before it never writes. When kernel i + 1
starts, every program of kernel i has passed its own wait, so kernel i - 1 and all before it have
finished and their writes are visible: weights, host copies into the step's buffers (row metadata,
block tables) and buffers written two or more launches back are safe to read while kernel i still
runs. Not so behind a launch that waits on counters (`wait_count`, below): it lets kernel i + 1 start
before its own producer has ended, so there only buffers written three or more launches back are
safe (the MoE exit after down reads none of gate_up's routing, moe_exit_triton). Used for
dependent chains that would otherwise start after the wait: the MoE entry's gate rows, the MoE
down's row blocks, the GDN state tile, the attention's
metadata down to each key's cache slot, the convolution's row metadata (tests/kernels/test_pdl.py,
EARLY_READS, lists each kernel's early loads). Streaming weights ahead of the wait was measured on
the H200 and taken out, as it competes with the previous kernel's stream: L2 bulk prefetches
(35B-A3B step 2.73 -> 2.86 ms with the MoE down weights; 9B 221 -> 211 tok/s with the start of each
linear's rows) and each linear's first weight tile (9B 221.3 -> 210.8 tok/s across runs, no gain at
35B-A3B in the same run), and the MoE down's whole weight tile in each direct-layout program, its
expert known from its own routing, while gate_up streams (35B-A3B cut to 24 layers on an H100: 1.880
against 1.801 ms; logs/variants-35b-l24-down-preload-095c162-h100.jsonl). Releasing the next kernel
only after the K loop, so that its prefetches overlap just this kernel's tail, did not help either
(35B-A3B 2.541 ms without, 2.563 with the late release alone, 2.765 with the prefetches too;
bench/results/logs/variants-35b-late-prefetch-b8ccd62.jsonl), nor did prefetching each output
projection into L2 from a side stream forked after the input projection, while the latency-bound
kernels between them run (2.536 -> 2.646 ms; 9B 226.5 -> 216.9 tok/s;
logs/variants-*-side-prefetch-5721537.jsonl).

After its wait a latency-bound launch may prefetch the first MiB of the next GEMM's weight into L2,
from programs of its own that do nothing else (l2_prefetch.py): that paid, where streaming before the
wait did not.

A launch whose programs each need only part of the previous launch's output may wait for that part
instead (`release`, `wait_count`, `finish`): it lets the next kernel launch, spins on a counter that
the previous launch's programs raise with release semantics as they store their part, and waits for
the previous grid only at its end, so that a kernel waiting on it still finds every launch before
it finished. The MoE down launch waits so for its row's gate_up tiles (moe_triton.DOWN_WAITS_FOR_ROW).

Off under the interpreter, on GPUs before sm_90, and with FREETOKEN_PDL=0.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from freetoken.kernels.compat_triton import INTERPRET


@functools.cache
def enabled() -> bool:
    """Whether kernels launch with PDL on this process's CUDA device."""
    if INTERPRET or os.environ.get("FREETOKEN_PDL", "1") == "0":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def launch_kwargs() -> dict[str, bool]:
    """The launch arguments of a kernel that starts with `sync(PDL)`."""
    on = enabled()
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def sync(PDL: tl.constexpr):
    """The first statement of every kernel: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel launch, without waiting for the previous one (a launch that waits on counters)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_count(count_ptr, target, PERIOD: tl.constexpr):
    """Spin until the int32 counter at count_ptr reaches target modulo PERIOD (a power of two, the
    counter's rise over one use, so that it never needs resetting; gpu-scope acquire: the writes made
    before each raise of the counter are visible after)."""
    count = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while (count & (PERIOD - 1)) < target:
        count = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def finish(PDL: tl.constexpr):
    """The last statement of a launch that waited on counters: wait for the previous grid, so that
    this launch ends after it (the next kernel's `sync` then covers both)."""
    if PDL:
        gdc_wait()
