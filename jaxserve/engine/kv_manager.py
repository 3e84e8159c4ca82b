"""A sequence's pages in every KV group: allocation, freeing, and sliding pages out of windows.

Plain Python (no jax). The scheduler owns one `KVManager` (which owns the page pool, a
`BlockAllocator`); the scheduler, its prefix cache and its forks call it for a sequence's
pages. The KV groups (`models/kv_groups.py`) all draw page ids from that one pool.

Per sequence: group 0 (global) is `Sequence.pages`, as for a model without groups; groups
1.. are `Sequence.group_pages`. Every table has one entry per page of the sequence so far
(the kernels index a table by position // page_size). A sliding group's table is
[trash page 0] * a + live pages: after every applied step (`slide`), the pages wholly older
than the next query's window are freed and their entries set to the trash page, so a
sequence holds at most ceil(window / page_size) + 1 pages there between steps.

Freed, not a ring: a slid-out page goes back to the pool (and, when it carries a prefix
hash, into the allocator's LRU of cached free pages, where a later sequence with the same
prefix can still match it until an allocation evicts it). A ring of ceil(w / ps) + 1 pages
reused in place would need ring indexing in every attention kernel (a table of a few
entries addressed modulo its length) and could not keep a slid-out page for prefix reuse;
freeing needs only the trash page in the table, which the kernels already mask (keys
outside the window are never read into the softmax), and the table keeps its width.

Without groups (`groups` None) every method is the plain single-table path.
"""

from __future__ import annotations

from typing import Sequence as GenericSequence

from jaxserve.engine.block_allocator import TRASH_PAGE, BlockAllocator
from jaxserve.engine.sequence import Sequence
from jaxserve.models.kv_groups import KVGroups, first_live_page


def group_key(group: int, page_hash: bytes) -> bytes:
    """A page hash as group `group` caches it: a page of group 0 under its hash as without
    groups, a page of another group salted with its group (one pool, one cache)."""
    return page_hash if group == 0 else bytes([group]) + page_hash


class KVManager:
    def __init__(self, allocator: BlockAllocator, groups: KVGroups | None):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.groups = groups
        self.num_groups = 1 if groups is None else groups.num_groups
        # (group, window) of each sliding group.
        self.sliding = () if groups is None else tuple(
            (g, groups.windows[g]) for g in groups.sliding)
        # Prefix-hit pages cut back because a sliding group's window pages were evicted.
        self.window_cut_pages = 0

    def tables(self, req: Sequence) -> list[list[int]]:
        """The sequence's block tables, group by group (created empty on first use)."""
        if len(req.group_pages) != self.num_groups - 1:
            req.group_pages = [[] for _ in range(self.num_groups - 1)]
        return [req.pages, *req.group_pages]

    def pages_needed(self, req: Sequence, num_tokens: int) -> int:
        """Fresh page ids `req` needs to hold pages for its first `num_tokens` tokens."""
        want = -(-num_tokens // self.page_size)
        if self.groups is None:  # (the per-step hot path of every model without groups)
            return want - len(req.pages)
        return sum(max(0, want - len(t)) for t in self.tables(req))

    def allocate(self, req: Sequence, num_tokens: int) -> None:
        """Extend every table of `req` to cover `num_tokens` tokens (`pages_needed` free)."""
        want = -(-num_tokens // self.page_size)
        if self.groups is None:
            req.pages.extend(self.allocator.allocate(want - len(req.pages)))
            return
        for table in self.tables(req):
            if want > len(table):
                table.extend(self.allocator.allocate(want - len(table)))

    def reserve(self, req: Sequence, num_tokens: int) -> bool:
        """Hold pages for `req`'s first `num_tokens` tokens if the free pool has them, never
        preempting: a draft model writes its KV up to position num_tokens + k - 2 before
        the verify step that would allocate those pages is scheduled (`Speculator.propose`). False (nothing taken): no room. What the verify step does
        not use is trimmed after it (`trim`) or freed with the sequence (`free`)."""
        need = self.pages_needed(req, num_tokens)
        if need > self.allocator.num_free_pages:
            return False
        if need > 0:
            self.allocate(req, num_tokens)
        return True

    def free(self, req: Sequence) -> None:
        """Drop every page `req` holds, in every group; its tables become empty."""
        if req.pages:
            self.allocator.free(req.pages)
        req.pages = []
        for table in req.group_pages:
            live = [p for p in table if p != TRASH_PAGE]
            if live:
                self.allocator.free(live)
        req.group_pages = []

    def trim(self, req: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens, in every group: the pages
        a speculative step reserved for proposals that were rejected (`Scheduler.
        _update_verified`). Never a page the prefix cache holds for this sequence: those
        are full pages of computed tokens, all below `num_tokens`."""
        want = -(-num_tokens // self.page_size)
        for table in self.tables(req) if self.groups is not None else [req.pages]:
            extra = [p for p in table[want:] if p != TRASH_PAGE]
            del table[want:]
            if extra:
                self.allocator.free(extra)

    def slide(self, req: Sequence) -> None:
        """Free each sliding group's pages that hold only keys older than the next query's
        window (its position is `num_computed_tokens`); a no-op without sliding groups.

        `num_computed_tokens`, not the scheduled count: a step dispatched but not applied
        reads from its first query's window on, which is no older than this one."""
        if not self.sliding:
            return
        for g, window in self.sliding:
            table = req.group_pages[g - 1] if req.group_pages else []
            stop = min(first_live_page(window, req.num_computed_tokens, self.page_size),
                       len(table))
            # Entries below a trash entry are trash (the table is trash then live pages):
            # walk back from the new boundary until the old one.
            gone = []
            i = stop - 1
            while i >= 0 and table[i] != TRASH_PAGE:
                gone.append(table[i])
                table[i] = TRASH_PAGE
                i -= 1
            if gone:
                self.allocator.free(gone[::-1])  # (free releases in reverse: oldest last)

    def num_live_pages(self, req: Sequence, group: int) -> int:
        """Pages `req` holds in `group` (not counting trash entries)."""
        return sum(p != TRASH_PAGE for p in self.tables(req)[group])

    # ------------------------------------------------------------------- prefix and forks
    def match_prefix(self, hashes: GenericSequence[bytes]) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of full pages (`hashes`, chained) that every group can
        serve: its length in pages k and each group's table for it, with a reference taken
        on every page in them.

        A global group needs all k pages cached; a sliding group only those under the window
        of the query at k * page_size, but those it does need: a hit whose window pages were
        evicted is cut back to the longest k whose window pages are all still cached (or
        to 0). Never served with missing KV. `window_cut_pages` counts what was cut."""
        alloc = self.allocator
        if self.groups is None:
            pages = alloc.match_prefix(hashes)
            return len(pages), [pages]
        if not alloc.enable_prefix_caching:
            return 0, [[] for _ in range(self.num_groups)]
        full: list[int] = []
        for h in hashes:
            page = alloc.cached_page(h)
            if page is None:
                break
            full.append(page)
        k = len(full)
        while k > 0:
            tables = self._window_pages(hashes, k)
            if tables is not None:
                break
            k -= 1
        else:
            tables = [[] for _ in self.sliding]
        result = [full[:k]] + [[] for _ in range(self.num_groups - 1)]
        for (g, _), table in zip(self.sliding, tables):
            result[g] = table
        for table in result:
            alloc.take([p for p in table if p != TRASH_PAGE])
        alloc.count_prefix(len(hashes), k)
        self.window_cut_pages += len(full) - k
        return k, result

    def _window_pages(self, hashes: GenericSequence[bytes], k: int) -> list[list[int]] | None:
        """Each sliding group's table for a cached prefix of k pages (trash below the window
        of the query at k * page_size), or None when one of its window pages is not cached."""
        out = []
        for g, window in self.sliding:
            first = first_live_page(window, k * self.page_size, self.page_size)
            table = [TRASH_PAGE] * first
            for j in range(first, k):
                page = self.allocator.cached_page(group_key(g, hashes[j]))
                if page is None:
                    return None
                table.append(page)
            out.append(table)
        return out

    def register(self, req: Sequence, start: int, stop: int,
                 hashes: GenericSequence[bytes]) -> None:
        """Cache pages [start, stop) of every group of `req` under their hashes."""
        for g, table in enumerate(self.tables(req)):
            for i in range(start, stop):
                if table[i] != TRASH_PAGE:
                    self.allocator.register(table[i], group_key(g, hashes[i]))

    def share_prefix(self, parent: Sequence, num_pages: int) -> list[list[int]] | None:
        """Tables for a fork of `parent` that shares its first `num_pages` pages (a reference
        taken on each page), or None when a sliding group of the parent no longer holds the
        window pages the fork's first query needs (it then computes its prompt itself)."""
        tables = self.tables(parent)
        out = [list(tables[0][:num_pages])]
        for g in range(1, self.num_groups):
            window = self.groups.windows[g] if self.groups is not None else None
            first = 0 if window is None else first_live_page(
                window, num_pages * self.page_size, self.page_size)
            part = tables[g][:num_pages]
            if any(p == TRASH_PAGE for p in part[first:]):
                return None
            out.append([TRASH_PAGE] * first + part[first:])
        for table in out:
            self.allocator.share([p for p in table if p != TRASH_PAGE])
        return out
