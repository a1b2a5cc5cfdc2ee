"""Throughput of freetoken's torch GGUF dequantizers, in MB/s of packed input, on CPU or GPU.

Why: conversion time of large quantized GGUFs is dominated by dequantization; gguf-py's numpy
reference runs at 4-170 MB/s on a small CPU (shared/reference/gguf.md §5.2). This script measures
ours next to it (numpy only on CPU, with --numpy).

Usage: python bench/dequant_speed.py [--device cuda] [--mb 4] [--types Q8_0,Q4_K] [--numpy]
Writes bench/results/dequant_speed-<device>.json: one record per type with ms, MB/s packed and
M elements/s (warm: the best of --repeat timed calls after one untimed call).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from freetoken.converters.gguf_quants import QUANT_TYPES, TYPE_IDS, dequantize

F16_SCALES = {  # byte offsets of fp16 scale fields, made finite so timings do not hit NaN paths
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0],
    "IQ3_S": [0], "IQ1_S": [0], "IQ4_NL": [0], "IQ4_XS": [0], "Q2_0": [0],
}


def packed_blocks(name: str, mb: float, rng: np.random.Generator) -> np.ndarray:
    qt = QUANT_TYPES[TYPE_IDS[name]]
    n = max(1, int(mb * 1e6) // qt.type_size)
    if qt.block_size == 1:  # plain floats
        vals = rng.standard_normal(n * qt.type_size // (4 if name == "F32" else 2)).astype(np.float32)
        return (vals if name == "F32" else vals.astype(np.float16)).view(np.uint8).reshape(n, -1)
    raw = rng.integers(0, 256, size=(n, qt.type_size), dtype=np.uint8)
    scales = (rng.standard_normal((n, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2, 2)
    for i, off in enumerate(F16_SCALES.get(name, [])):
        raw[:, off : off + 2] = scales[:, i]
    return raw


def timed(fn, repeat: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mb", type=float, default=4.0, help="packed MB per type")
    ap.add_argument("--types", default=",".join(QUANT_TYPES[i].name for i in QUANT_TYPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--numpy", action="store_true", help="also time gguf-py's numpy dequantize (CPU)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    records = []
    for name in args.types.split(","):
        qt = QUANT_TYPES[TYPE_IDS[name]]
        raw = packed_blocks(name, args.mb, rng)
        numel = raw.size // qt.type_size * qt.block_size
        x = torch.from_numpy(raw).to(device)
        sec = timed(lambda: dequantize(x, TYPE_IDS[name], (numel,)), args.repeat, sync)
        rec = {"type": name, "packed_mb": raw.nbytes / 1e6, "ms": sec * 1e3, "mb_per_s": raw.nbytes / 1e6 / sec, "melem_per_s": numel / 1e6 / sec}
        if args.numpy and name != "Q2_0":
            import gguf

            qtype = gguf.GGMLQuantizationType[name]
            nsec = timed(lambda: gguf.quants.dequantize(raw, qtype), 1, lambda: None)
            rec["numpy_mb_per_s"] = raw.nbytes / 1e6 / nsec
        records.append(rec)
        print(f"{name:8s} {rec['ms']:9.2f} ms {rec['mb_per_s']:10.1f} MB/s {rec['melem_per_s']:10.1f} Melem/s"
              + (f"   numpy {rec['numpy_mb_per_s']:8.1f} MB/s" if "numpy_mb_per_s" in rec else ""))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from freetoken.bench import environment

    info = {"command": "python bench/dequant_speed.py " + " ".join(sys.argv[1:]), **environment(), "device": str(device),
            "threads": torch.get_num_threads(), "machine": platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    path = out / f"dequant_speed-{device.type}.json"
    path.write_text(json.dumps({"info": info, "results": records}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
