"""Sweep the paged attention's partition size and warps at the Qwen3.5-9B decode and verify shapes.

Times `attention_triton.paged_attention` (partition + merge kernels) inside a CUDA graph of
back-to-back calls, one per attention layer's cache, for one sequence of `--context` keys with 1
(decode) and k + 1 (verify) query rows, the block table padded to the engine's width. One JSON line
per (partition, warps, rows).

    python bench/attention_speed.py [--context 576] [-k 3]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from freetoken.kernels import attention_triton as at
from freetoken.kernels.batched import SeqBatch
from graph_timing import graph_us

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 16, 4, 256, 8, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("-k", type=int, default=3)
    args = ap.parse_args()
    max_blocks = -(-(args.context + 64) // BLOCK_SIZE)
    slots = max_blocks * BLOCK_SIZE
    caches = [(torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    table = torch.arange(max_blocks, dtype=torch.int32, device="cuda")
    shipped = (at.PARTITION, at.NUM_WARPS)
    for (partition, warps), rows in itertools.product(itertools.product((32, 64, 128), (2, 4, 8)), (1, args.k + 1)):
        at.PARTITION, at.BLOCK_N, at.NUM_WARPS = partition, partition, warps
        batch = SeqBatch((0,), (rows,), (args.context - rows,), (-1,), (table,), torch.device("cuda"))
        q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        gate = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        try:
            us = graph_us([lambda kc=kc, vc=vc: at.paged_attention(q, kc, vc, batch, BLOCK_SIZE, HEAD_DIM**-0.5, gate) for kc, vc in caches])
        except Exception as e:  # a tile that does not fit
            print(json.dumps({"partition": partition, "warps": warps, "rows": rows, "error": str(e)[:100]}), flush=True)
            continue
        print(json.dumps({"partition": partition, "warps": warps, "rows": rows, "context": args.context, "us_per_call": round(us, 2),
                          "shipped": (partition, warps) == shipped}), flush=True)


if __name__ == "__main__":
    main()
