"""Prefix caching, the scheduler's side: which leading full pages of a sequence are computed.

Plain Python (no jax). The scheduler owns one `PrefixCache` and is its only caller.

Data flow:
  admission: a waiting sequence that holds no pages -> `match(req)` hashes its full pages
    (chained over every token before them, and salted with its LoRA adapter's load id,
    `lora_request.LoraBinding.salt`; memoised on `Sequence.page_hashes`) and takes a
    reference on the longest cached run (`BlockAllocator.match_prefix`); the sequence starts
    with those pages as its block table (`Sequence.pages`) and `num_computed_tokens` past
    them.
  not admitted after all (no pages or seat for the rest this step) -> `undo_match(req)` gives
    the references back, so a sequence that waits holds no pages.
  after each applied step (`Scheduler.update`) -> `register(req)` enters every page that has
    become full and computed under its hash (`BlockAllocator.register`), for later sequences
    (and this one, recomputing after a preemption) to match.

KV groups (`kv_manager.KVManager`): a hit is only as long as every group can serve it: a
sliding group needs the pages under the window of the first query after the hit still
cached (slid-out pages stay cached until evicted), else the hit is cut back.

State: the cache itself (hash -> page, the LRU of cached free pages) is the allocator's; per
sequence, `page_hashes` and `num_registered_pages` live on the `Sequence` (a preemption resets
`num_registered_pages`, the hashes stay valid: the tokens do not change). This class keeps no
state of its own, only the rules.
"""

from __future__ import annotations

from jaxserve.engine.block_allocator import hash_pages
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.sequence import Sequence


class PrefixCache:
    def __init__(self, kv: KVManager, page_size: int, enabled: bool):
        self.kv = kv
        self.page_size = page_size
        self.enabled = enabled

    def match(self, req: Sequence) -> None:
        """Start a page-less waiting sequence on the longest cached run of its full pages."""
        if not self.enabled or req.wants_prompt_logprobs:
            return  # (cached positions are never computed, so they would have no logprobs)
        # At least one token must be computed to produce logits.
        hashes = self._full_page_hashes(req, req.num_tokens - 1)
        k, tables = self.kv.match_prefix(hashes)
        req.pages, req.group_pages = tables[0], tables[1:]
        req.num_computed_tokens = req.num_scheduled_tokens = k * self.page_size
        req.num_registered_pages = k
        if req.metrics.first_scheduled_time is None:
            req.metrics.num_cached_tokens = req.num_computed_tokens

    def undo_match(self, req: Sequence) -> None:
        """Give back the pages `match` took, if the sequence holds nothing else yet."""
        if req.pages and req.num_computed_tokens == req.num_registered_pages * self.page_size:
            # Matched pages only (nothing computed yet): give the references back.
            self.kv.free(req)
            req.num_computed_tokens = req.num_scheduled_tokens = 0
            req.num_registered_pages = 0

    def register(self, req: Sequence) -> None:
        """Enter the sequence's newly full, computed pages into the cache."""
        if not self.enabled:
            return
        full = req.num_computed_tokens // self.page_size
        if full <= req.num_registered_pages:
            return
        hashes = self._full_page_hashes(req, full * self.page_size)
        self.kv.register(req, req.num_registered_pages, full, hashes)
        req.num_registered_pages = full

    def _full_page_hashes(self, req: Sequence, num_tokens: int) -> list[bytes]:
        """Chained hashes of the full pages among the first `num_tokens` tokens (memoised)."""
        ps = self.page_size
        have = len(req.page_hashes)
        want = num_tokens // ps
        if want > have:
            parent = req.page_hashes[-1] if have else b""
            # A LoRA sequence's chain is salted with its adapter's load id: KV computed under
            # one adapter (or the base model, unsalted) never serves another.
            salt = req.lora.salt if req.lora is not None else b""
            req.page_hashes.extend(hash_pages(req.all_token_ids[have * ps: want * ps], ps, parent,
                                              salt))
        return req.page_hashes[:want]
