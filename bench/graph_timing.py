"""Timing helpers shared by the benchmark scripts (GPU only)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import triton

from freetoken.bench import replay_ms


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), as the performance model counts it."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * a.numel() / (ms * 1e-3)


def graph_us(calls: Sequence[Callable[[], object]], reps: int = 10) -> float:
    """Mean GPU microseconds per call of a CUDA graph that replays `calls` back to back (no launch
    overhead between them, as inside the engine's step graph). The calls run once eagerly first."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return replay_ms(graph, reps) * 1e3 / len(calls)
