"""KV page allocator: free list, ref counts, prefix-cache hashes, LRU of cached free pages.

Plain Python/numpy (no jax): the scheduler owns one of these and is its only caller.

Data flow: the scheduler asks `allocate(n)` for fresh pages as a request's KV grows, `free()`s
a request's pages when it finishes, aborts or is preempted, and with prefix caching on it
(1) asks `match_prefix(hashes)` for the longest run of already-computed full pages of a new
request's prompt, and (2) `register(page, hash)` once a page is full and computed. A freed page
that carries a hash is not wiped: it joins an LRU of evictable pages and can be matched again
until a fresh allocation evicts it (oldest first). Page 0 is the trash page that padding
tokens write into; it is never handed out.

Hashes chain over the token ids of every page before them (`hash_pages`), so equal hashes mean
equal full prefixes, not merely equal pages.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from typing import Sequence

import numpy as np

TRASH_PAGE = 0


class NoFreePages(RuntimeError):
    """Raised by `allocate` when fewer pages are free than asked for."""


def hash_pages(token_ids: Sequence[int], page_size: int, parent: bytes = b"",
               extra: bytes = b"") -> list[bytes]:
    """Chained digests of every *full* page of `token_ids` (a partial tail page is skipped).

    `extra` salts the chain (e.g. a LoRA or model id) so different models never share pages.
    """
    out: list[bytes] = []
    prev = parent
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        chunk = token_ids[start:start + page_size]
        h = hashlib.blake2b(prev + extra, digest_size=16)
        h.update(struct.pack(f"<{page_size}q", *chunk))
        prev = h.digest()
        out.append(prev)
    return out


class BlockAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the trash page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = np.zeros(num_pages, np.int32)
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._page_hash: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        # Free pages that still hold a valid cached prefix, least recently used first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.prefix_queries = 0  # pages looked up
        self.prefix_hits = 0  # pages found

    # ----------------------------------------------------------------------- capacity
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an `allocate` can hand out now (truly free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by live requests (cached-but-free count as free)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    # ----------------------------------------------------------------------- alloc / free
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_pages:
            raise NoFreePages(f"asked for {n} pages, {self.num_free_pages} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self._page_hash.pop(page)]
            self._ref[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; released pages keep their cached hash if any.

        Pages are released in reverse so that a request's tail (least likely to be shared)
        is evicted before its head.
        """
        for page in reversed(pages):
            if page == TRASH_PAGE or self._ref[page] <= 0:
                raise ValueError(f"free of page {page} that is not allocated")
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._page_hash:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def share(self, pages: Sequence[int]) -> None:
        """Take one more reference on allocated pages (a fork shares its parent's prompt)."""
        for page in pages:
            if page == TRASH_PAGE or self._ref[page] <= 0:
                raise ValueError(f"share of page {page} that is not allocated")
            self._ref[page] += 1

    # ----------------------------------------------------------------------- prefix cache
    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Take a reference on the longest cached run of `hashes`; returns those pages."""
        if not self.enable_prefix_caching:
            return []
        pages: list[int] = []
        for h in hashes:
            page = self.cached_page(h)
            if page is None:
                break
            pages.append(page)
        self.take(pages)
        self.count_prefix(len(hashes), len(pages))
        return pages

    def cached_page(self, page_hash: bytes) -> int | None:
        """The page caching `page_hash` (live or evictable), or None; takes no reference."""
        return self._cached.get(page_hash) if self.enable_prefix_caching else None

    def take(self, pages: Sequence[int]) -> None:
        """Take a reference on cached pages (`cached_page`), pulling free ones out of the LRU."""
        for page in pages:
            if self._ref[page] == 0:
                del self._evictable[page]
            self._ref[page] += 1

    def count_prefix(self, queried: int, hit: int) -> None:
        """Count a prefix lookup of `queried` pages of which `hit` were served."""
        self.prefix_queries += queried
        self.prefix_hits += hit

    def register(self, page: int, page_hash: bytes) -> None:
        """Record that `page` holds the full, computed page whose chained hash is `page_hash`."""
        if not self.enable_prefix_caching or page in self._page_hash:
            return
        if page_hash in self._cached:
            return  # another page already caches this prefix; keep the first
        self._page_hash[page] = page_hash
        self._cached[page_hash] = page
