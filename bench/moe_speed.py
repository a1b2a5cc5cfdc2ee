"""Sweep the tile sizes of the Triton MoE expert GEMMs at the Qwen3.5-35B-A3B decode shape.

Times `moe_triton.moe_experts` (align, gate_up, down, combine) for a few token counts with random
distinct experts per token, and reports the achieved bandwidth of the selected experts' weights
(each selected expert read once) against the copy bandwidth. Calls are timed as a CUDA graph of
back-to-back calls, each with its own routing (so its experts stream from HBM), as inside the
decode graph: a single timed launch at one token would measure launch overhead. First the gate_up tiles are swept
with the shipped down tiles, then the down tiles with the best gate_up tiles. One JSON line each.

    python bench/moe_speed.py
"""

from __future__ import annotations

import itertools
import json

import torch

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
        calls.append((x, experts, weights))
        active += experts.unique().numel()
    us = graph_us([lambda x=x, e=e, w=w: mt.moe_experts(x, e, w, gate_up, down) for x, e, w in calls])
    weight_bytes = active / CALLS_PER_GRAPH * 3 * HIDDEN * INTER * 2
    return {"tokens": n, "us": round(us, 2), "active_experts": active / CALLS_PER_GRAPH, "fraction_of_copy_bw": round(weight_bytes / (us * 1e-6) / bw, 3)}


def main() -> None:
    bw = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_bytes_per_s": bw, "gpu": torch.cuda.get_device_name()}), flush=True)
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


if __name__ == "__main__":
    main()
