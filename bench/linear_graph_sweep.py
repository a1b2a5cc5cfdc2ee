"""Sweep the row-invariant Triton linear's launch configuration the way a decode step sees it.

Each (shape, config) is timed as a CUDA graph of back-to-back calls at M rows, every call on its own
copy of the weight (copies rotate through more than the L2 cache holds), so a call streams its
weight from HBM and pays no launch overhead, as inside the decode graph. Prints one JSON line per
measurement and, per shape, the best configuration against the shipped one; the last line sums the
shipped and the best times over the calls of one Qwen3.5-9B decode step.

    python bench/linear_graph_sweep.py [--m 1] [--m 4] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from freetoken.kernels import linear_triton as lt
from graph_timing import copy_bandwidth, graph_us

SHAPES_9B = {  # name: (N, K, calls per decode step) of the 9B shape, projections merged as the runtime merges them
    "gdn_in": (8192 + 4096 + 64, 4096, 24),
    "gdn_out": (4096, 4096, 24),
    "attn_qkv": (8192 + 2048, 4096, 8),
    "o_proj": (4096, 4096, 8),
    "mlp_gate_up": (24576, 4096, 32),
    "mlp_down": (4096, 12288, 32),
    "lm_head": (248320, 4096, 1),
}
SHAPES_35B = {  # the Qwen3.5-35B-A3B shape's dense linears
    "35b_gdn_in": (8192 + 4096 + 64, 2048, 30),
    "35b_gdn_out": (2048, 4096, 30),
    "35b_attn_qkv": (8192 + 1024, 2048, 10),
    "35b_o_proj": (2048, 4096, 10),
    "35b_gates": (257, 2048, 40),
    "35b_shared_gate_up": (1024, 2048, 40),
    "35b_shared_down": (2048, 512, 40),
    "35b_lm_head": (248320, 2048, 1),
}
L2_BYTES = 64 << 20
CALLS_PER_GRAPH = 16


def configs(n: int, k: int, quick: bool):
    yield lt.config_for(n, k, torch.bfloat16)
    if quick:
        return
    for bn, bk, warps, stages, target in itertools.product((64, 128), (128, 256), (4, 8), (3, 5), (264, 528)):
        n_tiles, k_blocks = triton.cdiv(n, bn), triton.cdiv(k, bk)
        yield lt.LinearConfig(bn, bk, max(1, min(k_blocks // 2, target // n_tiles)), warps, stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, action="append")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", action="append")
    ap.add_argument("--model", choices=("9b", "35b"), default="9b")
    args = ap.parse_args()
    ms = args.m or [1]
    bw = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_bytes_per_s": bw, "gpu": torch.cuda.get_device_name()}), flush=True)
    totals = {m: {"shipped_us": 0.0, "best_us": 0.0} for m in ms}
    for name, (n, k, calls) in (SHAPES_9B if args.model == "9b" else SHAPES_35B).items():
        if args.shape and name not in args.shape:
            continue
        copies = max(2, min(CALLS_PER_GRAPH, -(-2 * L2_BYTES // (n * k * 2))))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        lt.reserve_workspace(torch.device("cuda"), weights[:1])
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            seen, best, shipped = set(), None, None
            for cfg in configs(n, k, args.quick):
                if cfg in seen:
                    continue
                seen.add(cfg)
                try:
                    us = graph_us([lambda w=weights[i % copies], c=cfg: lt.linear(x, w, c) for i in range(CALLS_PER_GRAPH)])
                except Exception as e:  # a config that does not compile (shared memory) is skipped
                    print(json.dumps({"shape": name, "m": m, "cfg": cfg.__dict__, "error": str(e)[:100]}), flush=True)
                    continue
                row = {"shape": name, "n": n, "k": k, "m": m, "cfg": cfg.__dict__, "programs": triton.cdiv(n, cfg.block_n) * cfg.split,
                       "us": round(us, 2), "fraction_of_copy_bw": round(n * k * 2 / (us * 1e-6) / bw, 3)}
                print(json.dumps(row), flush=True)
                if shipped is None:
                    shipped = row
                if best is None or us < best["us"]:
                    best = row
            print(json.dumps({"best": best, "shipped": shipped}), flush=True)
            totals[m]["shipped_us"] += calls * shipped["us"]
            totals[m]["best_us"] += calls * best["us"]
    print(json.dumps({f"{args.model}_step_linear_totals": totals}), flush=True)


if __name__ == "__main__":
    main()
