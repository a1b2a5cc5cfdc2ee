"""Host time of one graphed decode step, without a GPU: the engine on the tiny bench shape on CPU, its
decode graphs replaced by stand-ins that skip capture and replay but keep the padding and the
staging copy. What is left is the Python of scheduling, staging, the read-back and the bookkeeping.

    python bench/host_step.py [--batch-size 1] [--steps 1000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from freetoken.bench import SHAPES, random_model
from freetoken.engine import cuda_graph
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams


class _NoGraph:
    def replay(self) -> None:
        """Nothing to launch."""


def stand_in_graphs(engine: LLMEngine, hidden_size: int) -> cuda_graph.DecodeGraphs:
    """Decode graphs whose steps return fixed results: no accepted draft, next token 1."""
    graphs = cuda_graph.DecodeGraphs(engine.model, engine.kv_pool, engine.state_pool, engine.device, engine.config.max_model_len // engine.config.block_size + 2, engine.config.max_num_seqs)

    def capture(groups, mode, greedy):
        b, rows = len(groups), len(groups[0].token_ids)
        staging = cuda_graph._Staging(b, rows, graphs.max_blocks, engine.device)
        return cuda_graph.GraphStep(_NoGraph(), staging, None, None, torch.zeros(b * rows, hidden_size), None, torch.tensor([[0] * b, [1] * b]))

    graphs._capture = capture
    return graphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cfg = SHAPES["tiny"]
    b = args.batch_size
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=b + 1, max_model_len=2 * args.steps + 64, cuda_graphs=False)
    engine = LLMEngine(random_model(cfg, "cpu", torch.float32, with_mtp=False), config)  # one spare state slot for the padding rows
    engine.graphs = stand_in_graphs(engine, cfg.hidden_size)
    for _ in range(b):
        engine.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=2 * args.steps, ignore_eos=True))
    for _ in range(21):  # the prefill, then warm steps
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"batch {b}: {(time.perf_counter() - start) / args.steps * 1e6:.1f} us of host time per decode step")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
