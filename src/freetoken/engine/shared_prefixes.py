"""Which page-aligned prompt prefixes the live requests share, and which of them a running request is
computing now.

The prefix cache hands every prompt over as it is added, as the keys of its full pages (tokens and
image content: prefix_cache.page_key). They form a chain: page i's id names its key together with
the chain before it, so two prompts have the same id at page i exactly when their first i + 1 pages
agree. From the counts of the live prompts per id, the prefix
cache learns how deep a prompt shares its prefix with another one (where its prefill should end a
piece, so that the state there can be snapshotted), and the scheduler holds back a waiting request
while another request is computing a prefix it shares (it then starts from the cache instead of
computing the same prefix in the same steps).
"""

from __future__ import annotations


class SharedPrefixes:
    def __init__(self):
        self.ids: dict[tuple[int, tuple], int] = {}  # (previous page's id or -1, page key) -> id
        self.counts: dict[int, int] = {}  # id -> live prompts through it
        self.keys: dict[int, tuple[int, tuple]] = {}  # id -> its key (to forget unused ids)
        self.chains: dict[int, list[int]] = {}  # request id -> its prompt's page ids
        self.computing: dict[int, int] = {}  # page id -> the request computing the prefix that ends there
        self.next_id = 0

    def add(self, request_id: int, pages: list[tuple]) -> None:
        """Count a new live prompt, given as the keys of its full pages."""
        chain, previous = [], -1
        for page in pages:
            key = (previous, page)
            previous = self.ids.get(key, -1)
            if previous < 0:
                previous = self.ids[key] = self.next_id
                self.keys[previous] = key
                self.next_id += 1
            self.counts[previous] = self.counts.get(previous, 0) + 1
            chain.append(previous)
        self.chains[request_id] = chain

    def remove(self, request_id: int) -> None:
        """The request is done: forget its prompt (and any prefix it was computing)."""
        self.stop_computing(request_id)
        for page_id in self.chains.pop(request_id, ()):
            self.counts[page_id] -= 1
            if not self.counts[page_id]:
                del self.counts[page_id], self.ids[self.keys.pop(page_id)]

    def shared_pages(self, request_id: int) -> int:
        """How many leading pages of the request's prompt another live prompt has too."""
        chain = self.chains.get(request_id, [])
        depth = 0
        while depth < len(chain) and self.counts[chain[depth]] > 1:
            depth += 1
        return depth

    def start_computing(self, request_id: int, num_pages: int) -> None:
        """The request is computing its first num_pages pages (for others to wait on)."""
        self.computing[self.chains[request_id][num_pages - 1]] = request_id

    def stop_computing(self, request_id: int) -> None:
        for page_id in [p for p, r in self.computing.items() if r == request_id]:
            del self.computing[page_id]

    def should_wait(self, request_id: int) -> bool:
        """Whether another request is computing a prefix of this request's prompt."""
        return any(self.computing.get(page_id, request_id) != request_id for page_id in self.chains.get(request_id, ()))
