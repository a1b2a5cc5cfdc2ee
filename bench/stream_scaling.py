"""How fast do G programs with the MoE gate_up's tile loop stream a fixed number of weight bytes? (GPU only)

The 35B-A3B decode gate_up runs 72 programs (9 routed rows x 8 feature tiles), each streaming 512 KiB
of its expert's gate and up rows in [64, 128] tiles, on a 132-SM H200. This times a kernel with the
same loop (two [64, BLOCK_K] weight tiles a K step, a wgmma against a [BLOCK_K, 16] activation tile,
fp32 accumulators) over the same 37.7 MB, cut into G programs by splitting the tiles' K range in
SPLIT slices (G = 72 * SPLIT) or by giving each program one of the two tiles (ONE_TILE: G = 144 * SPLIT),
at several pipeline depths. It answers whether more programs stream the experts faster, before any
kernel is rebuilt around it. Each call reads another of four weight copies, so nothing hits L2.

    python bench/stream_scaling.py > bench/results/logs/stream-scaling-<commit>.jsonl
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from graph_timing import copy_bandwidth, graph_us

HIDDEN, INTER, ROWS = 2048, 512, 9  # the 35B-A3B expert shape; routed rows + the shared expert
BLOCK_N, BLOCK_K, BLOCK_M = 64, 128, 16


@triton.jit
def _stream_kernel(w_ptr, x_ptr, out_ptr, K_SLICE: tl.constexpr, SPLIT: tl.constexpr, ONE_TILE: tl.constexpr,
                   H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_per_row: tl.constexpr = I // BLOCK_N * (2 if ONE_TILE else 1)
    unit = pid // SPLIT  # (row, feature tile [, which half]) of the gate_up weight
    k_lo = (pid % SPLIT) * K_SLICE
    row = unit // tiles_per_row
    tile = unit % tiles_per_row
    feats = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + row.to(tl.int64) * (2 * I * H)
    first = (tile * BLOCK_N + feats) if not ONE_TILE else ((tile // 2) * BLOCK_N + (tile % 2) * I + feats)
    acc_a = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K_SLICE, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + tl.arange(0, BLOCK_M)[None, :] * H + kk[:, None])
        wa = tl.load(w + first[:, None] * H + kk[None, :])
        acc_a = tl.dot(wa, x, acc_a)
        if not ONE_TILE:
            wb = tl.load(w + (first[:, None] + I) * H + kk[None, :])
            acc_b = tl.dot(wb, x, acc_b)
    out = out_ptr + pid * BLOCK_N * BLOCK_M + feats[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(out, acc_a + acc_b)


def time_config(weights: list[torch.Tensor], x: torch.Tensor, split: int, one_tile: bool, stages: int, bw: float) -> dict:
    programs = ROWS * INTER // BLOCK_N * (2 if one_tile else 1) * split
    out = torch.empty((programs, BLOCK_N, BLOCK_M), dtype=torch.float32, device="cuda")
    meta = dict(K_SLICE=HIDDEN // split, SPLIT=split, ONE_TILE=one_tile, H=HIDDEN, I=INTER, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M,
                num_warps=4, num_stages=stages)
    calls = [lambda w=w: _stream_kernel[(programs,)](w, x, out, **meta) for w in weights * 4]
    us = graph_us(calls)
    nbytes = weights[0].numel() * weights[0].element_size()
    return {"programs": programs, "split": split, "one_tile": one_tile, "stages": stages, "us": round(us, 2),
            "tb_per_s": round(nbytes / us / 1e6, 3), "fraction_of_copy_bw": round(nbytes / (us * 1e-6) / bw, 3)}


def main() -> None:
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                      "copy_bandwidth_bytes_per_s": bw, "bytes_per_call": ROWS * 2 * INTER * HIDDEN * 2}), flush=True)
    weights = [torch.randn(ROWS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    x = torch.randn(BLOCK_M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    for split, one_tile, stages in [(1, False, 5), (1, False, 4), (1, False, 3), (2, False, 3), (2, False, 4), (2, False, 5),
                                    (4, False, 2), (4, False, 3), (8, False, 2), (1, True, 3), (1, True, 5), (2, True, 3), (2, True, 2)]:
        print(json.dumps(time_config(weights, x, split, one_tile, stages, bw)), flush=True)


if __name__ == "__main__":
    main()
