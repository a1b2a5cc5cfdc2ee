"""Radix cache of prompt prefixes over the paged KV pool: a request admitted with a prefix that an
earlier request computed reuses its KV pages and linear-attention state instead of prefilling it.

Layout. One tree node per page (block_size tokens): its key is the page's tokens (`page_key`), its
value the KV block that holds them (the pool's reference counts count the tree as one holder), so a
path from the root is a page-aligned prefix. The cache inserts a request's committed pages after
each of its prefill steps and when it finishes, and `acquire`s the longest usable path for a request
it admits: the request's block table starts with the path's blocks (shared, read-only: a request
writes only at positions past its cached ones) and its prefill starts after them. At least one
prompt row is always left to prefill, so the spec method sees the last prompt row as usual.
Unreferenced leaves are evicted least recently used first when the KV pool is short (`reclaim`): the
leaves wait in a heap ordered by last use (leaf_heap.py), so eviction never scans the tree. A node's
last use is the last lookup or insert whose path went through it. Each request keeps the path it
acquired and inserted, and its next insert goes on from there instead of looking its pages up again.

Images. Every image pad has the same token id, so a key also names the image content of its pads:
for each image with pads in the page, (the image's content hash, the place of the page's first pad
among the image's pads) (RequestImages.content_key). Two requests share a page only if their
prompts agree on every token and every image up to its end; the mRoPE positions of the rows, which
depend on the grids of the images before them, are then the same too (models/vision/prompt.py
lays positions out from the start of the prompt). A request whose hit covers every one of its pads
does not run the vision tower at all (engine.py).

Lookahead keys (DESIGN.md invariant 6). When the spec method writes draft rows into the pages
(MTP: its KV row at position p is a function of token p + 1), a page's key also holds the token
after it (with that token's image content if it is a pad), so a hit never reuses a draft row written
for another next token.

Draft context (invariant 7). A method that keeps per-position state outside the pages (DFlash's
context rows) exports it for every page the cache takes and imports it on a hit, so drafts after
a hit equal drafts without the cache.

Linear-attention state (hybrid models). A hit ends at a node that holds a snapshot of the state
at exactly that token boundary (state_snapshots.py), taken right after a prefill step ended there.
The boundaries are planned: the scheduler ends a prefill piece at the deepest point the request's
prompt shares with another live prompt (shared_prefixes.py), a multiple of the page and of the
prefill alignment. The GDN rule a position gets (chunked or recurrent, layers/linear_attn.py)
depends on the request's chunkable end, so a snapshot records the positions below it that ran the
chunked rule; a request may restore it only if it would give those positions the same rule. With
prefill cuts that are not multiples of the GDN chunk (a tiny prefill budget) there are no
snapshots, hence no hits on hybrid models.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.leaf_heap import LeafHeap
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.request import Request
from freetoken.engine.request_images import RequestImages
from freetoken.engine.shared_prefixes import SharedPrefixes
from freetoken.engine.spec_protocol import SpecMethod
from freetoken.engine.state_snapshots import SnapshotStore
from freetoken.layers.linear_attn import CHUNK


@dataclass(eq=False)
class Node:
    key: tuple  # page_key of the page's tokens (+ the next token with lookahead keys)
    block: int  # the KV block holding the page
    parent: Node | None
    num_tokens: int  # prefix length through this page
    children: dict[tuple, Node] = field(default_factory=dict)  # by key
    last_use: int = 0
    context: Any = None  # the spec method's export for this page (None if it keeps nothing outside the pages)
    snapshot: int | None = None  # SnapshotStore slot of the linear state at num_tokens
    snapshot_chunked: int = 0  # positions below it ran the chunked GDN rule in that state
    heap_entry: list | None = None  # its current entry in the LeafHeap (None: not placed there)
    evicted: bool = False


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # admissions that looked the cache up
    hits: int = 0  # admissions that reused at least one page
    cached_tokens: int = 0  # prompt tokens taken from the cache instead of prefilled
    evicted_pages: int = 0


class PrefixCache:
    def __init__(self, kv_pool: KVPool, state_pool: LinearStatePool | None, spec: SpecMethod, prefill_align: int,
                 snapshot_budget_bytes: int):
        self.kv_pool, self.spec = kv_pool, spec
        self.block_size = kv_pool.block_size
        self.lookahead = int(getattr(spec, "pages_hold_draft_rows", False))
        self.prefill_align = prefill_align
        exact_snapshots = prefill_align % CHUNK == 0  # else the GDN rule of a position depends on where the prefill was cut
        self.snapshots = None  # None: no linear-attention state to keep
        if state_pool is not None:
            self.snapshots = SnapshotStore(state_pool, snapshot_budget_bytes if exact_snapshots else 0, kv_pool.num_blocks)
        self.cut_multiple = math.lcm(self.block_size, prefill_align) if self.hybrid else self.block_size
        self.shared = SharedPrefixes()
        self.root = Node((), -1, None, 0)
        self.num_pages = 0
        self.context_bytes = 0  # held by the pages' spec exports
        self.stats = PrefixCacheStats()
        self.clock = 0
        self.leaves = LeafHeap()
        self.paths: dict[int, list[Node]] = {}  # request id -> the tree path it acquired and inserted, root first
        kv_pool.reclaimer = self

    @property
    def hybrid(self) -> bool:
        """Whether the model has linear-attention state (a hit must restore a snapshot of it)."""
        return self.snapshots is not None

    # -- the requests' lifecycle -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new request: count its prompt among the live ones."""
        prompt, bs = request.prompt_token_ids, self.block_size
        self.shared.add(request.request_id, [page_key(prompt, request.images, start, start + bs) for start in range(0, len(prompt) - bs + 1, bs)])

    def should_wait(self, request: Request) -> bool:
        """Whether admitting the request should wait for another request to finish computing a prefix it shares."""
        return self.shared.should_wait(request.request_id)

    def acquire(self, request: Request) -> list[Node]:
        """Start a request's block table with its longest usable cached prefix -> the matched path. Its pages
        are held (not evictable) from now on; they count as used only once the admission completes (`restore`)."""
        path = self.match(request)
        for node in path:
            self.kv_pool.share(node.block)
            request.block_table.append(node.block)
        request.num_cached_tokens = len(path) * self.block_size
        return path

    def restore(self, request: Request, path: list[Node]) -> None:
        """Complete an admission (the request holds its state slot now): restore the state at the end of
        the path and the method's draft context, and plan where the prefill ends a piece for a snapshot."""
        self._touch(path)
        self.paths[request.request_id] = path
        self.stats.lookups += 1
        if path:
            self.stats.hits += 1
            self.stats.cached_tokens += path[-1].num_tokens
            if self.hybrid:
                self.snapshots.restore(path[-1].snapshot, request.state_slot)
            self.spec.import_context(request, [node.context for node in path])
        request.prefix_cut = self._cut(request)
        if request.prefix_cut:
            self.shared.start_computing(request.request_id, request.prefix_cut // self.block_size)

    def after_prefill(self, request: Request) -> None:
        """A prefill step of the request was committed and observed: cache its full pages, and the state
        if the step ended at its planned cut."""
        at_cut = request.num_cached_tokens == request.prefix_cut
        self.insert(request, request.num_cached_tokens, snapshot=at_cut)
        if at_cut:
            self.shared.stop_computing(request.request_id)

    def finish(self, request: Request, observed_tokens: int) -> None:
        """The request is done: cache the pages of its first observed_tokens tokens (those whose rows the
        spec method has seen), then forget its prompt."""
        self.insert(request, min(observed_tokens, request.num_tokens), snapshot=False)
        self.shared.remove(request.request_id)

    def release(self, request: Request) -> None:
        """The request gave its pages and slot back (preempted or finished): it computes nothing for others now."""
        self.shared.stop_computing(request.request_id)
        self.paths.pop(request.request_id, None)

    # -- the tree --------------------------------------------------------------------------------
    def _key(self, tokens: list[int], images: RequestImages | None, page: int) -> tuple:
        start = page * self.block_size
        return page_key(tokens, images, start, start + self.block_size + self.lookahead)

    def match(self, request: Request) -> list[Node]:
        """The longest cached path the request may reuse: at most its prefill rows less one, ending at a
        node with a fitting state snapshot on hybrid models."""
        tokens, node, path = request.token_ids, self.root, []
        limit = request.num_prefill_tokens - 1
        while (len(path) + 1) * self.block_size <= limit:
            node = node.children.get(self._key(tokens, request.images, len(path)))
            if node is None:
                break
            path.append(node)
        if self.hybrid:
            chunkable = request.chunkable_end(self.prefill_align)
            while path and not _snapshot_fits(path[-1], chunkable):
                path.pop()
        return path

    def insert(self, request: Request, num_tokens: int, snapshot: bool) -> None:
        """Cache the full pages of the request's first num_tokens tokens (committed), and with `snapshot`
        the linear state of its slot, which must be at exactly num_tokens tokens."""
        num_pages = min(num_tokens, request.num_tokens - self.lookahead) // self.block_size
        path = self.paths.get(request.request_id, [])
        if path and path[-1].evicted:  # a page of it was someone else's, and was evicted: look the pages up again
            path = []
        path = path[:num_pages]
        node = path[-1] if path else self.root
        tokens = request.token_ids if num_pages > len(path) else []
        for page in range(len(path), num_pages):
            key = self._key(tokens, request.images, page)
            child = node.children.get(key)
            if child is None:
                block = request.block_table[page]
                self.kv_pool.share(block)
                start = page * self.block_size
                stop = start + self.block_size
                child = node.children[key] = Node(key, block, node, stop, context=self.spec.export_context(request, start, stop))
                self.num_pages += 1
                self.context_bytes += _nbytes(child.context)
            path.append(child)
            node = child
        self._touch(path)
        if len(path) >= len(self.paths.get(request.request_id, ())):
            self.paths[request.request_id] = path
        at_boundary = node is not self.root and node.num_tokens == num_tokens
        if snapshot and self.hybrid and at_boundary and node.snapshot is None:
            node.snapshot = self.snapshots.take(request.state_slot, on_evict=lambda n=node: setattr(n, "snapshot", None))
            node.snapshot_chunked = min(num_tokens, request.chunkable_end(self.prefill_align))

    def _cut(self, request: Request) -> int:
        """Where the request's prefill should end a piece so that the state there can be snapshotted for
        other live prompts sharing its prefix (0: nowhere, also when a hybrid model's state cannot be kept)."""
        if self.hybrid and not self.snapshots.num_slots:
            return 0
        shared = self.shared.shared_pages(request.request_id) * self.block_size
        end = min(shared, request.num_prefill_tokens - 1)
        if self.hybrid:
            end = min(end, request.chunkable_end(self.prefill_align))
        end = end // self.cut_multiple * self.cut_multiple
        return end if end > request.num_cached_tokens else 0

    def _touch(self, path: list[Node]) -> None:
        """A lookup or insert went down this path (root first): it is the most recently used, deepest last."""
        clock = self.clock
        for node in path:
            clock += 1
            node.last_use = clock
            if node.snapshot is not None:
                self.snapshots.touch(node.snapshot)
        self.clock = clock
        if path and not path[-1].children:
            self.leaves.push(path[-1])

    def reclaim(self, num_blocks: int) -> bool:
        """Evict num_blocks pages no request holds, least recently used leaves first (a parent joins the
        leaves when its last child goes), if there are that many; else evict none -> whether it evicted."""
        refs, root = self.kv_pool.ref_counts, self.root
        plan: list[Node] = []  # to evict, in order
        held: list[Node] = []  # leaves passed over: a request holds them
        uncovered: dict[Node, int] = {}  # parent -> its children not in the plan
        parents: list[tuple[int, int, Node]] = []  # heap of the parents whose every child is in the plan
        while len(plan) < num_blocks:
            oldest = self.leaves.peek_oldest()
            if parents and (oldest is None or parents[0][0] < oldest.last_use):
                node = heapq.heappop(parents)[2]
            elif oldest is not None:
                node = self.leaves.pop_oldest()
            else:
                break
            if refs[node.block] > 1:
                held.append(node)
                continue
            plan.append(node)
            parent = node.parent
            if parent is not root:
                uncovered[parent] = uncovered.get(parent, len(parent.children)) - 1
                if not uncovered[parent]:
                    heapq.heappush(parents, (parent.last_use, id(parent), parent))
        if len(plan) < num_blocks:
            for node in plan + held:
                if not node.children:  # it came out of the leaf heap: put it back
                    self.leaves.push(node)
            return False
        for node in plan:
            self._remove(node)
        for node in held + [parent for _, _, parent in parents]:
            self.leaves.push(node)  # leaves now, not evicted
        return True

    def _remove(self, node: Node) -> None:
        del node.parent.children[node.key]
        node.evicted = True
        if node.snapshot is not None:
            self.snapshots.drop(node.snapshot)
        self.kv_pool.release(node.block)
        self.num_pages -= 1
        self.context_bytes -= _nbytes(node.context)
        self.stats.evicted_pages += 1


def page_key(tokens: list[int], images: RequestImages | None, start: int, stop: int) -> tuple:
    """What the rows of tokens[start:stop] are a function of besides the tokens before them: their token
    ids, then the image content of the image pads among them (RequestImages.content_key)."""
    key = tuple(tokens[start:stop])
    return key if images is None else key + images.content_key(start, stop)


def _snapshot_fits(node: Node, chunkable_end: int) -> bool:
    """Whether the node's snapshot is the state a request with this chunkable end would have there."""
    return node.snapshot is not None and min(node.num_tokens, chunkable_end) == node.snapshot_chunked


def _nbytes(context: Any) -> int:
    """Bytes of the tensors in a spec export (a tensor, a tuple of them or None)."""
    if context is None:
        return 0
    if isinstance(context, (tuple, list)):
        return sum(_nbytes(c) for c in context)
    return context.nbytes
