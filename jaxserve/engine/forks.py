"""Forks: the n > 1 samples of one request share its prompt's KV pages.

Plain Python (no jax). The scheduler owns one `Forks` table and is its only caller; the
engine queues a request's samples as children of sample 0 (`Scheduler.add_request(child,
fork_of=sample_0)`).

Data flow:
  queued -> `hold(child, parent)`: while the parent (sample 0) has not computed its prompt,
    the child waits here, outside the waiting queue, so the prompt is prefilled once, not n
    times over (n times the step budget and the pages). Otherwise the scheduler queues it at
    once and it computes its prompt itself (mostly from the prefix cache when that is on).
  the parent's update reaches the end of its prompt, or the parent finishes first ->
    `release(parent)`: each held child still waiting takes a reference on the parent's full
    prompt pages (`KVManager.share_prefix`) as the start of its block table (`Sequence.pages`),
    with `num_computed_tokens` past them: only the partial last page is its own to compute.
    A finished parent has freed its pages and shares nothing. The scheduler queues the
    returned children in their arrival order.
  a held child finishes (aborted) -> `drop(child)`.

State: the held children, keyed by their parent's seq_id, are this table's alone; the
scheduler counts them as waiting (`num_held`).
"""

from __future__ import annotations

from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.sequence import Sequence, SequenceStatus


class Forks:
    def __init__(self, kv: KVManager, page_size: int):
        self.kv = kv
        self.page_size = page_size
        self._held: dict[int, list[Sequence]] = {}  # parent seq_id -> its children waiting

    @property
    def num_held(self) -> int:
        return sum(len(c) for c in self._held.values())

    def hold(self, child: Sequence, parent: Sequence) -> bool:
        """Hold `child` until `parent` has computed its prompt; False when there is nothing
        to wait for (the caller queues it now)."""
        if parent.is_finished or parent.num_computed_tokens >= parent.num_prompt_tokens:
            return False
        self._held.setdefault(parent.seq_id, []).append(child)
        return True

    def release(self, parent: Sequence) -> list[Sequence]:
        """Let `parent`'s held children go, sharing its full prompt pages; returns the ones
        still waiting, for the caller to queue (none when it held none)."""
        children = self._held.pop(parent.seq_id, None)
        if not children:
            return []
        ps = self.page_size
        # Full pages before the prompt's last token: a child computes at least that token,
        # for the logits of its own first sample (as a prefix-cache match does).
        k = (parent.num_prompt_tokens - 1) // ps \
            if parent.status is SequenceStatus.RUNNING else 0
        released = []
        for child in children:
            if child.status is not SequenceStatus.WAITING:
                continue
            # With sliding KV groups the parent may have freed the window pages the child's
            # first query needs: then `share_prefix` shares nothing.
            tables = self.kv.share_prefix(parent, k) if k else None
            if tables is not None:
                child.pages, child.group_pages = tables[0], tables[1:]
                child.num_computed_tokens = child.num_scheduled_tokens = k * ps
                child.num_registered_pages = k
                child.metrics.num_cached_tokens = child.num_computed_tokens
            released.append(child)
        return released

    def drop(self, req: Sequence) -> bool:
        """Forget a held child (it finished while held); False when `req` is not held."""
        for children in self._held.values():
            if req in children:
                children.remove(req)
                return True
        return False
