"""The prefix cache's bookkeeping without a model: the page tree over a refcounted KV pool, lookahead
keys, LRU reclaim (all or nothing, so a failed admission evicts nothing), the snapshot budget and the
shared-prefix planning.

Oracles: hand-counted page paths, reference counts, free-list sizes and eviction orders for small
hand-built prompts; the eviction order of a scan of the whole tree for a random one; snapshot
contents compared with the state written into the live slot before it was snapshotted.
"""

from __future__ import annotations

import torch

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.leaf_heap import MIN_REBUILD
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.prefix_cache import PrefixCache, page_key
from freetoken.engine.request import Request
from freetoken.engine.shared_prefixes import SharedPrefixes
from freetoken.engine.spec_protocol import NoSpec
from freetoken.engine.state_snapshots import SnapshotStore
from freetoken.forward_context import StateSpec
from freetoken.sampling import SamplingParams

BS = 4  # tokens per page


class LookaheadSpec(NoSpec):
    pages_hold_draft_rows = True


def _pool(num_blocks: int = 12) -> KVPool:
    return KVPool(1, num_blocks, BS, 1, 2, torch.float32, "cpu")


def _request(request_id: int, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_new_tokens=4))


def _computed(pool: KVPool, cache: PrefixCache, request: Request, num_tokens: int) -> None:
    """The request computed its first num_tokens tokens into blocks of its own, then they were cached."""
    pool.grow(request.block_table, num_tokens)
    request.num_cached_tokens = num_tokens
    cache.insert(request, num_tokens, snapshot=False)


def test_match_shares_the_longest_cached_page_path_and_counts_its_holders():
    pool = _pool()
    cache = PrefixCache(pool, None, NoSpec(), prefill_align=64, snapshot_budget_bytes=0)
    a = _request(0, range(1, 15))  # 14 tokens: 3 full pages
    _computed(pool, cache, a, 13)
    assert cache.num_pages == 3 and [pool.ref_counts[b] for b in a.block_table] == [2, 2, 2, 1]

    b = _request(1, list(range(1, 10)) + [99, 98, 97, 96])  # agrees with a on 9 tokens: 2 full pages
    path = cache.acquire(b)
    assert [n.block for n in path] == a.block_table[:2] and b.num_cached_tokens == 8
    assert [pool.ref_counts[x] for x in a.block_table[:2]] == [3, 3]

    c = _request(2, range(1, 10))  # 9 tokens: 8 prefill rows, of which one must be left to prefill
    assert len(cache.match(c)) == 1

    pool.free(a.block_table)
    pool.free(b.block_table)
    assert [pool.ref_counts[n.block] for n in path] == [1, 1]  # the tree alone holds them now
    assert pool.num_free_blocks == 12 - 3


def test_lookahead_keys_need_the_token_after_the_page():
    pool = _pool()
    cache = PrefixCache(pool, None, LookaheadSpec(), prefill_align=64, snapshot_budget_bytes=0)
    a = _request(0, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    _computed(pool, cache, a, 8)  # page 1 ends at token 8: its key holds token 8 (13) too
    assert [n.key for n in cache.root.children.values()] == [(5, 6, 7, 8, 9)]

    same_next = _request(1, [5, 6, 7, 8, 9, 10, 11, 12, 13, 50, 51, 52])
    other_next = _request(2, [5, 6, 7, 8, 9, 10, 11, 12, 40, 50, 51, 52])  # page 1 agrees, the token after it does not
    assert len(cache.match(same_next)) == 2
    assert len(cache.match(other_next)) == 1

    plain = PrefixCache(_pool(), None, NoSpec(), prefill_align=64, snapshot_budget_bytes=0)
    _computed(plain.kv_pool, plain, _request(0, a.prompt_token_ids), 8)
    assert len(plain.match(other_next)) == 2  # without draft rows in the pages the page alone decides


def test_the_pool_reclaims_unheld_cached_pages_least_recently_used_leaf_first():
    pool = _pool(6)
    cache = PrefixCache(pool, None, NoSpec(), prefill_align=64, snapshot_budget_bytes=0)
    old = _request(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    new = _request(1, [1, 2, 3, 4, 20, 21, 22, 23, 24])
    _computed(pool, cache, old, 8)
    pool.free(old.block_table)
    _computed(pool, cache, new, 8)  # its first page is a copy of old's first page: the tree keeps old's
    held = list(new.block_table)
    assert cache.num_pages == 3 and pool.num_free_blocks == 6 - 4

    table: list[int] = []
    assert pool.can_grow(table, 3 * BS)  # 2 free blocks, then the unheld leaf (old's page 2)
    pool.grow(table, 3 * BS)
    assert cache.num_pages == 2 and cache.stats.evicted_pages == 1
    assert not pool.can_grow(table, 4 * BS)  # old's page 1 is unheld, but its child (new's page 2) is held by `new`

    pool.free(new.block_table)  # its copy of page 1 was never cached: free at once
    assert pool.ref_counts[held[0]] == 0 and pool.can_grow(table, 4 * BS) and cache.num_pages == 2
    pool.grow(table, 4 * BS)
    assert pool.can_grow(table, 5 * BS)  # new's page 2 is a leaf no request holds now
    assert cache.num_pages == 1 and pool.ref_counts[held[1]] == 0


def _live_pool(slots: int = 3) -> LinearStatePool:
    return LinearStatePool(2, slots, (3, 5), (2, 4, 4), torch.float32, "cpu", (StateSpec("win", 1, (2,), torch.int64),))


def test_snapshot_budget_holds_whole_snapshots_and_drops_the_least_recently_used():
    live = _live_pool()
    budget = 2 * live.slot_bytes + live.slot_bytes // 2
    store = SnapshotStore(live, budget, max_slots=100)
    assert store.num_slots == 2
    dropped = []
    written = []
    for i in range(3):
        live.state.recurrent[:, 0].normal_()
        live.state.conv[:, 0].normal_()
        live.state.extra["win"][:, 0] = i
        written.append((live.state.recurrent[:, 0].clone(), live.state.conv[:, 0].clone()))
        store.take(0, on_evict=lambda i=i: dropped.append(i))
        if i == 1:
            store.touch(0)  # the first snapshot was used again: the second is now the oldest
        assert store.held_bytes <= budget
    assert dropped == [1]
    store.restore(0, 2)  # the slot of the first snapshot
    assert torch.equal(live.state.recurrent[:, 2], written[0][0]) and torch.equal(live.state.conv[:, 2], written[0][1])
    assert live.state.extra["win"][0, 2].tolist() == [0, 0]
    assert SnapshotStore(live, live.slot_bytes - 1, max_slots=100).num_slots == 0


def test_a_snapshot_is_usable_only_by_a_request_that_gives_its_positions_the_same_gdn_rule():
    pool, live = _pool(80), _live_pool()
    cache = PrefixCache(pool, live, NoSpec(), prefill_align=64, snapshot_budget_bytes=10 * live.slot_bytes)
    a = _request(0, range(1, 71))  # 70 tokens: chunkable end 64, positions 64.. run the recurrence
    a.state_slot = live.allocate()
    for end in (64, 68):  # prefill pieces ending at 64 and 68, each snapshotted
        pool.grow(a.block_table, end)
        a.num_cached_tokens = end
        cache.insert(a, end, snapshot=True)
    at_64, at_68 = cache.match(_request(9, range(1, 90)))[15], cache.match(_request(9, range(1, 72)))[-1]
    assert (at_64.num_tokens, at_64.snapshot_chunked) == (64, 64) and (at_68.num_tokens, at_68.snapshot_chunked) == (68, 64)

    same_rule = _request(1, list(range(1, 70)) + [500, 501])  # 71 tokens: chunkable end 64 as a's
    longer = _request(2, list(range(1, 70)) + [500] * 130)  # chunkable end 192: it would run 64..67 chunked
    assert cache.match(same_rule)[-1] is at_68
    assert cache.match(longer)[-1] is at_64
    assert cache.match(_request(3, range(1, 66))) == []  # 65 tokens: 63 may come from the cache, no snapshot below

    cut = PrefixCache(_pool(80), live, NoSpec(), prefill_align=8, snapshot_budget_bytes=10 * live.slot_bytes)
    assert cut.snapshots.num_slots == 0  # prefill cuts off the GDN chunk grid: a position's rule depends on the cut


def test_shared_prefixes_plan_cuts_and_hold_back_requests_that_share_a_prefix_being_computed():
    def pages(prompt: list[int]) -> list[tuple]:
        return [page_key(prompt, None, start, start + BS) for start in range(0, len(prompt) - BS + 1, BS)]

    shared = SharedPrefixes()
    shared.add(0, pages(list(range(20))))
    shared.add(1, pages(list(range(10)) + [99] * 10))
    shared.add(2, pages([7] * 20))
    assert [shared.shared_pages(i) for i in range(3)] == [2, 2, 0]
    shared.start_computing(0, 2)
    assert shared.should_wait(1) and not shared.should_wait(0) and not shared.should_wait(2)
    shared.stop_computing(0)
    assert not shared.should_wait(1)
    shared.remove(1)
    assert shared.shared_pages(0) == 0
    shared.remove(0)
    shared.remove(2)
    assert not shared.ids and not shared.counts


def test_reclaim_evicts_in_least_recently_used_order_with_parents_entering_at_their_own_last_use():
    pool = _pool(16)
    cache = PrefixCache(pool, None, NoSpec(), prefill_align=64, snapshot_budget_bytes=0)
    names: dict[int, str] = {}

    def computed(request_id: int, tokens: list[int], num_tokens: int, labels: list[str]) -> Request:
        request = _request(request_id, tokens)
        cache.restore(request, cache.acquire(request))
        _computed(pool, cache, request, num_tokens)
        names.update(zip(request.block_table[len(request.block_table) - len(labels):], labels))
        return request

    def used(request_id: int, tokens: list[int], num_pages: int) -> Request:
        request = _request(request_id, tokens)
        path = cache.acquire(request)
        assert len(path) == num_pages
        cache.restore(request, path)
        return request

    a = computed(0, list(range(1, 14)), 12, ["a1", "a2", "a3"])
    b = computed(1, list(range(1, 9)) + [50, 51, 52, 53, 99], 12, ["b3"])  # shares a1 a2
    c = computed(2, list(range(70, 83)), 8, ["c1", "c2"])
    for r in (a, b, c):
        pool.free(r.block_table)
    pool.free(used(3, list(range(1, 13)) + [60, 61], 3).block_table)  # a1 a2 a3 used again
    holds_c1 = used(4, [70, 71, 72, 73, 90, 91, 92, 93, 94], 1)
    pool.free(computed(5, [30, 31, 32, 33, 34], 4, ["g1"]).block_table)
    pool.free(used(6, list(range(1, 9)) + [40, 41], 2).block_table)  # a1 a2 used after a3 and g1

    evicted = []
    while True:
        free_before = pool.num_free_blocks
        cache.reclaim(1)
        if pool.num_free_blocks == free_before:
            break
        evicted.append(names[pool.free_blocks[-1]])
    # c2's parent c1 is held; a2 (used after a3 and g1) becomes a leaf when a3 goes but waits behind g1
    assert evicted == ["b3", "c2", "a3", "g1", "a2", "a1"]
    pool.free(holds_c1.block_table)
    cache.reclaim(1)
    assert names[pool.free_blocks[-1]] == "c1" and cache.num_pages == 0


def test_an_admission_that_cannot_fit_evicts_no_cached_page():
    from freetoken.engine.scheduler import Scheduler

    pool = _pool(10)
    cache = PrefixCache(pool, None, NoSpec(), prefill_align=64, snapshot_budget_bytes=0)
    scheduler = Scheduler(pool, None, max_num_seqs=4, max_num_batched_tokens=64, num_draft_tokens=0, prefill_align=BS)
    scheduler.prefix_cache = cache
    cached = _request(0, range(100, 109))
    _computed(pool, cache, cached, 8)
    pool.free(cached.block_table)  # 2 cached pages no request holds
    elsewhere: list[int] = []
    pool.grow(elsewhere, 6 * BS)  # 6 blocks in use: 2 free, 2 reclaimable

    too_long = _request(1, range(200, 230))  # 29 prefill rows + 1 decode row: 8 blocks
    scheduler.add(too_long)
    cache.add(too_long)
    assert scheduler.schedule().prefill == [] and list(scheduler.waiting) == [too_long]
    assert cache.num_pages == 2 and cache.stats.evicted_pages == 0 and pool.num_free_blocks == 2
    assert too_long.block_table == [] and too_long.num_cached_tokens == 0

    fits = _request(2, range(300, 314))  # 13 prefill rows + 1 decode row: 4 blocks, 2 of them reclaimed
    scheduler.waiting.clear()
    scheduler.add(fits)
    cache.add(fits)
    assert [c.request for c in scheduler.schedule().prefill] == [fits]
    assert cache.num_pages == 0 and cache.stats.evicted_pages == 2 and len(fits.block_table) == 4


def test_reclaim_order_equals_a_scan_of_the_whole_tree_after_many_touches():
    import random

    rng = random.Random(0)
    pool = _pool(400)
    cache = PrefixCache(pool, None, NoSpec(), prefill_align=64, snapshot_budget_bytes=0)
    holders = []
    for i in range(300):  # prompts over a small alphabet: deep shared paths, many touches, heap rebuilds
        request = _request(i, [rng.randrange(3) for _ in range(rng.randrange(5, 30))])
        cache.restore(request, cache.acquire(request))
        if request.num_cached_tokens < len(request.prompt_token_ids) - 1 and pool.can_grow(request.block_table, len(request.prompt_token_ids) - 1):
            _computed(pool, cache, request, len(request.prompt_token_ids) - 1)
        if rng.random() < 0.1:
            holders.append(request)
        else:
            cache.release(request)
            pool.free(request.block_table)
    assert cache.leaves.pushes > 2 * MIN_REBUILD

    def oldest_first(k: int) -> list[int]:  # the oracle: k evictions, each a scan of the whole tree
        nodes, stack = [], list(cache.root.children.values())
        while stack:
            nodes.append(stack.pop())
            stack.extend(nodes[-1].children.values())
        gone: dict[int, int] = {}  # id -> block, in eviction order
        for _ in range(k):
            leaves = [n for n in nodes if id(n) not in gone and pool.ref_counts[n.block] == 1 and all(id(c) in gone for c in n.children.values())]
            if not leaves:
                return []
            oldest = min(leaves, key=lambda n: n.last_use)
            gone[id(oldest)] = oldest.block
        return list(gone.values())

    while want := oldest_first(3):
        assert cache.reclaim(3) and list(pool.free_blocks)[-3:] == want
    assert not cache.reclaim(3) and cache.num_pages > 0  # fewer than 3 left that no request holds: none evicted
    for request in holders:
        pool.free(request.block_table)
    assert cache.reclaim(cache.num_pages) and cache.num_pages == 0 and pool.num_free_blocks == 400
