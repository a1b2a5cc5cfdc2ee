"""Where a decode step's GPU time goes: per-kernel totals of eager decode steps (torch.profiler).

Builds a random-weight model of a bench shape, prefills one prompt, then profiles a few eager decode
(or verify, with -k) steps and prints the kernels by total time per step, the kernel count per step
and the sum of kernel time, as JSON lines. The gap between that sum and the graphed step time of
`freetoken bench` is launch overhead.

    python bench/profile_step.py --shape qwen3.5-9b [-k 3] [--steps 4]

--host profiles the host side of graphed steps instead (cProfile, by cumulative time) and splits
each step's wall time: before the replay is launched, the replay on the GPU (CUDA events around
the staging copy and the graph), and after it.

--graph profiles graphed steps as they run (PDL overlaps each kernel's launch with the previous
kernel, so kernel durations overlap): each kernel is charged its critical-path increment, the time
from the later of its start and the previous kernel's end to its own end. Prints, per kernel name and
grid, the increment and duration per step, then the kernels of one step in order (first --top).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import torch

from freetoken.bench import SHAPES, random_model
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("-k", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host", action="store_true", help="profile the host side of graphed steps (cProfile) instead")
    ap.add_argument("--graph", action="store_true", help="critical-path time per kernel of graphed steps instead")
    ap.add_argument("--layers", type=int, default=0, help="keep the shape's first LAYERS layers (a GPU with less memory than the whole shape needs)")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    if args.layers:
        layer_types = cfg.layer_types[: args.layers]
        cfg = dataclasses.replace(cfg, num_hidden_layers=len(layer_types), layer_types=layer_types)
    spec = "oracle" if args.k else "none"
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=args.prompt_len, max_model_len=args.prompt_len + 64 + args.k + 2,
                          cuda_graphs=args.host or args.graph, spec=spec, num_draft_tokens=args.k)
    model = random_model(cfg, "cuda", torch.bfloat16, with_mtp=False)
    engine = LLMEngine(model, config)
    prompt = torch.randint(0, cfg.vocab_size - 16, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    if spec == "oracle":
        engine.spec.set_continuations({0: [7] * 64}, 0.0, 0)
    engine.add_request(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    if args.host:
        _host_profile(engine, args.steps, args.top)
        return
    if args.graph:
        _graph_profile(engine, args.steps, args.top)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time_total
            counts[e.name] += 1
    total_us = sum(totals.values()) / args.steps
    print(json.dumps({"shape": args.shape, "k": args.k, "kernels_per_step": sum(counts.values()) / args.steps, "kernel_us_per_step": round(total_us, 1)}))
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(json.dumps({"kernel": name[:90], "us_per_step": round(us / args.steps, 1), "calls_per_step": counts[name] / args.steps, "share": round(us / args.steps / total_us, 3)}))


def _graph_profile(engine, steps: int, top: int) -> None:
    """Per kernel (name, grid) of graphed steps: critical-path increment and duration per step (us)."""
    import os
    import tempfile

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    inc: dict[tuple, float] = defaultdict(float)
    dur: dict[tuple, float] = defaultdict(float)
    count: dict[tuple, int] = defaultdict(int)
    order, end = [], None
    for e in events:
        key = (e["name"][:60], tuple(e.get("args", {}).get("grid", ())))
        start, stop = e["ts"], e["ts"] + e["dur"]
        step = stop - (start if end is None else max(start, end))
        end = stop if end is None else max(end, stop)
        inc[key] += step
        dur[key] += e["dur"]
        count[key] += 1
        order.append((key, step, e["dur"]))
    total = sum(inc.values()) / steps
    print(json.dumps({"graphed": True, "kernels_per_step": len(events) / steps, "critical_path_us_per_step": round(total, 1)}))
    for key in sorted(inc, key=lambda k: -inc[k]):
        print(json.dumps({"kernel": key[0], "grid": key[1], "calls_per_step": count[key] / steps, "increment_us_per_step": round(inc[key] / steps, 1),
                          "duration_us_per_step": round(dur[key] / steps, 1), "share": round(inc[key] / steps / total, 3)}))
    per_step = len(events) // steps
    for key, step, d in order[per_step: per_step + top]:  # the second step, in launch order
        print(json.dumps({"seq": key[0], "grid": key[1], "increment_us": round(step, 2), "duration_us": round(d, 2)}))


def _host_profile(engine, steps: int, top: int) -> None:
    """cProfile of graphed steps, then each step split into host-before, GPU replay and host-after (ms)."""
    import cProfile
    import pstats
    import time

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)

    graphs, marks = engine.graphs, {}
    run = graphs.run

    def timed_run(*a, **kw):
        marks["launch"] = time.perf_counter()
        marks["start"].record()
        out = run(*a, **kw)
        marks["stop"].record()
        marks["launched"] = time.perf_counter()
        return out

    graphs.run = timed_run
    rows = []
    for _ in range(steps):
        marks.update(start=torch.cuda.Event(enable_timing=True), stop=torch.cuda.Event(enable_timing=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        rows.append({"step_ms": (t1 - t0) * 1e3, "host_before_launch_ms": (marks["launch"] - t0) * 1e3,
                     "launch_call_ms": (marks["launched"] - marks["launch"]) * 1e3, "gpu_replay_ms": marks["start"].elapsed_time(marks["stop"])})
    graphs.run = run
    mean = {key: round(sum(r[key] for r in rows) / len(rows), 4) for key in rows[0]}
    mean["host_after_ms"] = round(mean["step_ms"] - mean["host_before_launch_ms"] - mean["gpu_replay_ms"], 4)
    print(json.dumps(mean))


if __name__ == "__main__":
    main()
