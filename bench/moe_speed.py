"""Time the Triton MoE expert GEMMs at the Qwen3.5-35B-A3B decode shape: tile sweep, or the two row layouts.

    python bench/moe_speed.py            # sweep the GEMM tiles
    python bench/moe_speed.py layouts    # direct vs aligned row layout per token count (DIRECT_MAX_ROWS)

Calls are timed as a CUDA graph of back-to-back calls, each with its own routing (so its experts
stream from HBM), as inside the decode graph: a single timed launch at one token would measure
launch overhead. One JSON line per result.

Tile sweep: times `moe_triton.moe_experts` (gate_up, down, combine, and align where the token count
takes the aligned layout; up to DIRECT_MAX_ROWS routed rows the engine's route launch writes the
row blocks, so they are made outside the graph) for a few token counts with random distinct
experts per token, and reports the achieved bandwidth of the selected experts' weights (each
selected expert read once) against the copy bandwidth. First the gate_up tiles are swept with the
shipped down tiles, then the down tiles with the best gate_up tiles.

Layouts: the stacked block (`moe_experts_with_shared`, the shared expert as expert E, R = top_k + 1
rows per token) once with the direct row blocks made outside the graph (as route writes them) and
once with align inside it, per token count; `shipped` names the layout DIRECT_MAX_ROWS picks.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from freetoken.kernels import moe_route_triton as mr
from freetoken.kernels import moe_triton as mt
from graph_timing import copy_bandwidth, graph_us

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 256, 8


CALLS_PER_GRAPH = 16


def time_tokens(n: int, gate_up: torch.Tensor, down: torch.Tensor, bw: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n)
    calls, active = [], 0
    for _ in range(CALLS_PER_GRAPH):
        x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        experts = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K] for _ in range(n)]).int()
        weights = torch.full((n, TOP_K), 1.0 / TOP_K, device="cuda", dtype=torch.bfloat16)
        blocks = mr.direct_blocks(experts, 0, EXPERTS) if mr.is_direct(experts.numel()) else None  # route's, in the engine
        calls.append((x, experts, weights, blocks))
        active += experts.unique().numel()
    us = graph_us([lambda x=x, e=e, w=w, b=b: mt.moe_experts(x, e, w, gate_up, down, blocks=b) for x, e, w, b in calls])
    weight_bytes = active / CALLS_PER_GRAPH * 3 * HIDDEN * INTER * 2
    return {"tokens": n, "us": round(us, 2), "active_experts": active / CALLS_PER_GRAPH, "fraction_of_copy_bw": round(weight_bytes / (us * 1e-6) / bw, 3)}


def sweep_tiles(bw: float) -> None:
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * INTER**-0.5
    shipped = {"gate_up": (mt.GATE_UP_BLOCK_N, mt.GATE_UP_BLOCK_K, mt.GATE_UP_WARPS, mt.GATE_UP_STAGES),
               "down": (mt.DOWN_BLOCK_N, mt.DOWN_BLOCK_K, mt.DOWN_WARPS, mt.DOWN_STAGES)}
    grid = list(itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 5)))
    for which in ("gate_up", "down"):
        best = None
        for cfg in grid:
            prefix = "GATE_UP" if which == "gate_up" else "DOWN"
            for name, value in zip(("BLOCK_N", "BLOCK_K", "WARPS", "STAGES"), cfg):
                setattr(mt, f"{prefix}_{name}", value)
            try:
                rows = [time_tokens(n, gate_up, down, bw) for n in (1, 4, 64)]
            except Exception as e:  # a tile that does not fit in shared memory
                print(json.dumps({which: cfg, "error": str(e)[:100]}), flush=True)
                continue
            print(json.dumps({which: cfg, "shipped": cfg == shipped[which], "runs": rows}), flush=True)
            if best is None or rows[0]["us"] < best[1][0]["us"]:
                best = (cfg, rows)
        for name, value in zip(("BLOCK_N", "BLOCK_K", "WARPS", "STAGES"), best[0]):
            setattr(mt, f"{'GATE_UP' if which == 'gate_up' else 'DOWN'}_{name}", value)
        print(json.dumps({"best_" + which: best[0], "runs": best[1]}), flush=True)


def compare_layouts() -> None:
    gate_up = torch.randn(EXPERTS + 1, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    down = torch.randn(EXPERTS + 1, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * INTER**-0.5
    for n in (1, 2, 3, 4, 7, 8, 16, 32):
        gen = torch.Generator(device="cuda").manual_seed(n)
        calls = []
        for _ in range(CALLS_PER_GRAPH):
            x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            routed = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K] for _ in range(n)])
            experts = torch.cat([routed, torch.full((n, 1), EXPERTS, device="cuda")], dim=1).int()
            weights = torch.full((n, TOP_K), 1.0 / TOP_K, device="cuda", dtype=torch.bfloat16)
            gate = torch.randn(n, 1, device="cuda", dtype=torch.bfloat16, generator=gen)
            calls.append((x, experts, weights, gate, mr.direct_blocks(experts, 0, EXPERTS + 1)))
        direct = graph_us([lambda x=x, e=e, w=w, g=g, b=b: mt.moe_experts_with_shared(x, e, w, gate_up, down, g, b) for x, e, w, g, b in calls])
        aligned = graph_us([lambda x=x, e=e, w=w, g=g: mt.moe_experts_with_shared(x, e, w, gate_up, down, g, mr.align(e, 0, EXPERTS + 1)) for x, e, w, g, _ in calls])
        rows = n * (TOP_K + 1)
        print(json.dumps({"tokens": n, "rows": rows, "direct_us": round(direct, 2), "aligned_us": round(aligned, 2),
                          "shipped": "direct" if mr.is_direct(rows) else "aligned"}), flush=True)


def main() -> None:
    bw = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_bytes_per_s": bw, "gpu": torch.cuda.get_device_name(), "direct_max_rows": mr.DIRECT_MAX_ROWS}), flush=True)
    if sys.argv[1:] == ["layouts"]:
        compare_layouts()
    else:
        sweep_tiles(bw)


if __name__ == "__main__":
    main()
