"""Sweep launch configurations of the row-invariant Triton linear over the bench models' decode shapes.

For each weight shape [N, K] and row count M, times `linear_triton.linear` (CUDA events via
triton.testing.do_bench) and reports the achieved weight bandwidth (N*K*2 bytes per call) against
the copy bandwidth. Prints one JSON object per line; used to choose `config_for`.

    python bench/linear_speed.py [--quick | --splits]

--quick times the shipped configuration only; --splits times the shipped tile with every K split
(at M = 1), the choice `config_for` makes from the weight shape.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import triton

from freetoken.kernels import linear_triton as lt
from graph_timing import copy_bandwidth

SHAPES = {  # name: (N, K) of the 9B shape, projections merged as the runtime merges them
    "gdn_in (qkv|z|b|a)": (8192 + 4096 + 64, 4096),
    "attn_qkv": (8192 + 2048, 4096),
    "o_proj": (4096, 4096),
    "mlp_gate_up": (24576, 4096),
    "mlp_down": (4096, 12288),
    "lm_head": (248320, 4096),
    "mtp_fc": (4096, 8192),
    "35b: gdn_in": (8192 + 4096 + 64, 2048),
    "35b: gdn_out": (2048, 4096),
    "35b: attn_qkv": (8192 + 1024, 2048),
    "35b: shared_gate_up": (1024, 2048),
    "35b: shared_down": (2048, 512),
    "35b: router": (257, 2048),
    "35b: lm_head": (248320, 2048),
}


def main() -> None:
    quick = "--quick" in sys.argv
    bw = copy_bandwidth()
    if "--splits" in sys.argv:
        return split_sweep(bw)
    print(json.dumps({"copy_bandwidth_bytes_per_s": bw, "gpu": torch.cuda.get_device_name()}), flush=True)
    configs = [None]  # the shipped config_for choice
    if not quick:
        for bn, bk, warps, stages, target in itertools.product((64, 128), (128, 256), (4, 8), (3, 5), (256, 512, 1024)):
            configs.append((bn, bk, warps, stages, target))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            best = None
            for c in configs:
                if c is None:
                    cfg = lt.config_for(n, k, torch.bfloat16)
                else:
                    bn, bk, warps, stages, target = c
                    n_tiles, k_blocks = triton.cdiv(n, bn), triton.cdiv(k, bk)
                    cfg = lt.LinearConfig(bn, bk, max(1, min(k_blocks // 4, target // n_tiles)), warps, stages)
                try:
                    ms = triton.testing.do_bench(lambda: lt.linear(x, w, cfg), warmup=5, rep=20)
                except Exception as e:  # a config that does not compile (shared memory) is skipped
                    print(json.dumps({"shape": name, "m": m, "cfg": str(cfg), "error": str(e)[:120]}), flush=True)
                    continue
                frac = n * k * 2 / (ms * 1e-3) / bw
                row = {"shape": name, "n": n, "k": k, "m": m, "cfg": cfg.__dict__, "shipped": c is None, "us": round(ms * 1e3, 2), "fraction_of_copy_bw": round(frac, 3)}
                if c is None:
                    print(json.dumps(row), flush=True)
                if best is None or ms < best["us"] / 1e3:
                    best = dict(row)
            print(json.dumps({"best": best}), flush=True)


def split_sweep(bw: float) -> None:
    """Every K split of the shipped tile at M = 1, per shape: one JSON line per (shape, split)."""
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        shipped = lt.config_for(n, k, torch.bfloat16)
        k_blocks = triton.cdiv(k, shipped.block_k)
        for split in sorted({1, 2, 3, 4, 6, 8, 12, 16, shipped.split}):
            if split > k_blocks:
                continue
            cfg = lt.LinearConfig(shipped.block_n, shipped.block_k, split, shipped.num_warps, shipped.num_stages)
            ms = triton.testing.do_bench(lambda: lt.linear(x, w, cfg), warmup=5, rep=30)
            print(json.dumps({"shape": name, "n": n, "k": k, "split": split, "programs": triton.cdiv(n, cfg.block_n) * split, "shipped": split == shipped.split,
                              "us": round(ms * 1e3, 2), "fraction_of_copy_bw": round(n * k * 2 / (ms * 1e-3) / bw, 3)}), flush=True)


if __name__ == "__main__":
    main()
