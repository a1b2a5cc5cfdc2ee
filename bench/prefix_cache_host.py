"""Host-side CPU time of the prefix cache's bookkeeping (insert after each prefill step, reclaim when the
KV pool is short), without a model: requests are admitted, "prefilled" in pieces (block tables grown,
pages inserted) and finished, in batches, over a pool too small to keep every page.

Scenario: --systems system prompts of --shared tokens, each request one of them plus --suffix tokens
of its own; --running requests at a time, prefilled --chunk tokens per step; 16-token pages. Prints
one JSON line: the seconds spent in PrefixCache.insert and PrefixCache.reclaim (perf_counter, summed
over calls), their call counts, and the cache's counters and a checksum of the eviction order (the same
for the same behaviour).

    python bench/prefix_cache_host.py [--requests 2000] [--shared 2048] [--blocks 2400]
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import torch

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.request import Request
from freetoken.engine.spec_protocol import NoSpec
from freetoken.sampling import SamplingParams

BLOCK_SIZE = 16


def timed(cls, name: str, totals: dict[str, list[float]]) -> None:
    """Wrap cls.name so that each call adds its perf_counter seconds to totals[name]."""
    inner = getattr(cls, name)
    totals[name] = [0.0, 0]

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += 1

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--shared", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=80)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2400)
    args = ap.parse_args()
    totals: dict[str, list[float]] = {}
    timed(PrefixCache, "insert", totals)
    timed(PrefixCache, "reclaim", totals)
    evicted: list[int] = []  # blocks in eviction order
    remove = PrefixCache._remove
    PrefixCache._remove = lambda self, node: (evicted.append(node.block), remove(self, node))[1]

    pool = KVPool(1, args.blocks, BLOCK_SIZE, 1, 1, torch.float32, "cpu")
    cache = PrefixCache(pool, None, NoSpec(), prefill_align=BLOCK_SIZE, snapshot_budget_bytes=0)
    systems = [[10_000 * s + i for i in range(args.shared)] for s in range(args.systems)]
    prompts = [systems[r % args.systems] + [1_000_000 + r * args.suffix + i for i in range(args.suffix)] for r in range(args.requests)]
    start = time.perf_counter()
    for first in range(0, args.requests, args.running):
        batch = [Request(r, prompts[r], SamplingParams(max_new_tokens=1)) for r in range(first, min(first + args.running, args.requests))]
        for request in batch:
            cache.add(request)
            cache.restore(request, cache.acquire(request))
        while any(r.in_prefill for r in batch):
            for request in batch:
                if request.in_prefill:
                    end = min(request.num_cached_tokens + args.chunk, request.num_prefill_tokens)
                    assert pool.can_grow(request.block_table, end)
                    pool.grow(request.block_table, end)
                    request.num_cached_tokens = end
                    cache.after_prefill(request)
        for request in batch:
            cache.finish(request, request.num_cached_tokens)
            cache.release(request)
            pool.free(request.block_table)
    wall = time.perf_counter() - start
    stats = cache.stats
    print(json.dumps({
        "wall_s": round(wall, 3),
        "insert_s": round(totals["insert"][0], 3), "insert_calls": totals["insert"][1],
        "reclaim_s": round(totals["reclaim"][0], 3), "reclaim_calls": totals["reclaim"][1],
        "eviction_order_crc32": zlib.crc32(str(evicted).encode()), "hits": stats.hits, "cached_tokens": stats.cached_tokens, "evicted_pages": stats.evicted_pages, "pages": cache.num_pages,
    }))


if __name__ == "__main__":
    main()
