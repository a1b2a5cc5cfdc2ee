"""Admits, runs and retires requests; preempts (recompute) when the KV pool runs out.

A step is either a prefill step (chunks of prompts, at most max_num_batched_tokens rows) or a decode
step (every running request past its prefill, k+1 rows each). Prefill comes first, as in
nano-vllm. A decode step reserves KV for k+1 new rows per request; if the pool cannot hold them,
the most recently admitted request is preempted: its blocks and state slot are freed and it is
re-queued, to be recomputed later from its tokens. Recompute is exact because every op is
row-invariant and the GDN recurrence is the same in prefill and decode.

A prompt is cut into pieces at multiples of `prefill_align` (when the budget allows at least one
such piece): the chunked GDN rule then always sees whole aligned chunks, and which rule a position
gets does not depend on the cut (layers/linear_attn.split_extend), so outputs do not depend on how
many requests shared the prefill steps either.

With a prefix cache, admission starts a request after its longest usable cached prefix (its pages
shared, its state restored), ends a prefill piece where the cache plans a state snapshot
(`Request.prefix_cut`, a multiple of `prefill_align`), and passes over a waiting request while
another one computes a prefix it shares. The KV pool reclaims cached pages nobody holds before a
request is ever preempted for lack of blocks, and only when the free and the reclaimable blocks
together are enough: an admission (or a growth) that fails anyway evicts nothing from the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.request import Request, RequestStatus
from freetoken.errors import FreetokenError


@dataclass
class PrefillChunk:
    request: Request
    start: int  # first position of the chunk
    length: int


@dataclass
class ScheduledStep:
    prefill: list[PrefillChunk]
    decode: list[Request]
    preempted: list[Request]


class Scheduler:
    def __init__(self, kv_pool: KVPool, state_pool: LinearStatePool | None, max_num_seqs: int, max_num_batched_tokens: int, num_draft_tokens: int, prefill_align: int = 64):
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.prefix_cache: PrefixCache | None = None  # set by the engine when the cache is on
        self.prefill_align = prefill_align if max_num_batched_tokens >= prefill_align else 1
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rows_per_decode = num_draft_tokens + 1
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        capacity = self.kv_pool.num_blocks * self.kv_pool.block_size
        longest = len(request.prompt_token_ids) + request.params.max_new_tokens + self.rows_per_decode
        if longest > capacity:
            raise FreetokenError(f"request {request.request_id} needs up to {longest} KV slots but the pool holds {capacity}")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        preempted: list[Request] = []
        chunks = self._schedule_prefill()
        if chunks:
            return ScheduledStep(prefill=chunks, decode=[], preempted=preempted)
        decode: list[Request] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.in_prefill:
                continue  # preempted while making room for an earlier request, or still prefilling
            need = request.num_cached_tokens + self.rows_per_decode
            while not self.kv_pool.can_grow(request.block_table, need):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self.kv_pool.grow(request.block_table, need)
                decode.append(request)
        if not decode and self.running:
            # Every running request is stuck mid-prefill on a full pool: free the newest one.
            if len(self.running) == 1:
                raise FreetokenError("the KV pool cannot hold a single request; raise --num-kv-blocks")
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
        return ScheduledStep(prefill=[], decode=decode, preempted=preempted)

    def continue_decode(self, batch: list[Request]) -> bool:
        """Grow the block tables of `batch` (running requests past their prompts) for one more decode step,
        unless that needs a decision schedule() would make: a waiting request may take a free seat, or
        the pool is short of blocks (preemption). Returns whether it grew them; if not, nothing changed."""
        if self.waiting and len(batch) < self.max_num_seqs:
            return False
        needs = [(r.block_table, r.num_cached_tokens + self.rows_per_decode) for r in batch]
        if sum(self.kv_pool.blocks_needed(table, n) for table, n in needs) > self.kv_pool.num_free_blocks:
            return False
        for table, n in needs:
            self.kv_pool.grow(table, n)
        return True

    def _schedule_prefill(self) -> list[PrefillChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[PrefillChunk] = []
        for request in self.running:
            if request.in_prefill and budget > 0:
                chunk = self._chunk(request, budget)
                if chunk is None:
                    break
                chunks.append(chunk)
                budget -= chunk.length
        cache, passed_over = self.prefix_cache, []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if cache is not None and cache.should_wait(request):
                passed_over.append(request)
                continue
            if self.state_pool is not None and self.state_pool.num_free_slots == 0:
                self.waiting.appendleft(request)
                break
            hit = cache.acquire(request) if cache is not None else []
            first = min(budget, request.num_prefill_tokens - request.num_cached_tokens)
            if not self.kv_pool.can_grow(request.block_table, request.num_cached_tokens + max(first, 1) + self.rows_per_decode):
                self.kv_pool.free(request.block_table)
                request.num_cached_tokens = 0
                self.waiting.appendleft(request)
                break
            request.status = RequestStatus.RUNNING
            if self.state_pool is not None:
                request.state_slot = self.state_pool.allocate()
            if cache is not None:
                cache.restore(request, hit)
            self.running.append(request)
            if request.in_prefill:
                chunk = self._chunk(request, budget)
                if chunk is not None:
                    chunks.append(chunk)
                    budget -= chunk.length
        self.waiting.extendleft(reversed(passed_over))
        return chunks

    def _chunk(self, request: Request, budget: int) -> PrefillChunk | None:
        remaining = request.num_prefill_tokens - request.num_cached_tokens
        length = min(budget, remaining)
        if request.num_cached_tokens < request.prefix_cut < request.num_cached_tokens + length:
            length = request.prefix_cut - request.num_cached_tokens  # a multiple of prefill_align too
        elif length < remaining:  # a cut inside the prompt lands on a multiple of prefill_align
            length -= (request.num_cached_tokens + length) % self.prefill_align
            if length <= 0:
                return None
        end = request.num_cached_tokens + length
        if not self.kv_pool.can_grow(request.block_table, end):
            return None
        self.kv_pool.grow(request.block_table, end)
        return PrefillChunk(request, request.num_cached_tokens, length)

    def preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(request)
        self.kv_pool.free(request.block_table)
        if request.state_slot is not None and self.state_pool is not None:
            self.state_pool.free(request.state_slot)
        request.state_slot = None
        if request in self.running:
            self.running.remove(request)
